"""Publish under a runner's limits: pull -> convert -> smoke -> upload against the loopback Hub,
with the converter in a memory-limited cgroup and its working folder on a small loop-mounted disk.

    sudo python -m benchmarks.constrained_publish --model Qwen3.5-4B --layers 6 --shard-gb 0.4 \\
        --mem-gb 1 --disk-gb 2.75 --no-smoke
    sudo python -m benchmarks.constrained_publish --model Qwen3.5-4B --layers 6 --shard-gb 0.4 \\
        --mem-gb 1 --disk-gb 3.25
    sudo python -m benchmarks.constrained_publish ... --no-smoke --prefetch-shards 0   # one raw shard at a time
    sudo python -m benchmarks.constrained_publish ... --shard-gb 2 --disk-gb 1.5 --raw-window 0.25   # byte ranges

Needs root (cgroup and loop mount). The limits are enforced by the kernel, not measured after
the fact: the memory limit is a cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) that
the converter process and its quantizer workers run in (the OOM killer ends the run if they go
over: page cache counts too and is reclaimed first); the disk is an ext4 image of ``--disk-gb``
mounted with ``-o loop``, holding the converter's working directory (OUT, the streamed raw
shards, the huggingface_hub cache). The synthetic source (``benchmarks/synth.py``) and the Hub's
storage live outside both limits, like the real Hub. Prints one JSON record: peak RSS of the
largest process, the cgroup's peak (RSS + page cache), peak disk used on the image and peak bytes
allocated in the partial output folder (both sampled every 20 ms), wall time, and what the repo
received. With the smoke on (the default: ``--smoke-mode layerwise``, random weights so
``--min-acceptance 0 --min-mlp-gain -1``) the smoke is fed each output shard as it is written and the shard is freed
once uploaded and consumed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.hubserver import FakeHub, Repo

ROOT = Path(__file__).resolve().parents[1]

GB = 1 << 30


def memory_cgroup(limit: int) -> Path:
    """A fresh memory cgroup with ``limit`` bytes (v1 here; v2 where that is what the host mounts)."""
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"mtpconvert-bench-{os.getpid()}"
    group.mkdir()
    if v1.is_dir():
        (group / "memory.limit_in_bytes").write_text(str(limit))
    else:
        (group / "memory.max").write_text(str(limit))
        (group / "memory.swap.max").write_text("0")
    return group


def cgroup_peak(group: Path) -> int:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if (group / name).exists():
            return int((group / name).read_text())
    return -1


def oom_kills(group: Path) -> int:
    events = group / ("memory.oom_control" if (group / "memory.oom_control").exists() else "memory.events")
    for line in events.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def loop_disk(image: Path, mount: Path, size: int) -> None:
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(image)], check=True)
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)


def disk_used(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def allocated_under(folder: Path) -> int:
    """Bytes allocated to the files under ``folder`` (holes not counted: a header stub is a few blocks)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # deleted while walking
                pass
    return total


class DiskWatch(threading.Thread):
    def __init__(self, mount: Path, every: float = 0.02):
        super().__init__(daemon=True)
        self.mount, self.every, self.base, self.peak = mount, every, disk_used(mount), 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.peak = max(self.peak, disk_used(self.mount) - self.base)
            self.peak_output = max(self.peak_output, allocated_under(self.mount / ".out.partial"))
            self.peak_raw = max(self.peak_raw, allocated_under(self.mount / ".out.stream"))
            self._halt.wait(self.every)

    peak_output = 0  # the partial output folder alone (shards with data, sidecar, the smoke's copies)
    peak_raw = 0  # the streamed raw shards (staging folder: header stubs and downloaded shards)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def serve_folder(hub: FakeHub, repo_id: str, folder: Path) -> None:
    """Serve a folder without reading it into memory: each file is a read-only map."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                files[p.relative_to(folder).as_posix()] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    hub.repos[repo_id] = Repo(files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3.5-4B")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--shard-gb", type=float, default=0.4, help="source shard size")
    ap.add_argument("--out-shard-gb", type=float, default=0.25, help="output shard size (--max-shard-size)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--mem-gb", type=float, default=1.0)
    ap.add_argument("--disk-gb", type=float, default=2.75)
    ap.add_argument("--no-smoke", action="store_true")
    ap.add_argument("--smoke-mode", default="layerwise", choices=["layerwise", "full"],
                    help="layerwise: fed shard by shard, shards freed as they go; full: every shard kept to the end")
    ap.add_argument("--prefetch-shards", type=int, default=None,
                    help="passed to the converter (--stream --prefetch-shards N; default: its own, 1)")
    ap.add_argument("--raw-window", type=float, default=None,
                    help="passed to the converter (--stream --raw-window GB: byte ranges instead of whole shards)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/constrained-publish"))
    args = ap.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    source = args.work / f"{args.model}-{args.layers}l"
    if not (source / "config.json").exists():
        subprocess.run([sys.executable, "-m", "benchmarks.synth", args.model, str(source),
                        "--layers", str(args.layers), "--shard-gb", str(args.shard_gb)], check=True)
    from mtpconvert.fixture import fixture_path

    for name in ("tokenizer.json", "tokenizer_config.json"):  # the smoke's prompts; the fixture's ids fit any vocab
        shutil.copy(fixture_path("dense") / name, source / name)
    source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    mount = args.work / "disk"
    loop_disk(args.work / "disk.img", mount, int(args.disk_gb * GB))
    group = memory_cgroup(int(args.mem_gb * GB))
    try:
        with FakeHub() as hub:
            serve_folder(hub, "Qwen/Synth", source)
            env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(mount / "cache"),
                   "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            command = ["pull-and-quantize", "Qwen/Synth", str(mount / "out"), "--bits", str(args.bits),
                       "--stream", "--max-shard-size", str(args.out_shard_gb), "--upload-repo", "bench/synth"]
            if args.prefetch_shards is not None:
                command += ["--prefetch-shards", str(args.prefetch_shards)]
            if args.raw_window is not None:
                command += ["--raw-window", str(args.raw_window)]
            command += ["--no-smoke"] if args.no_smoke else ["--smoke-mode", args.smoke_mode, "--min-acceptance", "0",
                                                                  "--min-mlp-gain", "-1"]
            watch = DiskWatch(mount)
            watch.start()
            t0 = time.perf_counter()
            # the child joins the cgroup before exec, so every process it starts is limited too
            proc = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
                                   sys.executable, "-m", "mtpconvert", *command],
                                  cwd=mount, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            peak_disk = watch.stop()
            repo = hub.repos.get("bench/synth")
            uploaded = {n: len(b) for n, b in (repo.files.items() if repo else [])}
            record = {
                "command": "mtpconvert " + " ".join(command),
                "exit_code": proc.returncode,
                "source_bytes": source_bytes,
                "output_bytes_uploaded": sum(uploaded.values()),
                "files_uploaded": len(uploaded),
                "model_shards_uploaded": sum(1 for n in uploaded if n.startswith("model-")),
                "commits": len(repo.commits) if repo else 0,
                "memory_limit_bytes": int(args.mem_gb * GB),
                "disk_limit_bytes": int(args.disk_gb * GB),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                "cgroup_peak_bytes": cgroup_peak(group),
                "oom_kills": oom_kills(group),
                "peak_disk_bytes": peak_disk,
                "peak_output_folder_bytes": watch.peak_output,
                "peak_raw_stage_bytes": watch.peak_raw,
                "wall_s": round(wall, 1),
                "tail": (proc.stdout + proc.stderr).strip().splitlines()[-6:],
            }
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        os.unlink(args.work / "disk.img")
        group.rmdir() if not (group / "cgroup.procs").read_text().strip() else None
    print(json.dumps(record, indent=2))
    return 0 if record["exit_code"] == 0 and record["commits"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
