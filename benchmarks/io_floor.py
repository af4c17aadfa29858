"""The machine's I/O floor for a conversion: how fast it reads a source and writes an output.

  page-cache read  every source shard read with plain reads (16 MiB, like a block), after one
                   warming pass, with 1 and with N threads
  cold read        the same with the page cache dropped first (root: /proc/sys/vm/drop_caches)
  write + fsync    ``--write-gb`` written in 16 MiB pwrites next to the source, then fsync

A converter must read its whole source and write its whole output; done at once, it takes at
least the longer of the two (``floor_s``, for a warm and a cold source: the output size is
given), and done one after the other their sum (``serial_s``).

    python -m benchmarks.io_floor /tmp/s27 --write-gb 6.6 --json io.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

CHUNK = 16 << 20


def _read_range(path: Path, start: int, stop: int) -> int:
    buf = np.empty(CHUNK, np.uint8)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = start
        while pos < stop:
            n = os.preadv(fd, [view[:min(CHUNK, stop - pos)]], pos)
            if n <= 0:
                break
            pos += n
    finally:
        os.close(fd)
    return pos - start


def read_all(files, threads: int) -> tuple:
    """(bytes, seconds) reading every file once, split in ``threads`` interleaved ranges of 256 MiB."""
    jobs = []
    for p in files:
        size = p.stat().st_size
        jobs += [(p, a, min(a + (256 << 20), size)) for a in range(0, size, 256 << 20)]
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(lambda j: _read_range(*j), jobs))
    return n, time.perf_counter() - t


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def write_fsync(folder: Path, nbytes: int) -> float:
    block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        fd = f.fileno()
        t = time.perf_counter()
        pos = 0
        while pos < nbytes:
            pos += os.pwrite(fd, block[:min(CHUNK, nbytes - pos)], pos)
        os.fsync(fd)
        return time.perf_counter() - t


def measure(src: Path, write_bytes: int, threads: int = 8) -> dict:
    files = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in files)
    res = {"source_bytes": total, "write_bytes": write_bytes, "cpu_count": os.cpu_count()}
    read_all(files, threads)  # warm
    for t in sorted({1, 4, threads}):
        n, s = read_all(files, t)
        res[f"cache_read_{t}t_gbps"] = n / s / 1e9
    res["cache_read_gbps"] = max(v for k, v in res.items() if k.startswith("cache_read_"))
    if drop_caches():
        n, s = read_all(files, threads)
        res["cold_read_gbps"] = n / s / 1e9
        read_all(files, threads)  # warm again for whatever runs next
    else:
        res["cold_read_gbps"] = None
    res["write_fsync_gbps"] = write_bytes / write_fsync(src.parent, write_bytes) / 1e9
    return res


def floor(io: dict, source_bytes: int, out_bytes: int) -> dict:
    """Seconds a converter needs at least for these sizes on the measured machine."""
    read_warm = source_bytes / 1e9 / io["cache_read_gbps"]
    write = out_bytes / 1e9 / io["write_fsync_gbps"]
    res = {"read_warm_s": read_warm, "write_fsync_s": write, "floor_s": max(read_warm, write),
           "serial_s": read_warm + write}
    if io.get("cold_read_gbps"):
        read_cold = source_bytes / 1e9 / io["cold_read_gbps"]
        res.update(read_cold_s=read_cold, floor_cold_s=max(read_cold, write), serial_cold_s=read_cold + write)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--write-gb", type=float, default=None, help="bytes to write (default: 30%% of the source)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    total = sum(p.stat().st_size for p in args.src.glob("*.safetensors"))
    write_bytes = int(args.write_gb * 1e9) if args.write_gb else int(0.3 * total)
    res = measure(args.src, write_bytes, args.threads)
    res.update(floor(res, total, write_bytes))
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
