"""Row blocks: how a plan item is made a slice at a time.

Every transform the plan uses (cast, norm+1, conv axis move, channels-last patch, expert
stacking, gate/up split, group-wise quantization along the last axis) makes output rows
``a:b`` of the leading axis from source rows ``a:b`` alone. So a tensor of any size can be
produced in blocks of bounded bytes, each written at its own offset: peak memory is a few
blocks, not the largest tensor, and blocks can be computed in parallel.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import LayoutError
from ..io.checkpoint import Checkpoint
from ..io.header import DTYPES, TensorInfo, leading_rows
from ..io.reader import TensorReader
from ..io.shard_writer import BF16Bits
from ..plan import PlanItem, SourceRef
from ..plan.fp8 import BLOCK as FP8_BLOCK
from ..plan.fp8 import is_block_scale, scale_rows
from ..plan.steps import HALVES, KV_B_PARTS, Cast, DequantFP8, Gather, Quantize, SplitGateUp, StackExperts
from . import npquant
from .ops import apply_steps, dequant_fp8, gather, split_kv_b

# measured: 8 MiB pays per-block overhead, 32+ MiB pays page faults (glibc mmaps big blocks);
# MTPCONVERT_BLOCK_MB overrides it (benchmarks); the bytes written do not depend on it
DEFAULT_BLOCK_BYTES = int(float(os.environ.get("MTPCONVERT_BLOCK_MB", "16")) * (1 << 20))


@dataclass(frozen=True)
class Block:
    """Output rows ``start:stop`` (leading axis) of one plan item."""

    item: PlanItem
    start: int
    stop: int

    @property
    def last(self) -> bool:
        return self.stop == rows(self.item)

    @property
    def key(self) -> Tuple[str, int, int]:
        """Names the block to a source feed (``hub.stream``): the same in its plan and at execution."""
        return (self.item.name, self.start, self.stop)


def rows(item: PlanItem) -> int:
    return leading_rows(item.slot.shape)


def is_fp8(item: PlanItem) -> bool:
    return item.sources[0].scale is not None


def is_block_fp8(item: PlanItem) -> bool:
    """FP8 sources with 128x128 block scales (not one scale per tensor)."""
    return is_fp8(item) and is_block_scale(item.sources[0].scale.key)


def item_blocks(item: PlanItem, max_bytes: int = DEFAULT_BLOCK_BYTES) -> List[Block]:
    """Split an item into blocks whose source bytes stay under ``max_bytes`` (at least one row each).
    A block-FP8 matrix is split on its 128-row scale blocks, so each block reads whole scale rows."""
    n = rows(item)
    if n == 0 or item.gather in KV_B_PARTS:  # a kv_b part is one attention's [heads, ...]: a few MB, one block
        return [Block(item, 0, n)]
    # an FP8 source is sized as the BF16 it becomes: its blocks then cost what a BF16 source's do
    work = 2 * sum(math.prod(s.shape) for s in item.sources) if is_fp8(item) else item.in_bytes
    per_row = max(1, work // n)
    step = max(1, max_bytes // per_row)
    if is_block_fp8(item) and len(item.sources[0].shape) == 2:
        step = max(FP8_BLOCK, step // FP8_BLOCK * FP8_BLOCK)
    return [Block(item, a, min(a + step, n)) for a in range(0, n, step)]


def read_fp8(source: SourceRef, ckpt: Checkpoint, reader: TensorReader, start: int, stop: int,
             part: Optional[Tuple[int, int]] = None) -> mx.array:
    """Rows ``start:stop`` of an FP8 source, dequantized with the scale rows they need (float32), or with its
    one per-tensor scale."""
    info, scale_info = ckpt.tensors[source.key], ckpt.tensors[source.scale.key]
    if is_block_scale(source.scale.key):
        first, last, offset = scale_rows(info.shape, start, stop)
        scale, block = reader.read_rows(scale_info, first, last, part=part), FP8_BLOCK
    else:
        scale, block, offset = reader.read(scale_info), 0, 0
    if not mx.all(mx.isfinite(scale)).item():
        raise LayoutError("FP8 scale holds NaN or Inf", file=scale_info.file, key=scale_info.key)
    codes = reader.read_rows(info, start, stop, part=part)
    return dequant_fp8(codes, scale, block, offset)


def read_block(block: Block, ckpt: Checkpoint, reader: TensorReader) -> mx.array:
    """The gathered source rows of one block: stacked experts, one half of a fused gate_up, ...;
    block-FP8 sources dequantized as they are read."""
    item, a, b = block.item, block.start, block.stop
    if item.gather in KV_B_PARTS:
        src = item.sources[0]
        whole = (read_fp8(src, ckpt, reader, 0, src.shape[0]) if is_fp8(item)
                 else reader.read(ckpt.tensors[src.key]))
        own = item.slot.shape[2] if item.gather is Gather.EMBED_Q else item.slot.shape[1]
        return split_kv_b(whole, item.gather, item.slot.shape[0], own)[a:b]
    if is_fp8(item):
        if item.gather is Gather.STACK:
            return gather([read_fp8(s, ckpt, reader, 0, leading_rows(s.shape)) for s in item.sources[a:b]],
                          Gather.STACK)
        part = (item.gather.half, 2) if item.gather in HALVES else None
        read = read_fp8(item.sources[0], ckpt, reader, a, b, part)
        return read if part else gather([read], item.gather)
    if item.gather is Gather.STACK:
        return gather([reader.read(ckpt.tensors[s.key]) for s in item.sources[a:b]], Gather.STACK)
    info = ckpt.tensors[item.sources[0].key]
    if item.gather in HALVES:
        return reader.read_rows(info, a, b, part=(item.gather.half, 2))
    return gather([reader.read_rows(info, a, b)], item.gather)


def produce_block(block: Block, ckpt: Checkpoint, reader: TensorReader) -> List[mx.array]:
    """The output arrays of one block, in ``item.outputs()`` order (lazy: not evaluated)."""
    return apply_steps(read_block(block, ckpt, reader), block.item.steps)


def produce(item: PlanItem, ckpt: Checkpoint, reader: TensorReader) -> List[mx.array]:
    """The whole output arrays of one (small) item, evaluated."""
    outs = produce_block(Block(item, 0, rows(item)), ckpt, reader)
    mx.eval(*outs)
    return outs


# Steps a numpy-quantized item may have: FP8 dequantization and gathers (done as the source is
# read), a cast and the quantization itself (both done by npquant).
NUMPY_STEPS = (DequantFP8, StackExperts, SplitGateUp, Cast, Quantize)
NUMPY_GATHERS = (Gather.LOAD, Gather.STACK) + HALVES


def quantized_in_numpy(item: PlanItem) -> bool:
    """Whether npquant can make this item's blocks: affine 2/4/8-bit from float sources,
    read straight from the files. The bytes are those of ``mx.quantize``; the CPU backend
    uses it because MLX's CPU kernel is the conversion's bottleneck."""
    q = item.quant
    return (q is not None and item.gather in NUMPY_GATHERS and (is_block_fp8(item) or not is_fp8(item))
            and all(isinstance(step, NUMPY_STEPS) for step in item.steps)
            and len({s.dtype for s in item.sources}) == 1
            and npquant.supports(item.sources[0].dtype, item.dtype, q.bits, q.group_size, q.mode))


def _source_runs(block: Block, ckpt: Checkpoint) -> List[Tuple[str, int, Tuple[int, ...]]]:
    """(file, byte offset, shape) of each contiguous run of the block's source rows, in output row order."""
    item, a, b = block.item, block.start, block.stop
    if item.gather is Gather.STACK:  # one whole expert per output row
        return [(str(info.file), info.start, info.shape) for info in (ckpt.tensors[s.key] for s in item.sources[a:b])]
    return _rows_runs(ckpt.tensors[item.sources[0].key], item.gather, a, b)


def _scale_runs(block: Block, ckpt: Checkpoint) -> List[Tuple[str, int, Tuple[int, ...]]]:
    """The runs of the FP8 scale rows a block reads (``read_fp8``), like ``_source_runs``."""
    item, a, b = block.item, block.start, block.stop
    if item.gather is Gather.STACK:
        return [(str(info.file), info.start, info.shape)
                for info in (ckpt.tensors[s.scale.key] for s in item.sources[a:b])]
    source = item.sources[0]
    if not is_block_scale(source.scale.key):  # one value for the whole tensor
        info = ckpt.tensors[source.scale.key]
        return [(str(info.file), info.start, info.shape)]
    return _rows_runs(ckpt.tensors[source.scale.key], item.gather, *scale_rows(source.shape, a, b)[:2])


def _scale_offset(block: Block) -> int:
    """How far the block's first row lies into its first scale row's rows (0 for a stack's whole experts)."""
    if block.item.gather is Gather.STACK:
        return 0
    return scale_rows(block.item.sources[0].shape, block.start, block.stop)[2]


def _rows_runs(info: TensorInfo, how: Gather, a: int, b: int) -> List[Tuple[str, int, Tuple[int, ...]]]:
    """The runs of rows ``a:b`` of one tensor: one run, or one per expert for a half of a fused gate_up."""
    row_bytes = info.nbytes // leading_rows(info.shape)
    if how in HALVES:  # [E, 2I, H] -> the gate or up half of each expert
        half_shape = (info.shape[1] // 2, *info.shape[2:])
        half_bytes = row_bytes // 2
        skip = how.half * half_bytes
        return [(str(info.file), info.start + e * row_bytes + skip, half_shape) for e in range(a, b)]
    return [(str(info.file), info.start + a * row_bytes, (b - a, *info.shape[1:]))]


def block_ranges(block: Block, ckpt: Checkpoint) -> List[Tuple[str, int, int]]:
    """Byte ranges ``(file, start, end)`` of the source that ``block`` reads, whichever path reads it
    (npquant, a direct read, MLX from the mapping: the last reads whole rows of a fused gate_up
    but keeps only this half, so only the half's bytes need to hold data). A ranged stream
    fetches exactly these before the block is made and frees them after it is written."""
    item = block.item
    if item.gather is Gather.STACK:  # one run per expert tensor
        itemsizes = [DTYPES[ckpt.tensors[s.key].dtype][2] for s in item.sources[block.start:block.stop]]
    else:
        itemsizes = itertools.repeat(DTYPES[ckpt.tensors[item.sources[0].key].dtype][2])
    ranges = [(file, offset, offset + math.prod(shape) * size)
              for (file, offset, shape), size in zip(_source_runs(block, ckpt), itemsizes)]
    if is_fp8(item):
        size = DTYPES[item.sources[0].scale.dtype][2]
        ranges += [(file, offset, offset + math.prod(shape) * size) for file, offset, shape in _scale_runs(block, ckpt)]
    return [r for r in ranges if r[2] > r[1]]


def numpy_task(block: Block, ckpt: Checkpoint, reader: TensorReader) -> tuple:
    """Arguments of ``npquant.quantize_file_rows`` for this block (picklable: a worker process
    reads the source itself). The files are mapped here first, so a streamed shard is
    fetched, and a truncated one named, before a worker reads it."""
    item, q = block.item, block.item.quant
    for s in item.sources[block.start:block.stop] if item.gather is Gather.STACK else item.sources[:1]:
        reader.ensure(ckpt.tensors[s.key])
        if s.scale is not None:
            reader.ensure(ckpt.tensors[s.scale.key])
    runs = _source_runs(block, ckpt)
    if is_fp8(item):  # each run with its scale rows (one run per expert, or the block's rows of a matrix)
        scale_dtype, offset = item.sources[0].scale.dtype, _scale_offset(block)
        runs = [(*run, (*scale, scale_dtype, offset)) for run, scale in zip(runs, _scale_runs(block, ckpt))]
    return (runs, item.sources[0].dtype, item.dtype, q.bits, q.group_size)


def numpy_groups(block: Block) -> int:
    """Quantization groups in a block npquant makes (a row of scales holds one per group)."""
    scales = block.item.outputs()[1]
    return (block.stop - block.start) * math.prod(scales.shape[1:])


def numpy_outputs(block: Block, made: Tuple[np.ndarray, np.ndarray, np.ndarray]) -> List[np.ndarray]:
    """npquant's flat (packed bytes, scales, biases) -> the block's outputs, shaped and typed
    as ``item.outputs()`` plans them."""
    n = block.stop - block.start
    packed, scales, biases = made
    out = []
    for spec, arr in zip(block.item.outputs(), (packed.view(np.uint32), scales, biases)):
        arr = arr.reshape((n, *spec.shape[1:]))
        out.append(arr.view(BF16Bits) if spec.dtype == "bfloat16" else arr)
    return out


@dataclass(frozen=True)
class DirectRead:
    """A block's gathered source as byte runs of its files, in output row order: read
    straight into one buffer, they make the gathered array (``shape``, ``dtype``) with no
    copy out of a mapping and no gather op. Block-FP8 runs come with ``scales``: the reader
    thread dequantizes each run into ``dtype`` (``npquant.dequantize_fp8``) as it reads it."""

    runs: List[Tuple[object, int, int]]  # (TensorInfo read, byte offset in its file, bytes)
    shape: Tuple[int, ...]
    dtype: str  # safetensors dtype name
    nbytes: int
    # per run: (scale TensorInfo, byte offset, bytes, scale rows' shape, first row within them, codes' shape)
    scales: Optional[List[Tuple[object, int, int, Tuple[int, ...], int, Tuple[int, ...]]]] = None


FLOAT_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def direct_read(block: Block, ckpt: Checkpoint, dequantize_fp8: bool = False) -> Optional[DirectRead]:
    """How to read ``block``'s gathered source in plain reads, or None where the gather needs
    a copy (vision patch), the block is empty or a scalar, or the sources differ in dtype.
    A block-FP8 item is read this way only with ``dequantize_fp8`` (the host dequantizes: a CPU
    backend) and when nothing but a cast follows its dequantization; a per-tensor FP8 item never (its
    scale has no rows to read with the codes: ``read_fp8`` dequantizes it in MLX)."""
    item, a, b = block.item, block.start, block.stop
    if item.gather not in NUMPY_GATHERS or b <= a or len({s.dtype for s in item.sources}) != 1:
        return None
    if is_fp8(item):
        return _direct_fp8(block, ckpt) if dequantize_fp8 and is_block_fp8(item) else None
    infos = ([ckpt.tensors[s.key] for s in item.sources[a:b]] if item.gather is Gather.STACK
             else [ckpt.tensors[item.sources[0].key]])
    if not infos[0].shape or infos[0].dtype not in DTYPES:
        return None
    runs = _source_runs(block, ckpt)
    shapes = {shape for _, _, shape in runs}
    if len(shapes) != 1:
        return None
    (run_shape,) = shapes
    itemsize = DTYPES[infos[0].dtype][2]
    run_bytes = math.prod(run_shape) * itemsize
    shape = tuple(run_shape) if item.gather is Gather.LOAD else (b - a, *run_shape)
    stacked = item.gather is Gather.STACK  # one run per expert, else runs of the one source tensor
    return DirectRead([(infos[i] if stacked else infos[0], off, run_bytes) for i, (_, off, _) in enumerate(runs)],
                      shape, infos[0].dtype, run_bytes * len(runs))


def _direct_fp8(block: Block, ckpt: Checkpoint) -> Optional[DirectRead]:
    """``direct_read`` of a float block-FP8 item: the codes' runs with their scale rows."""
    item = block.item
    if item.quant is not None or item.gather in HALVES or item.dtype not in FLOAT_ST or \
            not all(isinstance(step, (DequantFP8, StackExperts, Cast)) for step in item.steps):
        return None
    plain = direct_read(dataclasses.replace(block, item=dataclasses.replace(item, sources=tuple(
        dataclasses.replace(s, scale=None) for s in item.sources))), ckpt)
    if plain is None:
        return None
    source = item.sources[0]
    offset = _scale_offset(block)
    scale_infos = ([ckpt.tensors[s.scale.key] for s in item.sources[block.start:block.stop]]
                   if item.gather is Gather.STACK else [ckpt.tensors[source.scale.key]])
    itemsize = DTYPES[source.scale.dtype][2]
    scales = [(scale_infos[i if item.gather is Gather.STACK else 0], off, math.prod(shape) * itemsize, shape, offset,
               run_shape)
              for i, ((_, off, shape), (_, _, run_shape)) in enumerate(zip(_scale_runs(block, ckpt),
                                                                          _source_runs(block, ckpt)))]
    st = FLOAT_ST[item.dtype]
    return DirectRead(plain.runs, plain.shape, st, math.prod(plain.shape) * DTYPES[st][2], scales)
