"""`convert` and `pull-and-quantize`: parse options, call the API, show the plan and the result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import api
from ..compat import precision_warnings
from ..errors import OptionsError
from ..options import DEFAULT_HUB_TIMEOUT, HubSource, PublishOptions, RawPolicy
from ..provenance import checked_repo_id
from . import options as o
from .errors import handled
from .helpfmt import Command
from .progress import rich_events
from .render import human_bytes, plan_table, runtimes_table

console = Console(stderr=True)
out_console = Console()

CONVERT_EPILOG = """Examples:

  mtpconvert convert ~/models/Qwen3.5-27B out/ --bits 4 --dtype float16 --base-model Qwen/Qwen3.5-27B

  mtpconvert convert ~/models/Qwen3.5-27B out/ --bits 4 --dry-run --json
"""

PULL_EPILOG = """Examples:

  mtpconvert pull-and-quantize Qwen/Qwen3.5-27B --bits 4 --dtype float16

  mtpconvert pull-and-quantize Qwen/Qwen3.5-397B-A17B --bits 4 --stream --upload-repo me/Qwen3.5-397B-4bit-mtp

  mtpconvert pull-and-quantize Qwen/Qwen3.5-27B --bits 4 --stream --prefetch-shards 0   # one raw shard on disk
  mtpconvert pull-and-quantize Qwen/Qwen3.5-397B-A17B --bits 4 --mtp match --stream --raw-window 1   # ≤1 GB raw
"""


def print_checked_smoke(record, to: Console) -> None:
    """The smoke's result, and which smoke ran and why."""
    from .inspect import print_layerwise, print_smoke

    if record.smoke is None:
        return
    to.print(f"smoke: {record.smoke_mode} ({record.smoke_reason})", highlight=False)
    (print_layerwise if record.smoke_mode == "layerwise" else print_smoke)(record.smoke, to)


def print_result(result: api.ConversionResult) -> None:
    record = result.checks
    print_checked_smoke(record, console)
    for note in record.notes:
        console.print(note, highlight=False)
    reused = f", {result.shards_reused} reused after checking" if result.shards_reused else ""
    console.print(f"[green]wrote[/green] {result.out} ({len(result.shards)} shard(s){reused}, {result.tensors} "
                  "tensors)")
    if result.peak_stream_bytes is not None:
        console.print(f"streamed: at most {human_bytes(result.peak_stream_bytes)} of raw shards on disk at once")
    print_runtimes(result)


def mtp_choice(quant) -> str:
    """The option that set the head's precision, as the user typed it."""
    return f"--mtp-bits {quant.mtp_bits}" if quant.mtp_bits is not None else f"--mtp {quant.mtp}"


def print_runtimes(result: api.ConversionResult) -> None:
    """Which MTP runtimes can use the output, and a warning where the chosen head precision is why not."""
    table = api.runtimes(result.out)
    runtimes_table(table.runtimes, table.layout, console)
    for line in precision_warnings(table, mtp_choice(result.plan.options.quant)):
        console.print(f"[yellow]warning[/yellow]: {escape(line)}", highlight=False)


@handled
def convert(
    ctx: typer.Context,
    source: Annotated[Path, typer.Argument(help="Local checkpoint folder (raw Hugging Face or MLX).")],
    out: Annotated[Optional[Path], typer.Argument(help="Output folder (written atomically).", show_default=False)]
    = None,
    bits: o.Bits = None,
    group_size: o.GroupSize = None,
    q_mode: o.QModeOpt = o.DEFAULTS["q_mode"],
    dtype: o.DTypeOpt = None,
    mtp: o.Mtp = o.DEFAULTS["mtp"],
    mtp_bits: o.MtpBits = None,
    keep_vision: o.KeepVision = False,
    max_shard_gb: o.MaxShardSize = o.DEFAULTS["max_shard_gb"],
    mtp_layout: o.MtpLayout = o.DEFAULTS["mtp_layout"],
    dry_run: o.DryRun = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: the plan as JSON on stdout.")] = False,
    overwrite: o.Overwrite = False,
    resume: o.Resume = False,
    no_verify: o.NoVerify = False,
    no_smoke: o.NoSmoke = False,
    smoke_mode: o.SmokeMode = o.DEFAULTS["smoke_mode"],
    min_acceptance: o.MinAcceptance = o.DEFAULTS["min_acceptance"],
    min_mlp_gain: o.MinMlpGain = o.DEFAULTS["min_mlp_gain"],
    base_model: o.BaseModel = None,
):
    """Convert a local checkpoint folder into an MLX folder, keeping the MTP head."""
    options = o.convert_options(dtype=dtype, bits=bits, group_size=group_size, q_mode=q_mode, mtp=mtp,
                                mtp_bits=mtp_bits, keep_vision=keep_vision, max_shard_gb=max_shard_gb,
                                mtp_layout=mtp_layout)
    if dry_run:
        plan = api.plan(source, options)
        if as_json:
            out_console.print_json(json.dumps(plan.to_json()))
        else:
            plan_table(plan, out_console)
        return
    if as_json:
        raise OptionsError("--json needs --dry-run (a conversion prints its progress, not a plan)")
    if out is None:
        raise OptionsError("OUT is required unless --dry-run")
    with rich_events(console) as events:
        result = api.convert(source, out, options, checks=o.checks(no_verify, no_smoke, min_acceptance, smoke_mode,
                                                                 min_mlp_gain),
                             overwrite=overwrite, resume=resume, events=events,
                             extra_metadata={"source_repo": checked_repo_id(base_model)} if base_model else None)
    print_result(result)


@handled
def pull_and_quantize(
    ctx: typer.Context,
    repo_id: Annotated[str, typer.Argument(help="Hub repository, e.g. Qwen/Qwen3.5-27B.")],
    out: Annotated[Optional[Path], typer.Argument(help="Output folder (default: ./<name>-<bits>bit-mtp-mlx).",
                                                  show_default=False)] = None,
    revision: o.Revision = None,
    bits: o.Bits = None,
    group_size: o.GroupSize = None,
    q_mode: o.QModeOpt = o.DEFAULTS["q_mode"],
    dtype: o.DTypeOpt = None,
    mtp: o.Mtp = o.DEFAULTS["mtp"],
    mtp_bits: o.MtpBits = None,
    keep_vision: o.KeepVision = False,
    max_shard_gb: o.MaxShardSize = o.DEFAULTS["max_shard_gb"],
    mtp_layout: o.MtpLayout = o.DEFAULTS["mtp_layout"],
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="huggingface_hub cache (default: HF_HOME).",
                                                      show_default=False)] = None,
    local_dir: Annotated[Optional[Path], typer.Option("--local-dir", help="Download into this folder instead of "
                                                      "the cache.", show_default=False)] = None,
    token: o.Token = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be downloaded and its size.")] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Fetch each raw shard when first needed and delete it "
                                         "after its last use: raw data on disk stays within the two largest "
                                         "shards (one with --prefetch-shards 0; a byte window with "
                                         "--raw-window).")] = False,
    prefetch_shards: o.PrefetchShards = None,
    raw_window: o.RawWindow = None,
    timeout: o.Timeout = DEFAULT_HUB_TIMEOUT,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: the download plan as JSON.")] = False,
    overwrite: o.Overwrite = False,
    resume: o.Resume = False,
    no_smoke: o.NoSmoke = False,
    smoke_mode: o.SmokeMode = o.DEFAULTS["smoke_mode"],
    min_acceptance: o.MinAcceptance = o.DEFAULTS["min_acceptance"],
    min_mlp_gain: o.MinMlpGain = o.DEFAULTS["min_mlp_gain"],
    upload_repo: Annotated[Optional[str], typer.Option("--upload-repo", help="Upload the result here, with a model "
                                                       "card, in one commit. With --stream each shard is uploaded "
                                                       "as it is written; with --no-smoke too it is then removed "
                                                       "locally (disk: two output shards).", show_default=False)] = None,
    private: o.Private = False,
):
    """Download only what conversion needs, convert, quantize, verify, smoke-test; optionally upload."""
    options = o.convert_options(dtype=dtype, bits=bits, group_size=group_size, q_mode=q_mode, mtp=mtp,
                                mtp_bits=mtp_bits, keep_vision=keep_vision, max_shard_gb=max_shard_gb,
                                mtp_layout=mtp_layout)
    source = HubSource(repo_id, revision, token, cache_dir, local_dir, timeout)
    raw = RawPolicy(stream, prefetch_shards, raw_window)
    publish = PublishOptions(upload_repo, private) if upload_repo else None
    if dry_run:
        with console.status(f"resolving {repo_id}"):
            pull = api.pull_plan(source, options)
        print_pull_plan(pull, as_json)
        return
    if as_json:
        raise OptionsError("--json needs --dry-run")
    checks = o.checks(False, no_smoke, min_acceptance, smoke_mode, min_mlp_gain)
    with rich_events(console) as events:
        result = api.pull_and_convert(source, out, options, raw=raw, publish=publish, checks=checks,
                                      overwrite=overwrite, resume=resume, events=events)
    print_result(result)
    if publish is not None:
        console.print(f"[green]uploaded[/green] {publish.repo_id}")


def print_pull_plan(pull, as_json: bool) -> None:
    if as_json:
        out_console.print_json(json.dumps(pull.to_json()))
        return
    out_console.print(f"{pull.repo_id} @ {pull.sha}")
    for f in pull.files:
        out_console.print(f"  download {f.name:60s} {human_bytes(f.size or 0):>10s}", highlight=False)
    for f in pull.skipped:
        out_console.print(f"  skip     {f.name:60s} {human_bytes(f.size or 0):>10s}", style="dim", highlight=False)
    out_console.print(f"total to download: {human_bytes(pull.total_bytes)}")


def register(app: typer.Typer) -> None:
    app.command(cls=Command, epilog=CONVERT_EPILOG)(convert)
    app.command("pull-and-quantize", cls=Command, epilog=PULL_EPILOG)(pull_and_quantize)
