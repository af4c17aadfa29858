"""Where conversion time goes: the same plan run in stages, each a full pass over every block.

  read       copy every block out of the source mapping (no compute)
  transform  + renames/stacks/splits, norm+1, casts (evaluated, no quantization)
  quantize   + quantization with MLX's mx.quantize, on one stream per core, nothing written
  full (MLX) the real execute() with MLX quantizing (MTPCONVERT_NUMPY_QUANT=0): all of the
             above plus hashing and writing, pipelined
  full       the real execute() as it runs by default (npquant in worker processes on the CPU)

Also times the disk itself: a cold sequential read of the source (page cache dropped; root)
and a write + fsync of as many bytes as the output. Stages overlap in `full`, so it is less
than the sum.

    python benchmarks/time_split.py /tmp/synth27 [--mtp drop]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from convert_bench import prepare_cache

from mtpconvert.execute.blocks import item_blocks, read_block
from mtpconvert.execute import execute
from mtpconvert.execute.pipeline import compute_streams
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.reader import TensorReader
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.execute.ops import apply_steps


def warm(src: Path) -> None:
    prepare_cache(src, cold=False)


def timed_pass(plan, ckpt, stage: str) -> float:
    streams = compute_streams()
    t = time.perf_counter()
    with TensorReader() as reader:
        pending = []
        for k, block in enumerate(b for it in plan.items for b in item_blocks(it)):
            with mx.stream(streams[k % len(streams)]):
                w = read_block(block, ckpt, reader)
                if stage == "transform":
                    steps = [s for s in block.item.steps if not s.startswith("quantize:")]
                    outs = apply_steps(w, steps, None)
                elif stage == "quantize":
                    outs = apply_steps(w, block.item.steps, block.item.quant)
                else:
                    outs = [w]
            mx.async_eval(*outs)
            pending.append(outs)
            if len(pending) > len(streams):
                mx.eval(*pending.pop(0))
        for outs in pending:
            mx.eval(*outs)
    return time.perf_counter() - t


def disk(src: Path, out_bytes: int) -> dict:
    res = {}
    try:
        prepare_cache(src, cold=True)
        t = time.perf_counter()
        n = 0
        for p in sorted(src.glob("*.safetensors")):
            with open(p, "rb") as f:
                while block := f.read(1 << 24):
                    n += len(block)
        res["cold_read_gbps"] = n / (time.perf_counter() - t) / 1e9
    except OSError:
        res["cold_read_gbps"] = None
    with tempfile.NamedTemporaryFile(dir=src.parent) as f:
        block = b"\1" * (1 << 24)
        t = time.perf_counter()
        for _ in range(max(1, out_bytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        res["write_fsync_gbps"] = out_bytes / (time.perf_counter() - t) / 1e9
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--mtp", default="keep")
    args = ap.parse_args(argv)
    ckpt = open_checkpoint(args.src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=64, mtp=args.mtp)))
    in_bytes = sum(it.in_bytes for it in plan.items)
    out_bytes = sum(it.out_bytes for it in plan.items)
    rows = {}
    for stage in ("read", "transform", "quantize"):
        warm(args.src)
        rows[stage] = timed_pass(plan, ckpt, stage)
    for name, numpy_quant in (("full (MLX)", "0"), ("full", "1")):
        warm(args.src)
        os.environ["MTPCONVERT_NUMPY_QUANT"] = numpy_quant
        with tempfile.TemporaryDirectory(dir=args.src.parent) as tmp:
            t = time.perf_counter()
            execute(plan, ckpt, Path(tmp) / "out")
            rows[name] = time.perf_counter() - t
            shutil.rmtree(Path(tmp) / "out")
    d = disk(args.src, out_bytes)
    gib = 2**30
    print(f"{args.src}: {in_bytes / gib:.2f} GiB read, {out_bytes / gib:.2f} GiB written, "
          f"{len(compute_streams())} compute streams")
    print("| stage | wall s | added by this stage s |")
    print("|---|---|---|")
    prev = 0.0
    for stage, t in rows.items():
        added = t - prev if not stage.startswith("full") else t - rows["quantize"]
        print(f"| {stage} | {t:.1f} | {added:+.1f} |")
        prev = t
    cold = d["cold_read_gbps"]
    print(f"disk: cold sequential read {cold:.2f} GB/s, " if cold else "disk: cold read not measured (needs root), ",
          f"write+fsync {d['write_fsync_gbps']:.2f} GB/s; at those rates reading the source takes "
          f"{in_bytes / 1e9 / cold:.1f} s and writing the output {out_bytes / 1e9 / d['write_fsync_gbps']:.1f} s"
          if cold else f"write+fsync {d['write_fsync_gbps']:.2f} GB/s")


if __name__ == "__main__":
    main()
