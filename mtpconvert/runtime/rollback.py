"""Caches that can undo the rejected tail of a verify pass.

Full-attention layers keep a ``KVCache``: undoing n tokens is ``trim(n)``.
Linear-attention (GatedDeltaNet) layers keep a conv window and an SSM state that every
token overwrites, so the only way back is to have kept the state after each position.
``RecordingGatedDeltaNet`` is mlx-lm's GatedDeltaNet whose forward, when its cache asks
for it, steps the recurrence one position at a time and keeps every intermediate
(conv window, SSM state) pair; ``RollbackArraysCache.rollback(n)`` then returns to the
state after the n-th token of the last pass at no compute cost. The projections run
once over all positions, as in the stock forward, so the weights are read once.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet


class RollbackArraysCache(ArraysCache):
    """ArraysCache(conv window, SSM state) that remembers the state after each token of the last pass."""

    def __init__(self):
        super().__init__(size=2)
        self.history: List[Tuple[mx.array, mx.array]] = []

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last pass (1 <= keep <= its length)."""
        if not 1 <= keep <= len(self.history):
            raise ValueError(f"cannot keep {keep} of a {len(self.history)}-token pass")
        self[0], self[1] = self.history[keep - 1]
        self.history = self.history[:keep]


class RecordingGatedDeltaNet(GatedDeltaNet):
    """GatedDeltaNet that records per-position states into a RollbackArraysCache."""

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        if not isinstance(cache, RollbackArraysCache):
            return super().__call__(inputs, mask, cache)
        if self.sharding_group is not None or cache.lengths is not None:
            raise NotImplementedError("speculative decoding runs one unsharded sequence")
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)

        n_keep = self.conv_kernel_size - 1
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, self.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)

        state = cache[1]
        outs, history = [], []
        for t in range(S):
            s = slice(t, t + 1)
            out_t, state = gated_delta_update(
                q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], self.A_log, self.dt_bias, state,
                None if mask is None else mask[:, s], use_kernel=not self.training,
            )
            outs.append(out_t)
            history.append((conv_input[:, t + 1: t + 1 + n_keep], state))
        cache.history = history
        cache[0], cache[1] = history[-1]
        cache.advance(S)

        out = self.norm(mx.concatenate(outs, axis=1) if S > 1 else outs[0], z)
        return self.out_proj(out.reshape(B, S, -1))


def enable_rollback(model: nn.Module) -> None:
    """Make every linear-attention layer of a loaded qwen3_5 model record states (idempotent).

    Only the class changes: parameters, names and the stock forward (used whenever the
    cache is not a RollbackArraysCache) stay exactly mlx-lm's.
    """
    for layer in model.language_model.model.layers:
        if layer.is_linear and type(layer.linear_attn) is GatedDeltaNet:
            layer.linear_attn.__class__ = RecordingGatedDeltaNet


def make_rollback_cache(model: nn.Module) -> list:
    return [RollbackArraysCache() if layer.is_linear else KVCache() for layer in model.language_model.model.layers]


def rollback(cache: list, keep: int, length: int) -> None:
    """Undo the last ``length - keep`` tokens of the last pass in every layer's cache."""
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.rollback(keep)
        elif length > keep:
            c.trim(length - keep)
