"""Batched caches in which every row has its own length: what batched MTP decoding needs.

mlx-lm's ``BatchKVCache`` keeps one write cursor for the whole batch (rows are left-padded to
it), so one row cannot drop its rejected drafts while another keeps them. Here:

``RowKVCache``  full attention. Row r's keys sit left-aligned at positions [0, L_r) of a
    shared buffer. A pass of S tokens writes row r's keys at [L_r, L_r + S) (one scatter) and
    advances every row by S; ``trim_rows(n)`` then takes back row r's last n_r (padding, rejected
    drafts). Positions past L_r keep stale values that no query can see: query i of row r sits at
    position L_r + i and the mask lets it see keys j <= L_r + i only, and the next pass overwrites
    them. RoPE gets the per-row offsets L_r. A pass of one token sees keys [0, max L + 1) and, when
    all rows have the same length, no mask: mlx-lm's ``KVCache`` decode step (int offset, same
    slices). A pass of S > 1 tokens (verify, the head's pending pairs, prefill) sees a window of
    ``window(max L + S)`` keys (``step`` times a power of two) with an array mask, so its attention
    shapes change at each doubling of the context instead of every step: MLX's CUDA backend builds a
    cuDNN attention graph for every new (query, key, mask) shape of a multi-token query, 45-180 ms
    each.
``RowCacheList``  several caches one layer updates together, each of the same rows and lengths (GLM-5's
    MLA latents and its indexer keys, mlx-lm's ``CacheList``): every row operation goes to each.
``RowRollbackCache``  linear attention (GatedDeltaNet). The recording forward keeps the last
    pass's inputs (``rollback.RecordingGatedDelta``); ``rollback_rows(keep)`` re-runs the
    recurrence once over the pass with a per-row mask (position i counts for row r only when
    i < keep_r; a masked position leaves the state as it was, ``mx.where`` in mlx-lm's step) and
    takes each row's conv window at its own cut. Padding and rejected drafts so never reach a
    row's state.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache
from mlx_lm.models.gated_delta import gated_delta_update

from .rollback import RollbackArraysCache


class RowKVCache:
    """Full-attention KV cache for B rows of different lengths (see the module doc)."""

    step = 256

    def __init__(self, lengths: Sequence[int] = (0,)):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.lengths: List[int] = list(lengths)
        # ``lengths`` on the device, kept by device arithmetic while every row moves by the same count (a pass):
        # a new array from the host list each step would be a host-to-device copy per layer per step
        self._lengths_on_device: Optional[mx.array] = None

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1

    @property
    def offset(self) -> Union[int, mx.array]:
        """RoPE offset: an int when every row is at the same position (the stock path), else per row."""
        return self.lengths[0] if self.uniform else self.lengths_array()

    def lengths_array(self) -> mx.array:
        """``lengths`` as a device array [B]."""
        if self._lengths_on_device is None:
            self._lengths_on_device = mx.array(self.lengths)
        return self._lengths_on_device

    def _set_lengths(self, lengths: List[int]) -> None:
        self.lengths, self._lengths_on_device = lengths, None

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    def window(self, end: int) -> int:
        """Keys a pass of several tokens ending at ``end`` attends over: ``step`` times the power of
        two that reaches ``end`` (256, 512, 1024, ...: a new attention shape at each doubling of the
        context, at most twice the keys). The buffer grows to it, so it is a prefix of the buffer."""
        blocks = -(-end // self.step)
        return self.step << (blocks - 1).bit_length()

    def _grow(self, keys: mx.array, values: mx.array, end: int) -> None:
        need = self.window(end)
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        B, H, _, Dk = keys.shape
        have = 0 if self.keys is None else self.keys.shape[2]
        extra = need - have
        new_k = mx.zeros((B, H, extra, Dk), keys.dtype)
        new_v = mx.zeros((B, H, extra, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        end = max(self.lengths) + S
        self._grow(keys, values, end)
        if self.uniform:
            start = self.lengths[0]
            self.keys[..., start:end, :] = keys
            self.values[..., start:end, :] = values
        else:
            at = (self.lengths_array()[:, None] + mx.arange(S))[:, None, :, None]  # [B, 1, S, 1]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        moved = None if self._lengths_on_device is None else self._lengths_on_device + S
        self.lengths, self._lengths_on_device = [n + S for n in self.lengths], moved
        if S > 1:
            end = self.window(end)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """Mask for a pass of N tokens, made before it writes: query i of row r sees keys 0 .. L_r + i.
        One token: None when all rows have the same length, else [B, 1, 1, max L + 1]. Several
        tokens: always an array, [B, 1, N, window(max L + N)] (the padded window the pass reads)."""
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not used by Qwen3.5")
        end = max(self.lengths) + N
        if N == 1:
            if self.uniform:
                return None
        else:
            end = self.window(end)
        lengths = self.lengths_array()[:, None, None, None]
        return mx.arange(end) <= lengths + mx.arange(N)[:, None]

    def trim_rows(self, n: Sequence[int]) -> None:
        """Take back the last n[r] positions of row r."""
        if any(not 0 <= x <= length for x, length in zip(n, self.lengths)):
            raise ValueError(f"cannot trim {list(n)} from rows of lengths {self.lengths}")
        self._set_lengths([length - x for length, x in zip(self.lengths, n)])

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.trim_rows([n] * len(self.lengths))
        return n

    def add_empty_row(self) -> None:
        """Append a row holding nothing yet."""
        self._set_lengths(self.lengths + [0])
        if self.keys is not None:
            self.keys = mx.concatenate([self.keys, mx.zeros((1,) + self.keys.shape[1:], self.keys.dtype)])
            self.values = mx.concatenate([self.values, mx.zeros((1,) + self.values.shape[1:], self.values.dtype)])

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order)."""
        if self.keys is not None:
            idx = mx.array(list(rows))
            self.keys, self.values = self.keys[idx], self.values[idx]
        self._set_lengths([self.lengths[r] for r in rows])

    def extend(self, other: "RowKVCache") -> None:
        """Append ``other``'s rows after this cache's (buffers padded to the longer one)."""
        if other.keys is None:
            raise ValueError("cannot add rows with an empty cache")
        if self.keys is not None:
            size = max(self.keys.shape[2], other.keys.shape[2])
            pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)])  # noqa: E731
            self.keys = mx.concatenate([pad(self.keys), pad(other.keys)])
            self.values = mx.concatenate([pad(self.values), pad(other.values)])
        else:
            self.keys, self.values = other.keys, other.values
        self._set_lengths(self.lengths + other.lengths)


class RowCacheList(CacheList):
    """mlx-lm's ``CacheList`` of ``RowKVCache``s: the caches of one layer (GLM-5: MLA latents with their RoPE
    keys, and the indexer's keys), written by the same passes, so every row has one length in all of them.
    The layer reads offsets and masks from the first (as mlx-lm's model does from its ``CacheList``)."""

    @property
    def lengths(self) -> List[int]:
        return self.caches[0].lengths

    @property
    def offset(self):
        return self.caches[0].offset

    @property
    def state(self):
        return [x for c in self.caches for x in c.state]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return self.caches[0].make_mask(N, return_array, window_size)

    def trim_rows(self, n: Sequence[int]) -> None:
        for c in self.caches:
            c.trim_rows(n)

    def add_empty_row(self) -> None:
        for c in self.caches:
            c.add_empty_row()

    def filter(self, rows: Sequence[int]) -> None:
        for c in self.caches:
            c.filter(rows)

    def extend(self, other: "RowCacheList") -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)


def row_caches_like(caches: Sequence, rows: int) -> list:
    """Per-row twins of a library's attention caches, ``rows`` rows of length 0 each: ``KVCache`` ->
    ``RowKVCache``, ``CacheList`` -> ``RowCacheList`` of its caches' twins. Any other kind (a rotating
    window, a recurrent state) has no per-row twin here: ``ValueError`` naming it."""
    out = []
    for c in caches:
        if type(c) is KVCache:
            out.append(RowKVCache([0] * rows))
        elif type(c) is CacheList:
            out.append(RowCacheList(*row_caches_like(c.caches, rows)))
        else:
            raise ValueError(f"no per-row cache for mlx-lm's {type(c).__name__}")
    return out


class RowRecurrentCache:
    """The batched engine's row operations on a recurrent layer's undoable cache, mixed in before it
    (``class Twin(RowRecurrentCache, RollbackArraysCache)``): its last pass undone to a different prefix in every row,
    rows dropped and appended. ``cut_rows`` is where the recurrences differ."""

    def rollback_rows(self, keep: Sequence[int]) -> None:
        """Row r keeps the first keep[r] tokens of the last pass (1 <= keep[r] <= its length)."""
        S = self.pass_length
        if any(not 1 <= k <= S for k in keep):
            raise ValueError(f"cannot keep {list(keep)} of a {S}-token pass")
        if len(set(keep)) == 1:  # one cut for all rows: the single-sequence undo
            self.rollback(keep[0])
            return
        p, kept = self.recorded_pass(), mx.array(list(keep))
        self[1] = self.cut_rows(p, list(keep), kept)
        n_window = p.conv_input.shape[1] - S  # the conv window before the pass, then the pass's S inputs
        window = (kept[:, None] + mx.arange(n_window))[..., None]  # [B, K-1, 1]: each row's last K-1 inputs
        self[0] = mx.take_along_axis(p.conv_input, window, axis=1)
        self.last_pass = None  # rows now end at different cuts: no single prefix to return to
        self.pass_length = min(keep)

    def cut_rows(self, last_pass, keep: List[int], kept: mx.array) -> mx.array:
        """The recurrent state of every row after its first keep[r] positions of ``last_pass`` (``kept``: the same
        counts on the device)."""
        raise NotImplementedError

    def filter(self, rows: Sequence[int]) -> None:
        super().filter(mx.array(list(rows)))
        self.last_pass, self.pass_length = None, 0

    def extend(self, other) -> None:
        super().extend(other)
        self.last_pass, self.pass_length = None, 0


class RowRollbackCache(RowRecurrentCache, RollbackArraysCache):
    """Linear-attention (GatedDeltaNet) cache whose last pass can be undone to a different prefix in every row: one
    replay of the recurrence over the pass, a position counting for row r only while it is under keep[r] (a masked
    position leaves the state as it was, ``mx.where`` in mlx-lm's step)."""

    def cut_rows(self, last_pass, keep: List[int], kept: mx.array) -> mx.array:
        p = last_pass
        counts = mx.arange(self.pass_length)[None] < kept[:, None]  # [B, S]: positions each row keeps
        _, state = gated_delta_update(p.q, p.k, p.v, p.a, p.b, p.layer.A_log, p.layer.dt_bias, p.state, counts,
                                      use_kernel=not p.layer.training)
        return state


def undo_rows(cache: list, keep: Sequence[int], length: int) -> None:
    """Row r keeps the first keep[r] tokens of the last ``length``-token pass in every layer."""
    if all(k == length for k in keep):
        return
    for c in cache:
        if hasattr(c, "rollback_rows"):  # a recurrent state (GatedDeltaNet's here, a family's own kind)
            c.rollback_rows(keep)
        else:
            c.trim_rows([length - k for k in keep])
