"""The quantization kernel alone: MLX's CPU ``mx.quantize`` vs ``mtpconvert.npquant``, same bytes.

MLX runs one CPU stream per worker (its threads need no GIL); npquant runs in worker
processes (its numpy passes hold the GIL in between, so threads would queue), its results
either piped back or left in shared memory as conversions do, and, for comparison, in
threads. Inputs are 16 MiB bf16 blocks ([1536, 5120], the row blocks a
conversion makes), quantized at --bits/--group-size; every configuration runs --rounds
times, interleaved, and the best round is reported (this VM's speed drifts by +-15%).

    python -m benchmarks.quantize_kernel [--bits 4] [--group-size 64] [--blocks 16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import ExitStack, closing
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtpconvert.execute import npquant
from mtpconvert.execute.quantpool import QuantizerPool

ROWS, COLS = 1536, 5120


def mlx_run(blocks, streams, bits, group) -> float:
    t = time.perf_counter()
    pending = []
    for k, w in enumerate(blocks):
        with mx.stream(streams[k % len(streams)]):
            out = mx.quantize(w, group_size=group, bits=bits)
        mx.async_eval(out)
        pending.append(out)
        if len(pending) > len(streams):
            mx.eval(pending.pop(0))
    mx.eval(pending)
    return time.perf_counter() - t


def npquant_run(pool, path: str, n_blocks: int, bits: int, group: int) -> float:
    block_bytes = ROWS * COLS * 2
    reads = [[(path, k * block_bytes, (ROWS, COLS))] for k in range(n_blocks)]
    t = time.perf_counter()
    list(pool.map(npquant.quantize_file_rows, reads, ["BF16"] * n_blocks, ["bfloat16"] * n_blocks,
                  [bits] * n_blocks, [group] * n_blocks))
    return time.perf_counter() - t


def shm_run(pool: QuantizerPool, path: str, n_blocks: int, bits: int, group: int) -> float:
    """As a conversion runs it: results left in shared-memory slots, each freed once read."""
    block_bytes = ROWS * COLS * 2
    t = time.perf_counter()
    pending: deque = deque()
    for k in range(n_blocks):
        if not pool.has_free_slot():
            done = pending.popleft()
            pool.result(done)
            pool.release(done)
        pending.append(pool.submit(([(path, k * block_bytes, (ROWS, COLS))], "BF16", "bfloat16", bits, group)))
    for done in pending:
        pool.result(done)
        pool.release(done)
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((ROWS, COLS), np.float32) * 0.02) for _ in range(args.blocks)]
    blocks = [mx.array(d).astype(mx.bfloat16) for d in data]
    mx.eval(blocks)
    total = sum(b.nbytes for b in blocks)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        path = str(Path(tmp) / "blocks.bin")
        with open(path, "wb") as f:
            for b in blocks:
                f.write(np.array(b.view(mx.uint16)).tobytes())
        # same bytes, first block: the kernel is only worth timing if it is MLX's
        ref = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()
               for a in mx.quantize(blocks[0], group_size=args.group_size, bits=args.bits)]
        got = npquant.quantize_file_rows([(path, 0, (ROWS, COLS))], "BF16", "bfloat16", args.bits, args.group_size)
        assert [a.tobytes() for a in got] == ref, "npquant and mx.quantize disagree"

        ctx = multiprocessing.get_context("spawn")
        configs = {}
        for n in sorted({1, args.workers}):
            streams = [mx.new_stream(mx.cpu) for _ in range(n)]
            configs[f"mx.quantize, {n} MLX stream(s)"] = lambda s=streams: mlx_run(blocks, s, args.bits, args.group_size)
            procs = ProcessPoolExecutor(n, mp_context=ctx)
            threads = ThreadPoolExecutor(n)
            for pool in (procs, threads):
                npquant_run(pool, path, n, args.bits, args.group_size)  # warm up
            configs[f"npquant, {n} process(es), results piped"] = lambda p=procs: npquant_run(
                p, path, args.blocks, args.bits, args.group_size)
            slot_bytes = npquant.result_bytes(ROWS * COLS // args.group_size, args.bits, args.group_size, "bfloat16")
            shared = stack.enter_context(closing(QuantizerPool(n, 2 * n + 2, slot_bytes)))
            shm_run(shared, path, n, args.bits, args.group_size)  # warm up
            configs[f"npquant, {n} process(es), results in shared memory"] = lambda p=shared: shm_run(
                p, path, args.blocks, args.bits, args.group_size)
            if n > 1:
                configs[f"npquant, {n} threads"] = lambda p=threads: npquant_run(p, path, args.blocks, args.bits,
                                                                                  args.group_size)
        best = {}
        for _ in range(args.rounds):
            for name, run in configs.items():
                best[name] = min(best.get(name, float("inf")), run())
    print(f"{args.blocks} x 16 MiB bf16 blocks, --bits {args.bits} --group-size {args.group_size}, "
          f"best of {args.rounds} interleaved rounds")
    print("| kernel | MB/s of bf16 input | vs mx.quantize, same workers |")
    print("|---|---|---|")
    for name, secs in best.items():
        n = name.split(", ")[1].split()[0]
        base = best[f"mx.quantize, {n} MLX stream(s)"]
        print(f"| {name} | {total / secs / 1e6:.0f} | {base / secs:.2f}x |")


if __name__ == "__main__":
    main()
