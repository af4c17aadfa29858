"""Row blocks: how a plan item is made a slice at a time.

Every transform the plan uses (cast, norm+1, conv axis move, channels-last patch, expert
stacking, gate/up split, group-wise quantization along the last axis) makes output rows
``a:b`` of the leading axis from source rows ``a:b`` alone. So a tensor of any size can be
produced in blocks of bounded bytes, each written at its own offset: peak memory is a few
blocks, not the largest tensor, and blocks can be computed in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import mlx.core as mx

from .plan import PlanItem
from .safetensors_io import TensorReader, leading_rows
from .source import Checkpoint
from .transforms import apply_steps, gather

DEFAULT_BLOCK_BYTES = 16 << 20  # measured: 8 MiB pays per-block overhead, 32+ MiB pays page faults (glibc mmaps big blocks)
HALVES = ("gate_half", "up_half")


@dataclass(frozen=True)
class Block:
    """Output rows ``start:stop`` (leading axis) of one plan item."""

    item: PlanItem
    start: int
    stop: int

    @property
    def last(self) -> bool:
        return self.stop == rows(self.item)


def rows(item: PlanItem) -> int:
    return leading_rows(item.slot.shape)


def item_blocks(item: PlanItem, max_bytes: int = DEFAULT_BLOCK_BYTES) -> List[Block]:
    """Split an item into blocks whose source bytes stay under ``max_bytes`` (at least one row each)."""
    n = rows(item)
    if n == 0:
        return [Block(item, 0, 0)]
    per_row = max(1, item.in_bytes // n)
    step = max(1, max_bytes // per_row)
    return [Block(item, a, min(a + step, n)) for a in range(0, n, step)]


def read_block(block: Block, ckpt: Checkpoint, reader: TensorReader) -> mx.array:
    """The gathered source rows of one block: stacked experts, one half of a fused gate_up, ..."""
    item, a, b = block.item, block.start, block.stop
    if item.gather == "stack":
        return gather([reader.read(ckpt.tensors[s.key]) for s in item.sources[a:b]], "stack")
    info = ckpt.tensors[item.sources[0].key]
    if item.gather in HALVES:
        return reader.read_rows(info, a, b, part=(HALVES.index(item.gather), 2))
    return gather([reader.read_rows(info, a, b)], item.gather)


def produce_block(block: Block, ckpt: Checkpoint, reader: TensorReader) -> List[mx.array]:
    """The output arrays of one block, in ``item.outputs()`` order (lazy: not evaluated)."""
    return apply_steps(read_block(block, ckpt, reader), block.item.steps, block.item.quant)


def produce(item: PlanItem, ckpt: Checkpoint, reader: TensorReader) -> List[mx.array]:
    """The whole output arrays of one (small) item, evaluated."""
    outs = produce_block(Block(item, 0, rows(item)), ckpt, reader)
    mx.eval(*outs)
    return outs
