"""Nemotron-H's MTP head: one prediction module of several backbone blocks (``HeadDesign.forward``
"nemotron-h-mtp"), as NVIDIA's release, mlx-vlm's ``nemotron_h_mtp`` drafter and vLLM run it:

    x  = eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])        (block 0's enorm, hnorm, eh_proj)
    x  = block_j(x) for j in pattern order                      (x + mixer(norm(x)); attention blocks with their
                                                                 own KV cache over the head's positions, no RoPE)
    h' = final_layernorm(x)                                     (the last block's)
    logits(t+2) = lm_head(h')                                   (the backbone's lm_head; embed likewise)

At depth > 1 the same module runs again with ``h = h'`` of the previous draft. The blocks are mlx-lm's own
``NemotronHBlock`` of the kind the pattern names, stored as the child list ``layers`` so that the parameters are
named ``layers.{j}.*`` exactly as the release (``mtp.layers.{j}.*``) and mlx-vlm's drafter name them. To the decode
loop the whole module is ONE layer: the attribute ``layers`` answers ``[self]`` (speculative decoding runs one
MTP layer, and the layerwise check removes this layer's MLP), and ``mlp`` stands for the MLP-kind blocks' mixers
(the MoE, a relu² MLP) so that ``runtime.smoke.mlp_gain`` can take them out and put them back.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

MLP_KINDS = ("E", "-")  # the blocks whose mixer is an MLP (routed experts, or a plain relu² MLP)


class NemotronHHead(nn.Module):
    def __init__(self, blocks: Sequence[nn.Module], hidden_size: int, eps: float):
        """``blocks``: empty ``NemotronHBlock``s of the head's pattern (the backbone adapter builds them); the head's
        attention blocks each keep a KV cache, and the pattern must have one (its offset is the head's position)."""
        super().__init__()
        kinds = [b.block_type for b in blocks]
        if "M" in kinds or "*" not in kinds:
            raise ValueError(f"MTP block pattern {''.join(kinds)!r}: mtpconvert's runtime drafts with attention, MoE "
                             "and MLP blocks, and needs an attention block (its KV cache is what a rejected draft "
                             "trims)")
        H = hidden_size
        first, last = blocks[0], blocks[-1]
        first.enorm = nn.RMSNorm(H, eps=eps)
        first.hnorm = nn.RMSNorm(H, eps=eps)
        first.eh_proj = nn.Linear(2 * H, H, bias=False)
        last.final_layernorm = nn.RMSNorm(H, eps=eps)
        self["layers"] = list(blocks)  # the parameter tree's child list; the attribute is the decode loop's view

    @property
    def blocks(self) -> List[nn.Module]:
        return self["layers"]

    @property
    def layers(self) -> list:
        """One decoder layer to the decode loop: the prediction module itself."""
        return [self]

    @property
    def mlp(self) -> tuple:
        """The mixers of the MLP-kind blocks, in order: what ``runtime.smoke.mlp_gain`` swaps out and back."""
        return tuple(b.mixer for b in self.blocks if b.block_type in MLP_KINDS)

    def __setattr__(self, key, value):
        if key != "mlp":
            return super().__setattr__(key, value)
        mixers = value if isinstance(value, tuple) else (value,) * len(self.mlp)
        for block, mixer in zip([b for b in self.blocks if b.block_type in MLP_KINDS], mixers):
            block.mixer = mixer

    def make_cache(self) -> list:
        """One entry, as for every one-layer head: the KV cache of its attention block, or a CacheList of one per
        attention block (trimmed and offset together)."""
        caches = [KVCache() for b in self.blocks if b.block_type == "*"]
        return [caches[0] if len(caches) == 1 else CacheList(*caches)]

    def readout(self, state: mx.array) -> mx.array:
        """What the output projection reads of a head state: the state itself (``final_layernorm`` is applied)."""
        return state

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: Optional[list] = None,
                 step: int = 0) -> mx.array:
        """hidden: backbone states h_t (or the previous draft's h') [B, L, H]; next_embeddings: embed(t+1) [B, L, H].
        Returns h' after ``final_layernorm``."""
        first = self.blocks[0]
        x = first.eh_proj(mx.concatenate([first.enorm(next_embeddings), first.hnorm(hidden)], axis=-1))
        c = cache[0] if cache is not None else None
        caches = list(c.caches) if isinstance(c, CacheList) else ([c] if c is not None else [])
        mask = create_attention_mask(x, caches[0] if caches else None)
        attention = iter(caches)
        for block in self.blocks:
            x = block(x, mask=mask, cache=next(attention, None) if block.block_type == "*" else None)
        return self.blocks[-1].final_layernorm(x)
