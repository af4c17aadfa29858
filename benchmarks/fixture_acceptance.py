"""MTP draft acceptance of the text fixtures, correct and broken conversions, with 95% CIs over prompts.

Converts a raw fixture (default: the bundled ``text-qwen35-mtp`` / ``text-qwen35-moe-mtp``) with
``mtpconvert convert`` (a subprocess each, so the conversion is exactly the command line's) and
measures acceptance with the project's runtime (``mtpconvert.runtime.decoding.speculative.mtp_generate``)
on prompts cut from the held-out standard-library files listed in the fixture's training.json
(their SHA-256s are checked; another Python's stdlib gives slightly different prompts: a warning).

Acceptance = accepted / proposed drafts pooled over prompts; the interval is a percentile
bootstrap over prompts (2000 resamples), so it counts prompts, not drafts, as the independent unit.
At depth 2 ``d1``/``d2`` are the shares of steps whose first / first two drafts were kept.

Broken conversions are made from a correct output folder by editing its tensors the way a buggy
converter would have written them (tools/broken_heads.py: noshift-head, noshift-all, fc-swapped,
experts-rev and mtp-experts-rev for MoE); ``--mtp drop`` drops the head, and the runtime refuses to
load it (reported as such).

mlx's CPU backend has no bf16/fp16 ``gather_mm``, so on the CPU the MoE fixture is converted with
``--dtype float32`` (quantized experts use ``gather_qmm`` and run either way).

    python -m benchmarks.fixture_acceptance --variant dense --variant moe --json acceptance.json
    python -m benchmarks.fixture_acceptance --variant dense --only default --only q4   # a subset
    python -m benchmarks.fixture_acceptance --variant dense --cells sampled_k2 --json k2.json  # one more column
    python -m benchmarks.fixture_acceptance --render acceptance.json k2.json   # docs/runtime.md's tables
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from tools.broken_heads import MOE_ONLY, break_folder

REPO = Path(__file__).resolve().parents[1]

# (name, convert flags, derived-from + edit); greedy depth 1 and 2 and sampled T=0.6 run on each
CONVERSIONS = [
    ("default", []),
    ("mtp-bits 8", ["--mtp-bits", "8"]),
    ("mtp-bits 4", ["--mtp-bits", "4"]),
    ("mtp-bits 3", ["--mtp-bits", "3"]),
    ("mtp-bits 2", ["--mtp-bits", "2"]),
    ("q4", ["--bits", "4"]),
    ("q4 mtp match", ["--bits", "4", "--mtp", "match"]),
    ("q4 mtp-bits 8", ["--bits", "4", "--mtp-bits", "8"]),
    ("q4 mtp-bits 4", ["--bits", "4", "--mtp-bits", "4"]),
    ("q4 mtp-bits 3", ["--bits", "4", "--mtp-bits", "3"]),
    ("q4 mtp-bits 2", ["--bits", "4", "--mtp-bits", "2"]),
]
BROKEN = [  # (name, base conversion, edit)
    ("noshift-head", "default", "noshift_head"),
    ("noshift-all", "default", "noshift_all"),
    ("fc-swapped", "default", "fc_swapped"),
    ("experts-rev", "default", "experts_rev"),
    ("mtp-experts-rev", "default", "mtp_experts_rev"),
    ("q4 noshift-head", "q4", "noshift_head"),
    ("q4 experts-rev", "q4", "experts_rev"),
]
PRE_NORM = ("default", "q4")  # also measured with the pre-norm hidden state
CELLS = {  # name: (depth, sampling, hidden); greedy_k1 is always measured
    "greedy_k2": (2, "greedy", "post-norm"),
    "sampled_k1": (1, "sampled", "post-norm"),
    "sampled_k2": (2, "sampled", "post-norm"),
    "prenorm_k1": (1, "greedy", "pre-norm"),
    "prenorm_k2": (2, "greedy", "pre-norm"),
}


# ---------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------
def convert(src: Path, out: Path, flags: Sequence[str]) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-m", "mtpconvert", "convert", str(src), str(out), *flags]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    smoke = next((line.strip() for line in (p.stdout + p.stderr).splitlines() if "draft acceptance" in line), "")
    smoke = smoke.split(":", 1)[-1].split("(floor")[0].strip() if smoke else ("skipped" if "smoke skipped" in
                                                                           p.stdout + p.stderr else "")
    return {"command": "mtpconvert convert SRC OUT " + " ".join(flags), "rc": p.returncode,
            "seconds": round(time.time() - t0, 1), "smoke": smoke,
            "error": (p.stdout + p.stderr)[-600:] if p.returncode else None}


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
@dataclass
class Cell:
    depth: int
    proposed: np.ndarray  # [prompts, depth]
    accepted: np.ndarray
    mismatched: int = 0
    tokens_per_step: float = 0.0
    ci: List[List[float]] = field(default_factory=list)

    def rate(self, j: int = 0) -> float:
        return float(self.accepted[:, j].sum() / max(1, self.proposed[:, j].sum()))

    def to_json(self) -> dict:
        return {"depth": self.depth,
                "acceptance_by_depth": [round(self.rate(j), 4) for j in range(self.depth)],
                "ci95_by_depth": self.ci,
                "accepted": self.accepted.sum(0).tolist(), "proposed": self.proposed.sum(0).tolist(),
                "per_prompt_accepted": self.accepted.tolist(), "per_prompt_proposed": self.proposed.tolist(),
                "mismatched_prompts": self.mismatched, "tokens_per_step": round(self.tokens_per_step, 3)}


def bootstrap(acc: np.ndarray, prop: np.ndarray, n: int = 2000, seed: int = 0) -> List[float]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(acc), size=(n, len(acc)))
    r = acc[idx].sum(1) / np.maximum(1, prop[idx].sum(1))
    return [round(float(x), 4) for x in np.percentile(r, [2.5, 97.5])]


def paired_delta(a: Cell, b: Cell, n: int = 2000, seed: int = 0) -> List[float]:
    """Greedy k=1 acceptance of ``a`` minus ``b`` on the same prompts: estimate and percentile-bootstrap 95% CI."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a.accepted), size=(n, len(a.accepted)))

    def rates(c):
        return c.accepted[idx, 0].sum(1) / np.maximum(1, c.proposed[idx, 0].sum(1))

    d = rates(a) - rates(b)
    return [round(a.rate() - b.rate(), 4)] + [round(float(x), 4) for x in np.percentile(d, [2.5, 97.5])]


def measure(m, prompts, depth: int, max_tokens: int, sampling, hidden: str, seeds: int,
            plain: Optional[List[List[int]]] = None) -> Cell:
    from mtpconvert.runtime.decoding.speculative import mtp_generate

    P = np.zeros((len(prompts), depth), dtype=np.int64)
    A = np.zeros_like(P)
    mism, emitted, steps = 0, 0, 0
    for i, ids in enumerate(prompts):
        for s in range(seeds):
            toks, st = mtp_generate(m, ids, max_tokens, depth, sampling, hidden, seed=1000 * i + s)
            P[i] += st.proposed
            A[i] += st.accepted
            emitted += st.emitted - 1
            steps += st.steps
            if plain is not None and toks != plain[i]:
                mism += 1
    cell = Cell(depth, P, A, mism, emitted / max(1, steps))
    cell.ci = [bootstrap(A[:, j], P[:, j]) for j in range(depth)]
    return cell


def fmt(cell: Optional[Cell], j: int = 0) -> str:
    if cell is None:
        return "-"
    lo, hi = cell.ci[j]
    return f"{cell.rate(j):.1%} [{lo:.1%}, {hi:.1%}]"


def run_variant(variant: str, fixture: Path, work: Path, args) -> dict:
    from mtpconvert.errors import LayoutError
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.sampling import Sampling
    from mtpconvert.runtime.decoding.speculative import plain_generate

    from mtpconvert.fixture.text import heldout_prompts

    texts, prompts, where = heldout_prompts(fixture, args.per_file, args.prompt_tokens)
    print(f"\n## {variant}: {fixture.name}, {len(prompts)} held-out prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x {args.max_tokens} tokens", flush=True)
    extra = ["--dtype", "float32"] if variant in ("moe", "next") else []  # CPU gather_mm is float32-only
    greedy, sampled = Sampling(), Sampling(temperature=args.temperature)
    result = {"variant": variant, "fixture": str(fixture), "prompts": where, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "sample_seeds": args.seeds, "rows": []}
    folders: Dict[str, Path] = {}
    wanted = set(args.only or [])

    def keep(name):
        return not wanted or name in wanted

    print("| conversion | greedy k=1 | greedy k=2 d1 | greedy k=2 d2 | pre-norm k=1 | pre-norm k=2 d2 "
          f"| sampled T={args.temperature} k=1 | identical | tok/step k=1 | k=1 vs default (paired) | smoke at convert |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    reference: Optional[Cell] = None
    jobs = [(n, f, None, None) for n, f in CONVERSIONS] + [(n, None, b, e) for n, b, e in BROKEN]
    for name, flags, base, edit in jobs:
        if not keep(name) or (edit in MOE_ONLY and variant not in ("moe", "next")):
            continue
        out = work / f"{variant}-{name.replace(' ', '_')}"
        row = {"name": name}
        if flags is not None:
            row["convert"] = convert(fixture, out, flags + extra)
            if row["convert"]["rc"] != 0:
                print(f"| {name} | convert failed: {row['convert']['error']!r} |")
                result["rows"].append(row)
                continue
            folders[name] = out
        else:
            if base not in folders:
                folders[base] = work / f"{variant}-{base}-base"
                r = convert(fixture, folders[base], dict(CONVERSIONS)[base] + extra)
                if r["rc"]:
                    raise SystemExit(f"base conversion {base} failed: {r['error']}")
            row["edit"] = {"base": base, "edit": edit, "tensors_changed": break_folder(folders[base], out, fixture, edit)}
        m = load(out)
        plain = [plain_generate(m, ids, args.max_tokens)[0] for ids in prompts]
        cells = {"greedy_k1": measure(m, prompts, 1, args.max_tokens, greedy, "post-norm", 1, plain)}
        wanted_cells = set(args.cells or CELLS)
        if flags is not None:  # correct conversions: every cell; broken ones: greedy k=1 is enough
            for cell, (depth, how, hidden) in CELLS.items():
                if cell in wanted_cells and (hidden == "post-norm" or name in PRE_NORM):
                    sampling, seeds = (greedy, 1) if how == "greedy" else (sampled, args.seeds)
                    cells[cell] = measure(m, prompts, depth, args.max_tokens, sampling, hidden, seeds,
                                          plain if how == "greedy" else None)
        if "prenorm_k1" in cells:
            row["prenorm_minus_postnorm_k1"] = paired_delta(cells["prenorm_k1"], cells["greedy_k1"])
        row["cells"] = {k: c.to_json() for k, c in cells.items()}
        g = cells["greedy_k1"]
        if name == "default":
            reference = g
        delta = paired_delta(g, reference) if reference is not None and name != "default" else None
        row["delta_vs_default_k1"] = delta
        dtxt = f"{delta[0]:+.1%} [{delta[1]:+.1%}, {delta[2]:+.1%}]" if delta else "-"
        pd = row.get("prenorm_minus_postnorm_k1")
        pre_delta = f" (paired {pd[0]:+.1%} [{pd[1]:+.1%}, {pd[2]:+.1%}])" if pd else ""
        ident = sum(c.mismatched for k, c in cells.items() if not k.startswith("sampled"))
        smoke = row.get("convert", {}).get("smoke", "") or "-"
        print(f"| {name} | {fmt(g)} | {fmt(cells.get('greedy_k2'))} | {fmt(cells.get('greedy_k2'), 1)} "
              f"| {fmt(cells.get('prenorm_k1'))}{pre_delta} | {fmt(cells.get('prenorm_k2'), 1)} | {fmt(cells.get('sampled_k1'))} "
              f"| {'yes' if ident == 0 else f'NO ({ident})'} | {g.tokens_per_step:.2f} | {dtxt} | {smoke} |", flush=True)
        result["rows"].append(row)
    if keep("drop"):
        out = work / f"{variant}-drop"
        r = convert(fixture, out, ["--mtp", "drop"] + extra)
        try:
            load(out)
            msg = "loaded (unexpected)"
        except LayoutError as e:
            msg = f"load refused: {str(e).splitlines()[0].split(' (file')[0]}"
        result["rows"].append({"name": "--mtp drop", "convert": r, "load": msg})
        print(f"| --mtp drop | {msg} |")
    return result


# ---------------------------------------------------------------------------------------------
# docs/runtime.md's tables from saved runs
# ---------------------------------------------------------------------------------------------
def merged_rows(paths: Sequence[Path]) -> Dict[str, Dict[str, dict]]:
    """variant -> row name -> row, the cells of later files added to (or replacing) earlier ones."""
    rows: Dict[str, Dict[str, dict]] = {}
    for path in paths:
        for v in json.loads(Path(path).read_text())["variants"]:
            for row in v["rows"]:
                have = rows.setdefault(v["variant"], {}).setdefault(row["name"], dict(row, cells={}))
                have["cells"].update(row.get("cells", {}))
    return rows


def cell_text(cell: Optional[dict]) -> str:
    """``69.3% [64.2–74.8]`` per depth position, ``/``-separated; ``-`` when not measured."""
    if not cell:
        return "-"
    return " / ".join(f"{a:.1%} [{100 * lo:.1f}–{100 * hi:.1f}]"
                      for a, (lo, hi) in zip(cell["acceptance_by_depth"], cell["ci95_by_depth"]))


def render(paths: Sequence[Path]) -> str:
    cols = [("greedy k=1", "greedy_k1"), ("greedy k=2 (d1 / d2)", "greedy_k2"), ("sampled k=1", "sampled_k1"),
            ("sampled k=2 (d1 / d2)", "sampled_k2"), ("pre-norm greedy k=1", "prenorm_k1"),
            ("pre-norm greedy k=2 (d1 / d2)", "prenorm_k2")]
    out = []
    for variant, rows in merged_rows(paths).items():
        out += [f"\n{variant}\n", "| conversion | " + " | ".join(c for c, _ in cols) + " | smoke at convert |",
                "|---" * (len(cols) + 2) + "|"]
        for name, row in rows.items():
            if "load" in row:
                out.append(f"| {name} | {row['load']} |" + " |" * len(cols))
                continue
            smoke = (row.get("convert") or {}).get("smoke") or "-"
            out.append(f"| {name} | " + " | ".join(cell_text(row["cells"].get(k)) for _, k in cols) + f" | {smoke} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", choices=["dense", "moe", "next"], help="repeatable (default: dense and moe)")
    ap.add_argument("--fixture", type=Path, help="raw folder to use instead of the bundled one (one variant)")
    ap.add_argument("--per-file", type=int, default=2, help="prompts per held-out file (12 files)")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seeds", type=int, default=1, help="sampled decodes per prompt")
    ap.add_argument("--only", action="append", help="only these conversions (names as in the table; 'drop' too)")
    ap.add_argument("--work", type=Path, help="keep the converted folders here (default: a temp dir)")
    ap.add_argument("--cells", action="append", choices=sorted(CELLS),
                    help="only these measurements besides greedy k=1 (repeatable; default: all)")
    ap.add_argument("--quick", action="store_true", help="greedy depth 1 only")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--render", type=Path, nargs="+", metavar="JSON",
                    help="print docs/runtime.md's tables from saved runs (later files add cells) and exit")
    args = ap.parse_args(argv)
    if args.render:
        print(render(args.render))
        return
    if args.quick:
        args.cells = ["none"]  # no cell has that name: greedy k=1 only
    import mlx.core as mx

    from mtpconvert.fixture.text import text_fixture_path

    variants = args.variant or ["dense", "moe"]
    results = {"device": str(mx.default_device()), "mlx": mx.__version__, "python": sys.version.split()[0],
               "argv": sys.argv[1:], "variants": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for v in variants:
            fixture = args.fixture if args.fixture else text_fixture_path(v)
            results["variants"].append(run_variant(v, fixture, work, args))
            if args.json:  # after each variant, so an interrupted run keeps what it measured
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = round(time.time() - t0, 1)
    print(f"\n{results['seconds']} s on {results['device']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
