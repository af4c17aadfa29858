"""How the runtime drives a deepseek_v4 backbone as mlx-vlm 0.7.10 builds it (``models/deepseek_v4``).

Loaded, run and undone as every mlx-vlm backbone is (``runtime.vlm_backbone``): the hidden state the drafter reads
is the hc streams after the last layer, before ``hc_head`` and ``norm`` (``language.py:1140-1163``); ``hc_head``,
``norm`` and ``lm_head`` make the logits (``readout``, ``project``), through mlx-vlm's own projection helper, whose
short blocks reduce as single tokens do (so a verify pass scores its tokens as one-token decoding does). The
speculative transaction's rotating caches replay the accepted keys, its pooling caches (the compressed attention's
and the indexer's) restore their windows and keep the accepted ones. The batched engine's rows keep their own caches
(``row_cache``, ``rows.py``), each row cut at its own length.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import CacheList, PoolingCache, RotatingKVCache
from mlx_vlm.models.deepseek_v4.language import DeepseekV4Block, SparseCompressedAttention
from mlx_vlm.models.linear import linear

from ...runtime.vlm_backbone import VlmBackbone
from .head import DeepseekV4Head
from .rows import LayerRows, PoolRows, RowsIndexer, WindowRows


class DeepseekV4Backbone(VlmBackbone):
    @property
    def tied(self) -> bool:
        return False  # its own lm_head (the release's head.weight)

    # a token's path: the embedding copied onto every hyper-connection stream, the blocks, no close (the head reads
    # the streams), hc_head and norm, lm_head

    def lift(self, embedded: mx.array) -> mx.array:
        B, L, D = embedded.shape
        return mx.contiguous(mx.broadcast_to(embedded[:, :, None, :], (B, L, self.args.hc_mult, D)))

    def run_layer(self, layer: nn.Module, x: mx.array, tokens: mx.array, cache=None) -> mx.array:
        """One block over a whole sequence from its first token, with a fresh cache of its kind where none is given:
        a compressed attention without one lets every query see every pooled window."""
        cache = cache if cache is not None else self._layer_cache(layer)
        return layer(x, self.layer_mask(layer, x), cache, tokens, causal=True)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        return create_attention_mask(x[:, :, 0, :], None, window_size=self.args.sliding_window, return_array=True)

    def close(self, x: mx.array) -> mx.array:
        return x

    def readout(self, hidden: mx.array) -> mx.array:
        """hc_head then the final norm, over [B, L, hc, H] (a [B, hc, H] row is one position)."""
        if hidden.ndim == 3:
            return self.readout(hidden[:, None])[:, 0]
        return self.text.model.norm(self.text.model.hc_head(hidden))

    def project(self, z: mx.array) -> mx.array:
        return linear(self.text.lm_head, z)

    def new_layer(self, index: int) -> nn.Module:
        return DeepseekV4Block(self.args, index)

    # caches

    def _layer_cache(self, layer: nn.Module):
        """A fresh cache of one block's kind (``LanguageModel.make_cache``, ``language.py:1274-1295``)."""
        local = RotatingKVCache(max_size=self.args.sliding_window)
        ratio = layer.attn.compress_ratio
        if ratio == 0:
            return local
        pools = (PoolingCache(ratio), PoolingCache(ratio)) if isinstance(layer.attn, SparseCompressedAttention) \
            else (PoolingCache(ratio),)
        return CacheList(local, *pools)

    def row_cache(self, max_pass: int, rows: int) -> list:
        """Per-row twins of ``_layer_cache`` (``rows.py``): sliding-window keys, and the compressed blocks' pools
        beside them. Nothing in them is undone by replay, so ``max_pass`` does not bound a cut."""
        out = []
        for layer in self.layers:
            local, ratio = WindowRows([0] * rows), layer.attn.compress_ratio
            if ratio == 0:
                out.append(local)
                continue
            pools = 2 if isinstance(layer.attn, SparseCompressedAttention) else 1
            if pools == 2:  # the same module, selecting row by row where mlx-vlm's batch would not as a row alone
                layer.attn.indexer.__class__ = RowsIndexer
            out.append(LayerRows(local, *(PoolRows(ratio, rows) for _ in range(pools))))
        return out

    def attention_cache(self, cache: list):
        """The first block's sliding-window cache: its offset is the tokens the model has seen."""
        first = cache[0]
        return first[0] if isinstance(first, (CacheList, LayerRows)) else first

    def make_head(self, num_layers: int) -> nn.Module:
        return DeepseekV4Head(self.args)
