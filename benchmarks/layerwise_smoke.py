"""Layer-by-layer MTP check vs the full smoke on a large-shaped model: peak RSS and wall time.

Writes a synthetic raw checkpoint shaped like a published release (``synth.py``: the first
``--layers`` decoder layers plus the MTP head, random weights), converts it with
``mtpconvert convert --no-smoke``, copies the bundled fixture's tokenizer into it (its ids fit any
Qwen3.5 vocabulary, so both checks read real text), then runs each check in a fresh process:

- ``layerwise``: ``mtpconvert.runtime.smoke.layerwise.layerwise_acceptance`` (default prompts, cut to
  ``--max-prompt-tokens`` each);
- ``full``: the ``mtpconvert smoke`` command (whole model loaded, greedy draft/verify decoding),
  with ``--full-max-tokens`` tokens per prompt (the command's default is 48 x 3 prompts).

Each child reports its own wall time and peak RSS (``ru_maxrss``). Before each run the weight
files are dropped from the page cache (``posix_fadvise DONTNEED`` on those files only), so both
start from disk; ``read`` is the time of one plain cold read of the same files. Random weights
make acceptance meaningless: only memory and time are measured.

    python -m benchmarks.layerwise_smoke Qwen3.5-27B /tmp/lw27 --layers 4 --bits 4
    python -m benchmarks.layerwise_smoke Qwen3.5-397B-A17B /tmp/lw397 --layers 1 --bits 4 --mtp match --skip-full
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def weight_files(folder: Path):
    return sorted(glob.glob(str(folder / "model*.safetensors"))) + (
        [str(folder / "mtp.safetensors")] if (folder / "mtp.safetensors").exists() else [])


def drop_cache(folder: Path) -> None:
    for f in weight_files(folder):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read_s(folder: Path) -> float:
    drop_cache(folder)
    t = time.perf_counter()
    for f in weight_files(folder):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t


def maxrss() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def child(kind: str, out: Path, args) -> dict:
    """Runs in a fresh process: one check, its own time and peak RSS."""
    t = time.perf_counter()
    if kind == "layerwise":
        from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance

        say = lambda m: print(f"[{time.perf_counter() - t:7.1f}s] {m}", file=sys.stderr, flush=True)  # noqa: E731
        r = layerwise_acceptance(out, max_prompt_tokens=args.max_prompt_tokens, progress=say,
                                 exact=True if args.exact else None)
        info = r.to_json()
    else:
        from typer.testing import CliRunner

        from mtpconvert.cli import app

        cmd = ["smoke", str(out), "--json", "--max-tokens", str(args.full_max_tokens), "--min-acceptance", "0"]
        for p in args.full_prompt or ():
            cmd += ["--prompt", p]
        res = CliRunner().invoke(app, cmd)
        if res.exception and not isinstance(res.exception, SystemExit):
            raise res.exception
        info = json.loads(res.stdout[res.stdout.index("{"):])
    info["wall_s"] = round(time.perf_counter() - t, 1)
    info["peak_rss_bytes"] = maxrss()
    return info


def run_child(kind: str, out: Path, args) -> dict:
    drop_cache(out)
    cmd = [sys.executable, "-m", "benchmarks.layerwise_smoke", "--child", kind, args.model, str(args.work),
           "--max-prompt-tokens", str(args.max_prompt_tokens), "--full-max-tokens", str(args.full_max_tokens)]
    if args.exact:
        cmd.append("--exact")
    for p in args.full_prompt or ():
        cmd += ["--full-prompt", p]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{kind} check failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a folder name under ../shared/layouts, e.g. Qwen3.5-27B")
    ap.add_argument("work", type=Path, help="scratch folder (raw/ and out/ are written here)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--mtp", default="keep", choices=["keep", "match"], help="the head's precision (convert --mtp)")
    ap.add_argument("--max-prompt-tokens", type=int, default=96)
    ap.add_argument("--full-max-tokens", type=int, default=48)
    ap.add_argument("--full-prompt", action="append", help="prompt for the full smoke (default: its 3 prompts)")
    ap.add_argument("--exact", action="store_true", help="layerwise with stock quantized kernels (slow on the CPU)")
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--skip-layerwise", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the folders (default: delete them at the end)")
    ap.add_argument("--child", choices=["layerwise", "full"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    raw, out = args.work / "raw", args.work / "out"
    if args.child:
        print(json.dumps(child(args.child, out, args)))
        return
    from benchmarks import synth

    from mtpconvert.fixture import fixture_path

    report = {"model": args.model, "layers": args.layers, "bits": args.bits, "mtp": args.mtp,
              "ld_preload": os.environ.get("LD_PRELOAD", "")}
    try:
        if not out.exists():
            t = time.perf_counter()
            report["synth"] = synth.write(args.model, raw, args.layers, shard_gb=2.0, sparse=False)
            report["synth_s"] = round(time.perf_counter() - t, 1)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "mtpconvert", "convert", str(raw), str(out), "--bits",
                            str(args.bits), "--mtp", args.mtp, "--no-smoke"], check=True)
            report["convert_s"] = round(time.perf_counter() - t, 1)
            shutil.rmtree(raw)  # disk: only the converted folder is needed from here on
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(fixture_path("dense") / f, out / f)
        from mtpconvert.runtime.smoke.sizing import stored_bytes_by_unit

        groups = stored_bytes_by_unit(out)
        report["weight_bytes"] = sum(groups.values())
        report["largest_layer_bytes"] = max(v for k, v in groups.items() if k.startswith(("layer", "mtp")))
        report["groups"] = groups
        report["cold_read_s"] = round(cold_read_s(out), 1)
        print(json.dumps({k: v for k, v in report.items() if k != "groups"}), flush=True)
        if not args.skip_layerwise:
            report["layerwise"] = run_child("layerwise", out, args)
            print(json.dumps({"layerwise": report["layerwise"]}), flush=True)
        if not args.skip_full:
            report["full"] = run_child("full", out, args)
            print(json.dumps({"full": report["full"]}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
