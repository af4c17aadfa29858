"""How much the MTP layer's MLP carries on a converted MoE folder: teacher-forced acceptance of the
head (the share of positions where its draft equals the backbone's greedy next token) with the
head's MLP intact, its routed experts reversed or rolled by one (a converter's expert-order bug),
the routed experts or the shared expert zeroed, and the whole MLP zeroed.

If reversing the experts costs about what zeroing the whole MLP costs, and that is small, no
acceptance floor can tell a head with misordered experts from a correct one on this model.

    python -m benchmarks.mtp_mlp_ablation OUT --heldout STAGE/heldout.npy [--prompts 12] [--tokens 256]

OUT: a float MoE conversion of a text fixture (``mtpconvert convert SRC OUT --dtype float32``);
prompts are consecutive windows of the held-out token ids that ``python -m tools.fixture_training
prepare`` writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.utils
import numpy as np

from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full
from mtpconvert.runtime.decoding.load import load

ROUTED = ("gate_proj", "up_proj", "down_proj")


def prompts_from(heldout: Path, n: int, tokens: int):
    ids = np.load(heldout).astype(np.int64)
    return [ids[i:i + tokens].tolist() for i in range(0, n * tokens, tokens)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    m = load(args.folder)
    prompts = prompts_from(args.heldout, args.prompts, args.tokens)
    mlp = m.head.layers[0].mlp
    original = dict(mlx.utils.tree_flatten(mlp.parameters()))
    routed = {n: original[f"switch_mlp.{n}.weight"] for n in ROUTED}

    def set_routed(fn):
        for n, w in routed.items():
            getattr(mlp.switch_mlp, n).weight = fn(w)

    edits = {
        "correct": lambda: None,
        "routed experts reversed": lambda: set_routed(lambda w: w[::-1]),
        "routed experts rolled by one": lambda: set_routed(lambda w: mx.concatenate([w[1:], w[:1]])),
        "routed experts zeroed": lambda: set_routed(mx.zeros_like),
        "shared expert zeroed": lambda: setattr(mlp.shared_expert.down_proj, "weight",
                                                mx.zeros_like(original["shared_expert.down_proj.weight"])),
        "whole MLP zeroed": lambda: (set_routed(mx.zeros_like), edits["shared expert zeroed"]()),
    }
    results = {}
    for name, edit in edits.items():
        edit()
        r = teacher_forced_full(m, prompts)
        results[name] = {"agreed": r.agreed, "compared": r.compared, "acceptance": round(r.acceptance, 4)}
        print(f"{name}: {r.agreed}/{r.compared} = {r.acceptance:.1%}", flush=True)
        mlp.update(mlx.utils.tree_unflatten(list(original.items())))
    if args.json:
        args.json.write_text(json.dumps({"folder": str(args.folder), "prompts": len(prompts),
                                         "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
