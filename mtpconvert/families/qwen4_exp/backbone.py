"""How the runtime drives a qwen4_exp backbone as mlx-vlm 0.7.10 builds it (``models/qwen4_exp``).

Loaded, run and undone as every mlx-vlm backbone is (``runtime.vlm_backbone``): the hidden state the drafter reads
is the last layer's output before the hyper-connection mixer (``language.py:2076-2086``); the mixer and ``lm_head``
make the logits (``readout``, ``project``). The speculative transaction records the recurrent states and causal
windows after every position of a pass (the GatedDeltaNet's, the n-gram embedding's conv and token history) and
keeps those of the accepted prefix on commit; its sparse-attention caches are trimmed.

Over the batched engine's per-row caches (``row_cache``: mlx-vlm's ArraysCache committing each row's prefix for
the linear layers, right-aligned rows for the QSA ones, ``rows.py``) a pass runs mlx-vlm's layers as its language
model would, given each row's own positions: a pass of several tokens through its model, a one-token pass layer by
layer through its batch-invariant decode (what a single row's one-token pass runs), with the attention mask of
``QSARows.attention_mask`` in place of the string mask that would drop the indexer's selection.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_ssm_mask
from mlx_vlm.models.qwen4_exp.language import (_QWEN4_BATCH_INVARIANT_FORWARD, Qwen4ExpDecoderLayer,
                                               _create_qwen4_exp_attention_mask)

from ...runtime.vlm_backbone import VlmBackbone
from ...runtime.vlm_rows import RowArraysCache, begin_passes
from .head import Qwen4ExpHead
from .rows import QSARows, is_rows


class Qwen4ExpBackbone(VlmBackbone):
    def is_recurrent(self, layer: nn.Module) -> bool:
        return layer.is_linear

    # a token's path: the embedding repeated on every hyper-connection stream, the layers, no final norm (the
    # head reads the streams), the mixer, lm_head

    def lift(self, embedded: mx.array) -> mx.array:
        return mx.tile(embedded, (1, 1, self.args.hc_count))

    def run_layer(self, layer: nn.Module, x: mx.array, tokens: mx.array, cache=None) -> mx.array:
        """One layer over a whole sequence from its first token (the layerwise check's cacheless pass)."""
        positions = self.text.get_rope_index(tokens, None, None, None)[0]
        return layer(x, tokens, mask=self.layer_mask(layer, x), cache=cache, position_ids=positions)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        return _create_qwen3_5_ssm_mask(x, None) if layer.is_linear else _create_qwen4_exp_attention_mask(x, None)

    def close(self, x: mx.array) -> mx.array:
        return x

    def readout(self, hidden: mx.array) -> mx.array:
        return self.norm(hidden)

    def new_layer(self, index: int) -> nn.Module:
        return Qwen4ExpDecoderLayer(self.args, index)

    def attention_cache(self, cache: list):
        return cache[self.text.model.fa_idx]

    def forward(self, tokens: mx.array, cache: list):
        if not is_rows(cache):
            return super().forward(tokens, cache)
        begin_passes(cache, tokens.shape[1])  # the linear layers record a pass of 2..max_pass tokens
        rows = cache[self.text.model.fa_idx]
        positions = rows.positions(tokens.shape[1])
        if tokens.shape[1] > 1:
            out = self.text(tokens, cache=cache, position_ids=positions, return_hidden=True, skip_logits=True)
            return None, out.hidden_states[self.hidden_state_index]
        return None, self._one_token_rows(tokens, cache, positions, rows.attention_mask(1))

    def _one_token_rows(self, tokens: mx.array, cache: list, positions: mx.array, attention_mask) -> mx.array:
        """A one-token pass over per-row caches: mlx-vlm's batch-invariant decode (``Qwen4ExpBatchInvariantForward
        ._model``, which its language model runs for every one-token pass), but for the attention layers' mask."""
        model, forward = self.text.model, _QWEN4_BATCH_INVARIANT_FORWARD
        hidden = mx.tile(model.embed_tokens(tokens), (1, 1, model.args.hc_count))
        ssm_mask = _create_qwen3_5_ssm_mask(hidden, cache[model.ssm_idx])
        for layer, layer_cache in zip(model.layers, cache):
            hidden = forward._layer(layer, hidden, tokens, ssm_mask if layer.is_linear else attention_mask,
                                    layer_cache, positions)
        return hidden

    def row_cache(self, max_pass: int, rows: int) -> list:
        """Per-row caches (module doc): the n-gram embedding's conv window and token history live in its layer's
        ArraysCache (four entries where the layer has one), committed per row as the linear attention's state."""
        return [RowArraysCache(max_pass, size=4 if "ple" in layer else 2) if layer.is_linear else QSARows(rows)
                for layer in self.layers]

    def make_head(self, num_layers: int) -> nn.Module:
        return Qwen4ExpHead(self.args, num_layers)
