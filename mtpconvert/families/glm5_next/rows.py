"""Per-row caches of a glm5_next model for the batched engine (``runtime.decoding.batched``): rows of different
lengths, each pass undone per row.

mlx-vlm's glm5_next layers read their caches as a batch whose rows all end at the same position (its own batches are
left-padded): the sparse attention's indexer takes a row's first key as its first valid one, pools keys in windows
of ``index_kpool`` from there, and places every query at ``keys - queries + i``. So the rows here are right-aligned
too, row r holding its tokens at ``[pad_r, size)``, and no position is ever needed otherwise (the attention and
its indexer have no RoPE: a row's keys may sit anywhere as long as their order is kept).

``SparseRows``  one sparse-attention layer (the backbone's, or the head's): the MLA latents; where the layer has
    an indexer of its own, the indexer's raw keys and gates, whose pools are computed afresh from them at every
    pass (``_compress_pools`` of every complete window from ``pad_r``: the values mlx-vlm's ``PoolingCache`` computes
    window by window, with nothing pooled to take back when a row is cut), and its key validity (``pad_r`` on);
    mlx-vlm's projected-key cache is never matched (``size`` -1), so a long pass projects the latents it reads.
    A row is cut (``trim_rows``) by shifting it right by what it drops beyond the batch's common cut: its dropped
    positions become its padding, as mlx-vlm's ``BatchKVCache.finalize`` rolls a ragged tail.
A linear-attention layer keeps mlx-vlm's ``ArraysCache`` (``runtime.vlm_rows.RowArraysCache``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx


class SparseRows:
    """One sparse-attention layer's caches for B rows (module doc), indexed as the layer indexes mlx-vlm's
    ``CacheList``: [latents, validity, pools, projected] with an indexer of its own, [latents, projected] without."""

    def __init__(self, rows: int, index_kpool: Optional[int]):
        self.kpool = index_kpool
        self.pad: List[int] = [0] * rows
        self.size = 0
        self.latent: Optional[mx.array] = None  # [B, 1, size, kv_lora_rank]
        self.index_keys: Optional[mx.array] = None  # [B, size, index_head_dim]
        self.index_gates: Optional[mx.array] = None
        self.caches = [_Latents(self), _Validity(self), _Pools(self), _NoProjection()] if index_kpool else \
            [_Latents(self), _NoProjection()]

    def __getitem__(self, i):
        return self.caches[i]

    @property
    def lengths(self) -> List[int]:
        return [self.size - p for p in self.pad]

    @property
    def offset(self):
        """Tokens each row holds: an int when all rows hold the same number."""
        lengths = self.lengths
        return lengths[0] if len(set(lengths)) == 1 else mx.array(lengths)

    @property
    def state(self):
        return [x for x in (self.latent, self.index_keys, self.index_gates) if x is not None]

    # the arrays a row operation applies to, and their position axis
    ARRAYS = (("latent", 2), ("index_keys", 1), ("index_gates", 1))

    def _map(self, fn) -> None:
        for name, axis in self.ARRAYS:
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, fn(x, axis))

    def trim_rows(self, n: Sequence[int]) -> None:
        """Take back the last n[r] positions of row r."""
        lengths = self.lengths
        if any(not 0 <= x <= length for x, length in zip(n, lengths)):
            raise ValueError(f"cannot trim {list(n)} from rows of lengths {lengths}")
        common = min(n)
        if common:
            self.size -= common
            self._map(lambda x, axis: _take(x, axis, mx.arange(self.size)))
        extra = [x - common for x in n]
        if any(extra):  # shift each row right by its extra cut: its dropped positions become padding
            source = (mx.arange(self.size)[None] - mx.array(extra)[:, None]) % max(self.size, 1)  # [B, size]
            self._map(lambda x, axis: mx.take_along_axis(x, source.reshape(_index_shape(x, axis, source)), axis=axis))
            self.pad = [p + e for p, e in zip(self.pad, extra)]

    def trim(self, n: int) -> int:
        self.trim_rows([n] * len(self.pad))
        return n

    def add_empty_row(self) -> None:
        self.pad.append(self.size)
        self._map(lambda x, axis: mx.concatenate([x, mx.zeros((1,) + x.shape[1:], x.dtype)]))

    def filter(self, rows: Sequence[int]) -> None:
        idx = mx.array(list(rows))
        self._map(lambda x, axis: x[idx])
        self.pad = [self.pad[r] for r in rows]
        drop = min(self.pad)  # padding every row has
        if drop:
            self.size -= drop
            self.pad = [p - drop for p in self.pad]
            self._map(lambda x, axis: _take(x, axis, mx.arange(drop, drop + self.size)))

    def extend(self, other: "SparseRows") -> None:
        """Append ``other``'s rows after this cache's, both right-aligned at the longer one's size."""
        size = max(self.size, other.size)
        for c in (self, other):
            grow = size - c.size
            if grow:
                c._map(lambda x, axis: mx.concatenate(
                    [mx.zeros(x.shape[:axis] + (grow,) + x.shape[axis + 1:], x.dtype), x], axis=axis))
                c.pad, c.size = [p + grow for p in c.pad], size
        for name, axis in self.ARRAYS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                continue
            if a is None or b is None:
                raise ValueError("cannot join rows that hold nothing yet with rows that do")
            setattr(self, name, mx.concatenate([a, b]))
        self.pad = self.pad + other.pad

    # what the views below give the layer

    def append(self, name: str, x: mx.array, axis: int) -> mx.array:
        have = getattr(self, name)
        setattr(self, name, x if have is None else mx.concatenate([have, x], axis=axis))
        return getattr(self, name)

    def validity(self) -> mx.array:
        return mx.arange(self.size)[None] >= mx.array(self.pad)[:, None]  # [B, size]

    def pool_counts(self) -> List[int]:
        return [(self.size - p) // self.kpool for p in self.pad]


def _take(x: mx.array, axis: int, idx: mx.array) -> mx.array:
    return mx.take(x, idx, axis=axis)


def _index_shape(x: mx.array, axis: int, source: mx.array):
    """``source`` [B, size] broadcast to index ``x`` along ``axis``."""
    shape = [1] * x.ndim
    shape[0], shape[axis] = source.shape
    return shape


class _Latents:
    """The layer's latent cache: written first in a pass, it advances the rows."""

    def __init__(self, owner: SparseRows):
        self.owner = owner

    @property
    def offset(self):
        return self.owner.offset

    def update_and_fetch(self, latent: mx.array, _values: mx.array):
        o = self.owner
        o.size += latent.shape[2]
        return o.append("latent", latent, 2), _values


class _Validity:
    """The indexer's key-validity cache: a row's keys are valid from its padding on."""

    def __init__(self, owner: SparseRows):
        self.owner = owner

    def update_and_fetch(self, _query_valid: mx.array, _values: mx.array):
        # every query of a pass is a row's token (the engine passes no padding mask)
        return self.owner.validity()[:, None, :, None], _values


class _Pools:
    """The indexer's pooled keys, computed from every row's complete windows at each pass (module doc)."""

    def __init__(self, owner: SparseRows):
        self.owner = owner

    @property
    def offset(self) -> mx.array:
        return mx.array(self.owner.pool_counts())

    def accumulate_windows(self, keys: mx.array, gates: mx.array, _offset):
        o = self.owner
        o.append("index_keys", keys, 1)
        o.append("index_gates", gates, 1)
        windows = max(o.pool_counts()) * o.kpool
        at = mx.minimum(mx.array(o.pad)[:, None] + mx.arange(windows)[None], max(o.size - 1, 0))[..., None]
        return (mx.take_along_axis(o.index_keys, at, axis=1), mx.take_along_axis(o.index_gates, at, axis=1), None)

    def update_and_fetch(self, pooled: mx.array) -> mx.array:
        return pooled


class _NoProjection:
    """mlx-vlm's projected-key cache, never matched: a long pass projects the latents it reads."""

    def size(self) -> int:
        return -1
