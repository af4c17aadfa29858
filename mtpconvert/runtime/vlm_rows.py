"""Per-row caches over mlx-vlm's own cache kinds, for the batched engine (``runtime.decoding.batched``) on the
families whose backbone only mlx-vlm loads.

``RowArraysCache``  a recurrent layer's arrays (linear attention's state and convolution window, an n-gram
    embedding's token history): mlx-vlm's ``ArraysCache``, whose speculative transaction records, during a pass, the
    state and window after each position and keeps each row's own prefix on commit (``rollback_rows``); the
    family's backbone starts one for every pass of 2..max_pass tokens (``begin``, from its ``forward``).
``begin_passes``  what that ``forward`` calls.
``RightAlignedRows``  an attention layer's arrays for rows of different lengths, right-aligned (row r holds its
    positions at ``[pad_r, size)``) as mlx-vlm's left-padded batches are: each row's own cut a shift right; a
    family's sparse-attention rows name the arrays and give the views its layers read.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache


class RowArraysCache(ArraysCache):
    """A recurrent layer's arrays for B rows; a pass of up to ``max_pass`` tokens is undone per row by mlx-vlm's own
    speculative commit."""

    def __init__(self, max_pass: int, size: int = 2):
        super().__init__(size=size)
        self.max_pass = max_pass

    def begin(self, length: int, undoable: bool) -> None:
        """Before a pass of ``length`` tokens: close the last pass (kept whole) and record this one if ``undoable``."""
        self.close()
        if undoable:
            self.start_speculation(length)

    def close(self) -> None:
        if self._speculation is not None:
            self.commit_speculation([self._speculation["length"]] * self.batch_size)

    def rollback_rows(self, keep: Sequence[int]) -> None:
        """Row r keeps the first keep[r] tokens of the last pass."""
        if self._speculation is None:
            raise ValueError("the last pass was not recorded (longer than max_pass)")
        self.commit_speculation(list(keep))

    def filter(self, rows: Sequence[int]) -> None:
        self.close()
        super().filter(mx.array(list(rows)))

    def extend(self, other: "RowArraysCache") -> None:
        self.close()
        other.close()
        super().extend(other)


def begin_passes(cache: list, length: int) -> None:
    """Before a pass of ``length`` tokens over per-row caches: every ``RowArraysCache`` records it when it can be
    undone (2..max_pass tokens; a one-token pass is never cut)."""
    for c in cache:
        if isinstance(c, RowArraysCache):
            c.begin(length, undoable=1 < length <= c.max_pass)


class RightAlignedRows:
    """Arrays of B rows along a position axis, right-aligned at ``size``: row r's tokens at ``[pad[r], size)``, zeros
    before, and some row unpadded (mlx-vlm's layers take the longest row's end for the arrays' end). A subclass names
    its arrays and their position axes (``ARRAYS``)."""

    ARRAYS: Tuple[Tuple[str, int], ...] = ()

    def __init__(self, rows: int):
        self.pad: List[int] = [0] * rows
        self.size = 0
        for name, _ in self.ARRAYS:
            setattr(self, name, None)

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
        return [x for x in (getattr(self, name) for name, _ in self.ARRAYS) if x is not None]

    def _map(self, fn) -> None:
        for name, axis in self.ARRAYS:
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, fn(x, axis))

    def append(self, name: str, x: mx.array, axis: int) -> mx.array:
        have = getattr(self, name)
        setattr(self, name, x if have is None else mx.concatenate([have, x], axis=axis))
        return getattr(self, name)

    def validity(self) -> mx.array:
        return mx.arange(self.size)[None] >= mx.array(self.pad)[:, None]  # [B, size]

    def trim_rows(self, n: Sequence[int]) -> None:
        """Take back the last n[r] positions of row r."""
        lengths = self.lengths
        if any(not 0 <= x <= length for x, length in zip(n, lengths)):
            raise ValueError(f"cannot trim {list(n)} from rows of lengths {lengths}")
        common = min(n)
        if common:
            self.size -= common
            self._map(lambda x, axis: mx.take(x, mx.arange(self.size), axis=axis))
        extra = [x - common for x in n]
        if any(extra):  # shift each row right by its extra cut: its dropped positions become padding
            source = (mx.arange(self.size)[None] - mx.array(extra)[:, None]) % max(self.size, 1)  # [B, size]
            self._map(lambda x, axis: mx.take_along_axis(x, source.reshape(_index_shape(x, axis, source)), axis=axis))
            self.pad = [p + e for p, e in zip(self.pad, extra)]
            self._drop_common_padding()

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
        self._drop_common_padding()

    def _drop_common_padding(self) -> None:
        drop = min(self.pad, default=0)
        if drop:
            self.size -= drop
            self.pad = [p - drop for p in self.pad]
            self._map(lambda x, axis: mx.take(x, mx.arange(drop, drop + self.size), axis=axis))

    def extend(self, other: "RightAlignedRows") -> None:
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


def _index_shape(x: mx.array, axis: int, source: mx.array):
    """``source`` [B, size] broadcast to index ``x`` along ``axis``."""
    shape = [1] * x.ndim
    shape[0], shape[axis] = source.shape
    return shape
