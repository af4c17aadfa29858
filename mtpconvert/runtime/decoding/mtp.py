"""The MTP head of each head design, built from mlx-lm's own layers; ``head_class`` finds a family's.

qwen3_5-mtp (``MTPHead``):
h' = fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])
h' = decoder_layer(h', own KV cache)          (a full-attention Qwen3.5 layer)
logits(t+2) = lm_head(norm(h'))               (lm_head shared with the backbone)

With several MTP layers, draft step k uses layer k mod n (vLLM's convention).

nextn (``NextNHead``, GLM; DeepSeek-V3's design):
h' = eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])
h' = decoder_layer(h', own KV cache)          (a backbone layer: its attention and its MoE)
logits(t+2) = shared_head.head(shared_head_norm(h'))   (the backbone's lm_head where the head has none;
                                               embed likewise: ``MTPModel.embed`` / ``draft_logits``)
The block's modules sit at the head's top level (``self_attn``, ``mlp``...), as mlx-vlm's drafter holds them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from ...execute.ops import gather
from ...families.base import Family, Gather
from ...plan.head import SIDECAR_PREFIX


def text_model(model: nn.Module) -> nn.Module:
    """The text model inside an mlx-lm ``Model`` (``.model``, ``.lm_head``, ``.args``): Qwen3.5's
    wraps it as ``language_model``, a flat family's Model is it."""
    return getattr(model, "language_model", model)


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs, num_layers: int = 1, layer_class: type = DecoderLayer):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        # the backbone's own decoder-layer class; layer_idx = interval - 1 makes mlx-lm build it with
        # full attention (and, in Qwen3-Next, the MoE block wherever the model has experts)
        self.layers = [layer_class(args, layer_idx=args.full_attention_interval - 1) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(
        self,
        hidden: mx.array,
        next_embeddings: mx.array,
        cache: Optional[List[KVCache]] = None,
        step: int = 0,
    ) -> mx.array:
        """hidden: backbone states h_t [B, L, H]; next_embeddings: embed(t+1) [B, L, H].

        Returns the post-norm MTP state (feed lm_head for logits of t+2, or chain it
        as the hidden input of the next draft step).
        """
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h = self.fc(x)
        idx = step % len(self.layers)
        c = cache[idx] if cache is not None else None
        mask = create_attention_mask(h, c)
        h = self.layers[idx](h, mask=mask, cache=c)
        return self.norm(h)


class SharedHead(nn.Module):
    """A nextn head's own output projection (``shared_head.head``)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(hidden, vocab, bias=False)


class NextNHead(nn.Module):
    def __init__(self, model: nn.Module, own_vocab: bool):
        super().__init__()
        lm = text_model(model)
        args = lm.args
        H, eps = args.hidden_size, args.rms_norm_eps
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        # the backbone's decoder-layer class at the nextn layer's index: mlx-lm then builds its MoE block
        layer_class = type(lm.model.layers[0])
        block = layer_class(args, layer_idx=args.num_hidden_layers)
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            setattr(self, name, block[name])
        self._block = layer_class.__call__  # runs on this module's own block attributes
        self.shared_head_norm = nn.RMSNorm(H, eps=eps)
        if own_vocab:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
            self.shared_head = SharedHead(H, args.vocab_size)
        self._new_cache = lambda: make_prompt_cache(model)[-1]  # the backbone's cache kind (KVCache, CacheList)

    @property
    def layers(self) -> list:
        """One decoder layer: the head itself (speculative decoding and the batched engine count these)."""
        return [self]

    def make_cache(self) -> list:
        return [self._new_cache()]

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: Optional[list] = None,
                 step: int = 0) -> mx.array:
        """As MTPHead: the head's state after ``shared_head_norm`` (logits through ``MTPModel.draft_logits``)."""
        x = self.eh_proj(mx.concatenate([self.enorm(next_embeddings), self.hnorm(hidden)], axis=-1))
        c = cache[0] if cache is not None else None
        mask = create_attention_mask(x, c[0] if isinstance(c, CacheList) else c, return_array=True)
        return self.shared_head_norm(self._block(self, x, mask, c))


def make_head(family: Family, model: nn.Module, num_layers: int) -> nn.Module:
    """The (empty) head module that runs ``family``'s head design on ``model``."""
    lm = text_model(model)
    if family.head.forward == "nextn":
        return NextNHead(model, own_vocab="lm_head" not in family.head.shares)
    return MTPHead(lm.args, num_layers, type(lm.model.layers[0]))


def stack_experts(weights: Dict[str, mx.array], family: Family) -> Dict[str, mx.array]:
    """Per-expert or fused expert weights -> the stacked ``switch_mlp`` ones the head's MoE layer
    holds, through the family's own mapping (``Family.contributions``, the one the plan uses)."""
    parts = defaultdict(list)
    out = {}
    for name, w in weights.items():
        mapped = family.contributions(SIDECAR_PREFIX + name)
        if len(mapped) == 1 and mapped[0].part is Gather.LOAD and mapped[0].target.endswith(SIDECAR_PREFIX + name):
            out[name] = w
            continue
        for m in mapped:
            parts[m.target[len(family.head_prefix):]].append((m, w))
    for name, contribs in parts.items():
        if contribs[0][0].part is Gather.STACK:
            out[name] = gather([w for _, w in sorted(contribs, key=lambda c: c[0].index)], Gather.STACK)
        else:
            ((m, w),) = contribs
            out[name] = gather([w], m.part)
    return out
