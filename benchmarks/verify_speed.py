"""Time `verify` (headers only) on a full-size synthetic Qwen3.5-122B-A10B raw folder written sparse.

    python -m benchmarks.verify_speed [--model Qwen3.5-122B-A10B] [--repeat 5]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.synth import write

from mtpconvert.verify import verify


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="Qwen3.5-122B-A10B")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        info = write(args.model, Path(tmp), None, 4.0, sparse=True)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = verify(Path(tmp))
            times.append(time.perf_counter() - t0)
        errors = [f.code for f in report.findings if f.severity == "error"]
        print(f"{args.model}: {info['tensors']} tensors, {info['shards']} shards, {info['bytes'] / 2**30:.0f} GiB "
              f"(sparse); verify ok={report.ok} errors={errors[:3]}; "
              f"median {statistics.median(times):.3f} s, max {max(times):.3f} s over {args.repeat} runs")


if __name__ == "__main__":
    main()
