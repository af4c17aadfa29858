"""Command line: thin wrappers over plan / execute / verify."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

from . import __version__
from .errors import ConvertError, LayoutError, OptionsError
from .plan import ConvertOptions, build_plan
from .quant import QuantOptions

app = typer.Typer(
    help="Convert Qwen3.5/3.6 checkpoints to MLX with the Multi-Token-Prediction head kept.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out_console = Console()


class MtpPolicy(str, Enum):
    keep = "keep"
    match = "match"
    drop = "drop"


class DType(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


class QMode(str, Enum):
    affine = "affine"
    mxfp4 = "mxfp4"
    nvfp4 = "nvfp4"
    mxfp8 = "mxfp8"


def _fail(e: ConvertError) -> None:
    console.print(f"[red]error:[/red] {e}", highlight=False)
    raise typer.Exit(e.exit_code)


def _terminate_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so temp folders and locks are cleaned up."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


@app.callback(invoke_without_command=True)
def main(version: bool = typer.Option(False, "--version", help="Print the version and exit.")):
    if version:
        out_console.print(__version__)
        raise typer.Exit(0)


def _convert_options(dtype, bits, group_size, q_mode, mtp, mtp_bits, keep_vision, max_shard_gb) -> ConvertOptions:
    """The shared conversion options of `convert` and `pull-and-quantize`."""
    return ConvertOptions(
        dtype=dtype.value if dtype else None,
        quant=QuantOptions(bits, group_size, q_mode.value, mtp.value, mtp_bits),
        keep_vision=keep_vision,
        max_shard_bytes=int(max_shard_gb * (1 << 30)),
    )


@app.command()
def convert(
    source: Path = typer.Argument(..., help="Local checkpoint folder (raw Hugging Face or MLX)."),
    out: Optional[Path] = typer.Argument(None, help="Output folder (written atomically)."),
    bits: Optional[int] = typer.Option(None, "--bits", "-q", help="Quantize the backbone to this many bits."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Quantization group size (mode default)."),
    q_mode: QMode = typer.Option(QMode.affine, "--q-mode", help="Quantization mode."),
    dtype: Optional[DType] = typer.Option(None, "--dtype", help="Float dtype (default: the source's)."),
    mtp: MtpPolicy = typer.Option(MtpPolicy.keep, "--mtp", help="MTP head: keep at --dtype, match the backbone, or drop."),
    mtp_bits: Optional[int] = typer.Option(None, "--mtp-bits", help="Quantize the MTP head to N bits (affine)."),
    keep_vision: bool = typer.Option(False, "--keep-vision", help="Keep the vision tower (mlx-vlm naming)."),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-size", help="Largest output shard, GB."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and write nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    resume: bool = typer.Option(False, "--resume", help="Reuse shards an interrupted run finished (re-hashed first)."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip verifying the output before it is committed."),
    no_smoke: bool = typer.Option(False, "--no-smoke", help="Skip the MTP decode smoke test (it loads the model)."),
    min_acceptance: float = typer.Option(0.30, "--min-acceptance", help="Smoke floor for greedy draft acceptance."),
):
    """Convert a local checkpoint folder into an MLX folder, keeping the MTP head."""
    from .render import plan_table
    from .source import open_checkpoint

    _terminate_as_interrupt()
    try:
        opts = _convert_options(dtype, bits, group_size, q_mode, mtp, mtp_bits, keep_vision, max_shard_gb)
        ckpt = open_checkpoint(source)
        plan = build_plan(ckpt, opts)
        if dry_run:
            if as_json:
                out_console.print_json(json.dumps(plan.to_json()))
            else:
                plan_table(plan, out_console)
            return
        if out is None:
            raise typer.BadParameter("OUT is required unless --dry-run")
        _write(plan, ckpt, out, overwrite=overwrite, resume=resume, run_verify=not no_verify,
               run_smoke=not no_smoke, min_acceptance=min_acceptance)
    except ConvertError as e:
        _fail(e)


def _write(plan, ckpt, out: Path, *, overwrite: bool, resume: bool, run_verify: bool, run_smoke: bool,
           min_acceptance: float, extra_metadata: Optional[dict] = None, record: Optional[dict] = None,
           stream=None):
    """Execute a plan with a progress bar and the pre-commit checks; Ctrl-C exits 130 with nothing at OUT."""
    from .execute import execute
    from .render import plan_summary

    plan_summary(plan, console)
    total = sum(it.out_bytes for it in plan.items)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("converting", total=total)
            result = execute(
                plan, ckpt, out, overwrite=overwrite, extra_metadata=extra_metadata,
                progress=lambda item, i: bar.advance(task, item.out_bytes),
                check=_output_checks(run_verify, run_smoke and plan.mtp_layers > 0, min_acceptance, record),
                resume=resume, stream=stream,
            )
    except KeyboardInterrupt:
        console.print(f"[red]interrupted[/red]: nothing was written to {out}; finished shards are kept in "
                      f"{out.parent / ('.' + out.name + '.partial')} for `--resume`")
        raise typer.Exit(130)
    reused = f", {result.shards_reused} reused after checking" if result.shards_reused else ""
    console.print(f"[green]wrote[/green] {result.out} ({len(result.shards)} shard(s){reused}, {result.tensors} tensors)")
    return result


def _output_checks(run_verify: bool, run_smoke: bool, min_acceptance: float, record: Optional[dict] = None):
    """Checks run on the finished temp folder before it is renamed to OUT: a failure leaves nothing at OUT."""
    if not (run_verify or run_smoke):
        return None
    record = record if record is not None else {}

    def check(folder: Path) -> None:
        if run_verify:
            _check_output(folder)
            record["verify_ok"] = True
        if run_smoke:
            result = _check_smoke(folder, min_acceptance)
            if result is not None:
                record["smoke_acceptance"] = result.acceptance

    return check


def _check_output(folder: Path) -> None:
    from .verify import verify

    report = verify(folder)
    if not report.ok:
        first = next(f for f in report.findings if f.severity == "error")
        raise LayoutError(f"output failed verification: {first.code}: {first.message}", key=first.key,
                          hint="this is a bug in mtpconvert; please report it with --dry-run --json output")


def _check_smoke(folder: Path, min_acceptance: float):
    from .runtime.smoke import smoke as run_smoke

    reason = _cannot_run_here(folder)
    if reason:
        console.print(f"[yellow]smoke skipped[/yellow]: {reason}")
        return None
    with console.status("MTP smoke test (greedy draft/verify decoding)"):
        result = run_smoke(folder, min_acceptance=min_acceptance)
    _print_smoke(result, console)
    if not result.ok:
        raise LayoutError(
            f"MTP smoke test failed: greedy draft acceptance {result.acceptance:.1%} < {min_acceptance:.0%}"
            if result.identical else "MTP decoding differs from plain greedy decoding",
            file=folder, hint="the head is converted wrongly; nothing was written (use --no-smoke to keep it anyway)",
        )
    return result


def _cannot_run_here(folder: Path) -> Optional[str]:
    """Known device limits, checked up front so real failures are never mistaken for them."""
    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    tc = config.get("text_config", config)
    dtype = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["mtpconvert"]["dtype"]
    if (tc.get("num_experts") and "quantization" not in config and dtype != "float32"
            and mx.default_device() == mx.cpu):
        return f"mlx's CPU backend has no {dtype} gather_mm for unquantized MoE experts (run smoke on a GPU/Mac)"
    return None


def _print_smoke(result, to: Console) -> None:
    status = "[green]pass[/green]" if result.ok else "[red]FAIL[/red]"
    acc, prop = sum(result.mtp.accepted), sum(result.mtp.proposed)
    same = "identical to plain greedy" if result.identical else (
        f"[red]differs from plain greedy[/red] on prompt(s) {result.mismatched_prompts}")
    to.print(f"MTP draft acceptance ({result.hidden}): {acc}/{prop} = {result.acceptance:.1%} "
             f"(floor {result.min_acceptance:.0%}), {result.mtp.tokens_per_step:.2f} tokens/step, output {same} "
             f"{status}", highlight=False)


@app.command("verify")
def verify_cmd(
    path: Path = typer.Argument(..., help="Folder to check (raw HF, mtpconvert output, or another MLX conversion)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    deep: bool = typer.Option(False, "--deep", help="Also read every float tensor and report NaN/Inf by name."),
):
    """Check a folder from its headers: layout, MTP, experts, norm shift, quantization, index."""
    from .render import report_table
    from .verify import verify

    report = verify(path, deep=deep)
    if as_json:
        out_console.print_json(json.dumps(report.to_json()))
    else:
        report_table(report, out_console)
    raise typer.Exit(0 if report.ok else 1)


class Hidden(str, Enum):
    post = "post-norm"
    pre = "pre-norm"


@app.command()
def smoke(
    path: Path = typer.Argument(..., help="Converted MLX folder with an MTP head."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", "-p", help="Prompt text (repeatable)."),
    max_tokens: int = typer.Option(48, "--max-tokens", help="Greedy tokens generated per prompt."),
    min_acceptance: float = typer.Option(0.30, "--min-acceptance", help="Fail below this draft acceptance."),
    hidden: Hidden = typer.Option(Hidden.post, "--mtp-hidden", help="Backbone state fed to the head."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Greedy MTP decoding next to plain greedy on a few prompts; non-zero exit when the head is absent or broken."""
    from .runtime.smoke import smoke as run_smoke

    try:
        result = run_smoke(path, prompt, max_tokens, hidden.value, min_acceptance)
    except ConvertError as e:
        _fail(e)
    if as_json:
        out_console.print_json(json.dumps(result.to_json()))
    else:
        _print_smoke(result, out_console)
    raise typer.Exit(0 if result.ok else 1)


class BenchHidden(str, Enum):
    post = "post-norm"
    pre = "pre-norm"
    both = "both"


@app.command()
def bench(
    path: Path = typer.Argument(..., help="Converted MLX folder with an MTP head."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", "-p", help="Prompt text (repeatable)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens generated per prompt and decoder."),
    depth: list[int] = typer.Option([1], "--depth", "-k", help="Chained MTP drafts per step (repeatable)."),
    hidden: BenchHidden = typer.Option(BenchHidden.both, "--mtp-hidden", help="Backbone state fed to the head."),
    temperature: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json"),
):
    """MTP speculative decoding vs plain decoding: acceptance per depth, tokens/step, tok/s, speedup, step costs."""
    from .render import bench_table
    from .runtime.bench import bench as run_bench
    from .runtime.sampling import Sampling

    if any(d < 1 for d in depth):
        _fail(OptionsError("--depth must be >= 1"))
    try:
        sampling = Sampling(temperature, top_p, top_k)
    except ValueError as e:
        _fail(OptionsError(str(e)))
    hiddens = ("post-norm", "pre-norm") if hidden is BenchHidden.both else (hidden.value,)
    n_prompts = len(prompt) if prompt else 3
    total = 2 * n_prompts * len(hiddens) * len(depth) * max_tokens
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
                      TimeElapsedColumn(), console=console, transient=True, disable=as_json) as bar:
            task = bar.add_task("decoding", total=total)
            result = run_bench(path, prompt, max_tokens, depth, hiddens, sampling, seed,
                               on_tokens=lambda n: bar.advance(task, n))
    except ConvertError as e:
        _fail(e)
    if as_json:
        out_console.print_json(json.dumps(result.to_json()))
    else:
        bench_table(result, out_console)


@app.command("pull-and-quantize")
def pull_and_quantize(
    repo_id: str = typer.Argument(..., help="Hub repository, e.g. Qwen/Qwen3.5-27B."),
    out: Optional[Path] = typer.Argument(None, help="Output folder (default: ./<name>-<bits>bit-mtp-mlx)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit (pinned to its sha)."),
    bits: Optional[int] = typer.Option(None, "--bits", "-q"),
    group_size: Optional[int] = typer.Option(None, "--group-size"),
    q_mode: QMode = typer.Option(QMode.affine, "--q-mode"),
    dtype: Optional[DType] = typer.Option(None, "--dtype"),
    mtp: MtpPolicy = typer.Option(MtpPolicy.keep, "--mtp"),
    mtp_bits: Optional[int] = typer.Option(None, "--mtp-bits"),
    keep_vision: bool = typer.Option(False, "--keep-vision"),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-size"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="huggingface_hub cache (default: HF_HOME)."),
    local_dir: Optional[Path] = typer.Option(None, "--local-dir", help="Download into this folder instead of the cache."),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN / saved login).",
                                        show_default=False),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be downloaded and its size."),
    stream: bool = typer.Option(False, "--stream", help="Fetch each raw shard when first needed and delete it after "
                                "its last use: raw data on disk stays within the two largest shards."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the Hub before failing."),
    as_json: bool = typer.Option(False, "--json"),
    overwrite: bool = typer.Option(False, "--overwrite"),
    resume: bool = typer.Option(False, "--resume"),
    no_smoke: bool = typer.Option(False, "--no-smoke"),
    min_acceptance: float = typer.Option(0.30, "--min-acceptance"),
    upload_repo: Optional[str] = typer.Option(None, "--upload-repo", help="Upload the result here, with a model card."),
    private: bool = typer.Option(False, "--private"),
):
    """Download only what conversion needs, convert, quantize, verify, smoke-test; optionally upload."""
    from . import hub
    from .render import human_bytes
    from .source import open_checkpoint

    _terminate_as_interrupt()
    try:
        opts = _convert_options(dtype, bits, group_size, q_mode, mtp, mtp_bits, keep_vision, max_shard_gb)
        with console.status(f"resolving {repo_id}"):
            pull = hub.plan_pull(repo_id, revision, token=token, keep_vision=keep_vision,
                                 keep_mtp=mtp.value != "drop", cache=cache_dir, timeout=timeout)
        if dry_run:
            if as_json:
                out_console.print_json(json.dumps(pull.to_json()))
            else:
                out_console.print(f"{repo_id} @ {pull.sha}")
                for f in pull.files:
                    out_console.print(f"  download {f.name:60s} {human_bytes(f.size or 0):>10s}")
                for f in pull.skipped:
                    out_console.print(f"  skip     {f.name:60s} {human_bytes(f.size or 0):>10s}", style="dim")
                out_console.print(f"total to download: {human_bytes(pull.total_bytes)}")
            return
        name = repo_id.split("/")[-1]
        out = out or Path(f"{name}-{bits}bit-mtp-mlx" if bits else f"{name}-mtp-mlx")
        meta = {"source_repo": repo_id, "source_revision": pull.sha}
        record: dict = {}
        write = dict(overwrite=overwrite, resume=resume, run_verify=True, run_smoke=not no_smoke,
                     min_acceptance=min_acceptance, record=record, extra_metadata=meta)
        if stream:
            _pull_streamed(pull, out, opts, token=token, local_dir=local_dir, timeout=timeout, write=write)
        else:
            with Progress(TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as bar:
                task = bar.add_task(f"downloading {repo_id}", total=pull.total_bytes or None)
                folder = hub.download(pull, token=token, cache=cache_dir, local_dir=local_dir, timeout=timeout,
                                      on_file=lambda f: bar.advance(task, f.size or 0))
            ckpt = open_checkpoint(folder)
            _write(build_plan(ckpt, opts), ckpt, out, **write)
        if upload_repo:
            card = hub.model_card(out, upload_repo, smoke_acceptance=record.get("smoke_acceptance"),
                                  verify_ok=record.get("verify_ok"))
            url = hub.upload(out, upload_repo, token=token, private=private, card=card)
            console.print(f"[green]uploaded[/green] {upload_repo}: {url}")
    except ConvertError as e:
        _fail(e)


def _pull_streamed(pull, out: Path, opts: ConvertOptions, *, token, local_dir: Optional[Path], timeout: float,
                   write: dict) -> None:
    """Plan from header stubs, then convert while shards are fetched on first use and deleted after last use."""
    from . import hub
    from .source import open_checkpoint
    from .streaming import ShardStream, first_use_order

    stage = local_dir or out.absolute().parent / f".{out.name}.stream"
    try:
        with console.status(f"reading {pull.repo_id} shard headers"):
            ckpt = open_checkpoint(hub.fetch_stubs(pull, stage, token=token, timeout=timeout))
        plan = build_plan(ckpt, opts)
        feed = ShardStream(first_use_order(plan, ckpt),
                           lambda name, dest: hub.fetch_file(pull, name, dest, token=token, timeout=timeout))
        try:
            _write(plan, ckpt, out, stream=feed, **write)
        finally:
            feed.close()
        from .render import human_bytes
        console.print(f"streamed: at most {human_bytes(feed.peak_bytes)} of raw shards on disk at once")
    finally:
        if local_dir is None:
            shutil.rmtree(stage, ignore_errors=True)


@app.command("upload")
def upload_cmd(
    path: Path = typer.Argument(..., help="Converted MLX folder."),
    repo_id: str = typer.Argument(..., help="Target Hub repository (created if absent)."),
    token: Optional[str] = typer.Option(None, "--token", show_default=False),
    private: bool = typer.Option(False, "--private"),
    no_smoke: bool = typer.Option(False, "--no-smoke", help="Do not measure acceptance for the card."),
):
    """Verify a folder, write its model card, and upload it with huggingface_hub."""
    from . import hub
    from .verify import verify

    try:
        report = verify(path)
        if not report.ok:
            first = next(f for f in report.findings if f.severity == "error")
            raise LayoutError(f"refusing to upload a folder that fails verify: {first.code}: {first.message}",
                              file=path, key=first.key)
        acceptance = None
        if not no_smoke and report.mtp_layers_config:
            acceptance = _check_smoke(path, 0.0)
            acceptance = acceptance.acceptance if acceptance is not None else None
        card = hub.model_card(path, repo_id, smoke_acceptance=acceptance, verify_ok=True)
        url = hub.upload(path, repo_id, token=token, private=private, card=card)
    except ConvertError as e:
        _fail(e)
    console.print(f"[green]uploaded[/green] {repo_id}: {url}")


@app.command("add-mtp")
def add_mtp(
    source_repo: str = typer.Argument(..., help="The original release on the Hub, e.g. Qwen/Qwen3.5-27B."),
    mlx_dir: Path = typer.Argument(..., help="Existing MLX folder without an MTP head (e.g. from mlx_lm.convert)."),
    revision: Optional[str] = typer.Option(None, "--revision"),
    mtp: MtpPolicy = typer.Option(MtpPolicy.keep, "--mtp", help="keep (float) or match the folder's quantization."),
    mtp_bits: Optional[int] = typer.Option(None, "--mtp-bits"),
    token: Optional[str] = typer.Option(None, "--token", show_default=False),
    no_smoke: bool = typer.Option(False, "--no-smoke"),
    min_acceptance: float = typer.Option(0.30, "--min-acceptance"),
):
    """Graft the MTP head onto an existing MLX folder, reading only the mtp.* byte ranges from the Hub."""
    from .graft import add_mtp_from_hub
    from .render import human_bytes

    _terminate_as_interrupt()
    if mtp is MtpPolicy.drop:
        _fail(OptionsError("--mtp drop makes no sense for add-mtp"))
    try:
        info = add_mtp_from_hub(source_repo, mlx_dir, revision=revision, token=token, mtp=mtp.value,
                                mtp_bits=mtp_bits, check=_output_checks(True, not no_smoke, min_acceptance))
    except ConvertError as e:
        _fail(e)
    console.print(f"[green]added[/green] {info['added']} MTP tensors to {mlx_dir} from {source_repo}@{info['sha'][:12]} "
                  f"(read {human_bytes(info['fetched_bytes'])} of {human_bytes(info['source_bytes'])})")


recipe_app = typer.Typer(help="Per-model conversion recipes (recipes/*.toml).", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("list")
def recipe_list(folder: Path = typer.Option(Path("recipes"), "--dir", help="Folder of recipe files.")):
    """Every recipe with its repository and options."""
    from rich.table import Table

    from .recipes import list_recipes

    try:
        recipes = list_recipes(folder)
    except ConvertError as e:
        _fail(e)
    table = Table(title=f"recipes in {folder}")
    for col in ("file", "repo", "bits", "group", "dtype", "MTP", "upload to"):
        table.add_column(col, overflow="fold")
    for r in recipes:
        table.add_row(r.path.name, r.repo, str(r.bits or "-"), str(r.group_size or "-"), r.dtype or "source",
                      r.mtp if r.mtp_bits is None else f"{r.mtp_bits}-bit", r.upload_repo or "-")
    out_console.print(table)


@recipe_app.command("run")
def recipe_run(
    path: Path = typer.Argument(..., help="A recipe file."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the download plan only."),
    no_upload: bool = typer.Option(False, "--no-upload", help="Convert but do not upload."),
    token: Optional[str] = typer.Option(None, "--token", show_default=False),
):
    """Run one recipe: pull-and-quantize -> verify -> smoke -> upload."""
    from .recipes import load_recipe

    try:
        recipe = load_recipe(path)
    except ConvertError as e:
        _fail(e)
    args = recipe.cli_args()
    if out is not None:
        args.insert(2, str(out))
    if dry_run:
        args.append("--dry-run")
    if recipe.upload_repo and not no_upload and not dry_run:
        args += ["--upload-repo", recipe.upload_repo]
    if token:
        args += ["--token", token]
    console.print("mtpconvert " + " ".join(a if a != token else "***" for a in args), highlight=False)
    typer.main.get_command(app).main(args, prog_name="mtpconvert", standalone_mode=False)


def run() -> None:
    app()


if __name__ == "__main__":
    sys.exit(run())
