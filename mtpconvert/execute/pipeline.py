"""The block pipeline: compute blocks on MLX streams or npquant workers while a thread writes finished ones.

Three things overlap: blocks are computed (on one MLX stream per core, or in the npquant
worker processes, which read the source themselves and leave their results in shared
memory), the main thread prepares the next block, and a writer thread hashes and writes
finished blocks at their offsets (hashlib and pwrite release the GIL).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional

import mlx.core as mx

from ..io.checkpoint import Checkpoint
from ..io.reader import TensorReader
from ..io.shard_writer import StreamingShardWriter
from ..plan import Plan, PlanItem
from . import npquant
from .blocks import (DEFAULT_BLOCK_BYTES, Block, item_blocks, numpy_groups, numpy_outputs, numpy_task, produce_block,
                     quantized_in_numpy)
from .quantpool import Pending, QuantizerPool, slots_that_fit

_STREAMS: Dict[tuple, List[mx.Stream]] = {}


def compute_streams(workers: Optional[int] = None) -> List[mx.Stream]:
    """Streams to evaluate blocks on: one CPU stream per worker (default: per core, at most 8),
    since MLX runs each CPU stream on its own thread; a GPU needs only its default stream.

    MLX streams live as long as the process and belong to the thread that made them, so
    they are made once per thread and reused.
    """
    if mx.default_device() != mx.cpu:
        return [mx.default_stream(mx.default_device())]
    n = workers or min(os.cpu_count() or 1, 8)
    key = (threading.get_ident(), n)
    if key not in _STREAMS:
        _STREAMS[key] = [mx.new_stream(mx.cpu) for _ in range(n)]
    return _STREAMS[key]


WRITE_AHEAD = 4  # evaluated blocks queued for the writer thread at most


def _write_block(writer: StreamingShardWriter, block: Block, outs: List[mx.array]) -> None:
    for spec, arr in zip(block.item.outputs(), outs):
        writer.write(spec.key, arr, block.start)


def write_blocks(blocks: Iterable[Block], ckpt: Checkpoint, reader: TensorReader, writer: StreamingShardWriter,
                 streams: List[mx.Stream], on_item: Callable[[PlanItem], None],
                 quantizers: Optional[QuantizerPool] = None) -> None:
    """Produce and write ``blocks``, ``len(streams)`` of them being computed at any time
    (and as many more queued for the worker processes).

    Three things overlap: blocks k..k+n-1 are computed (on the MLX streams, or, for
    items npquant can make, in the ``quantizers`` worker processes, which read the
    source themselves and leave their results in shared memory), the main thread prepares
    block k+n (copying its source out of the mapping for MLX), and a writer thread hashes
    and writes finished blocks at their offsets (hashlib and pwrite release the GIL).
    ``on_item`` runs on the main thread once an item's last block is on disk.
    """
    computing: deque = deque()  # (block, lazy mx outputs, or a Pending npquant result)
    writing: deque = deque()  # (block, future, the Pending whose slot it writes, or None)
    # a worker process that finishes early finds the next block already queued for it
    depth = len(streams) * (2 if quantizers is not None else 1)

    def finish_write() -> None:
        block, future, pending = writing.popleft()
        future.result()  # re-raises the writer's error (disk full, ...) here
        if pending is not None:
            quantizers.release(pending)
        if block.last:
            on_item(block.item)

    with ThreadPoolExecutor(1, thread_name_prefix="shard-writer") as pool:
        def hand_over() -> None:
            block, outs = computing.popleft()
            pending = None
            if isinstance(outs, Pending):
                made = quantizers.result(outs)
                # None: a NaN or an infinity, whose quantization MLX's kernel decides
                if made is None:
                    outs = produce_block(block, ckpt, reader)
                else:
                    pending, outs = outs, numpy_outputs(block, made)
            mx.eval(*[o for o in outs if isinstance(o, mx.array)])  # the writer only reads finished arrays
            writing.append((block, pool.submit(_write_block, writer, block, outs), pending))
            while len(writing) > WRITE_AHEAD:
                finish_write()

        try:
            for k, block in enumerate(blocks):
                if quantizers is not None and quantized_in_numpy(block.item):
                    while not quantizers.has_free_slot():  # every slot holds a result not yet written
                        hand_over() if computing else finish_write()
                    computing.append((block, quantizers.submit(numpy_task(block, ckpt, reader))))
                else:
                    with mx.stream(streams[k % len(streams)]):
                        outs = produce_block(block, ckpt, reader)
                    mx.async_eval(*outs)
                    computing.append((block, outs))
                if len(computing) > depth:
                    hand_over()
            while computing:
                hand_over()
            while writing:
                finish_write()
        except BaseException:
            for _, pending in computing:
                if isinstance(pending, Pending):
                    pending.future.cancel()
            for _, future, _ in writing:
                future.cancel()
            raise


NUMPY_MIN_BYTES = 256 << 20  # below this much to quantize, starting worker processes does not pay


@contextmanager
def quantizer_pool(plan: Plan, streams: List[mx.Stream],
                   block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Optional[QuantizerPool]]:
    """Worker processes for npquant, one per compute stream, or None where MLX quantizes.

    npquant is faster than MLX's CPU kernel with the same bytes, but only in processes:
    its numpy passes hold the GIL in between, so threads would queue on it. A GPU
    quantizes faster than either. ``MTPCONVERT_NUMPY_QUANT=0`` turns this off. Results
    come back in shared-memory slots: enough for every block in flight (computing, and
    queued for the writer), fewer where /dev/shm is small (the pipeline then waits).
    """
    on_cpu = all(s.device == mx.cpu for s in streams)
    items = [item for item in plan.items if quantized_in_numpy(item)]
    if not on_cpu or sum(item.in_bytes for item in items) < NUMPY_MIN_BYTES \
            or os.environ.get("MTPCONVERT_NUMPY_QUANT", "1") == "0":
        yield None
        return
    # an item's first block is its largest (item_blocks cuts equal blocks, the last one shorter)
    firsts = [item_blocks(item, block_bytes)[0] for item in items]
    slot_bytes = max(npquant.result_bytes(numpy_groups(b), b.item.quant.bits, b.item.quant.group_size, b.item.dtype)
                     for b in firsts)
    slots = slots_that_fit(2 * len(streams) + WRITE_AHEAD + 2, slot_bytes)
    if slots < 2:
        yield None
        return
    try:
        workers = QuantizerPool(len(streams), slots, slot_bytes)
    except OSError:  # no shared memory to be had (no /dev/shm, no permission): MLX quantizes
        yield None
        return
    try:
        yield workers
    finally:
        workers.close()
