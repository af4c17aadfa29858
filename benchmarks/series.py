"""Conversion cost as the model grows: synthetic checkpoints of ~2, 8 and 16 GiB (dense) and a
35B-A3B-shaped MoE, each converted by mlx_lm.convert and mtpconvert in fresh processes, in one run.

    python -m benchmarks.series /tmp/series --json benchmarks/results/series.json [--repeat 2]
    python -m benchmarks.series /tmp/series --json gpu.json --tools mlx_lm,mtpconvert,mlx_lm@cpu,mtpconvert@cpu --digest
    python -m benchmarks.plot benchmarks/results/series.json benchmarks/results/scaling.png

Needs ~40 GiB of free disk for the sources (kept in ROOT, reused by later runs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import convert_bench, synth

# name -> (layout, decoder layers kept); sizes are what synth.py writes from the published tables
POINTS = {
    "dense-2g": ("Qwen3.5-2B", 8),
    "dense-8g": ("Qwen3.5-27B", 4),
    "dense-16g": ("Qwen3.5-27B", 15),
    "moe-10g": ("Qwen3.5-35B-A3B", 4),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool, round-robin; the fastest is kept")
    ap.add_argument("--tools", default="mlx_lm,mtpconvert-drop,mtpconvert",
                    help="convert_bench.py tools; add @cpu ones for the CPU backend of a GPU machine")
    ap.add_argument("--digest", action="store_true", help="record each output's digest (bytes across backends)")
    args = ap.parse_args(argv)
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    for name in args.points.split(","):
        model, layers = POINTS[name]
        src = args.root / name
        if not (src / "model.safetensors.index.json").exists():
            synth.write(model, src, layers, args.shard_gb, sparse=False)
        shards = sorted(src.glob("*.safetensors"))
        tools = args.tools.split(",")
        tries = {t: [] for t in tools}
        for _ in range(args.repeat):  # round-robin, so a slow spell of the VM hits every tool
            for t in tools:
                tries[t].append(convert_bench.run(t, src, 4, digest=args.digest))
        rows = {t: min(runs, key=lambda r: r["wall_s"]) for t, runs in tries.items()}
        results[name] = {"model": model, "layers": layers, "source_bytes": sum(p.stat().st_size for p in shards),
                         "largest_shard": max(p.stat().st_size for p in shards), "runs": rows,
                         "all_walls_s": {t: [round(r["wall_s"], 1) for r in runs] for t, runs in tries.items()}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(name, json.dumps({t: round(r["wall_s"], 1) for t, r in rows.items()}), flush=True)


if __name__ == "__main__":
    main()
