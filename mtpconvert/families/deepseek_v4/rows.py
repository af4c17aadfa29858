"""Per-row caches of a deepseek_v4 model for the batched engine (``runtime.decoding.batched``): rows of different
lengths, each pass undone per row.

mlx-vlm's caches of this model cannot take back a different number of tokens in each row: its sliding-window
``RotatingKVCache`` overwrites, in place, the keys a rejected draft displaced, and its ``PoolingCache`` folds a
window's raw keys into one pooled key as the window completes. Here every row keeps what a cut needs, so a cut is
only a shorter length:

``WindowRows``  the sliding-window attention (every block's local keys, the head's): row r's keys, RoPE'd at their
    own positions (the layer reads ``offset``: the rows' lengths, an array when they differ), left-aligned at
    [0, L_r) as ``RowKVCache`` keeps them, all of them; the mask applies the window as mlx-vlm's rotating cache does
    (query at position p sees keys p - window < j <= p).
``PoolRows``  one compressor's pool (the compressed attention's, or the indexer's): each row's raw keys and gates
    (left-aligned, all of them) and its pooled keys, the first L_r // ratio of them valid. A pass pools, in every
    row, the windows it completes, from the raw keys, as mlx-vlm's ``PoolingCache.accumulate_windows`` hands them
    to the compressor: the windows completed in one call together (a ratio-4 compressor's overlap reads the window
    before only within the call, as mlx-vlm's does), with the RoPE position of the row's first one. A cut row's
    windows past its new length are computed again when it completes them again, so nothing pooled is taken back.
``LayerRows``  a compressed block's caches [local, pool(s)], indexed as the layer indexes mlx-vlm's ``CacheList``.
``RowsIndexer``  mlx-vlm's sparse indexer, which scores a batch's pools at once: rows with different pool counts
    need a mask, and with one its one-token pass scores every pool (the dense top-k), where a row alone, all of its
    pools visible, selects hierarchically (HISA) once it holds ``index_block * index_keep`` of them. There the
    indexer runs row by row on each row's own pools, as the row alone runs it.

The hyper-connections carry nothing from one token to the next (they mix a token's own streams), so no cache
holds them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import mlx.core as mx
from mlx_vlm.models.deepseek_v4.language import Indexer

from ...runtime.decoding.rowcache import RowKVCache


class WindowRows(RowKVCache):
    """Sliding-window keys of B rows (module doc). mlx-vlm's layer writes its keys as ``keys`` and no values (a
    zero-width array): they are kept as they come."""

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """Mask for a pass of N tokens, made before it writes: query i of row r (position L_r + i) sees keys
        L_r + i - window < j <= L_r + i. One token of rows of one length that all still see their whole past:
        None (the stock decode step)."""
        end = max(self.lengths) + N
        if N == 1:
            if self.uniform and (window_size is None or end <= window_size):
                return None
        else:
            end = self.window(end)
        query = self.lengths_array()[:, None, None, None] + mx.arange(N)[:, None]  # [B, 1, N, 1]
        keys = mx.arange(end)
        mask = keys <= query
        return mask if window_size is None else mask & (keys > query - window_size)


class PoolRows:
    """One compressor's pool for B rows (module doc): what the layer calls on mlx-vlm's ``PoolingCache``
    (``accumulate_windows``, ``update_and_fetch``, ``make_mask``) and the engine's row operations."""

    step = 256  # raw positions a buffer grows by
    pooled_step = 64  # pooled keys

    def __init__(self, ratio: int, rows: int):
        self.ratio = ratio
        self.lengths: List[int] = [0] * rows
        self.raw_kv: Optional[mx.array] = None  # [B, capacity, kv width]
        self.raw_gate: Optional[mx.array] = None
        self.pooled: Optional[mx.array] = None  # [B, pooled capacity, head_dim]
        self._first: List[int] = []  # the window each row's pass pools first (accumulate -> update_and_fetch)

    @property
    def counts(self) -> List[int]:
        """Pooled keys valid in each row: its complete windows."""
        return [n // self.ratio for n in self.lengths]

    @property
    def state(self):
        return [x for x in (self.raw_kv, self.raw_gate, self.pooled) if x is not None]

    # what the layer calls

    def accumulate_windows(self, kv: mx.array, gate: mx.array, _offset):
        """Store the pass's raw keys and gates; return every row's windows this pass completes ([B, n * ratio, .],
        n the most any row completes, rows that complete fewer padded with windows whose pools are dropped) and the
        position of each row's first one."""
        L = kv.shape[1]
        before = self.lengths
        self.raw_kv = _write(self.raw_kv, kv, before, self.step)
        self.raw_gate = _write(self.raw_gate, gate, before, self.step)
        self.lengths = [n + L for n in before]
        self._first = [n // self.ratio for n in before]
        windows = max(c - f for c, f in zip(self.counts, self._first))
        if windows == 0:
            return kv[:, :0], gate[:, :0], 0
        start = [f * self.ratio for f in self._first]
        if len(set(start)) == 1:
            at = slice(start[0], start[0] + windows * self.ratio)
            return self.raw_kv[:, at], self.raw_gate[:, at], start[0]
        at = mx.minimum(mx.array(start)[:, None] + mx.arange(windows * self.ratio)[None],
                        self.raw_kv.shape[1] - 1)[..., None]
        ready_kv = mx.take_along_axis(self.raw_kv, at, axis=1)
        ready_gate = mx.take_along_axis(self.raw_gate, at, axis=1)
        return ready_kv, ready_gate, mx.array(start)

    def update_and_fetch(self, pooled: mx.array) -> mx.array:
        """Write each row's new pooled keys after its valid ones; return the pool [B, most valid, head_dim]."""
        if pooled.shape[1]:
            self.pooled = _write(self.pooled, pooled, self._first, self.pooled_step)
        size = max(self.counts)
        if self.pooled is None:
            return mx.zeros((len(self.lengths), 0, pooled.shape[-1]), pooled.dtype)
        return self.pooled[:, :size]

    def make_mask(self, L: int = 1, _offset=0):
        """Which pooled keys each query sees: those of windows complete at its position (mlx-vlm's
        ``PoolingCache.make_mask``, made after the pass wrote: query j of row r sits at L_r - L + j). None where
        every query sees every pooled key; [L, P] for rows of one length; [B, L, P] otherwise."""
        counts = self.counts
        size = max(counts)
        if size == 0 or (L == 1 and len(set(counts)) == 1):
            return None
        if len(set(self.lengths)) == 1:
            query = mx.arange(self.lengths[0] - L + 1, self.lengths[0] + 1)[:, None]  # [L, 1]
        else:
            query = mx.array(self.lengths)[:, None, None] - L + 1 + mx.arange(L)[:, None]  # [B, L, 1]
        return mx.arange(size) < query // self.ratio

    # the engine's row operations

    def trim_rows(self, n: Sequence[int]) -> None:
        if any(not 0 <= x <= length for x, length in zip(n, self.lengths)):
            raise ValueError(f"cannot trim {list(n)} from rows of lengths {self.lengths}")
        self.lengths = [length - x for length, x in zip(self.lengths, n)]

    def add_empty_row(self) -> None:
        self.lengths.append(0)
        for name in ("raw_kv", "raw_gate", "pooled"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, mx.concatenate([x, mx.zeros((1,) + x.shape[1:], x.dtype)]))

    def filter(self, rows: Sequence[int]) -> None:
        idx = mx.array(list(rows))
        for name in ("raw_kv", "raw_gate", "pooled"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x[idx])
        self.lengths = [self.lengths[r] for r in rows]

    def extend(self, other: "PoolRows") -> None:
        """Append ``other``'s rows after this cache's (buffers padded to the longer one)."""
        for name in ("raw_kv", "raw_gate", "pooled"):
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                continue
            like = a if a is not None else b
            a = a if a is not None else mx.zeros((len(self.lengths), 0) + like.shape[2:], like.dtype)
            b = b if b is not None else mx.zeros((len(other.lengths), 0) + like.shape[2:], like.dtype)
            size = max(a.shape[1], b.shape[1])
            pad = lambda x: mx.pad(x, [(0, 0), (0, size - x.shape[1]), (0, 0)])  # noqa: E731
            setattr(self, name, mx.concatenate([pad(a), pad(b)]))
        self.lengths = self.lengths + other.lengths


def _write(buffer: Optional[mx.array], x: mx.array, at: List[int], step: int) -> mx.array:
    """``x`` [B, S, D] written into ``buffer`` [B, capacity, D] at row r's positions at[r] .. at[r] + S (the buffer
    grown by multiples of ``step`` where it is too short)."""
    B, S, D = x.shape
    need = max(at) + S
    have = 0 if buffer is None else buffer.shape[1]
    if need > have:
        grow = -(-(need - have) // step) * step
        fresh = mx.zeros((B, grow, D), x.dtype)
        buffer = fresh if buffer is None else mx.concatenate([buffer, fresh], axis=1)
    if len(set(at)) == 1:
        buffer[:, at[0]:at[0] + S] = x
        return buffer
    where = (mx.array(at)[:, None] + mx.arange(S))[..., None]  # [B, S, 1]
    return mx.put_along_axis(buffer, mx.broadcast_to(where, x.shape), x, axis=1)


class LayerRows:
    """A compressed block's caches for B rows: [local, pool] (ratio 128) or [local, pool, indexer pool] (ratio 4),
    as the layer indexes mlx-vlm's ``CacheList``; the model's mask and offset are the local cache's."""

    def __init__(self, *caches):
        self.caches = list(caches)

    def __getitem__(self, i):
        return self.caches[i]

    @property
    def lengths(self) -> List[int]:
        return self.caches[0].lengths

    @property
    def offset(self) -> Union[int, mx.array]:
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

    def extend(self, other: "LayerRows") -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)


class _OneRowPools:
    """Row r's pools as mlx-vlm's ``PoolingCache`` of that row alone presents them to the indexer after a one-token
    pass: its valid pooled keys, no new window (the batch's pass pooled them already), every one visible."""

    def __init__(self, pools: PoolRows, r: int):
        self.pools, self.r = pools, r

    def accumulate_windows(self, kv: mx.array, gate: mx.array, _offset):
        return kv[:, :0], gate[:, :0], 0

    def update_and_fetch(self, pooled: mx.array) -> mx.array:
        count = self.pools.counts[self.r]
        if count == 0:
            return pooled
        return self.pools.pooled[self.r:self.r + 1, :count]

    def make_mask(self, L: int = 1, _offset=0):
        return None


class RowsIndexer(Indexer):
    """mlx-vlm's indexer (module doc): row by row where a one-token pass over rows of different pool counts has a
    row that selects hierarchically alone; mlx-vlm's own call otherwise."""

    def _hierarchical(self, count: int) -> bool:
        """Whether a row alone, ``count`` pools all visible, takes mlx-vlm's one-token HISA path."""
        k = min(self.index_topk, count)
        return self.index_block > 0 and count >= self.index_block * self.index_keep and self.index_keep * \
            self.index_block >= k

    def __call__(self, x, q_residual, position_rope, pool_cache, offset):
        if not isinstance(pool_cache, PoolRows) or x.shape[1] != 1:
            return super().__call__(x, q_residual, position_rope, pool_cache, offset)
        counts = [(n + 1) // pool_cache.ratio for n in pool_cache.lengths]  # after this token
        if len(set(counts)) == 1 or not any(self._hierarchical(n) for n in counts):
            return super().__call__(x, q_residual, position_rope, pool_cache, offset)
        self.compressor(x, pool_cache, offset)  # the batch's new windows, pooled once
        k = min(self.index_topk, max(counts))
        picks = []
        for r, count in enumerate(counts):
            at = offset[r:r + 1] if isinstance(offset, mx.array) else offset
            topk = super().__call__(x[r:r + 1], q_residual[r:r + 1], position_rope, _OneRowPools(pool_cache, r), at)
            chosen = 0 if topk is None else topk.shape[-1]
            # a row alone with fewer than k pools selects all of them; the batch's k is made up of pools past its
            # count, which the attention's pool mask hides
            rest = mx.arange(count, count + k - chosen, dtype=mx.int32).reshape(1, 1, -1)
            picks.append(rest if topk is None else mx.concatenate([topk.astype(mx.int32), rest], axis=-1))
        return mx.concatenate(picks)
