"""Where conversion time goes: the same plan run in stages, each a full pass over every block,
pipelined as ``execute`` does it (reader threads ahead, a few blocks evaluating at once), on
MLX's default device (a GPU where there is one; ``--cpu`` for the CPU backend):

  read        the blocks' sources read by the reader threads into their buffers (no MLX)
  to device   + each buffer made an MLX array and reduced on the device (moves it there)
  quantize    + the plan's transforms and quantization on the device, outputs evaluated
  to host     + the outputs' bytes copied out on the host (moves them back)
  hash        + sha256 of those bytes
  old: read + to device   read + to device as before: the main thread copying each block out
              of the source mapping into a new MLX array, one block in flight per stream
  full (MLX)  the real execute(), MLX quantizing (MTPCONVERT_NUMPY_QUANT=0): all of the above
              plus pwrite + fsync, with hashing and writing on their own threads
  full        the real execute() as it runs by default (npquant worker processes on the CPU backend)
  full (npquant workers)   with a GPU: execute() with MTPCONVERT_NUMPY_QUANT=all

Blocks whose gather needs a copy (vision patch; none in a text checkpoint) are left out of the
stage passes. Each stage's row also says how much it added to the one before.

    python -m benchmarks.time_split /tmp/s27 --mtp drop [--json split.json] [--cpu] [--sweep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from benchmarks.convert_bench import prepare_cache

from mtpconvert.execute import execute
from mtpconvert.execute.blocks import direct_read, item_blocks, read_block
from mtpconvert.execute.ops import apply_steps
from mtpconvert.execute.pipeline import GPU_DEPTH, READ_THREADS, SourceBuffers, _read_into, compute_streams
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.io.reader import TensorReader
from mtpconvert.io.shard_writer import array_bytes
from mtpconvert.options import ConvertOptions, ExecuteOptions, QuantOptions
from mtpconvert.plan import build_plan

STAGES = ("read", "to device", "quantize", "to host", "hash")


def timed_pass(plan, ckpt, stage: str) -> float:
    level = STAGES.index(stage)
    streams = compute_streams()
    depth = GPU_DEPTH if streams[0].device != mx.cpu else len(streams)
    buffers = SourceBuffers(READ_THREADS + depth + 2, streams[0])
    sink = np.empty(16 << 20, np.uint8)
    queued, computing = deque(), deque()
    t = time.perf_counter()

    def finish() -> None:
        outs, slot = computing.popleft()
        mx.eval(*outs)
        if level >= 3:
            for o in outs:
                data = np.frombuffer(array_bytes(o), np.uint8)
                for a in range(0, len(data), len(sink)):  # a copy out, in pieces
                    part = data[a:a + len(sink)]
                    np.copyto(sink[:len(part)], part)
                if level >= 4:
                    hashlib.sha256(data).digest()
        buffers.release(slot)

    def compute() -> None:
        block, future, slot, read = queued.popleft()
        future.result()
        if level == 0:
            buffers.release(slot)
            return
        with mx.stream(streams[compute.k % len(streams)]):
            src = buffers.array(slot, read)
            outs = [src.view(mx.uint8).max()] if level == 1 else apply_steps(src, block.item.steps)
        compute.k += 1
        mx.async_eval(*outs)
        computing.append((outs, slot))
        if len(computing) > depth:
            finish()
    compute.k = 0

    with TensorReader() as reader, ThreadPoolExecutor(READ_THREADS) as readers:
        for block in (b for it in plan.items for b in item_blocks(it)):
            read = direct_read(block, ckpt)
            if read is None:
                continue
            runs = [(reader.fileno(info), off, n) for info, off, n in read.runs]
            while not buffers.has_free():
                compute() if queued else finish()
            slot = buffers.take(read.nbytes)
            queued.append((block, readers.submit(_read_into, runs, buffers.view(slot, read.nbytes)), slot, read))
            if len(queued) > READ_THREADS:
                compute()
        while queued:
            compute()
        while computing:
            finish()
    return time.perf_counter() - t


def old_read_pass(plan, ckpt) -> float:
    """read + to device as the pipeline did before reader threads: the main thread copies each
    block out of the source mapping into a new MLX array, one block evaluating at a time."""
    streams = compute_streams()
    t = time.perf_counter()
    pending = deque()
    with TensorReader() as reader:
        for k, block in enumerate(b for it in plan.items for b in item_blocks(it)):
            with mx.stream(streams[k % len(streams)]):
                outs = [read_block(block, ckpt, reader).view(mx.uint8).max()]
            mx.async_eval(*outs)
            pending.append(outs)
            if len(pending) > len(streams):
                mx.eval(*pending.popleft())
        while pending:
            mx.eval(*pending.popleft())
    return time.perf_counter() - t


def full(plan, ckpt, src: Path, numpy_quant: str, **config) -> tuple:
    """(wall s, seconds per stage from pipeline.PROFILE plus the shards' fsync) of one execute().
    ``config``: block_bytes, and pipeline constants to try (READ_THREADS=8, GPU_DEPTH=6, ...)."""
    from mtpconvert.execute import pipeline
    from mtpconvert.io import shard_writer

    block_bytes = config.pop("block_bytes", None)
    saved = {k: getattr(pipeline, k) for k in config}
    real_close = shard_writer.StreamingShardWriter.close

    def timed_close(self):
        t = time.perf_counter()
        real_close(self)
        pipeline.PROFILE["shard close: fsync (main)"] += time.perf_counter() - t

    os.environ["MTPCONVERT_NUMPY_QUANT"] = numpy_quant
    shard_writer.StreamingShardWriter.close = timed_close
    for k, v in config.items():
        setattr(pipeline, k, v)
    pipeline.PROFILE.clear()
    try:
        with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
            t = time.perf_counter()
            execute(plan, ckpt, Path(tmp) / "out", ExecuteOptions(block_bytes=block_bytes))
            took = time.perf_counter() - t
            shutil.rmtree(Path(tmp) / "out")
        return took, dict(pipeline.PROFILE)
    finally:
        os.environ.pop("MTPCONVERT_NUMPY_QUANT", None)
        shard_writer.StreamingShardWriter.close = real_close
        for k, v in saved.items():
            setattr(pipeline, k, v)


SWEEP = {  # execute() configurations --sweep tries (MLX quantizing on the default device)
    "default": {},
    "1 hash thread": {"HASH_THREADS": 1},
    "64 MiB blocks": {"block_bytes": 64 << 20},
    "8 reader threads, depth 6": {"READ_THREADS": 8, "GPU_DEPTH": 6},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--mtp", default="keep")
    ap.add_argument("--cpu", action="store_true", help="MLX's CPU backend where the default device is a GPU")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", action="store_true", help="instead: execute() with each of SWEEP's configurations")
    args = ap.parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    ckpt = open_checkpoint(args.src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=64, mtp=args.mtp)))
    in_bytes = sum(it.in_bytes for it in plan.items)
    out_bytes = sum(it.out_bytes for it in plan.items)
    rows, profiles = {}, {}
    if args.sweep:
        for name, config in SWEEP.items():
            prepare_cache(args.src, cold=False)
            rows[name], profiles[name] = full(plan, ckpt, args.src, "0", **config)
            print(f"{name}: {rows[name]:.2f} s", json.dumps({k: round(v, 2) for k, v in profiles[name].items()}),
                  flush=True)
    else:
        for stage in STAGES:
            prepare_cache(args.src, cold=False)
            rows[stage] = timed_pass(plan, ckpt, stage)
        prepare_cache(args.src, cold=False)
        rows["old: read + to device"] = old_read_pass(plan, ckpt)
        on_gpu = mx.default_device() != mx.cpu
        fulls = [("full (MLX)", "0"), ("full", "1")] + ([("full (npquant workers)", "all")] if on_gpu else [])
        for name, numpy_quant in fulls:
            prepare_cache(args.src, cold=False)
            rows[name], profiles[name] = full(plan, ckpt, args.src, numpy_quant)
    gib = 2**30
    print(f"{args.src}: {in_bytes / gib:.2f} GiB read, {out_bytes / gib:.2f} GiB written, device {mx.default_device()}, "
          f"{len(compute_streams())} compute stream(s), --mtp {args.mtp}")
    print("| stage | wall s | added by this stage s |")
    print("|---|---|---|")
    prev = 0.0
    for stage, t in rows.items():
        added = (t - prev if stage in STAGES else t - rows["hash" if stage.startswith("full") else "read"]) \
            if "hash" in rows else 0.0
        print(f"| {stage} | {t:.1f} | {added:+.1f} |")
        prev = t if stage in STAGES else prev
    for name, prof in profiles.items():
        print(f"\n{name}: {rows[name]:.1f} s wall; seconds in each part, summed over the threads doing it:")
        print("| part | s |\n|---|---|")
        for k, v in sorted(prof.items()):
            print(f"| {k} | {v:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "in_bytes": in_bytes,
                                         "out_bytes": out_bytes, "mtp": args.mtp, "stages_s": rows,
                                         "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
