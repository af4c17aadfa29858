"""`smoke` (its own prompts, 48 greedy tokens) on correct and broken conversions of the text fixtures.

The data behind the smoke floors (docs/runtime.md, "The smoke floor"): every precision's correct
conversion against the broken ones of tools/broken_heads.py, each scored by the decoding smoke and the
layerwise check (docs/smoke.md): acceptance, the head's MLP gain (runtime/smoke/mlp_gain.py) with its 95%
interval, and each check's verdict.

    python -m benchmarks.smoke_floor [--work DIR] [--json OUT] [--only LABEL ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.checkpoints import convert_folder
from tools.broken_heads import EDITS, MOE_ONLY, break_folder

DTYPE = {"dense": "bfloat16", "moe": "float32"}  # mlx's CPU gather_mm is float32-only
PRECISIONS = [  # (label, quant options of a correct conversion)
    ("default", {}),
    ("mtp-bits 8", dict(mtp_bits=8)),
    ("mtp-bits 4", dict(mtp_bits=4)),
    ("mtp-bits 3", dict(mtp_bits=3)),
    ("mtp-bits 2", dict(mtp_bits=2)),
    ("q4", dict(bits=4)),
    ("q4 mtp-bits 8", dict(bits=4, mtp_bits=8)),
    ("q4 mtp-bits 4", dict(bits=4, mtp_bits=4)),
    ("q4 mtp-bits 3", dict(bits=4, mtp_bits=3)),
    ("q4 mtp-bits 2", dict(bits=4, mtp_bits=2)),
]
BROKEN = [  # (label prefix, quant options of the correct base, edits)
    ("", {}, EDITS),
    ("q4 ", dict(bits=4), ("noshift_head", "experts_rev", "mtp_experts_rev")),
]
# (label, variant, quant options of the correct base, edit or None)
CASES = [(f"{v} {label}", v, q, None) for v in ("dense", "moe") for label, q in PRECISIONS] + [
    (f"{v} {prefix}{edit}", v, q, edit) for v in ("dense", "moe") for prefix, q, edits in BROKEN
    for edit in edits if v == "moe" or edit not in MOE_ONLY]


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


def gain_cell(g) -> str:
    return f"{g.gain * 100:+.1f} [{g.low * 100:+.1f}, {g.high * 100:+.1f}] ({g.helped}/{g.hurt})"


def verdict(r) -> str:
    """pass, or what failed it: the acceptance floor and/or the MLP gain floor."""
    why = [w for w, bad in (("acceptance", not r.acceptance_ok), ("MLP gain", not r.mlp_ok)) if bad]
    return "pass" if not why else "FAIL: " + " + ".join(why)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", action="append", help="run only the row with this label (repeatable)")
    args = ap.parse_args(argv)
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.decode import smoke

    rows, made = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("| conversion | smoke (decoding) | smoke MLP gain [95% CI] | layerwise (teacher-forced) "
              "| layerwise MLP gain [95% CI] | smoke ok | layerwise ok | identical |\n|---|---|---|---|---|---|---|---|")
        for label, variant, quant, edit in CASES:
            if args.only and label not in args.only:
                continue
            folder = folder_for(work, variant, quant, edit, made)
            s, lw = smoke(folder), layerwise_acceptance(folder)
            rows.append({"name": label, "accepted": sum(s.mtp.accepted), "proposed": sum(s.mtp.proposed),
                         "acceptance": round(s.acceptance, 4), "identical": s.identical,
                         "smoke_mlp": s.mlp_gain_paired.to_json(), "smoke_ok": s.ok,
                         "layerwise": round(lw.acceptance, 4), "layerwise_mlp": lw.mlp_gain_paired.to_json(),
                         "layerwise_ok": lw.ok})
            print(f"| {label} | {rows[-1]['accepted']}/{rows[-1]['proposed']} = {s.acceptance:.1%} "
                  f"| {gain_cell(s.mlp_gain_paired)} | {lw.acceptance:.1%} | {gain_cell(lw.mlp_gain_paired)} "
                  f"| {verdict(s)} | {verdict(lw)} | {'yes' if s.identical else 'NO'} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
