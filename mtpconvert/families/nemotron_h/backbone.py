"""How the runtime drives a Nemotron-H backbone as mlx-lm builds it (``mlx_lm.models.nemotron_h``), and the Mamba2
recording twin that lets a rejected draft be undone exactly.

mlx-lm's model keeps ``backbone.{embeddings, layers, norm_f}`` and ``lm_head``; each block is ``x + mixer(norm(x))``
of its kind. Its cache list is sparse: one entry per Mamba2 (``M``: conv window and SSM state) or attention
(``*``: KVCache) block, none for MoE and MLP blocks, walked in block order by ``NemotronHModel.__call__``. The
adapter runs that forward as it is (post-``norm_f`` states only: the head reads those) and builds caches in the
same sparse order.

A Mamba2 block's state is overwritten by every token, so a verify pass cannot be trimmed like a KV cache. Its
recording twin runs the stock forward (mlx-lm's own ``_conv`` and ``_ssm``, so the pass is bit for bit the stock
one) and keeps references to what went in: the conv window and SSM state before the pass, the pre-conv inputs,
the post-conv ``x``, ``B``, ``C`` and ``dt``. ``rollback(keep)`` takes the conv window from the kept positions'
inputs and re-runs mlx-lm's chunked scan (``ssm_attn``) over the ``keep`` kept positions from the saved state:
what the stock forward leaves after only those positions (GatedDeltaNet's scheme, ``runtime.decoding.rollback``).

For the batched engine (``row_cache``) attention blocks take ``RowKVCache``s (no RoPE here, so only their per-row
lengths and masks matter) and Mamba2 blocks ``MambaRowRollbackCache``s: every row feeds the same number of tokens per
pass, so the stock forward runs unmasked, and ``rollback_rows(keep)`` cuts each row's pass at its own keep.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.nemotron_h import NemotronHBlock, NemotronHMamba2Mixer
from mlx_lm.models.ssm import ssm_attn

from ...runtime.backbone import TextModelBackbone
from ...runtime.decoding.rollback import RollbackArraysCache
from ...runtime.decoding.rowcache import RowKVCache, RowRecurrentCache
from .head import NemotronHHead


class MambaPass(NamedTuple):
    """What went into one Mamba2 pass of S positions: enough to recompute its state at any prefix."""

    mixer: nn.Module  # the recording mixer (its A_log, D, dt_bias, conv kernel size, time-step limit)
    conv_input: mx.array  # [B, K-1 + S, conv_dim]: the conv window before the pass, then the S pre-conv inputs
    x: mx.array  # [B, S, intermediate]: the scan's input after the conv
    B: mx.array  # [B, S, groups * state]
    C: mx.array
    dt: mx.array  # [B, S, heads], before softplus
    state: Optional[mx.array]  # the SSM state before the pass


class MambaRollbackCache(RollbackArraysCache):
    """ArraysCache(conv window, SSM state) of a Mamba2 block that can return to any prefix of its last pass."""

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last pass (1 <= keep <= its length)."""
        if not 1 <= keep <= self.pass_length:
            raise ValueError(f"cannot keep {keep} of a {self.pass_length}-token pass")
        if keep < self.pass_length:
            p = self.recorded_pass()
            n_window = p.mixer.conv_kernel_size - 1
            self[0], self[1] = p.conv_input[:, keep: keep + n_window], scan_prefix(p, keep)
            self.last_pass = p._replace(conv_input=p.conv_input[:, : keep + n_window], x=p.x[:, :keep],
                                        B=p.B[:, :keep], C=p.C[:, :keep], dt=p.dt[:, :keep])
        self.pass_length = keep


def scan_prefix(p: MambaPass, keep: int, rows: Optional[mx.array] = None) -> mx.array:
    """The SSM state after the first ``keep`` positions of pass ``p`` (of ``rows`` only, when given): mlx-lm's
    chunked scan (``ssm_attn``, what its forward runs over several positions) from the state before the pass."""
    m = p.mixer
    x, B, C, dt, state = p.x, p.B, p.C, p.dt, p.state
    if rows is not None:
        x, B, C, dt = x[rows], B[rows], C[rows], dt[rows]
        state = None if state is None else state[rows]
    b = x.shape[0]
    _, state = ssm_attn(x[:, :keep].reshape(b, keep, m.num_heads, m.head_dim), m.A_log,
                        B[:, :keep].reshape(b, keep, m.n_groups, m.ssm_state_size),
                        C[:, :keep].reshape(b, keep, m.n_groups, m.ssm_state_size),
                        m.D.astype(x.dtype), dt[:, :keep], m.dt_bias, state, m.time_step_limit)
    return state


class MambaRowRollbackCache(RowRecurrentCache, MambaRollbackCache):
    """The Mamba2 cache of B rows for the batched engine, whose last pass is undone to a different prefix in every
    row.

    mlx-lm's scan masks left padding only: it returns the state at the pass's last position, and a masked last
    position drops the kept positions' inputs too (only the decayed state before the pass is left). So the kept
    prefixes are cut per row instead: one scan per distinct cut (at most the pass's length) over the rows that keep
    that many, each the single-row undo's scan, then the states back in row order."""

    def cut_rows(self, last_pass: MambaPass, keep: List[int], kept: mx.array) -> mx.array:
        cuts = sorted(set(keep))
        order = [r for n in cuts for r, k in enumerate(keep) if k == n]  # rows grouped by cut
        states = []
        for n in cuts:
            rows = mx.array([r for r, k in enumerate(keep) if k == n])
            # rows that keep the whole pass keep the state the stock forward left
            states.append(scan_prefix(last_pass, n, rows) if n < self.pass_length else self[1][rows])
        back = mx.array(sorted(range(len(order)), key=order.__getitem__))  # row r's place in `order`
        return mx.concatenate(states)[back]


class RecordingMamba2Mixer(NemotronHMamba2Mixer):
    """mlx-lm's Mamba2 mixer whose pass, over a ``MambaRollbackCache``, can be undone to any prefix."""

    def __call__(self, hidden_states: mx.array, mask: Optional[mx.array], cache=None) -> mx.array:
        if not isinstance(cache, MambaRollbackCache):
            return super().__call__(hidden_states, mask, cache)
        if mask is not None or cache.lengths is not None:
            raise NotImplementedError("speculative decoding runs one unpadded sequence")
        B, S, _ = hidden_states.shape
        gate, conv_in, dt = mx.split(self.in_proj(hidden_states), [self.intermediate_size,
                                                                   self.intermediate_size + self.conv_dim], axis=-1)
        window = cache[0] if cache[0] is not None else mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim),
                                                                dtype=conv_in.dtype)
        state_before = cache[1]
        conv_out = self._conv(conv_in, cache, None)  # the stock conv: sets the cache's window
        x, b, c = mx.split(conv_out, [self.intermediate_size, self.intermediate_size + self.n_groups *
                                      self.ssm_state_size], axis=-1)
        y = self._ssm(x, b, c, dt, cache, None)  # the stock scan: sets the cache's state
        cache.record(MambaPass(self, mx.concatenate([window, conv_in], axis=1), x, b, c, dt, state_before), S)
        cache.advance(S)
        return self.out_proj(self.norm(y, gate))


class NemotronHBackbone(TextModelBackbone):
    recording = {NemotronHMamba2Mixer: RecordingMamba2Mixer}

    @property
    def rms_norm_eps(self) -> float:
        return self.args.layer_norm_epsilon

    @property
    def tied(self) -> bool:
        return False  # mlx-lm's nemotron_h always builds its lm_head

    def is_recurrent(self, layer: nn.Module) -> bool:
        return layer.block_type == "M"

    def forward(self, tokens: mx.array, cache: list) -> Tuple[Optional[mx.array], mx.array]:
        return None, self.model.backbone(tokens, cache)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        # as NemotronHModel.__call__ passes them: the attention mask to attention blocks, the SSM mask (None for one
        # unpadded sequence) to the others, which only Mamba2 blocks read
        return create_attention_mask(x, None) if layer.block_type == "*" else None

    def new_layer(self, index: int) -> nn.Module:
        return NemotronHBlock(self.args, self.args.hybrid_override_pattern[index])

    def attention_cache(self, cache: list):
        return cache[self.model.backbone.fa_idx]  # the first attention block's entry in the sparse list

    def enable_rollback(self) -> None:
        for layer in self.layers:
            if layer.block_type == "M" and type(layer.mixer) in self.recording:
                layer.mixer.__class__ = self.recording[type(layer.mixer)]

    def rollback_cache(self, max_pass: int) -> list:
        return [MambaRollbackCache(max_pass) if layer.block_type == "M" else KVCache()
                for layer in self.layers if layer.block_type in "M*"]

    def row_cache(self, max_pass: int, rows: int) -> list:
        # the head's caches come from row_caches_like (its attention blocks' KVCaches); NemotronHHead refuses a head
        # pattern with a Mamba2 block, whose state would need a per-row undo of its own
        return [MambaRowRollbackCache(max_pass) if layer.block_type == "M" else RowKVCache([0] * rows)
                for layer in self.layers if layer.block_type in "M*"]

    def make_head(self, num_layers: int) -> nn.Module:
        """The prediction module (``num_layers`` is the config's 1: its blocks are one MTP layer)."""
        pattern = self.family.spec(self.config).mtp_pattern
        return NemotronHHead([NemotronHBlock(self.args, kind) for kind in pattern], self.hidden_size,
                             self.rms_norm_eps)
