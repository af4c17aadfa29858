"""Where a conversion's CPU time goes, thread by thread: the main thread, the shard writer
(hashing and pwrite), the process pool's result thread, MLX's stream threads, and the
quantizer worker processes together. On a 2-core machine every CPU second the parent
spends is taken from the workers, so this is what to cut.

    python -m benchmarks.cpu_threads /tmp/series/dense-8g [--mtp drop] [--bits 4]

Linux only (reads /proc/self/task). Threads are sampled every 0.2 s; one that ends between
samples loses its last 0.2 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.convert_bench import prepare_cache, steal_s


def thread_cpu() -> dict:
    """user and system seconds of each live thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


ROLES = {"_ExecutorManagerThread": "process pool (results)", "QueueFeederThread": "process pool (submit)",
         "_RefreshThread": "progress display"}


def role(kind: str, name: str, tid: int) -> str:
    if tid == os.getpid():
        return "main thread"
    if name.startswith("shard-writer"):
        return "shard writer (hash, pwrite)"
    if kind in ROLES or name in ROLES:
        return ROLES.get(kind) or ROLES[name]
    return "native threads (MLX streams, ...)" if kind == "?" else f"{kind} {name}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--bits", default="4")
    ap.add_argument("--mtp", default="drop")
    args = ap.parse_args(argv)
    from mtpconvert.cli import app

    prepare_cache(args.src, cold=False)
    seen, names, done = {}, {}, threading.Event()

    def sample():
        while not done.is_set():
            for t in threading.enumerate():
                if t.native_id is not None:
                    names[t.native_id] = (type(t).__name__, t.name)
            seen.update(thread_cpu())
            done.wait(0.2)

    sampler = threading.Thread(target=sample, name="sampler", daemon=True)
    with tempfile.TemporaryDirectory(dir=args.src.parent) as tmp:
        stolen = steal_s()
        before = thread_cpu()  # the main thread has just read the source into the page cache
        sampler.start()
        t = time.perf_counter()
        try:
            app(["convert", str(args.src), str(Path(tmp) / "out"), "--bits", args.bits, "--group-size", "64",
                 "--mtp", args.mtp, "--no-smoke"], standalone_mode=False)
        except SystemExit:
            pass
        wall = time.perf_counter() - t
        done.set()
        sampler.join()
        stolen = steal_s() - stolen
    rows: dict = {}
    for tid, (user, system) in seen.items():
        user, system = user - before.get(tid, (0, 0))[0], system - before.get(tid, (0, 0))[1]
        kind, name = names.get(tid, ("?", "?"))
        if name == "sampler":
            continue
        r = role(kind, name, tid)
        acc = rows.setdefault(r, [0.0, 0.0])
        acc[0] += user
        acc[1] += system
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows["quantizer processes (all)"] = [kids.ru_utime, kids.ru_stime]
    print(f"{args.src}: --bits {args.bits} --mtp {args.mtp}, wall {wall:.1f} s, steal {stolen:.1f} s")
    print("| where | user s | system s |")
    print("|---|---|---|")
    for r, (user, system) in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {r} | {user:.1f} | {system:.1f} |")
    total = sum(sum(v) for v in rows.values())
    print(f"| all | {total:.1f} CPU-s over {wall:.1f} s wall = {total / wall:.2f} cores busy | |")


if __name__ == "__main__":
    main()
