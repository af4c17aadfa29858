"""The Nemotron-H fixture's command line: ``python -m tools.fixture_training.nemotron_h train|head|export|mlx-vlm``."""

from __future__ import annotations

import argparse

from tools.fixture_training import nemotron_h
from tools.fixture_training.folders import REPO
from tools.fixture_training.nemotron_h.model import FIXTURE, SHAPE
from tools.fixture_training.training import add_logging_args, add_optimisation_args


def add_train_args(p) -> None:
    p.add_argument("--stage", required=True)
    p.add_argument("--out", required=True)
    add_optimisation_args(p, seq=128)
    p.add_argument("--hidden-size", type=int, default=None, help=f"default {SHAPE['hidden_size']}")
    p.add_argument("--pattern", default=None, help=f"backbone blocks (default {SHAPE['hybrid_override_pattern']})")
    p.add_argument("--mtp-pattern", default=None, help=f"head blocks (default {SHAPE['mtp_hybrid_override_pattern']})")
    p.add_argument("--experts", type=int, default=None, help=f"routed experts (default {SHAPE['n_routed_experts']})")
    p.add_argument("--top-k", type=int, default=None, help=f"experts per token (default {SHAPE['num_experts_per_tok']})")
    p.add_argument("--expert-size", type=int, default=None,
                   help=f"moe_intermediate_size (default {SHAPE['moe_intermediate_size']})")
    p.add_argument("--latent-size", type=int, default=None, help=f"moe_latent_size (default {SHAPE['moe_latent_size']})")
    p.add_argument("--shared-expert-size", type=int, default=None,
                   help=f"moe_shared_expert_intermediate_size (default {SHAPE['moe_shared_expert_intermediate_size']})")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias step per training step")
    p.add_argument("--final-norm-spread", type=float, default=3.0,
                   help="final norms' gains start log-uniform in [1/S, S] (1: all ones)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--chunk-seconds", type=float, default=None,
                   help="stop after this many seconds, saving OUT/resume.pt (exit 3); run again to continue")
    add_logging_args(p)


# each command's function, imported when it runs (train needs no mlx, mlx-vlm no torch)
COMMANDS = {"train": "train:train_nemotron", "head": "head:train_head", "export": "export:export_nemotron",
            "mlx-vlm": "vlm_drafter:mlx_vlm_check"}


def main(argv=None) -> None:
    import importlib

    ap = argparse.ArgumentParser(prog="python -m tools.fixture_training.nemotron_h", description=nemotron_h.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("train", help="train the Nemotron-H model and its head (torch)")
    add_train_args(p)
    p.set_defaults(command="train", variant="nemotron_h")

    p = sub.add_parser("head", help="retrain the MTP head on a folder's frozen backbone, with the broken-conversion "
                                     "contrast (torch; head.py)")
    p.add_argument("--stage", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--source", default=None, help=f"the folder whose backbone and head it starts from (default "
                                                  f"{FIXTURE.relative_to(REPO)})")
    add_optimisation_args(p, seq=128)
    p.add_argument("--margin", type=float, default=3.0,
                   help="nats each broken head's cross-entropy is pushed above the correct head's")
    p.add_argument("--contrast", type=float, default=1.0, help="weight of the hinge terms")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias step per training step")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_logging_args(p)
    p.set_defaults(command="head", variant="nemotron_h")

    p = sub.add_parser("export", help="checkpoint -> release layout folder, acceptance, mlx-lm parity, records")
    p.add_argument("--stage", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the last)")
    p.add_argument("--out", default=None, help=f"default {FIXTURE.relative_to(REPO)}")
    p.add_argument("--seq", type=int, default=None, help="teacher-forced windows (default: the training --seq)")
    p.add_argument("--tokens", type=int, default=128, help="held-out tokens of the mlx-lm comparison")
    p.add_argument("--commands", nargs="*", help="the commands that made it, recorded in training.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(command="export")

    p = sub.add_parser("mlx-vlm", help="the head as mlx-vlm's nemotron_h_mtp drafter: greedy acceptance (no torch)")
    p.add_argument("folder")
    p.add_argument("--stage", required=True)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--per-file", type=int, default=3)
    p.add_argument("--record", action="store_true", help="add the result to the folder's training.json and README.md")
    p.set_defaults(command="mlx-vlm")
    args = ap.parse_args(argv)
    module, _, function = COMMANDS[args.command].partition(":")
    getattr(importlib.import_module(f"tools.fixture_training.nemotron_h.{module}"), function)(args)


if __name__ == "__main__":
    main()
