"""How the runtime drives a glm5_next backbone as mlx-vlm 0.7.10 builds it (``models/glm5_next``).

As qwen4_exp's adapter (``families/qwen4_exp/backbone.py``): the model is loaded, built and sanitized by mlx-vlm's
own loader, ``forward`` is its language model asked for the hidden state its drafter reads, and a pass is undone
with mlx-vlm's speculative cache transaction (the linear attention's recurrent state and convolution window per
position, the sparse attention's latent, index and pooled-key caches trimmed). What differs:

* a token's path: the embedding repeated on the ``hc_mult`` hyper-connection streams (``lift``), each layer
  (``run_layer``; a sparse-attention layer without an indexer of its own reuses the top-k of the last one that
  has one, carried through the linear layers as mlx-vlm's forward carries it), the streams' mean under the final
  norm (``close``: the post-norm hidden the nextn head reads), ``lm_head``;
* the head: mlx-vlm's drafter modules (``head.Glm5NextHead``);
* the layerwise check reads a folder's tensors under their stored names (``sanitize``: the folder holds mlx-vlm's
  names already) and fuses a layer's projections stored apart (``families/glm5_next/slots.py``) with mlx-vlm's own
  sanitize only when it loads that layer (``layer_weights``): the streamed check opens one output shard at a time,
  a layer's parts may be written to two, and it holds a layer's tensors by their stored names.
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.glm5_next.language import DecoderLayer

from ...runtime.vlm_rows import RowArraysCache, begin_passes
from ..qwen4_exp.backbone import Qwen4ExpBackbone
from .head import Glm5NextHead, head_weights
from .rows import SparseRows


class Glm5NextBackbone(Qwen4ExpBackbone):
    """mlx-vlm's glm5_next model by role (module doc); loading and undoing as qwen4_exp's."""

    hidden_state_index = -1  # the last of them: what its drafter reads

    def __init__(self, model: nn.Module, family, config: dict):
        super().__init__(model, family, config)
        self._topk: Dict[Tuple[int, ...], mx.array] = {}  # prompt -> the top-k a shared indexer layer reuses

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """A converted folder's tensors as stored: mlx-vlm's names but for the parts it fuses, which
        ``layer_weights`` fuses when their layer is loaded (module doc)."""
        return dict(weights)

    def layer_weights(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """One layer's stored tensors (full keys) as its module holds them: mlx-vlm's sanitize, which concatenates
        the parts stored apart (``language.py:973-1053``)."""
        return self.text.sanitize(dict(weights))

    def is_recurrent(self, layer: nn.Module) -> bool:
        return layer.is_linear

    def lift(self, embedded: mx.array) -> mx.array:
        return mx.repeat(embedded[:, :, None], self.args.hc_mult, axis=2)

    def run_layer(self, layer: nn.Module, x: mx.array, tokens: mx.array, cache=None) -> mx.array:
        """One layer over a whole sequence from its first token (the layerwise check's cacheless pass, layer by
        layer over several prompts: the top-k a layer hands on is kept per prompt)."""
        key = tuple(tokens.reshape(-1).tolist())
        out, topk = layer(x, None, cache, self._topk.get(key))
        if topk is not None:
            self._topk[key] = topk
        return out

    def layer_mask(self, layer: nn.Module, x: mx.array):
        return None

    def close(self, x: mx.array) -> mx.array:
        return self.norm(x.mean(axis=2))

    def readout(self, hidden: mx.array) -> mx.array:
        return hidden

    def new_layer(self, index: int) -> nn.Module:
        return DecoderLayer(self.args, index)

    def forward(self, tokens: mx.array, cache: list):
        """mlx-vlm's forward; over per-row caches (``row_cache``) a pass of 2..max_pass tokens is recorded in every
        linear-attention layer, so that each row can keep its own prefix of it."""
        begin_passes(cache, tokens.shape[1])
        return super().forward(tokens, cache)

    def row_cache(self, max_pass: int, rows: int) -> list:
        """Per-row caches (``rows.py``): mlx-vlm's ArraysCache with its per-row speculative commit for the linear
        layers, right-aligned rows for the sparse-attention ones."""
        return [RowArraysCache(max_pass) if layer.is_linear
                else SparseRows(rows, layer.self_attn.indexer.index_kpool if layer.self_attn.indexer else None)
                for layer in self.layers]

    def attention_cache(self, cache: list):
        """A sparse-attention layer's latent cache: its offset is the tokens the model has seen."""
        index = next(i for i, layer in enumerate(self.layers) if not layer.is_linear)
        return cache[index][0]

    def make_head(self, num_layers: int) -> nn.Module:
        return Glm5NextHead(self.args)

    def head_weights(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return head_weights(self.args, weights)
