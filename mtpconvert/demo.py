"""The offline demo: bundled raw fixture -> convert (with convert's checks: verify, smoke) -> bench.

    python -m mtpconvert.demo [--out demo-out] [--all | --conversion NAME] [--variant dense|moe|next]
                              [--fixture text|markov] [--max-tokens 64]

One conversion by default (on the CPU without quantization, elsewhere ``--bits 4`` with the head
kept in bf16); ``--all`` runs the four of ``CONVERSIONS``. Each is converted as ``mtpconvert
convert`` does it (verified and smoke-tested before it is committed), then benched against
mlx-lm's own ``generate_step``. The default fixture is the text one (trained on the stdlib's
sources, realistic acceptance), benched on prompts from stdlib files held out of its training;
``--fixture markov`` runs the synthetic-language fixture, whose every head accepts ~100%.
Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import api
from .cli.progress import rich_events
from .cli.render import plan_summary, report_table
from .fixture import fixture_path
from .fixture.language import MarkovLanguage
from .fixture.text import heldout_prompts, text_fixture_path
from .gate import Gate, GateFailed
from .logs import quiet_known_warnings
from .options import BenchOptions, ConvertOptions, QuantOptions
from .runtime.smoke.floors import DECODING_MIN_ACCEPTANCE, MIN_MLP_GAIN

# untimed, per prompt and decoder: each prompt's prefill, and over the prompts every pass shape of a depth-1
# decode (drafts kept and rejected); a full-length warm-up doubled the bench's time and changed no acceptance
WARMUP_TOKENS = 8


def fixture_prompts(n: int = 4, length: int = 12, seed: int = 1234):
    lang = MarkovLanguage()
    rng = np.random.default_rng(seed)
    return [lang.text(lang.sample(length, rng)) for _ in range(n)]


def text_prompts(src: Path, n: int = 4):
    """``n`` prompts of ~48 tokens from the first held-out stdlib files (one each)."""
    texts, _, _ = heldout_prompts(src, per_file=1, prompt_tokens=48, files=n)
    return texts


CONVERSIONS = [  # (folder, label, options); hidden size 192, so group 32 lets every weight be quantized
    ("q4-mtp-keep", "--bits 4 (MTP bf16)", dict(bits=4, group_size=32)),
    ("q4-mtp-match", "--bits 4 --mtp match", dict(bits=4, group_size=32, mtp="match")),
    ("q4-mtp-8bit", "--bits 4 --mtp-bits 8", dict(bits=4, group_size=32, mtp_bits=8)),
    ("bf16", "no quantization", dict()),
]


def chosen(every: bool = False, name: Optional[str] = None):
    """The ``CONVERSIONS`` to run: all of them, the one named, or ``default_conversion``'s."""
    return [c for c in CONVERSIONS if every or c[0] == (name or default_conversion())]


def default_conversion() -> str:
    # MLX's CPU kernels multiply 4-bit weights with bf16 scales one row at a time several times slower than
    # bf16 weights (this fixture decodes ~9x slower): on the CPU the quick run is the unquantized conversion
    return "bf16" if mx.default_device() == mx.cpu else "q4-mtp-keep"


def command_path() -> str:
    """How to call the ``mtpconvert`` command from here: the venv's script when it is not on PATH."""
    script = Path(sys.executable).parent / "mtpconvert"
    if not script.exists() or os.path.dirname(str(script)) in os.environ.get("PATH", "").split(os.pathsep):
        return "mtpconvert"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def results_table(rows, title: str) -> Table:
    """``rows``: (label, verify cell, smoke cell, ``BenchResult`` or None where the checks failed); a pre-norm
    column when the bench measured that state too."""
    pre_norm = any(r is not None and len(r.rows) > 1 for *_, r in rows)
    table = Table(title=title)
    for col in ("conversion", "verify", "smoke", "accept post-norm", *(["accept pre-norm"] if pre_norm else []),
                "tok/step", "mlx-lm tok/s", "MTP tok/s", "speedup"):
        table.add_column(col, justify="left" if col == "conversion" else "right")
    for label, verify, smoke, result in rows:
        if result is None:
            table.add_row(label, verify, smoke, *["-"] * (len(table.columns) - 3))
            continue
        post = result.rows[0]
        pre = [f"{result.rows[1].mtp.acceptance:.1%}" if len(result.rows) > 1 else "-"] if pre_norm else []
        table.add_row(label, verify, smoke, f"{post.mtp.acceptance:.1%}", *pre, f"{post.mtp.tokens_per_step:.2f}",
                      f"{post.plain.decode_tps:.0f}", f"{post.mtp.decode_tps:.0f}", f"{post.speedup:.2f}x")
    return table


def next_steps(out: Path, folders, console: Console) -> None:
    """What to run next: a checkpoint of one's own, verify, and where the folders are and what loads them."""
    cmd = command_path()
    usable = [{r.runtime.split("-drafter")[0] for r in api.runtimes(out / f).runtimes if r.head_usable.ok}
              for f in folders]  # from headers: the runtimes that draft with each folder's head
    heads = sorted(set.intersection(*usable))
    lines = [
        ("convert your own checkpoint", f"{cmd} convert ~/models/Qwen3.5-27B out/ --bits 4"),
        ("or straight from the Hub", f"{cmd} pull-and-quantize Qwen/Qwen3.5-27B --bits 4"),
        ("check any folder", f"{cmd} verify {out / folders[0]}   (which runtimes load it and use its head)"),
        ("the converted folders" if len(folders) > 1 else "the converted folder",
         f"{', '.join(str(out / f) for f in folders)}: mlx_lm.load loads the backbone; "
         f"{', '.join(heads) or 'no runtime'} draft with the MTP head{' of each' if len(folders) > 1 else ''} "
         "(docs/interop.md)"),
    ]
    if len(folders) < len(CONVERSIONS):
        lines.append(("all four conversions", "make demo DEMO_ARGS=--all   (python -m mtpconvert.demo --all)"))
    console.print("next:", style="bold")
    for what, how in lines:
        console.print(f"  {what + ':':<30}{how}", highlight=False, soft_wrap=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo-out"))
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="all four conversions (--bits 4 with the head bf16, "
                       "--mtp match, --mtp-bits 8, no quantization)")
    which.add_argument("--conversion", choices=[c[0] for c in CONVERSIONS],
                       help="this one conversion (default: bf16 on the CPU, else q4-mtp-keep)")
    ap.add_argument("--variant", choices=["dense", "moe", "next"], default="dense",
                    help="Qwen3.5 dense or MoE, or Qwen3-Next (next: text fixture only)")
    ap.add_argument("--fixture", choices=["text", "markov"], default="text")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each prompt decodes in the bench")
    args = ap.parse_args(argv)
    if args.variant == "next" and args.fixture != "text":
        ap.error("--variant next has a text fixture only")
    quiet_known_warnings()
    started = time.monotonic()
    console = Console(width=None if sys.stdout.isatty() else 132)  # logs and pipes get the full table
    err = Console(stderr=True)
    src = text_fixture_path(args.variant) if args.fixture == "text" else fixture_path(args.variant)
    # mlx's CPU backend has no bf16 gather_mm: float MoE experts run in float32 there
    dtype = "float32" if args.variant != "dense" and mx.default_device() == mx.cpu else "bfloat16"
    conversions = chosen(args.all, args.conversion)
    console.rule(f"mtpconvert demo: {src.name} (raw Hugging Face layout, bundled)")
    if not args.all and not args.conversion:
        console.print(f"one conversion, {conversions[0][1]}: "
                      + ("the quick one on the CPU, whose 4-bit matmuls run several times slower than bf16 ones; "
                         if conversions[0][0] == "bf16" else "")
                      + "--all runs the four conversions", style="dim", highlight=False)
    # the head's input as the config declares it; --all also the other one, whose lower acceptance shows the
    # declared one is the head's
    hiddens = ("post-norm", "pre-norm") if args.all else ("post-norm",)
    prompts, rows, shown = None, [], False
    with rich_events(err, summary=False) as events:
        for folder, label, quant in conversions:
            out = args.out / folder
            options = ConvertOptions(dtype=dtype, quant=QuantOptions(**quant))
            events.stage(f"converting {src.name} to {out} ({label})")
            if not rows:
                plan_summary(api.plan(src, options), console)
            try:  # as `mtpconvert convert` does it: verified and smoke-tested (its own prompts) before the commit
                converted = api.convert(src, out, options, checks=Gate(), overwrite=True, events=events)
            except GateFailed as e:  # the table says which check failed; nothing was written to OUT
                err.print(f"[red]{escape(label)}: {escape(str(e))}[/red]", highlight=False)
                verify_failed = "verification" in str(e)
                rows.append((label, "FAILED" if verify_failed else "ok", "-" if verify_failed else "FAIL", None))
                continue
            if not shown:  # the first folder's verify report: what `mtpconvert verify` prints
                report_table(api.verify(converted.out), console)
                shown = True
            if prompts is None:
                events.stage("reading the bench's prompts")
                prompts = text_prompts(src) if args.fixture == "text" else fixture_prompts()
            result = api.bench(out, BenchOptions(prompts, args.max_tokens, hiddens=hiddens, warmup_tokens=WARMUP_TOKENS,
                                                 cross_check=False, step_costs=False), events=events)
            rows.append((label, "ok", "pass", result))
    device = mx.default_device()
    benched = [r for *_, r in rows if r is not None]
    n_prompts = benched[0].prompts if benched else 0
    console.print(results_table(rows, f"MTP speculative decoding on {src.name} (greedy, depth 1, {n_prompts} "
                                      f"prompts x {args.max_tokens} tokens, {device})"))
    drafts = sorted(sum(r.rows[0].mtp.proposed) for r in benched)
    if drafts:
        kind = "held-out stdlib" if args.fixture == "text" else "synthetic-language"
        counted = f"{drafts[0]}" if drafts[0] == drafts[-1] else f"{drafts[0]}-{drafts[-1]}"
        console.print(
            f"Each row: {n_prompts} {kind} prompts x {args.max_tokens} tokens per decoder, after an untimed "
            f"{WARMUP_TOKENS}-token warm-up of each; acceptance over {counted} drafts (post-norm). smoke (what convert "
            f"gates on): acceptance >= {DECODING_MIN_ACCEPTANCE:.0%} and the head's MLP gain >= "
            f"{MIN_MLP_GAIN * 100:.1f} points on smoke's own 3 prompts x 48 tokens (token identity with plain greedy "
            "is reported, not gated). mlx-lm tok/s: mlx_lm.generate.generate_step on the same prompts; speedup = MTP "
            "tok/s / mlx-lm tok/s. On this tiny model a step is dominated by per-op overhead, so speedup says little "
            "about real models; see docs/runtime.md.", style="dim", highlight=False)
    console.print(f"demo finished in {time.monotonic() - started:.0f} s", style="dim")
    done = [folder for (folder, _, _), row in zip(conversions, rows) if row[-1] is not None]
    if done:
        next_steps(args.out, done, console)
    return 0 if len(benched) == len(rows) else 1


def run(argv=None) -> int:
    """main() for `make demo`: Ctrl-C ends it with one line and exit 130, like the CLI (no traceback)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        Console(stderr=True).print("[red]interrupted[/red]")
        return 130
    except api.Interrupted as e:  # Ctrl-C during a conversion: the API says what it left behind
        Console(stderr=True).print(f"[red]{escape(str(e))}[/red]", highlight=False)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(run())
