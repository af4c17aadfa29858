"""Run a plan: stream source tensors through their transforms into output shards.

Items are cut into row blocks of bounded size (``blocks``); a few blocks are in flight
at once: quantized weights in one npquant worker process per core (CPU backend), the
rest on one MLX stream per core while the main thread copies the next block out of the
source mapping, and a writer thread writes finished ones at their offsets. Shards are
written with their header fixed up front, so memory is bounded by the block size and the
pipeline depth, never by the largest tensor; the bytes do not depend on the order blocks
finish in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional

import mlx.core as mx

from . import __version__, npquant
from .plan import Plan, PlanItem
from .quantpool import Pending, QuantizerPool, slots_that_fit
from .blocks import (DEFAULT_BLOCK_BYTES, Block, item_blocks, numpy_groups, numpy_outputs, numpy_task, produce_block,
                     quantized_in_numpy)
from .safetensors_io import StreamingShardWriter, TensorReader, shard_digest
from .streaming import ShardStream
from .source import SIDECAR_FILES, VISION_SIDECAR_FILES, Checkpoint, safe_member
from .writer import OutputFolder, describe_os_error

Progress = Callable[[PlanItem, int], None]


RESUME_DIR = ".mtpconvert-resume"  # inside the partial folder; removed before commit


@dataclass
class ConvertResult:
    out: Path
    shards: List[str]
    tensors: int
    bytes_written: int
    shards_reused: int = 0


def plan_fingerprint(plan: Plan, ckpt: Checkpoint) -> str:
    """Identifies what a shard was made from: the full plan plus each source file's size and mtime."""
    h = hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode())
    for f in sorted({t.file for t in ckpt.tensors.values()}):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _reusable(folder: OutputFolder, shard: str, fingerprint: str) -> bool:
    """A shard left by an interrupted run is reused only if its record and its bytes check out."""
    record, path = folder.path(RESUME_DIR) / f"{shard}.json", folder.path(shard)
    try:
        done = json.loads(record.read_text())
        return (done.get("fingerprint") == fingerprint and path.stat().st_size == done.get("size")
                and shard_digest(path) == done.get("sha256"))
    except (OSError, ValueError, AttributeError):
        return False


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


def index_json(plan: Plan, extra_metadata: Optional[dict] = None) -> dict:
    weight_map = {}
    total = 0
    for item in plan.items:
        for spec in item.outputs():
            weight_map[spec.key] = item.shard
            total += spec.nbytes
    meta = {
        "format": "mlx",
        "total_size": total,
        "mtpconvert": {
            "version": __version__,
            "source_layout": plan.style,
            "norm_shift_applied": plan.raw,
            "dtype": plan.dtype,
            "mtp_policy": plan.options.quant.mtp,
            "mtp_layers": plan.mtp_layers,
            **(extra_metadata or {}),
        },
    }
    return {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}


def copy_sidecars(src: Path, out: OutputFolder, keep_vision: bool) -> List[str]:
    names = list(SIDECAR_FILES) + (list(VISION_SIDECAR_FILES) if keep_vision else [])
    copied = []
    for name in names:
        p = src / name
        if not p.is_file():
            continue
        safe_member(src, name, "file", file=p)  # links only within the folder or its hub blob store
        shutil.copyfile(p, out.path(name))
        copied.append(name)
    return copied


def execute(
    plan: Plan,
    ckpt: Checkpoint,
    out: Path,
    *,
    overwrite: bool = False,
    progress: Optional[Progress] = None,
    extra_metadata: Optional[dict] = None,
    check: Optional[Callable[[Path], None]] = None,
    resume: bool = False,
    workers: Optional[int] = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    stream: Optional[ShardStream] = None,
) -> ConvertResult:
    """Write the plan's output folder atomically; ``check`` runs on the finished temp folder.

    With ``resume``, shards finished by an interrupted run of the same plan are kept when
    their recorded sha256 still matches; everything else is rewritten. With ``stream``,
    source shards are fetched when first read and deleted after their last use.
    """
    shards: Dict[str, List[PlanItem]] = {}
    for item in plan.items:
        shards.setdefault(item.shard, []).append(item)
    last_use: Dict[Path, int] = {}
    for i, item in enumerate(plan.items):
        for s in item.sources:
            last_use[ckpt.tensors[s.key].file] = i
    release_at: Dict[int, List[Path]] = {}
    for f, last in last_use.items():
        release_at.setdefault(last, []).append(f)

    written = reused = 0
    fingerprint = plan_fingerprint(plan, ckpt)
    with OutputFolder(out, overwrite=overwrite, resume=resume) as folder:
        folder.path(RESUME_DIR).mkdir(exist_ok=True)
        reader = TensorReader(stream.ensure, stream.release) if stream else TensorReader()
        streams = compute_streams(workers)
        position = 0

        def item_done(item: PlanItem) -> None:
            """Unmap source files this item used last, report progress, move on."""
            nonlocal position
            for f in release_at.get(position, ()):
                reader.release(f)
            if progress:
                progress(item, position)
            position += 1

        with quantizer_pool(plan, streams, block_bytes) as quantizers:
            try:
                for shard_name, items in shards.items():
                    specs = [spec for item in items for spec in item.outputs()]
                    path = folder.path(shard_name)
                    if resume and _reusable(folder, shard_name, fingerprint):
                        reused += 1
                        written += path.stat().st_size
                        for item in items:
                            item_done(item)
                        continue
                    writer = StreamingShardWriter(path, specs, {"format": "mlx"})
                    try:
                        blocks = (b for item in items for b in item_blocks(item, block_bytes))
                        write_blocks(blocks, ckpt, reader, writer, streams, item_done, quantizers)
                        writer.close()
                        written += writer.size
                        record = {"fingerprint": fingerprint, "size": writer.size, "sha256": writer.digest()}
                        (folder.path(RESUME_DIR) / f"{shard_name}.json").write_text(json.dumps(record))
                    except BaseException:
                        writer.abort()
                        raise
            except OSError as e:
                raise describe_os_error(e, out) from e
            finally:
                reader.close()
        try:
            folder.write_json("model.safetensors.index.json", index_json(plan, extra_metadata), indent=2)
            folder.write_json("config.json", plan.config)
            copy_sidecars(ckpt.root, folder, plan.options.keep_vision)
        except OSError as e:
            raise describe_os_error(e, out) from e
        shutil.rmtree(folder.path(RESUME_DIR))
        if check is not None:
            check(folder.tmp)
        folder.commit()
    return ConvertResult(out, list(shards), sum(len(i.outputs()) for i in plan.items), written, reused)
