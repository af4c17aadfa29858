"""The head modules of the head designs families share, built from the backbone's own layers.

A family's backbone adapter (``runtime.backbone.Backbone.make_head``) builds the head of its design;
a design only one family has lives in that family's package.

Qwen MTP (``MTPHead``; ``HeadDesign.forward`` "qwen-mtp"):
h' = fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])
h' = decoder_layer(h', own KV cache)          (a full-attention backbone layer)
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
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

from ...execute.ops import gather
from ...families.base import Family, Gather
from ...plan.head import SIDECAR_PREFIX


class MTPHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, layers: List[nn.Module]):
        """``layers``: the head's decoder layers, full-attention layers of the backbone's own class (its adapter
        builds them)."""
        super().__init__()
        H = hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.layers = list(layers)
        self.norm = nn.RMSNorm(H, eps=eps)

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def readout(self, state: mx.array) -> mx.array:
        """What the output projection reads of a head state: the state itself (``norm`` is already applied)."""
        return state

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
    def __init__(self, block: nn.Module, hidden_size: int, eps: float, vocab_size: int, own_vocab: bool,
                 new_cache: Callable[[], object]):
        """``block``: the backbone's decoder layer at the nextn layer's index (its adapter builds it, with the
        MoE block there); ``new_cache``: a cache of the backbone's attention kind (KVCache, GLM-5's CacheList)."""
        super().__init__()
        H = hidden_size
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            setattr(self, name, block[name])
        self._block = type(block).__call__  # runs on this module's own block attributes
        self.shared_head_norm = nn.RMSNorm(H, eps=eps)
        if own_vocab:
            self.embed_tokens = nn.Embedding(vocab_size, H)
            self.shared_head = SharedHead(H, vocab_size)
        self._new_cache = new_cache

    @property
    def layers(self) -> list:
        """One decoder layer: the head itself (speculative decoding and the batched engine count these)."""
        return [self]

    def make_cache(self) -> list:
        return [self._new_cache()]

    def readout(self, state: mx.array) -> mx.array:
        """What the output projection reads of a head state: the state itself (``shared_head_norm`` is applied)."""
        return state

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: Optional[list] = None,
                 step: int = 0) -> mx.array:
        """As MTPHead: the head's state after ``shared_head_norm`` (logits through ``MTPModel.draft_logits``)."""
        x = self.eh_proj(mx.concatenate([self.enorm(next_embeddings), self.hnorm(hidden)], axis=-1))
        c = cache[0] if cache is not None else None
        mask = create_attention_mask(x, c[0] if isinstance(c, CacheList) else c, return_array=True)
        return self.shared_head_norm(self._block(self, x, mask, c))


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
