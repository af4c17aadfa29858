"""How the runtime drives a Qwen3.5 / 3.6 backbone as mlx-lm builds it (``mlx_lm.models.qwen3_5``): GatedDeltaNet
and full-attention layers, each kind with its own mask, and the head of Qwen's MTP design."""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from ...runtime.backbone import TextModelBackbone
from ...runtime.decoding.heads import MTPHead
from ...runtime.decoding.rollback import RecordingGatedDelta, RollbackArraysCache
from ...runtime.decoding.rowcache import RowKVCache, RowRollbackCache


class RecordingGatedDeltaNet(RecordingGatedDelta, GatedDeltaNet):
    """Qwen3.5's GatedDeltaNet (split projections) whose pass can be undone to any prefix."""

    def _project(self, inputs: mx.array):
        B, S, _ = inputs.shape
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(inputs), z, self.in_proj_b(inputs), self.in_proj_a(inputs)


class Qwen35Backbone(TextModelBackbone):
    # each linear-attention class of the backbone and its recording twin (same parameters, same stock forward)
    recording = {GatedDeltaNet: RecordingGatedDeltaNet}

    def is_recurrent(self, layer: nn.Module) -> bool:
        return layer.is_linear

    def forward(self, tokens: mx.array, cache: list) -> Tuple[Optional[mx.array], mx.array]:
        """The text model's own forward, stopped before its final norm to give the pre-norm states too."""
        inner = self.text.model
        x = inner.embed_tokens(tokens)
        fa_mask = create_attention_mask(x, cache[inner.fa_idx])
        ssm_mask = create_ssm_mask(x, cache[inner.ssm_idx])
        for layer, c in zip(inner.layers, cache):
            x = layer(x, mask=ssm_mask if layer.is_linear else fa_mask, cache=c)
        return x, inner.norm(x)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        if layer.is_linear:
            return create_ssm_mask(x, None)
        return create_attention_mask(x, None)  # mlx-lm's "causal" shorthand, as the model's forward passes it

    def attention_cache(self, cache: list):
        return cache[self.text.model.fa_idx]

    def enable_rollback(self) -> None:
        for layer in self.layers:
            if layer.is_linear and type(layer.linear_attn) in self.recording:
                layer.linear_attn.__class__ = self.recording[type(layer.linear_attn)]

    def rollback_cache(self, max_pass: int) -> list:
        return [RollbackArraysCache(max_pass) if layer.is_linear else KVCache() for layer in self.layers]

    def row_cache(self, max_pass: int, rows: int) -> list:
        return [RowRollbackCache(max_pass) if layer.is_linear else RowKVCache([0] * rows) for layer in self.layers]

    def head_layers(self, num_layers: int) -> List[nn.Module]:
        # layer_idx = interval - 1 makes mlx-lm build a full-attention layer (and, in Qwen3-Next, the MoE block
        # wherever the model has experts)
        return [self.new_layer(self.args.full_attention_interval - 1) for _ in range(num_layers)]

    def make_head(self, num_layers: int) -> nn.Module:
        return MTPHead(self.hidden_size, self.rms_norm_eps, self.head_layers(num_layers))
