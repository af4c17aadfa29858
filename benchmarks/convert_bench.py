"""mtpconvert vs mlx_lm.convert on the same synthetic raw checkpoint, same machine, one run.

Each tool runs in its own fresh process; we report wall time, peak RSS (ru_maxrss), and bytes
read/written (/proc/self/io, Linux). mlx_lm.convert drops the MTP head, so mtpconvert runs twice:
with `--mtp drop` (same work as mlx-lm) and with the head kept.

    python -m benchmarks.synth Qwen3.5-27B /tmp/synth --layers 4 --shard-gb 2
    python -m benchmarks.convert_bench /tmp/synth --bits 4 [--tools mtpconvert-drop-mlxquant,mtpconvert-drop] [--repeat 3]
    python -m benchmarks.convert_bench /tmp/synth --tools mlx_lm,mtpconvert-drop,mlx_lm@cpu,mtpconvert-drop@cpu --digest

``--fp8-twin DIR`` runs every tool on DIR as well (rows ``tool[fp8]``), round-robin with the source: the
block-FP8 twin of the same checkpoint (``benchmarks/fp8_twin.py``), whose output has the same shapes.

    python -m benchmarks.fp8_twin /tmp/synth /tmp/synth-fp8
    python -m benchmarks.convert_bench /tmp/synth --fp8-twin /tmp/synth-fp8 --tools mtpconvert --repeat 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
tool, src, out, bits = sys.argv[1:5]
tool, _, backend = tool.partition("@")
import mlx.core as mx
if backend == "cpu":  # MLX's CPU backend on a machine whose default device is a GPU
    mx.set_default_device(mx.cpu)
device = str(mx.default_device())
if tool == "mlx_lm":
    from mlx_lm import convert
    if bits == "0":  # no quantization: the source's dtype (config.json's torch_dtype), as mtpconvert keeps it
        convert(hf_path=src, mlx_path=out)
    else:
        convert(hf_path=src, mlx_path=out, quantize=True, q_bits=int(bits), q_group_size=64)
else:
    if "-mlxquant" in tool:  # the same conversion with MLX's mx.quantize instead of npquant
        os.environ["MTPCONVERT_NUMPY_QUANT"] = "0"
    if "-workers" in tool:  # npquant worker processes with a GPU too
        os.environ["MTPCONVERT_NUMPY_QUANT"] = "all"
    from mtpconvert.cli import app
    args = ["convert", src, out, "--no-smoke"] + (["--bits", bits, "--group-size", "64"] if bits != "0" else [])
    if tool.startswith("mtpconvert-drop"):
        args += ["--mtp", "drop"]
    try:
        app(args, standalone_mode=False)
    except SystemExit:
        pass
wall = time.perf_counter() - t0
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
# mtpconvert's quantizer processes (one per core) run alongside it: count each at the largest one's peak
workers = min(os.cpu_count() or 1, 8) if kids.ru_maxrss else 0
print(json.dumps({"wall_s": wall, "device": device, "user_s": me.ru_utime + kids.ru_utime,
                  "sys_s": me.ru_stime + kids.ru_stime, "peak_rss_kib": me.ru_maxrss + workers * kids.ru_maxrss,
                  "peak_rss_self_kib": me.ru_maxrss, "peak_rss_worker_kib": kids.ru_maxrss, "workers": workers,
                  "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "read_bytes": int(io["read_bytes"]), "write_bytes": int(io["write_bytes"]),
                  "rchar": int(io["rchar"]), "wchar": int(io["wchar"])}))
"""


def prepare_cache(src: Path, cold: bool) -> None:
    """Same start for every tool: source pages all cached (warm) or none (cold, needs root)."""
    subprocess.run(["sync"])
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for p in sorted(src.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def steal_s() -> float:
    """CPU time the hypervisor took from this VM so far, all cores (Linux /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def output_digest(out: Path) -> str:
    """sha256 over the output's safetensors files (name and content), hashed in parallel."""
    files = sorted(p for p in out.rglob("*.safetensors") if p.is_file() and not p.is_symlink())

    def one(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as f:
            while block := f.read(1 << 24):
                h.update(block)
        return f"{p.relative_to(out)} {h.hexdigest()}"

    with ThreadPoolExecutor(8) as pool:
        lines = list(pool.map(one, files))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def run(tool: str, src: Path, bits: int, cold: bool = False, digest: bool = False) -> dict:
    """One conversion in a fresh process. ``tool``: mlx_lm, mtpconvert or mtpconvert-drop
    (``--mtp drop``), with ``-mlxquant`` (MLX quantizes, no npquant workers), ``-workers``
    (npquant workers with a GPU too) or ``-base`` (the package in $MTPCONVERT_BASE, e.g. a
    snapshot of the commit before) in the name, and ``@cpu`` for MLX's CPU backend on a
    machine whose default device is a GPU."""
    # The child runs in a scratch folder: its working directory comes first on its sys.path and holds no
    # mtpconvert, so the package it imports is $MTPCONVERT_BASE's for a -base tool, else this checkout's.
    first = [os.environ["MTPCONVERT_BASE"]] if "-base" in tool else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*first, str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        out = Path(tmp).resolve() / "out"
        prepare_cache(src, cold)
        stolen = steal_s()
        proc = subprocess.run([sys.executable, "-c", WRAPPER, tool, str(src.resolve()), str(out), str(bits)],
                              capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(f"{tool} failed:\n{proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["steal_s"] = steal_s() - stolen
        # each file once: the MTP sidecar's mtp/weights.safetensors is a hard link of mtp.safetensors
        files = {(s.st_dev, s.st_ino): s.st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink()
                 for s in [p.stat()]}
        result["out_bytes"] = sum(files.values())
        if digest:
            result["digest"] = output_digest(out)
        shutil.rmtree(out, ignore_errors=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--bits", type=int, default=4, help="0: no quantization (mlx_lm.convert without -q)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root); default: warm")
    ap.add_argument("--tools", default="mlx_lm,mtpconvert-drop,mtpconvert",
                    help="mlx_lm, mtpconvert, mtpconvert-drop (--mtp drop); a -mlxquant suffix quantizes "
                         "with mx.quantize instead of npquant")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool, round-robin; the fastest is kept")
    ap.add_argument("--digest", action="store_true", help="sha256 of each output (after timing): equal digests "
                    "are byte-identical outputs")
    ap.add_argument("--json", type=Path, help="also write every run here")
    ap.add_argument("--fp8-twin", type=Path, help="the source's block-FP8 twin: every tool runs on it too")
    args = ap.parse_args(argv)
    shards = sorted(args.src.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in shards)
    largest = max(p.stat().st_size for p in shards)
    sources = {t: args.src for t in args.tools.split(",")}
    if args.fp8_twin:
        sources.update({f"{t}[fp8]": args.fp8_twin for t in args.tools.split(",")})
    tries = {t: [] for t in sources}
    for _ in range(args.repeat):
        for t in tries:
            tries[t].append(run(t.removesuffix("[fp8]"), sources[t], args.bits, args.cold, args.digest))
            print(t, json.dumps(tries[t][-1]), flush=True)
    rows = {t: min(runs, key=lambda r: r["wall_s"]) for t, runs in tries.items()}
    gib = 2**30
    print(f"source: {args.src} ({src_bytes / gib:.2f} GiB in {len(shards)} shards, largest {largest / gib:.2f} GiB), "
          f"--bits {args.bits} --group-size 64, {'cold' if args.cold else 'warm'} page cache")
    print(f"best of {args.repeat} run(s) per tool; CPU s = user + system of the tool and its workers; "
          "steal s = CPU time the hypervisor took from this VM during the run")
    print("| tool | device | wall s (all runs) | vs first tool | user + sys CPU s | steal s | peak RSS GiB "
          "| RSS - largest shard | written to storage GiB | output GiB | output MB/s | output digest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = next(iter(rows.values()))["wall_s"]
    for tool, r in rows.items():
        rss = r["peak_rss_kib"] * 1024
        walls = ", ".join(f"{x['wall_s']:.1f}" for x in tries[tool])
        print(f"| {tool} | {r['device']} | {r['wall_s']:.1f} ({walls}) | {r['wall_s'] / base:.2f}x "
              f"| {r['user_s']:.1f} + {r['sys_s']:.1f} | {r['steal_s']:.1f} | {rss / gib:.2f} | {(rss - largest) / gib:+.2f} "
              f"| {r['write_bytes'] / gib:.2f} | {r['out_bytes'] / gib:.2f} | {r['out_bytes'] / r['wall_s'] / 1e6:.0f} "
              f"| {r.get('digest', '')} |")
    print(json.dumps(rows))
    if args.json:
        args.json.write_text(json.dumps({"source_bytes": src_bytes, "largest_shard": largest, "best": rows,
                                         "runs": tries}, indent=1))


if __name__ == "__main__":
    main()
