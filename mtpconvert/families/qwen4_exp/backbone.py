"""How the runtime drives a qwen4_exp backbone as mlx-vlm 0.7.10 builds it (``models/qwen4_exp``).

Loaded, run and undone as every mlx-vlm backbone is (``runtime.vlm_backbone``): the hidden state the drafter reads
is the last layer's output before the hyper-connection mixer (``language.py:2076-2086``); the mixer and ``lm_head``
make the logits (``readout``, ``project``). The speculative transaction records the recurrent states and causal
windows after every position of a pass (the GatedDeltaNet's, the n-gram embedding's conv and token history) and
keeps those of the accepted prefix on commit; its sparse-attention caches are trimmed.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_ssm_mask
from mlx_vlm.models.qwen4_exp.language import Qwen4ExpDecoderLayer, _create_qwen4_exp_attention_mask

from ...runtime.vlm_backbone import VlmBackbone
from .head import Qwen4ExpHead


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

    def make_head(self, num_layers: int) -> nn.Module:
        return Qwen4ExpHead(self.args, num_layers)
