"""`mtpconvert bench --json` on a converted text fixture, prompted with held-out stdlib text.

The prompts are the fixture's held-out standard-library files (``heldout_prompts``: whole lines,
at least --prompt-tokens tokens, --per-file per file, the first --files files), passed to the CLI
as -p texts, so the run is exactly ``python -m mtpconvert bench FOLDER -p ... --json``.

    python -m benchmarks.gpu_fixture_bench FIXTURE CONVERTED --depth 1 --depth 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mtpconvert.fixture.text import heldout_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("fixture", type=Path, help="the raw fixture (its training.json lists the held-out files)")
    ap.add_argument("converted", type=Path)
    ap.add_argument("--depth", type=int, action="append")
    ap.add_argument("--per-file", type=int, default=1)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--mtp-hidden", default="post-norm")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    texts, _, where = heldout_prompts(a.fixture, a.per_file, a.prompt_tokens, a.files)
    cmd = [sys.executable, "-m", "mtpconvert", "bench", str(a.converted), "--max-tokens", str(a.max_tokens),
           "--mtp-hidden", a.mtp_hidden, "--json"]
    for d in a.depth or [1]:
        cmd += ["--depth", str(d)]
    for t in texts:
        cmd += ["-p", t]
    t0 = time.time()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    result = {"argv": [c if i == 0 or cmd[i - 1] != "-p" else "<prompt>" for i, c in enumerate(cmd)][1:],
              "prompts_from": where, "wall_s": round(time.time() - t0, 1), "bench": json.loads(out)}
    a.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["bench"])[:4000])


if __name__ == "__main__":
    main()
