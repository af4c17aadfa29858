"""The offline demo: bundled raw fixture -> convert (--bits 4 variants) -> verify -> smoke -> bench.

    python -m mtpconvert.demo [--out demo-out] [--variant dense|moe|next] [--fixture text|markov]

The default fixture is the text one (trained on the stdlib's sources, realistic acceptance),
benched on prompts from stdlib files held out of its training; ``--fixture markov`` runs the
synthetic-language fixture, whose every head accepts ~100%. Plain decoding is mlx-lm's own
``generate_step``.
"""

from __future__ import annotations

import argparse
import sys
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from rich.console import Console
from rich.table import Table

from .execute import execute
from .fixture import fixture_path
from .fixture.language import MarkovLanguage
from .fixture.text import heldout_prompts, text_fixture_path
from .options import ConvertOptions, QuantOptions
from .plan import build_plan
from .cli.render import plan_summary, report_table
from .runtime.smoke.floors import DECODING_MIN_ACCEPTANCE, MIN_MLP_GAIN
from .runtime.smoke.decode import smoke
from .runtime.decoding.load import load
from .runtime.measure.bench import bench
from .io.checkpoint import open_checkpoint
from .logs import quiet_known_warnings
from .verify import verify


def fixture_prompts(n: int = 4, length: int = 12, seed: int = 1234):
    lang = MarkovLanguage()
    rng = np.random.default_rng(seed)
    return [lang.text(lang.sample(length, rng)) for _ in range(n)]


def text_prompts(src: Path, n: int = 4):
    """``n`` prompts of ~48 tokens from the first held-out stdlib files (one each)."""
    texts, _, _ = heldout_prompts(src, per_file=1, prompt_tokens=48, files=n)
    return texts


VARIANTS = [  # (folder, label, options); hidden size 96, so group 32 lets every weight be quantized
    ("q4-mtp-keep", "--bits 4 (MTP bf16)", dict(bits=4, group_size=32)),
    ("q4-mtp-match", "--bits 4 --mtp match", dict(bits=4, group_size=32, mtp="match")),
    ("q4-mtp-8bit", "--bits 4 --mtp-bits 8", dict(bits=4, group_size=32, mtp_bits=8)),
    ("bf16", "no quantization", dict()),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo-out"))
    ap.add_argument("--variant", choices=["dense", "moe", "next"], default="dense",
                    help="Qwen3.5 dense or MoE, or Qwen3-Next (next: text fixture only)")
    ap.add_argument("--fixture", choices=["text", "markov"], default="text")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    quiet_known_warnings()
    console = Console(width=None if sys.stdout.isatty() else 132)  # logs and pipes get the full table
    if args.variant == "next" and args.fixture != "text":
        ap.error("--variant next has a text fixture only")
    src = text_fixture_path(args.variant) if args.fixture == "text" else fixture_path(args.variant)
    # mlx's CPU backend has no bf16 gather_mm: float MoE experts run in float32 there
    dtype = "float32" if args.variant != "dense" and mx.default_device() == mx.cpu else "bfloat16"
    console.rule(f"mtpconvert demo: {src.name} (raw Hugging Face layout, bundled)")
    prompts = text_prompts(src) if args.fixture == "text" else fixture_prompts()
    rows = []
    for folder, label, quant in VARIANTS:
        out = args.out / folder
        if out.exists():
            shutil.rmtree(out)
        ckpt = open_checkpoint(src)
        plan = build_plan(ckpt, ConvertOptions(dtype=dtype, quant=QuantOptions(**quant)))
        if not rows:
            plan_summary(plan, console)
        execute(plan, ckpt, out)
        report = verify(out)
        if not rows:
            report_table(report, console)
        m = load(out)
        checked = smoke(out, model=m)  # its own prompts and floor, as convert runs it
        with console.status(f"bench {label}"):
            result = bench(out, prompts, args.max_tokens, model=m)
        rows.append((label, report.ok, checked, result))
    table = Table(title=f"MTP speculative decoding on {src.name} (greedy, depth 1, {len(prompts)} prompts x "
                        f"{args.max_tokens} tokens, {mx.default_device()})")
    for col in ("conversion", "verify", "smoke", "accept post-norm", "accept pre-norm", "tok/step", "mlx-lm tok/s",
                "MTP tok/s", "speedup"):
        table.add_column(col, justify="left" if col == "conversion" else "right")
    for label, ok, checked, result in rows:
        post, pre = result.rows
        table.add_row(label, "ok" if ok else "FAILED", "pass" if checked.ok else "FAIL", f"{post.mtp.acceptance:.1%}",
                      f"{pre.mtp.acceptance:.1%}", f"{post.mtp.tokens_per_step:.2f}", f"{post.plain.decode_tps:.0f}",
                      f"{post.mtp.decode_tps:.0f}", f"{post.speedup:.2f}x")
    console.print(table)
    console.print(f"smoke: acceptance >= {DECODING_MIN_ACCEPTANCE:.0%} and the head's MLP gain >= "
                  f"{MIN_MLP_GAIN * 100:.1f} points on smoke's own prompts (token identity with plain greedy is "
                  "reported, not gated). mlx-lm tok/s: mlx_lm.generate.generate_step on the same prompts; "
                  "speedup = MTP tok/s / mlx-lm tok/s. On this tiny model a step is dominated by per-op overhead, "
                  "so speedup says little about real models; see docs/runtime.md.", style="dim")
    console.print(f"output folders under {args.out}/ (load them with mlx_lm.load)")
    return 0 if all(ok and checked.ok for _, ok, checked, _ in rows) else 1


def run(argv=None) -> int:
    """main() for `make demo`: Ctrl-C ends it with one line and exit 130, like the CLI (no traceback)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        Console(stderr=True).print("[red]interrupted[/red]")
        return 130


if __name__ == "__main__":
    raise SystemExit(run())
