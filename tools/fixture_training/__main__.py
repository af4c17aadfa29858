"""The text fixtures' command line: ``python -m tools.fixture_training prepare|train|export|parity``, each
variant's code chosen by ``--variant`` (parity: by the folder's model_type)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools import fixture_training
from tools.fixture_training import qwen3_5, qwen3_next
from tools.fixture_training.corpus import VOCAB, prepare
from tools.fixture_training.glm.export import export_glm, parity_glm
from tools.fixture_training.glm.train import train_glm
from tools.fixture_training.qwen3_5 import VARIANTS
from tools.fixture_training.training import add_logging_args, add_optimisation_args


def train(args) -> None:
    {"next": qwen3_next.train_next, "glm5": train_glm}.get(args.variant, qwen3_5.train)(args)


def export(args) -> None:
    {"next": qwen3_next.export_next, "glm5": export_glm}.get(args.variant, qwen3_5.export)(args)


def parity(args) -> None:
    model_type = json.loads((Path(args.folder) / "config.json").read_text())["model_type"]
    {"qwen3_next": qwen3_next.parity_next, "glm_moe_dsa": parity_glm}.get(model_type, qwen3_5.parity)(args)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.fixture_training", description=fixture_training.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("prepare", help="corpus -> tokenizer and token ids")
    p.add_argument("--stage", required=True)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.set_defaults(func=prepare)

    p = sub.add_parser("train", help="train one variant (torch)")
    p.add_argument("--stage", required=True)
    p.add_argument("--variant", choices=sorted(VARIANTS) + ["next", "glm5"], default="dense")
    p.add_argument("--out", required=True)
    add_optimisation_args(p)
    p.add_argument("--experts", type=int, default=None, help="MoE: routed experts (default: the variant's)")
    p.add_argument("--top-k", type=int, default=None, help="MoE: experts per token")
    p.add_argument("--expert-size", type=int, default=None, help="MoE: each routed expert's intermediate size")
    p.add_argument("--shared-expert-size", type=int, default=None, help="MoE: the shared expert's intermediate size")
    p.add_argument("--final-norm-spread", type=float, default=3.0,
                   help="final norms' gains start log-uniform in [1/S, S] (1: all ones)")
    p.add_argument("--device", default=None)
    p.add_argument("--experts-implementation", default=None,
                   help="MoE: transformers' experts kernel (grouped_mm, batched_mm, eager; default: its choice)")
    add_logging_args(p)
    p.set_defaults(func=train)

    p = sub.add_parser("export", help="checkpoint -> raw Hugging Face fixture folder")
    p.add_argument("--stage", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--variant", choices=sorted(VARIANTS) + ["next", "glm5"], default="dense")
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the last)")
    p.add_argument("--out", default=None)
    p.add_argument("--commands", nargs="*", help="the commands that made it, recorded in training.json")
    p.set_defaults(func=export)

    p = sub.add_parser("parity", help="transformers vs MLX on a raw folder (Qwen3-Next: vs the trained model, torch only)")
    p.add_argument("folder")
    p.add_argument("--stage", default=None, help="take the tokens from STAGE's held-out ids")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--run", default=None, help="Qwen3-Next: also compare with this train run's checkpoint")
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the one training.json names)")
    p.add_argument("--acceptance", action="store_true", help="Qwen3-Next: also measure the head's acceptance (STAGE)")
    p.set_defaults(func=parity)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
