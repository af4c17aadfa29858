"""The block pipeline: read, compute and write blocks, each stage on its own threads.

Blocks' sources are read ahead by reader threads straight into MLX buffers (or by the
npquant worker processes, which quantize them too and leave their results in shared
memory); blocks are computed on one MLX stream per core, or on the GPU's; a writer thread
pwrites finished blocks at their offsets while the shard writer's flusher writes them back
to disk, and hash threads add them to the per-tensor sha256 (hashlib, pwrite, preadv and
fdatasync release the GIL).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import LayoutError
from ..io.checkpoint import Checkpoint
from ..io.header import DTYPES
from ..io.reader import TensorReader, pread_into
from ..io.shard_writer import StreamingShardWriter, array_bytes
from ..plan import Plan, PlanItem
from . import npquant
from .blocks import (DEFAULT_BLOCK_BYTES, Block, DirectRead, direct_read, item_blocks, numpy_groups, numpy_outputs,
                     numpy_task, produce_block, quantized_in_numpy)
from .ops import apply_steps
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
READ_THREADS = 4  # blocks whose sources are read ahead, in parallel, where no worker processes read them
GPU_DEPTH = 3  # blocks evaluating on a GPU stream at once (a transfer, a kernel, a transfer back)
HASH_THREADS = 3  # sha256 runs at ~1 GB/s a core: one thread would bound a GPU conversion


class SourceBuffers:
    """Buffers that reader threads read blocks' gathered sources into, made on demand (at
    most ``limit``, each a power of two from 1 MiB that holds its block: memory stays within
    ``limit`` × twice the largest block) and reused once the block is written.

    A buffer is an MLX array written through a numpy view of its own memory, so the bytes go
    from the page cache to the array in one copy, on a reader thread, and a block's source
    array is a view of it. Where a backend's array memory cannot be written that way
    (checked on the first buffer: the device must read what the view wrote), buffers are
    numpy arrays and ``array`` copies them into MLX.
    """

    def __init__(self, limit: int, stream: mx.Stream):
        self.limit, self._stream = limit, stream
        self._arrays: List[Optional[mx.array]] = []
        self._views: List[np.ndarray] = []
        self._free: List[int] = []
        self.direct: Optional[bool] = None

    def has_free(self) -> bool:
        return bool(self._free) or len(self._views) < self.limit

    def take(self, nbytes: int) -> int:
        """A free buffer of at least ``nbytes`` (``has_free`` first): the smallest free one that
        holds it, or a new one sized to it, replacing a free one that is too small where
        ``limit`` buffers exist."""
        fits = [i for i in self._free if len(self._views[i]) >= nbytes]
        if fits:
            slot = min(fits, key=lambda i: len(self._views[i]))
            self._free.remove(slot)
            return slot
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())
        if self.direct is None:
            self.direct = self._writable_in_place()
        if self.direct:
            arr = mx.zeros((size,), mx.uint8, stream=mx.cpu)
            mx.eval(arr)
            made = (arr, np.asarray(memoryview(arr)))
        else:
            made = (None, np.empty(size, np.uint8))
        if len(self._views) < self.limit:
            self._arrays.append(made[0])
            self._views.append(made[1])
            return len(self._views) - 1
        slot = self._free.pop()  # too small: replaced
        self._arrays[slot], self._views[slot] = made
        return slot

    def _writable_in_place(self) -> bool:
        try:
            arr = mx.zeros((16,), mx.uint8, stream=mx.cpu)
            mx.eval(arr)
            view = np.asarray(memoryview(arr))
            view[:] = np.arange(1, 17, dtype=np.uint8)
            with mx.stream(self._stream):
                total = arr.astype(mx.uint32).sum()
            return total.item() == 136
        except (TypeError, ValueError, BufferError, RuntimeError):
            return False

    def view(self, slot: int, nbytes: int) -> memoryview:
        return memoryview(self._views[slot][:nbytes])

    def array(self, slot: int, read: DirectRead) -> mx.array:
        """The block's gathered source, ``read.shape`` of ``read.dtype``, from its buffer."""
        _, mx_dtype, _ = DTYPES[read.dtype]
        if self.direct:
            flat = self._arrays[slot][:read.nbytes]
        else:
            flat = mx.array(self._views[slot][:read.nbytes])
        return flat.view(mx_dtype).reshape(read.shape)

    def release(self, slot: int) -> None:
        self._free.append(slot)


# Seconds spent per stage, summed over every thread that does it (benchmarks/time_split.py
# reads them): a stage's total may exceed the wall time it overlaps with.
PROFILE: Dict[str, float] = defaultdict(float)


def _read_into(runs: List[Tuple[int, int, int]], dest: memoryview) -> None:
    t = time.perf_counter()
    pos = 0
    for fd, offset, nbytes in runs:
        pread_into(fd, offset, dest[pos:pos + nbytes])
        pos += nbytes
    PROFILE["read (reader threads)"] += time.perf_counter() - t


def _dequantize_into(runs: List[Tuple[int, int, int]], scales: list, target_dtype: str, dest: memoryview) -> None:
    """``_read_into`` for block-FP8 runs: each run's codes and scale rows read, dequantized into ``dest``
    as ``target_dtype`` (numpy releases the GIL in its passes: reader threads run in parallel)."""
    t = time.perf_counter()
    pos = 0
    for (fd, offset, nbytes), (scale_fd, scale_info, scale_offset, scale_bytes, scale_shape, first, shape) in zip(
            runs, scales):
        codes = np.empty(shape, np.uint8)
        pread_into(fd, offset, memoryview(codes.reshape(-1)))
        scale = np.empty(scale_shape, npquant.READ_DTYPES[scale_info.dtype])
        pread_into(scale_fd, scale_offset, memoryview(scale.reshape(-1).view(np.uint8)))
        values = npquant.dequantize_fp8(codes, scale, scale_info.dtype, first, target_dtype)
        if values is None:
            raise LayoutError("FP8 scale holds NaN or Inf", file=scale_info.file, key=scale_info.key)
        dest[pos:pos + values.nbytes] = values.reshape(-1).view(np.uint8)
        pos += values.nbytes
    PROFILE["read (reader threads)"] += time.perf_counter() - t


class Hashers:
    """Threads that add written bytes to the shard's per-tensor sha256: each tensor's rows on
    one thread, in order (tensors are given to the threads in turn), so tensors hash in parallel."""

    def __init__(self, n: int):
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix="shard-hash") for _ in range(n)]
        self._of: Dict[str, int] = {}

    def submit(self, writer: StreamingShardWriter, key: str, data: memoryview) -> Future:
        if key not in self._of:
            self._of[key] = len(self._of) % len(self._pools)
        return self._pools[self._of[key]].submit(_hash_rows, writer, key, data)

    def shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True, cancel_futures=True)


def _hash_rows(writer: StreamingShardWriter, key: str, data: memoryview) -> None:
    t = time.perf_counter()
    writer.hash_rows(key, data)
    PROFILE["sha256 (hash threads)"] += time.perf_counter() - t


def _write_block(writer: StreamingShardWriter, hashers: Hashers, block: Block, outs: List[mx.array]) -> List[Future]:
    """pwrite a block's outputs, then hand their bytes to the hash threads (whose futures this returns)."""
    t = time.perf_counter()
    for arr in outs:  # a device's result is moved to the host here (timed apart from the write)
        array_bytes(arr)
    t2 = time.perf_counter()
    written = [(spec.key, writer.write(spec.key, arr, block.start, hash=False))
               for spec, arr in zip(block.item.outputs(), outs)]
    PROFILE["to host (writer thread)"] += t2 - t
    PROFILE["pwrite (writer thread)"] += time.perf_counter() - t2
    return [hashers.submit(writer, key, data) for key, data in written]


def write_blocks(blocks: Iterable[Block], ckpt: Checkpoint, reader: TensorReader, writer: StreamingShardWriter,
                 streams: List[mx.Stream], on_item: Callable[[PlanItem], None],
                 quantizers: Optional[QuantizerPool] = None, feed=None) -> None:
    """Produce and write ``blocks``, several at each stage at any time.

    Stages, all overlapping: (1) the source is read: by the ``quantizers`` worker processes
    for items npquant makes (they quantize it too, and leave their results in shared memory),
    else by reader threads, straight into a buffer that becomes the block's MLX source array
    (``SourceBuffers``; a gather that needs a copy is done by MLX from the mapping instead);
    (2) blocks are computed on the MLX streams (one per core, or the GPU's); (3) a writer
    thread ``pwrite``s finished blocks at their offsets (the shard writer's flusher thread
    writes them back to disk meanwhile) and (4) hash threads add them to the shard's
    per-tensor sha256 (hashlib, pwrite and fdatasync release the GIL). ``on_item`` runs on the main
    thread once an item's last block is on disk and hashed. A source ``feed`` (a ranged stream) is
    asked for each block's source bytes before the block is read (``acquire``) and told when it is
    written (``done``).
    """
    hashers = Hashers(HASH_THREADS)
    with ThreadPoolExecutor(1, thread_name_prefix="shard-writer") as write_pool, \
            ThreadPoolExecutor(READ_THREADS, thread_name_prefix="source-read") as read_pool:
        pipeline = BlockPipeline(ckpt, reader, writer, streams, on_item, quantizers, feed,
                                 read_pool=read_pool, write_pool=write_pool, hashers=hashers)
        try:
            pipeline.run(blocks)
        except BaseException:
            pipeline.cancel()
            raise
        finally:
            hashers.shutdown()


class BlockPipeline:
    """The stages of ``write_blocks`` for one shard: the blocks in flight, in three queues, oldest first.

    A block waits in ``queued`` while its source is read (a reader thread's future, or a worker
    process's ``Pending`` result), in ``computing`` while MLX evaluates it (or the worker quantizes
    it), and in ``writing`` until its bytes are written and hashed. Each queue is bounded (reads
    ahead, compute depth, ``WRITE_AHEAD``): a stage that is full moves its oldest block on.
    """

    def __init__(self, ckpt: Checkpoint, reader: TensorReader, writer: StreamingShardWriter,
                 streams: List[mx.Stream], on_item: Callable[[PlanItem], None], quantizers: Optional[QuantizerPool],
                 feed, *, read_pool: ThreadPoolExecutor, write_pool: ThreadPoolExecutor, hashers: Hashers):
        self.ckpt, self.reader, self.writer, self.streams = ckpt, reader, writer, streams
        self.on_item, self.quantizers, self.feed = on_item, quantizers, feed
        self.read_pool, self.write_pool, self.hashers = read_pool, write_pool, hashers
        self.on_gpu = any(s.device != mx.cpu for s in streams)
        # (block, what is being made: a read future, a Pending npquant result, or None; its buffer slot; its read)
        self.queued: deque = deque()
        self.computing: deque = deque()  # (block, lazy mx outputs, or a Pending npquant result; buffer slot)
        self.writing: deque = deque()  # (block, future of the write (-> future of the hash), Pending or None, slot)
        # worker processes read ahead themselves, and one that finishes early finds the next block queued
        self.ahead = 0 if quantizers is not None else READ_THREADS
        self.depth = 2 * quantizers.workers if quantizers is not None else (GPU_DEPTH if self.on_gpu else len(streams))
        self.buffers = SourceBuffers(self.ahead + self.depth + WRITE_AHEAD + 2, streams[0])
        self.started = 0  # blocks started on the MLX streams, which take them in turn
        self.item_files: Dict[str, set] = {}  # item name -> the source files it reads

    def run(self, blocks: Iterable[Block]) -> None:
        """Every block through every stage; returns once the last one is on disk and hashed."""
        for block in blocks:
            self._wait_for_source(block)
            self._queue(block)
            if len(self.queued) > self.ahead:
                self._start_compute()
        while self.queued:
            self._start_compute()
        while self.computing:
            self._hand_over()
        while self.writing:
            self._finish_write()

    def cancel(self) -> None:
        """After a failure: cancel the reads, quantizations and writes not yet started."""
        for _, made, _, _ in self.queued:
            if made is not None:
                (made.future if isinstance(made, Pending) else made).cancel()
        for _, pending, _ in self.computing:
            if isinstance(pending, Pending):
                pending.future.cancel()
        for _, future, _, _ in self.writing:
            future.cancel()

    def _wait_for_source(self, block: Block) -> None:
        """Keep within the raw-shard budget of a streamed source, and have a feed fetch the block's bytes."""
        files = self.item_files.get(block.item.name)
        if files is None:
            files = self.item_files[block.item.name] = {self.ckpt.tensors[s.key].file for s in block.item.sources}
        if not all(self.reader.admits(f) for f in files):
            # a streamed shard over the raw-shard budget: finish the blocks in flight, whose
            # last items release the shards they read (--prefetch-shards 0: one at a time)
            t = time.perf_counter()
            while self.queued or self.computing or self.writing:
                self._advance()
            PROFILE["main: drains for the raw-shard budget"] += time.perf_counter() - t
        if self.feed is not None:
            t = time.perf_counter()
            self.feed.acquire(block.key)
            PROFILE["main: waits for source ranges"] += time.perf_counter() - t

    def _queue(self, block: Block) -> None:
        """Stage 1: start the block's read (a worker process's, for npquant's items) and queue it."""
        if self.quantizers is not None and quantized_in_numpy(block.item):
            while not self.quantizers.has_free_slot():  # every slot holds a result not yet written
                self._advance()
            self.queued.append((block, self.quantizers.submit(numpy_task(block, self.ckpt, self.reader)), None, None))
            return
        read = direct_read(block, self.ckpt, dequantize_fp8=not self.on_gpu)
        if read is None:  # a gather MLX copies from the mapping when the block is computed
            self.queued.append((block, None, None, None))
            return
        runs = [(self.reader.fileno(info), offset, n) for info, offset, n in read.runs]
        while not self.buffers.has_free():
            self._advance()
        slot = self.buffers.take(read.nbytes)
        dest = self.buffers.view(slot, read.nbytes)
        if read.scales:
            scales = [(self.reader.fileno(info), info, *rest) for info, *rest in read.scales]
            future = self.read_pool.submit(_dequantize_into, runs, scales, block.item.dtype, dest)
        else:
            future = self.read_pool.submit(_read_into, runs, dest)
        self.queued.append((block, future, slot, read))

    def _start_compute(self) -> None:
        """Stage 2: the oldest queued block starts evaluating on the next MLX stream (a worker's result
        goes on as it is)."""
        block, made, slot, read = self.queued.popleft()
        if isinstance(made, Pending):
            self.computing.append((block, made, None))
        else:
            with mx.stream(self.streams[self.started % len(self.streams)]):
                if read is not None:
                    t = time.perf_counter()
                    made.result()  # re-raises a read error
                    PROFILE["main: waits for reads"] += time.perf_counter() - t
                    outs = apply_steps(self.buffers.array(slot, read), block.item.steps)
                else:
                    outs = produce_block(block, self.ckpt, self.reader)
            self.started += 1
            mx.async_eval(*outs)
            self.computing.append((block, outs, slot))
        if len(self.computing) > self.depth:
            self._hand_over()

    def _hand_over(self) -> None:
        """Stage 3: the oldest computed block, once evaluated, goes to the writer thread."""
        block, outs, slot = self.computing.popleft()
        pending = None
        t = time.perf_counter()
        if isinstance(outs, Pending):
            made = self.quantizers.result(outs)
            # None: a NaN or an infinity, whose quantization MLX's kernel decides
            if made is None:
                outs = produce_block(block, self.ckpt, self.reader)
            else:
                pending, outs = outs, numpy_outputs(block, made)
        mx.eval(*[o for o in outs if isinstance(o, mx.array)])  # the writer only reads finished arrays
        PROFILE["main: waits for device / workers"] += time.perf_counter() - t
        future = self.write_pool.submit(_write_block, self.writer, self.hashers, block, outs)
        self.writing.append((block, future, pending, slot))
        while len(self.writing) > WRITE_AHEAD:
            self._finish_write()

    def _finish_write(self) -> None:
        """Stage 4: wait for the oldest block's write and hashes, then free what it held."""
        block, future, pending, slot = self.writing.popleft()
        t = time.perf_counter()
        for hashed in future.result():  # re-raises the writer's error (disk full, ...) here
            hashed.result()
        PROFILE["main: waits for write + hash"] += time.perf_counter() - t
        if pending is not None:
            self.quantizers.release(pending)
        if slot is not None:
            self.buffers.release(slot)
        if self.feed is not None:
            self.feed.done(block.key)
        if block.last:
            self.on_item(block.item)

    def _advance(self) -> None:
        """Move the oldest block on a stage, to free a buffer or a result slot."""
        if self.queued:
            self._start_compute()
        elif self.computing:
            self._hand_over()
        else:
            self._finish_write()


NUMPY_MIN_BYTES = 256 << 20  # below this much to quantize, starting worker processes does not pay


@contextmanager
def quantizer_pool(plan: Plan, streams: List[mx.Stream],
                   block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Optional[QuantizerPool]]:
    """Worker processes for npquant, one per compute stream, or None where MLX quantizes.

    npquant is faster than MLX's CPU kernel with the same bytes, but only in processes:
    its numpy passes hold the GIL in between, so threads would queue on it. A GPU
    quantizes faster than either. ``MTPCONVERT_NUMPY_QUANT=0`` turns this off, ``=all`` on
    with a GPU too (one process per core, at most 8). Results
    come back in shared-memory slots: enough for every block in flight (computing, and
    queued for the writer), fewer where /dev/shm is small (the pipeline then waits).
    """
    on_cpu = all(s.device == mx.cpu for s in streams)
    items = [item for item in plan.items if quantized_in_numpy(item)]
    setting = os.environ.get("MTPCONVERT_NUMPY_QUANT", "1")
    if not items or not (on_cpu or setting == "all") or sum(item.in_bytes for item in items) < NUMPY_MIN_BYTES \
            or setting == "0":
        yield None
        return
    n = len(streams) if on_cpu else min(os.cpu_count() or 1, 8)
    # an item's first block is its largest (item_blocks cuts equal blocks, the last one shorter)
    firsts = [item_blocks(item, block_bytes)[0] for item in items]
    slot_bytes = max(npquant.result_bytes(numpy_groups(b), b.item.quant.bits, b.item.quant.group_size, b.item.dtype)
                     for b in firsts)
    slots = slots_that_fit(2 * n + WRITE_AHEAD + 2, slot_bytes)
    if slots < 2:
        yield None
        return
    try:
        workers = QuantizerPool(n, slots, slot_bytes)
    except OSError:  # no shared memory to be had (no /dev/shm, no permission): MLX quantizes
        yield None
        return
    try:
        yield workers
    finally:
        workers.close()
