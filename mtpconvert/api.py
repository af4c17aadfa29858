"""The Python API: every command of the CLI as a function, with the same checks. Options are values
(``mtpconvert.options``) that check themselves when made: the CLI parses text into them.

    from mtpconvert import api
    from mtpconvert.options import BenchOptions, ConvertOptions, PublishOptions, QuantOptions, RawPolicy

    result = api.convert("Qwen3.5-27B", "out", ConvertOptions(quant=QuantOptions(bits=4)))
    report = api.verify("out")
    smoke = api.smoke("out")
    bench = api.bench("out", BenchOptions(depths=(1, 2)))
    pulled = api.pull_and_convert("Qwen/Qwen3.5-27B", None, ConvertOptions(quant=QuantOptions(bits=4)),
                                  raw=RawPolicy(stream=True), publish=PublishOptions("me/Qwen3.5-27B-4bit-mtp"))

Progress reaches the caller through ``Events`` callbacks (the CLI draws its bars from
them); failures raise ``ConvertError`` subclasses whose message names the file, key or
option. Nothing here prints.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

from .gate import GateRecord, Gate, run_gate
from .errors import ConvertError, Kept, OptionsError
from .io.checkpoint import Checkpoint, open_checkpoint
from .options import (BenchOptions, ConvertOptions, ExecuteOptions, HubSource, PublishOptions, RawPolicy,
                      checked_prompts)
from .plan import Plan, PlanItem, build_plan
from .progress import Events
from .provenance import conversion_record

PathLike = Union[str, Path]


class Interrupted(ConvertError):
    """Ctrl-C or SIGTERM: nothing was written to OUT; finished shards stay for ``--resume``."""

    exit_code = 130
    default_code = "interrupted"


@dataclass
class ConversionResult:
    out: Path
    plan: Plan
    shards: List[str]
    tensors: int
    bytes_written: int
    shards_reused: int = 0
    checks: GateRecord = field(default_factory=GateRecord)
    source_repo: Optional[str] = None
    source_revision: Optional[str] = None
    peak_stream_bytes: Optional[int] = None


def plan(source: PathLike, options: ConvertOptions = ConvertOptions()) -> Plan:
    """The conversion plan of a local checkpoint folder, from its headers alone (``--dry-run``)."""
    return build_plan(open_checkpoint(Path(source)), options)


def _partial(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _kept(error: BaseException, record: GateRecord) -> Optional[Kept]:
    """What a failed run left for --resume: the partial folder ``OutputFolder`` kept (it keeps
    it once a shard is finished: ``io.output_folder``), and the check that failed."""
    partial = getattr(error, "kept_partial", None)
    if partial is None:
        return None
    if isinstance(error, KeyboardInterrupt):  # not a failed check: resume runs the checks again
        return Kept(partial)
    return Kept(partial, record.failed, record.smoke_mode if record.failed == "smoke" else None)


def _interrupted(out: Path, kept: Optional[Kept]) -> Interrupted:
    summary = f"interrupted: nothing was written to {out}"
    error = Interrupted(f"{summary}; finished shards are kept in {kept.partial} for --resume" if kept else summary)
    error.summary, error.kept = summary, kept
    return error


def _execute(plan_: Plan, ckpt: Checkpoint, out: Path, execute_options: ExecuteOptions, *, checks: Gate,
             events: Events, stream=None, publisher=None,
             after_checks: Optional[Callable[[Path, GateRecord], None]] = None) -> ConversionResult:
    """``publisher`` (``hub.publish.ShardPublisher``) receives each finished shard (and feeds its
    ``consumer``, the streamed smoke, which then replaces the post-hoc one); ``after_checks`` runs on
    the temp folder once the checks passed, before it becomes OUT (a failure keeps the shards)."""
    from .execute import execute

    events.plan(plan_)
    record = GateRecord()
    streamed = getattr(publisher, "consumer", None)

    def check(folder: Path) -> None:
        if publisher is not None:
            publisher.drain()  # the last shard's upload: an upload error is reported before any check runs
        # contract: mtplx_runtime.json, before after_checks commits the folder to the Hub
        run_gate(folder, checks, record, has_mtp=plan_.mtp_layers > 0, on_stage=events.stage, streamed=streamed,
                 contract=True, progress=events.progress)
        if after_checks is not None:
            after_checks(folder, record)

    try:
        done = execute(plan_, ckpt, out, execute_options, progress=lambda item, _i: events.item(item),
                       check=check, stream=stream, sink=publisher)
    except KeyboardInterrupt as e:
        raise _interrupted(out, _kept(e, record)) from None
    except BaseException as e:
        if streamed is not None:
            streamed.close()  # its copies go; the shards it fed stay (or are on the Hub) for --resume
            if streamed.failed:  # it raised while fed during the conversion: the resume advice is the smoke's
                record.failed, record.smoke_mode = "smoke", "layerwise"
        # finished shards that survived (a post-check failed, an error after some shards were
        # written) are named on the error, whatever its type, so the caller can say how to resume
        kept = _kept(e, record)
        if kept is not None:
            e.kept = kept
        raise
    return ConversionResult(done.out, plan_, done.shards, done.tensors, done.bytes_written, done.shards_reused,
                            record)


def convert(source: PathLike, out: PathLike, options: ConvertOptions = ConvertOptions(), *,
            checks: Gate = Gate(), overwrite: bool = False, resume: bool = False,
            events: Optional[Events] = None, extra_metadata: Optional[dict] = None) -> ConversionResult:
    """Convert a local checkpoint folder into an MLX folder at ``out``, atomically.

    The finished folder is verified and smoke-tested (``checks``) before it is renamed
    into place; any failure leaves nothing at ``out``. Shards finished before a failure stay in
    ``.OUT.partial`` for ``resume=True``: the exception's ``kept`` (``errors.Kept``) names them.
    """
    events = events or Events()
    ckpt = open_checkpoint(Path(source))
    record = {**conversion_record("convert", options, source_folder=Path(source).resolve().name),
              **(extra_metadata or {})}
    execute_options = ExecuteOptions(overwrite=overwrite, resume=resume, extra_metadata=record)
    return _execute(build_plan(ckpt, options), ckpt, Path(out), execute_options, checks=checks, events=events)


def default_out(repo_id: str, options: ConvertOptions) -> Path:
    name = repo_id.split("/")[-1]
    bits = options.quant.bits
    return Path(f"{name}-{bits}bit-mtp-mlx" if bits else f"{name}-mtp-mlx")


def _hub_source(source: Union[str, HubSource]) -> HubSource:
    """A repo id as the ``HubSource`` of its main branch, with the defaults; a ``HubSource`` as it is."""
    return source if isinstance(source, HubSource) else HubSource(source)


def pull_plan(source: Union[str, HubSource], options: ConvertOptions = ConvertOptions()):
    """What ``pull_and_convert`` would download (``--dry-run``): files, sizes, the pinned commit."""
    from .hub import pull

    source = _hub_source(source)
    options.quant.validated()
    return pull.plan_pull(source.repo_id, source.revision, token=source.token, keep_vision=options.keep_vision,
                          keep_mtp=options.quant.mtp != "drop", cache=source.cache_dir, timeout=source.timeout)


def pull_and_convert(source: Union[str, HubSource], out: Optional[PathLike] = None,
                     options: ConvertOptions = ConvertOptions(), *, raw: RawPolicy = RawPolicy(),
                     publish: Optional[PublishOptions] = None, checks: Gate = Gate(), overwrite: bool = False,
                     resume: bool = False, events: Optional[Events] = None) -> ConversionResult:
    """Download only what the conversion needs (pinned to one commit), convert, check; optionally upload.

    ``source``: a repo id, or a ``HubSource`` (revision, token, cache or local folder, timeout). ``raw``:
    how much of the raw release is on disk at once (``RawPolicy``: every file downloaded first, or streamed:
    each raw shard fetched when first needed and deleted after its last use, or byte ranges within a
    window). ``publish``: upload the result with its model card in one commit; streamed, each output shard
    goes up as it is written and the commit follows the checks.
    """
    from .hub import pull

    source = _hub_source(source)
    events = events or Events()
    events.stage(f"resolving {source.repo_id}")
    pulled = pull_plan(source, options)
    out = Path(out) if out is not None else default_out(source.repo_id, options)
    meta = conversion_record("pull-and-quantize", options, source_repo=source.repo_id, source_revision=pulled.sha)
    if raw.record() is not None:  # a window, or a prefetch depth other than the default
        meta["stream"] = raw.record()
    execute_options = ExecuteOptions(overwrite=overwrite, resume=resume, extra_metadata=meta)
    if raw.stream:
        result = _convert_streamed(pulled, source, out, options, raw, execute_options, publish=publish,
                                   checks=checks, events=events)
    else:
        events.stage(f"downloading {source.repo_id}")
        events.download(0, pulled.total_bytes or None)
        folder = pull.download(pulled, token=source.token, cache=source.cache_dir, local_dir=source.local_dir,
                               timeout=source.timeout, on_file=lambda f: events.download(f.size or 0, None))
        ckpt = open_checkpoint(folder, absent=pulled.skipped_shards)
        result = _execute(build_plan(ckpt, options), ckpt, out, execute_options, checks=checks, events=events)
    result.source_repo, result.source_revision = source.repo_id, pulled.sha
    if publish is not None and not raw.stream:  # streamed, the shards went up as they were written
        upload(out, publish.repo_id, token=source.token, private=publish.private,
               checks=Gate(verify=True, smoke=False), record=result.checks, events=events)
    return result


def _convert_streamed(pulled, source: HubSource, out: Path, options: ConvertOptions, raw: RawPolicy,
                      execute_options: ExecuteOptions, *, publish: Optional[PublishOptions], checks: Gate,
                      events: Events) -> ConversionResult:
    """Plan from header stubs, then convert while the raw data arrives as ``raw`` says (``_raw_feed``); with
    ``publish`` each finished output shard is uploaded as it is written and one commit publishes the folder
    once the checks passed (``hub.publish``)."""
    from .hub import pull
    from .hub.publish import committer, shard_publisher
    from .hub.stream import raw_feed

    stage = source.local_dir or out.absolute().parent / f".{out.name}.stream"
    publisher = None
    try:
        events.stage(f"reading {pulled.repo_id} shard headers")
        ckpt = open_checkpoint(pull.fetch_stubs(pulled, stage, token=source.token, timeout=source.timeout),
                               absent=pulled.skipped_shards)
        plan_ = build_plan(ckpt, options)
        if publish is not None:
            publisher = shard_publisher(publish, _partial(out.absolute()), source.token, plan_, checks)
        feed = raw_feed(pulled, plan_, ckpt, token=source.token, timeout=source.timeout, keep=raw.shards_held,
                        window=raw.window_bytes, on_download=events.download)
        if publisher is not None:
            publisher.open()
        try:
            result = _execute(plan_, ckpt, out, execute_options, checks=checks, events=events, stream=feed,
                              publisher=publisher,
                              after_checks=committer(publisher, events.stage) if publisher else None)
        except BaseException:
            feed.abandon()  # Ctrl-C must not wait for a multi-GB download in flight
            if publisher is not None:
                publisher.abandon()
            raise
        feed.close()
        result.peak_stream_bytes = feed.peak_bytes
        if publisher is not None:
            _drop_stubs(out, publisher.stubbed, events)
        return result
    finally:
        if source.local_dir is None:
            shutil.rmtree(stage, ignore_errors=True)


def _drop_stubs(out: Path, stubbed: Sequence[str], events: Events) -> None:
    """Header stubs have holes for data: not a model. OUT keeps config, tokenizer, index and the MTP head."""
    for name in stubbed:
        (out / name).unlink(missing_ok=True)
    if stubbed:
        events.note(f"{len(stubbed)} model shard(s) were uploaded as they were written and are on the Hub only; "
                    f"{out} keeps config, tokenizer, index and the MTP head")


def add_mtp(source: str, mlx_dir: PathLike, *, revision: Optional[str] = None, mtp: str = "keep",
            mtp_bits: Optional[int] = None, token: Optional[str] = None, mtp_layout: str = "sidecar",
            checks: Gate = Gate(), events: Optional[Events] = None) -> dict:
    """Graft the MTP head of ``source`` onto an existing MLX folder, in ``mtp_layout``.

    ``source`` is the original release: a Hub repo id (only the head's byte ranges are read)
    or a local raw folder (offline).
    """
    from . import __version__
    from .graft import add_mtp_from_hub, graft
    from .provenance import library_versions, record_graft

    events = events or Events()
    if mtp == "drop":
        raise OptionsError("--mtp drop makes no sense for add-mtp")
    record = GateRecord()

    def check(folder: Path) -> None:
        run_gate(folder, checks, record, has_mtp=True, on_stage=events.stage, contract=True, progress=events.progress)

    try:
        if Path(source).is_dir():
            events.stage(f"adding the MTP head of {source} to {mlx_dir}")
            added = graft(Path(source), Path(mlx_dir), mtp=mtp, mtp_bits=mtp_bits, mtp_layout=mtp_layout, check=check,
                          progress=events.progress)
            info = {"sha": "local", "fetched_bytes": 0, "source_bytes": 0, "added": len(added)}
        else:
            events.stage(f"reading {source}'s shard headers and its MTP head's byte ranges")
            info = add_mtp_from_hub(source, Path(mlx_dir), revision=revision, token=token, mtp=mtp,
                                    mtp_bits=mtp_bits, mtp_layout=mtp_layout, check=check, progress=events.progress,
                                    on_bytes=lambda n: events.download(n, None))
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: {mlx_dir} is unchanged") from None
    where = {"source_folder": Path(source).resolve().name} if info["sha"] == "local" else {
        "source_repo": source, "source_revision": info["sha"]}
    record_graft(Path(mlx_dir), {"command": "add-mtp", "version": __version__, "libraries": library_versions(),
                                 "options": {"mtp": mtp, "mtp_bits": mtp_bits, "mtp_layout": mtp_layout}, **where})
    info["checks"] = record
    return info


def upload(folder: PathLike, repo_id: str, *, token: Optional[str] = None, private: bool = False,
           checks: Gate = Gate(min_acceptance=0.0, min_mlp_gain=None), record: Optional[GateRecord] = None,
           events: Optional[Events] = None, base_model: Optional[str] = None) -> str:
    """Verify a folder, make its model card, upload both in one commit; return the commit URL.

    ``base_model``: the source release's repo id, when the folder does not record it (a local conversion).
    """
    from .hub.card import model_card
    from .hub.upload import upload as push

    events = events or Events()
    folder = Path(folder)
    record = record if record is not None else GateRecord()
    if record.verify is None or record.smoke is None:
        report = verify(folder)
        run_gate(folder, Gate(verify=record.verify is None, smoke=checks.smoke and record.smoke is None,
                                  min_acceptance=checks.min_acceptance, min_mlp_gain=checks.min_mlp_gain),
                   record, has_mtp=(report.mtp_layers_config or report.mtp_layers_found) > 0, on_stage=events.stage,
                   progress=events.progress)
    card = model_card(folder, repo_id, smoke_acceptance=record.smoke_acceptance, verify_ok=record.verify_ok,
                      base_model=base_model)
    return push(folder, repo_id, token=token, private=private, card=card, on_stage=events.stage)


def verify(path: PathLike, deep: bool = False, events: Optional[Events] = None):
    """Check any folder (raw HF, ours, another MLX conversion) from its headers; see ``verify.Report``
    (``.runtimes``: the MTP runtime compatibility table). ``deep``: the tensors read go to ``events.progress``."""
    from .verify import verify as run

    events = events or Events()
    if deep:
        events.stage(f"verifying {path} (reading every float tensor)")
    return run(Path(path), deep=deep, progress=events.progress)


def families() -> List[dict]:
    """Every supported model family: its config model_types, head design, mlx-lm modules and the runtimes
    that use its head (``Family.describe``)."""
    from .families import FAMILIES

    return [family.describe() for family in FAMILIES]


def runtimes(path: PathLike):
    """Which MTP runtimes can load the folder and use its head, from headers alone; see ``compat.CompatReport``."""
    from .compat import check_folder

    return check_folder(Path(path))


def _readable_shards(folder: Path) -> None:
    """Every file the loader reads passes the folder rule and every shard's header fits its file: a truncated
    shard or a link out of the folder is named here, not deep inside MLX's loader."""
    from .runtime.decoding.locate import readable_folder

    readable_folder(folder)


def smoke(path: PathLike, prompts: Optional[Sequence[str]] = None, max_tokens: int = 48,
          hidden: str = "post-norm", min_acceptance: Optional[float] = None, events: Optional[Events] = None):
    """Greedy MTP decoding next to plain greedy; ``.ok`` is False when the head is absent or broken."""
    events = events or Events()
    events.stage(f"MTP smoke test on {path}: {max_tokens} tokens a prompt, plain greedy and MTP at depths 1 and 3")
    from .runtime.smoke.decode import smoke as run  # mlx-lm and transformers: seconds to import

    checked_prompts(prompts)
    _readable_shards(Path(path))
    return run(Path(path), prompts, max_tokens, hidden, Gate(min_acceptance=min_acceptance).floor_for("full"),
               progress=events.progress)


def bench(path: PathLike, options: BenchOptions = BenchOptions(), *,
          on_tokens: Optional[Callable[[int], None]] = None, events: Optional[Events] = None):
    """MTP speculative decoding against plain decoding: acceptance per depth, tok/s, step costs.

    With ``options.concurrency`` (e.g. (1, 2, 4, 8)): batched MTP against mlx-lm's BatchGenerator at each
    number of concurrent streams, for the first of ``options.hiddens``
    (``runtime.measure.batch_bench.ConcurrencyResult``). ``options.oracle`` (acceptance rates P, greedy only):
    every row runs once per P with each draft replaced by the true greedy token with probability P
    (``runtime.measure.oracle``; with ``concurrency`` each draft is kept with probability P instead:
    ``oracle_batch.OracleConcurrencyResult``). ``options.cuda_qmv``: on a CUDA device, the multi-row
    quantized matvec where it measures faster (``runtime.decoding.cuda_qmv``). ``on_tokens(n)``: n more
    tokens decoded; ``events.progress``: the tokens (one stream) or runs (``concurrency``) decoded so far."""
    events = events or Events()
    events.stage(f"bench on {path}: " + (
        f"batched MTP vs mlx-lm's BatchGenerator at {list(options.concurrency)} streams" if options.concurrency
        else f"MTP vs mlx-lm's generate_step, {'/'.join(options.hiddens)} state, depth {list(options.depths)}")
        + f", {options.max_tokens} tokens a prompt")
    from .runtime.decoding.sampling import Sampling  # mlx-lm and transformers: seconds to import
    from .runtime.measure.bench import bench as run

    sampling = Sampling(options.temperature, options.top_p, options.top_k)
    _readable_shards(Path(path))
    if options.concurrency is not None:
        return _bench_concurrency(Path(path), options, sampling, on_tokens, events)
    return run(Path(path), options.prompts, options.max_tokens, options.depths, options.hiddens, sampling,
               options.seed, on_tokens=on_tokens, oracle=options.oracle, cuda_qmv=options.cuda_qmv,
               progress=events.progress, warmup_tokens=options.warmup_tokens, cross_check=options.cross_check,
               step_costs=options.step_costs)


def _bench_concurrency(path: Path, options: BenchOptions, sampling, on_tokens, events: Events):
    """``bench`` at each of ``options.concurrency`` streams at once (families whose capabilities say batched)."""
    from .families import family_for
    from .runtime.decoding.load import load
    from .runtime.measure.batch_bench import bench_concurrency
    from .runtime.measure.oracle_batch import bench_concurrency_oracle
    from .runtime.smoke.decode import encode_prompts

    family = family_for(open_checkpoint(path).config)
    if not family.capabilities.batched:
        raise OptionsError(f"--concurrency: batched MTP does not run the {family.name} family "
                           f"({family.head.forward} head): it benches one stream at a time (leave --concurrency out)")
    if family.backbone_library != "mlx-lm":  # the baseline every speedup divides by runs mlx-lm's models only
        raise OptionsError(f"--concurrency: the batched bench's baseline, mlx-lm's BatchGenerator, does not run the "
                           f"{family.name} backbone ({family.backbone_library}'s model); batched MTP runs it "
                           "(runtime.decoding.batched.run_batch), the bench does not (leave --concurrency out)")
    m = load(path)
    if options.cuda_qmv:
        from .runtime.decoding import cuda_qmv as kernel

        kernel.enable(m.model, m.head)
    encoded = encode_prompts(path, options.prompts)
    hidden = options.hiddens[0]
    if options.oracle:
        return bench_concurrency_oracle(m, str(path), encoded, options.concurrency, options.oracle, options.max_tokens,
                                        options.depths, options.seed, hidden, on_tokens=on_tokens,
                                        progress=events.progress)
    return bench_concurrency(m, str(path), encoded, options.concurrency, options.max_tokens, options.depths, sampling,
                             options.seed, hidden, on_tokens=on_tokens, progress=events.progress)


def run_recipe(path: PathLike, out: Optional[PathLike] = None, *, stream: bool = False,
               raw: Optional[RawPolicy] = None, upload: bool = True, token: Optional[str] = None,
               checks: Gate = Gate(), overwrite: bool = False, resume: bool = False,
               events: Optional[Events] = None) -> ConversionResult:
    """Run one recipe (a file, or the name of a bundled one): pull-and-convert with its options, then upload
    to its repo unless ``upload=False``. ``stream``: with the recipe's raw-disk policy (``Recipe.raw_policy``:
    its ``raw_window_gb``, else its ``prefetch_shards``); ``raw``: another policy, which replaces that choice."""
    from .recipes import find_recipe, load_recipe

    recipe = load_recipe(find_recipe(path))
    if raw is None:
        raw = recipe.raw_policy if stream else RawPolicy()
    return pull_and_convert(recipe.source(token), out, recipe.options, raw=raw,
                            publish=recipe.publish if upload else None, checks=checks, overwrite=overwrite,
                            resume=resume, events=events)
