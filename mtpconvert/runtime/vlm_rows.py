"""Per-row caches over mlx-vlm's own cache kinds, for the batched engine (``runtime.decoding.batched``) on the
families whose backbone only mlx-vlm loads.

``RowArraysCache``  a recurrent layer's arrays (linear attention's state and convolution window, an n-gram
    embedding's token history): mlx-vlm's ``ArraysCache``, whose speculative transaction records, during a pass, the
    state and window after each position and keeps each row's own prefix on commit (``rollback_rows``); the
    family's backbone starts one for every pass of 2..max_pass tokens (``begin``, from its ``forward``).
``begin_passes``  what that ``forward`` calls.
"""

from __future__ import annotations

from typing import Sequence

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
