"""The qwen4_exp fixture's command line:
``python -m tools.fixture_training.qwen4_exp train|export|acceptance|check``."""

from __future__ import annotations

import argparse

from tools.fixture_training import qwen4_exp
from tools.fixture_training.folders import REPO
from tools.fixture_training.qwen4_exp.model import FIXTURE, TEXT
from tools.fixture_training.qwen4_exp.train import train_qwen4_exp
from tools.fixture_training.training import add_logging_args, add_optimisation_args


def add_train_args(p) -> None:
    p.add_argument("--stage", required=True)
    p.add_argument("--out", required=True)
    add_optimisation_args(p, seq=128, seq_help="at most indexer_budget (dense indexer)")
    p.add_argument("--hidden-size", type=int, default=None, help=f"default {TEXT['hidden_size']}")
    p.add_argument("--experts", type=int, default=None, help=f"routed experts (default {TEXT['num_experts']})")
    p.add_argument("--top-k", type=int, default=None, help=f"experts per token (default {TEXT['num_experts_per_tok']})")
    p.add_argument("--expert-size", type=int, default=None,
                   help=f"moe_intermediate_size (default {TEXT['moe_intermediate_size']})")
    p.add_argument("--ngram-base", type=int, default=None,
                   help=f"ngram_vocab_size_base: rows per n-gram head (default {TEXT['ngram_vocab_size_base']})")
    p.add_argument("--head-norm-spread", type=float, default=3.0,
                   help="the head's norms' gains start log-uniform in [1/S, S] (1: all ones)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest on a busy 2-core box)")
    add_logging_args(p)


def main(argv=None) -> None:
    from tools.fixture_training.qwen4_exp.export import export_qwen4_exp, remeasure_qwen4_exp
    from tools.fixture_training.qwen4_exp.check import check_folder

    ap = argparse.ArgumentParser(prog="python -m tools.fixture_training.qwen4_exp", description=qwen4_exp.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("train", help="train the model and its head (torch)")
    add_train_args(p)
    p.set_defaults(func=train_qwen4_exp, variant="qwen4_exp")

    p = sub.add_parser("export", help="checkpoint -> raw release layout folder, torch acceptance, records")
    p.add_argument("--stage", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the last)")
    p.add_argument("--out", default=None, help=f"default {FIXTURE.relative_to(REPO)}")
    p.add_argument("--commands", nargs="*", help="the commands that made it, recorded in training.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the acceptance (default: torch's)")
    p.set_defaults(func=export_qwen4_exp)

    p = sub.add_parser("acceptance", help="the head's torch acceptance of a written folder again, into training.json")
    p.add_argument("folder", nargs="?", default=str(FIXTURE))
    p.add_argument("--stage", required=True, help="the stage the folder was trained on (its heldout.npy)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-record", action="store_true", help="print only; leave training.json as it is")
    p.set_defaults(func=remeasure_qwen4_exp)

    p = sub.add_parser("check", help="convert the folder, our smoke and mlx-vlm's drafter on it; into training.json")
    p.add_argument("folder", nargs="?", default=str(FIXTURE))
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts for mlx-vlm (one per held-out file)")
    p.add_argument("--tokens", type=int, default=64, help="tokens each prompt is continued by")
    p.add_argument("--no-record", action="store_true", help="print only; leave training.json as it is")
    p.set_defaults(func=check_folder)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
