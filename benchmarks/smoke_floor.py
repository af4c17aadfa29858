"""`smoke` (its own prompts, 48 greedy tokens) on correct and broken conversions of the text fixtures.

The data behind the smoke floor (docs/runtime.md, "The smoke floor"): the lowest-accepting correct
conversion against the broken ones of tools/broken_heads.py, plus the layerwise check's
teacher-forced acceptance of each folder (docs/smoke.md).

    python benchmarks/smoke_floor.py [--work DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))
from broken_heads import break_folder  # noqa: E402
from checkpoints import convert_folder  # noqa: E402

DTYPE = {"dense": "bfloat16", "moe": "float32"}  # mlx's CPU gather_mm is float32-only
# (label, variant, quant options of the correct base, edit or None)
CASES = [
    ("dense default", "dense", {}, None),
    ("dense noshift_head", "dense", {}, "noshift_head"),
    ("dense fc_swapped", "dense", {}, "fc_swapped"),
    ("dense q4 mtp-bits 2", "dense", dict(bits=4, mtp_bits=2), None),
    ("moe default", "moe", {}, None),
    ("moe noshift_head", "moe", {}, "noshift_head"),
    ("moe fc_swapped", "moe", {}, "fc_swapped"),
    ("moe experts_rev", "moe", {}, "experts_rev"),
    ("moe mtp_experts_rev", "moe", {}, "mtp_experts_rev"),
    ("moe q4 experts_rev", "moe", dict(bits=4), "experts_rev"),
    ("moe q4 mtp-bits 2", "moe", dict(bits=4, mtp_bits=2), None),
]


def folder_for(work: Path, variant: str, quant: dict, edit, made: dict) -> Path:
    """The converted (and, with ``edit``, broken) folder of one case, each base converted once."""
    from mtpconvert.fixture.text import text_fixture_path

    src = text_fixture_path(variant)
    key = (variant, tuple(sorted(quant.items())))
    if key not in made:
        made[key] = work / f"{variant}-{len(made)}"
        convert_folder(src, made[key], dtype=DTYPE[variant], **quant)
    if edit is None:
        return made[key]
    out = work / f"{made[key].name}-{edit}"
    break_folder(made[key], out, src, edit)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from mtpconvert.runtime.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke import smoke

    rows, made = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("| conversion | smoke (decoding) | layerwise (teacher-forced) | identical |\n|---|---|---|---|")
        for label, variant, quant, edit in CASES:
            folder = folder_for(work, variant, quant, edit, made)
            s, lw = smoke(folder), layerwise_acceptance(folder)
            rows.append({"name": label, "accepted": sum(s.mtp.accepted), "proposed": sum(s.mtp.proposed),
                         "acceptance": round(s.acceptance, 4), "identical": s.identical,
                         "layerwise": round(lw.acceptance, 4)})
            print(f"| {label} | {rows[-1]['accepted']}/{rows[-1]['proposed']} = {s.acceptance:.1%} "
                  f"| {lw.acceptance:.1%} | {'yes' if s.identical else 'NO'} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
