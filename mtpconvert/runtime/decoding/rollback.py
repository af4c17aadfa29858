"""Caches that can undo the rejected tail of a verify pass.

Full-attention layers keep a ``KVCache``: undoing n tokens is ``trim(n)``.
Linear-attention (GatedDeltaNet) layers keep a conv window and an SSM state that every
token overwrites, so there is nothing to trim. A family's recording twin of its GatedDeltaNet
(``RecordingGatedDelta`` over the library's class, in the family's backbone adapter, which swaps
it in: ``Backbone.enable_rollback``) is that layer whose forward, when its cache is a
``RollbackArraysCache``, runs the pass
exactly as the stock forward does (one recurrence call over all positions) and only keeps
references to what went in: the state before the pass, the conv input and the per-position
q, k, v, a, b. ``rollback(keep)`` then takes the conv window from the kept positions and
re-runs the recurrence over the ``keep`` kept positions from the saved state: no
projection is recomputed, nothing is evaluated until the next pass needs it, and a fully
accepted pass costs nothing extra. (Stepping the recurrence one position at a time to keep
every intermediate state costs k+1 recurrence calls per layer on every verify pass and
every prefill token; on a launch-bound GPU that made a 2-token verify 1.6 decode steps.)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk


class LinearPass(NamedTuple):
    """What went into one linear-attention pass: enough to recompute its state at any prefix."""

    layer: nn.Module  # the recording GatedDeltaNet (its A_log, dt_bias and conv kernel size)
    conv_input: mx.array  # [B, K-1 + S, C]: the conv window before the pass, then the S inputs
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state: Optional[mx.array]  # SSM state before the pass
    mask: Optional[mx.array]

    def prefix(self, keep: int) -> "LinearPass":
        """The same pass, as if it had been only its first ``keep`` tokens."""
        cut = lambda x: None if x is None else x[:, :keep]  # noqa: E731
        n_window = self.layer.conv_kernel_size - 1
        return self._replace(conv_input=self.conv_input[:, : keep + n_window], q=cut(self.q), k=cut(self.k),
                             v=cut(self.v), a=cut(self.a), b=cut(self.b), mask=cut(self.mask))


class RollbackArraysCache(ArraysCache):
    """ArraysCache(conv window, SSM state) that can return to any prefix of the last pass.

    Only passes of at most ``max_pass`` tokens are kept undoable: a verify pass is k+1
    tokens, while a prompt prefill is never undone and its saved inputs would be large.
    """

    def __init__(self, max_pass: int = 16):
        super().__init__(size=2)
        self.max_pass = max_pass
        self.last_pass: Optional[LinearPass] = None
        self.pass_length = 0

    def record(self, last_pass: LinearPass, length: int) -> None:
        self.last_pass = last_pass if length <= self.max_pass else None
        self.pass_length = length

    def recorded_pass(self):
        """The last pass's record, which an undo replays; ``ValueError`` where it was too long to be recorded."""
        if self.last_pass is None:
            raise ValueError(f"a {self.pass_length}-token pass is longer than max_pass={self.max_pass}: not undoable")
        return self.last_pass

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last pass (1 <= keep <= its length)."""
        if not 1 <= keep <= self.pass_length:
            raise ValueError(f"cannot keep {keep} of a {self.pass_length}-token pass")
        if keep < self.pass_length:
            p = self.recorded_pass().prefix(keep)
            _, state = gated_delta_update(p.q, p.k, p.v, p.a, p.b, p.layer.A_log, p.layer.dt_bias, p.state, p.mask,
                                          use_kernel=not p.layer.training)
            self[0], self[1] = p.conv_input[:, keep:], state
            self.last_pass = p
        self.pass_length = keep


class RecordingGatedDelta:
    """The recording forward shared by every GatedDeltaNet variant, mixed in before the library's class
    (``class Twin(RecordingGatedDelta, GatedDeltaNet)``): ``_project`` is where the variants differ."""

    def _project(self, inputs: mx.array):
        """(mixed q|k|v before the conv, z, b, a) of the input positions."""
        raise NotImplementedError

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        if not isinstance(cache, RollbackArraysCache):
            return super().__call__(inputs, mask, cache)
        if inputs.shape[1] == 1:  # a one-token pass is never undone (it keeps its one token): the library's forward
            cache.record(None, 1)
            return super().__call__(inputs, mask, cache)
        if getattr(self, "sharding_group", None) is not None or cache.lengths is not None:
            raise NotImplementedError("speculative decoding runs one unsharded sequence")
        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)

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

        state_before = cache[1]
        out, state = gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, state_before, mask, use_kernel=not self.training,
        )
        cache.record(LinearPass(self, conv_input, q, k, v, a, b, state_before, mask), S)
        cache[0], cache[1] = mx.contiguous(conv_input[:, -n_keep:]), state
        cache.advance(S)

        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


def rollback(cache: list, keep: int, length: int) -> None:
    """Undo the last ``length - keep`` tokens of the last pass in every layer's cache."""
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.rollback(keep)
        elif length > keep:
            c.trim(length - keep)
