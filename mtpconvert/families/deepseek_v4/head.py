"""The deepseek_v4 MTP head, built from mlx-vlm 0.7.10's own deepseek_v4 modules with the parameters of its
``DeepseekV4MTPDraftModel`` (``speculative/drafters/deepseek_v4_mtp/deepseek_v4_mtp.py:47-122``), so the tensors it
loads are the ones that drafter reads and it computes what that drafter computes:

    e   = e_proj(enorm(embed(t+1)))                       [H], added to every stream
    x_k = e + h_proj(hnorm(h_t,k))                        for each of the hc streams  [hc, H]
    y   = decoder(x)      one sliding-window block (attention with sinks, MoE, hyper-connections), own KV cache
    logits(t+2) = lm_head(norm(hc_head(y)))              (``readout``, then the target's lm_head)

``h_t`` is the backbone's hc streams after its last layer, before its own ``hc_head`` and ``norm``; ``y`` (the
head's streams before its ``hc_head``) is what a chained draft reads next. Positions are the cache's offset, as
the drafter's ``_next_position`` counts them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import RotatingKVCache
from mlx_vlm.models.deepseek_v4.hyper_connection import HyperHead
from mlx_vlm.models.deepseek_v4.language import DeepseekV4Block


class BlockView:
    """The head's block as the runtime's smokes name a decoder layer's parts: its MoE is ``mlp`` (the block's
    ``ffn``, which its hyper-connection runs with the token ids)."""

    def __init__(self, block: nn.Module):
        self.block = block

    @property
    def mlp(self) -> nn.Module:
        return self.block.ffn

    @mlp.setter
    def mlp(self, module: nn.Module) -> None:
        self.block.ffn = module


class DeepseekV4Head(nn.Module):
    def __init__(self, args):
        """``args``: mlx-vlm's deepseek_v4 ``ModelConfig`` of the backbone."""
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.sliding_window = args.sliding_window
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        # one sliding-window block with a score-routed MoE, as the drafter builds it
        self.decoder = DeepseekV4Block(replace(args, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0), 0)
        self.hc_head = HyperHead(args)
        self.norm = nn.RMSNorm(H, eps=eps)

    @property
    def layers(self) -> list:
        """One decoder layer (speculative decoding counts these; the MLP-gain smoke swaps its ``mlp``)."""
        return [BlockView(self.decoder)]

    def make_cache(self) -> List[RotatingKVCache]:
        return [RotatingKVCache(max_size=self.sliding_window)]

    def row_cache(self, rows: int) -> list:
        """The batched engine's per-row twin of ``make_cache`` (``rows.WindowRows``)."""
        from .rows import WindowRows

        return [WindowRows([0] * rows)]

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: Optional[list] = None,
                 step: int = 0) -> mx.array:
        """hidden: the backbone's (or this head's) hc streams [B, L, hc, H]; next_embeddings: embed(t+1) [B, L, H].
        Returns the head's streams (``readout`` gives what lm_head reads)."""
        streams = self.h_proj(self.hnorm(hidden.reshape(-1, hidden.shape[-1]))).reshape(hidden.shape)
        x = self.e_proj(self.enorm(next_embeddings))[:, :, None, :] + streams
        c = cache[0] if cache is not None else None
        mask = create_attention_mask(x[:, :, 0, :], c, window_size=self.sliding_window, return_array=True)
        return self.decoder(x, mask, c, None)

    def readout(self, state: mx.array) -> mx.array:
        """What the output projection reads of a head state: its own hc_head, then its norm."""
        return self.norm(self.hc_head(state))
