"""`verify`, `smoke` and `bench`: check a folder, and measure its MTP head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, List

import typer
from rich.console import Console

from .. import api
from ..errors import OptionsError
from ..options import HIDDEN_STATES, BenchOptions
from . import options as o
from .errors import handled
from .helpfmt import Command
from .progress import rich_events
from .render import (bench_table, concurrency_table, divergence_text, oracle_concurrency_table, report_table,
                     runtimes_table)

console = Console(stderr=True)
out_console = Console()

VERIFY_EPILOG = """Examples:

  mtpconvert verify out/

  mtpconvert verify mlx-community/Qwen3.5-2B-mxfp4 --json --deep
"""

SMOKE_EPILOG = """Examples:

  mtpconvert smoke out/ -p "def fibonacci(n):" --min-acceptance 0.5
"""

BENCH_EPILOG = """Examples:

  mtpconvert bench out/ --depth 1 --depth 2

  mtpconvert bench out/ --temp 0.7 --top-p 0.9 --json

  mtpconvert bench out/ --concurrency 1,2,4,8 --depth 1 --depth 2

  mtpconvert bench out/ --oracle-acceptance 0.6 --oracle-acceptance 0.8 --oracle-acceptance 0.9
"""


def print_smoke(result, to: Console) -> None:
    status = "[green]pass[/green]" if result.ok else "[red]FAIL[/red]"
    acc, prop = sum(result.mtp.accepted), sum(result.mtp.proposed)
    # token identity is a diagnostic: near-ties may part a k+1-token verify pass from a 1-token step
    same = "identical to plain greedy" if result.identical else (
        "[yellow]differs from plain greedy[/yellow] at " + "; ".join(map(divergence_text, result.divergences)))
    to.print(f"MTP draft acceptance ({result.hidden}): {acc}/{prop} = {result.acceptance:.1%} "
             f"(floor {result.min_acceptance:.0%}), {result.mtp.tokens_per_step:.2f} tokens/step, output {same}"
             f"{mlp_gain_text(result)} {status}", highlight=False)


def mlp_gain_text(result) -> str:
    """``, MLP gain +8.6 points [...]``: the head's acceptance with its MLP minus without it (empty when not measured)."""
    g = result.mlp_gain_paired
    if g is None:
        return ""
    floor = "not gated" if result.min_mlp_gain is None else f"floor {result.min_mlp_gain * 100:+.0f}"
    return (f", MLP gain {g.gain * 100:+.1f} points (95% CI {g.low * 100:+.1f} to {g.high * 100:+.1f} over "
            f"{g.positions} positions; {floor})")


def print_layerwise(result, to: Console) -> None:
    status = "[green]pass[/green]" if result.ok else "[red]FAIL[/red]"
    to.print(f"MTP draft acceptance (layerwise, teacher-forced, {result.hidden}): {result.agreed}/{result.compared} "
             f"= {result.acceptance:.1%} (floor {result.min_acceptance:.0%}){mlp_gain_text(result)} in "
             f"{result.seconds:.0f} s {status}",
             highlight=False)


@handled
def verify(
    path: Annotated[Path, typer.Argument(help="Folder to check (raw HF, mtpconvert output, or another MLX "
                                         "conversion).")],
    as_json: o.Json = False,
    deep: Annotated[bool, typer.Option("--deep", help="Also read every float tensor and report NaN/Inf by "
                                       "name.")] = False,
):
    """Check a folder from its headers: layout, MTP, experts, norm shift, quantization, index, and which MTP
    runtimes can load it and use its head."""
    with rich_events(console, quiet=as_json) as events:
        report = api.verify(path, deep=deep, events=events)
    if as_json:
        out_console.print_json(json.dumps(report.to_json()))
    else:
        report_table(report, out_console)
        runtimes_table(report.runtimes, report.mtp_layout, out_console)
    raise typer.Exit(0 if report.ok else 1)


@handled
def smoke(
    path: Annotated[Path, typer.Argument(help="Converted MLX folder with an MTP head.")],
    prompt: o.Prompts = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Greedy tokens generated per prompt.", min=1)] = 48,
    min_acceptance: o.MinAcceptance = o.DEFAULTS["min_acceptance"],
    hidden: Annotated[o.Hidden, typer.Option("--mtp-hidden", help="Backbone state fed to the head.")]
    = o.Hidden["post-norm"],
    as_json: o.Json = False,
):
    """Greedy MTP decoding next to plain greedy on a few prompts; non-zero exit when the head is absent or broken."""
    with rich_events(console, quiet=as_json) as events:
        result = api.smoke(path, prompt, max_tokens, hidden.value, min_acceptance, events=events)
    if as_json:
        out_console.print_json(json.dumps(result.to_json()))
    else:
        print_smoke(result, out_console)
    raise typer.Exit(0 if result.ok else 1)


@handled
def bench(
    path: Annotated[Path, typer.Argument(help="Converted MLX folder with an MTP head.")],
    prompt: o.Prompts = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens generated per prompt and decoder.",
                                            min=1)] = 128,
    depth: Annotated[List[int], typer.Option("--depth", "-k", help="Chained MTP drafts per step (repeatable).")]
    = [1],  # noqa: B006 - typer reads the default, never mutates it
    hidden: Annotated[o.BenchHidden, typer.Option("--mtp-hidden", help="Backbone state fed to the head.")]
    = o.BenchHidden.both,
    temperature: Annotated[float, typer.Option("--temp", help="Sampling temperature (0 = greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the top tokens up to this "
                                         "probability mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep only the k most likely tokens (0 = off).")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampled draws.")] = 0,
    concurrency: o.Concurrency = None,
    oracle: o.OracleAcceptance = None,
    cuda_qmv: o.CudaQmv = False,
    as_json: o.Json = False,
):
    """MTP speculative decoding vs plain decoding: acceptance per depth, tokens/step, tok/s, speedup, step costs.
    With --concurrency: batched MTP vs mlx-lm's BatchGenerator at each number of concurrent streams."""
    options = BenchOptions(prompts=prompt, max_tokens=max_tokens, depths=depth,
                           hiddens=HIDDEN_STATES if hidden is o.BenchHidden.both else (hidden.value,),
                           temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           concurrency=_concurrency(concurrency), oracle=oracle or (), cuda_qmv=cuda_qmv)
    with rich_events(console, quiet=as_json) as events:
        result = api.bench(path, options, events=events)
    if as_json:
        out_console.print_json(json.dumps(result.to_json(), default=str))
    elif options.concurrency is not None and options.oracle:
        oracle_concurrency_table(result, out_console)
    elif options.concurrency is not None:
        concurrency_table(result, out_console)
    else:
        bench_table(result, out_console)


def _concurrency(text):
    """"1,2,4,8" -> [1, 2, 4, 8]; None stays None (the range is ``BenchOptions``'s to check)."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OptionsError(f"--concurrency must be comma-separated integers, not {text!r}") from None


def register(app: typer.Typer) -> None:
    app.command("verify", cls=Command, epilog=VERIFY_EPILOG)(verify)
    app.command(cls=Command, epilog=SMOKE_EPILOG)(smoke)
    app.command(cls=Command, epilog=BENCH_EPILOG)(bench)
