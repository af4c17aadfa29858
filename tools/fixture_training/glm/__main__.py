"""The GLM-5 fixture's command line: ``python -m tools.fixture_training.glm train|export|parity|mlx-vlm``."""

from __future__ import annotations

import argparse

from tools.fixture_training import glm
from tools.fixture_training.folders import REPO
from tools.fixture_training.glm.export import export_glm, parity_glm
from tools.fixture_training.glm.model import FIXTURE, GLM_SHAPE
from tools.fixture_training.glm.train import train_glm
from tools.fixture_training.glm.vlm_drafter import mlx_vlm_check
from tools.fixture_training.training import add_logging_args, add_optimisation_args


def add_train_args(p) -> None:
    p.add_argument("--stage", required=True)
    p.add_argument("--out", required=True)
    add_optimisation_args(p, seq=128, seq_help="at most index_topk (dense indexer)")
    p.add_argument("--hidden-size", type=int, default=None, help=f"default {GLM_SHAPE['hidden_size']}")
    p.add_argument("--layers", type=int, default=None,
                   help=f"backbone layers (default {GLM_SHAPE['num_hidden_layers']})")
    p.add_argument("--experts", type=int, default=None,
                   help=f"routed experts (default {GLM_SHAPE['n_routed_experts']})")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"experts per token (default {GLM_SHAPE['num_experts_per_tok']})")
    p.add_argument("--expert-size", type=int, default=None,
                   help=f"moe_intermediate_size (default {GLM_SHAPE['moe_intermediate_size']})")
    p.add_argument("--index-topk", type=int, default=None, help=f"default {GLM_SHAPE['index_topk']}")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias step per training step")
    p.add_argument("--final-norm-spread", type=float, default=3.0,
                   help="final norms' gains start log-uniform in [1/S, S] (1: all ones)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--experts-implementation", default=None,
                   help="transformers' experts kernel (grouped_mm, batched_mm, eager; default: its choice)")
    p.add_argument("--chunk-seconds", type=float, default=None,
                   help="stop after this many seconds, saving OUT/resume.pt (exit 3); run again to continue")
    add_logging_args(p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.fixture_training.glm", description=glm.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("train", help="train the GLM-5 model and its head (torch)")
    add_train_args(p)
    p.set_defaults(func=train_glm, variant="glm5")

    p = sub.add_parser("export", help="checkpoint -> raw GLM-5 layout folder, acceptance, mlx-lm parity, records")
    p.add_argument("--stage", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the last)")
    p.add_argument("--out", default=None, help=f"default {FIXTURE.relative_to(REPO)}")
    p.add_argument("--seq", type=int, default=None, help="teacher-forced windows (default: the training --seq)")
    p.add_argument("--tokens", type=int, default=128, help="held-out tokens of the mlx-lm comparison")
    p.add_argument("--commands", nargs="*", help="the commands that made it, recorded in training.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=export_glm)

    p = sub.add_parser("parity", help="check a folder: layout, transformers, mlx-lm (and acceptance)")
    p.add_argument("folder")
    p.add_argument("--stage", default=None, help="take the tokens from STAGE's held-out ids")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--acceptance", action="store_true", help="also measure the head's acceptance (STAGE)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=parity_glm)

    p = sub.add_parser("mlx-vlm", help="the head as mlx-vlm's glm_moe_dsa_mtp drafter: greedy acceptance (no torch)")
    p.add_argument("folder")
    p.add_argument("--stage", required=True)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--per-file", type=int, default=3)
    p.add_argument("--record", action="store_true", help="add the result to the folder's training.json and README.md")
    p.set_defaults(func=mlx_vlm_check)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
