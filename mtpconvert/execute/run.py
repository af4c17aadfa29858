"""Run a plan: stream source tensors through their transforms into output shards.

Items are cut into row blocks of bounded size (``blocks``); a few blocks are in flight
at once: quantized weights in one npquant worker process per core (CPU backend), the
rest on one MLX stream per core while the main thread copies the next block out of the
source mapping, and a writer thread writes finished ones at their offsets. Shards are
written with their header fixed up front, so memory is bounded by the block size and the
pipeline depth, never by the largest tensor; the bytes do not depend on the order blocks
finish in.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Set, Union

from .. import __version__
from ..families import family_for
from ..io.checkpoint import MTP_FILE, SIDECAR_FILES, VISION_SIDECAR_FILES, Checkpoint
from ..io.files import contained
from ..io.output_folder import OutputFolder, describe_os_error
from ..io.reader import TensorReader
from ..io.shard_writer import StreamingShardWriter
from ..options import ExecuteOptions
from ..plan import Plan, PlanItem
from ..plan.head import MTP_DRAFTER_CONFIG, MTP_LINK, MTP_MANIFEST, MTP_MANIFEST_BODY
from .blocks import DEFAULT_BLOCK_BYTES, block_ranges, item_blocks
from .pipeline import compute_streams, quantizer_pool, write_blocks
from .resume import RESUME_DIR, plan_fingerprint, reusable

if TYPE_CHECKING:  # a download feed (whole shards or byte ranges); execution calls its hooks only
    from ..hub.ranges import RangeStream
    from ..hub.stream import ShardStream

Progress = Callable[[PlanItem, int], None]


class ShardSink(Protocol):
    """Where finished output shards go besides the folder (``hub.publish``: uploaded as they finish)."""

    def delivered(self, shard: str, fingerprint: str) -> Optional[int]:
        """The size of a shard an earlier run of this plan already delivered (not rewritten), else None."""

    def finished(self, shard: str, path: Path, fingerprint: str) -> None:
        """``path`` is complete and its resume record written; the sink may replace the file by a header stub."""


@dataclass
class ConvertResult:
    out: Path
    shards: List[str]
    tensors: int
    bytes_written: int
    shards_reused: int = 0


def index_json(plan: Plan, extra_metadata: Optional[dict] = None) -> dict:
    weight_map = {}
    total = 0
    for item in plan.items:
        if item.shard == MTP_FILE:  # the sidecar is found by name, never through the index
            continue
        for spec in item.outputs():
            weight_map[spec.key] = item.shard
            total += spec.nbytes
    meta = {
        "format": "mlx",
        "total_size": total,
        "mtpconvert": {
            "version": __version__,
            "source_layout": plan.style,
            "norm_shift_applied": plan.norms_shifted,
            "dtype": plan.dtype,
            "mtp_policy": plan.options.quant.mtp,
            "mtp_layers": plan.mtp_layers,
            "mtp_layout": plan.options.mtp_layout if plan.mtp_layers else None,
            **(extra_metadata or {}),
        },
    }
    return {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}


def item_files(item: PlanItem, ckpt: Checkpoint) -> Set[Path]:
    return {ckpt.tensors[s.key].file for s in item.sources}


def source_users(plan: Plan, ckpt: Checkpoint) -> Dict[Path, Set[str]]:
    """For each source file, the items that read it: a file is released (unmapped; a streamed
    shard deleted) once its set is empty, whatever order items finish in."""
    users: Dict[Path, Set[str]] = {}
    for item in plan.items:
        for f in item_files(item, ckpt):
            users.setdefault(f, set()).add(item.name)
    return users


def shard_order(plan: Plan) -> Dict[str, List[PlanItem]]:
    """Items by output shard, each shard taken when the plan reaches its last item: model
    shards are runs of the plan, while the MTP sidecar gathers items from wherever the head
    sits in the source (usually its last shards)."""
    shards: Dict[str, List[PlanItem]] = {}
    last: Dict[str, int] = {}
    for i, item in enumerate(plan.items):
        shards.setdefault(item.shard, []).append(item)
        last[item.shard] = i
    return {name: shards[name] for name in sorted(shards, key=last.__getitem__)}


def link_head(folder: OutputFolder, config: dict) -> None:
    """vllm-mlx reads the head from mtp/weights.safetensors next to a manifest: the same bytes
    as mtp.safetensors (a hard link; a relative symlink where links are not supported). With the
    model's config beside them, mtp/ is the drafter folder mlx-vlm's ``--draft-model`` takes."""
    folder.path("mtp").mkdir(exist_ok=True)
    link = folder.path(MTP_LINK)
    link.unlink(missing_ok=True)
    try:
        os.link(folder.path(MTP_FILE), link)
    except OSError:
        link.symlink_to(Path("..") / MTP_FILE)
    folder.write_json(MTP_MANIFEST, MTP_MANIFEST_BODY)
    folder.write_json(MTP_DRAFTER_CONFIG, family_for(config).drafter_config(config))


def copy_sidecars(src: Path, out: OutputFolder, keep_vision: bool) -> List[str]:
    names = list(SIDECAR_FILES) + (list(VISION_SIDECAR_FILES) if keep_vision else [])
    copied = []
    for name in names:
        if not os.path.lexists(src / name):
            continue
        p = contained(src, name)  # a regular file inside the folder or its hub blob store: a FIFO is refused
        shutil.copyfile(p, out.path(name))
        copied.append(name)
    return copied


class OutputShards:
    """The output shards of one ``execute``, made in turn: each reused where an earlier run of the plan left it
    (``--resume``) or written through the block pipeline, then handed to the sink. Counts the shards reused and
    the bytes on disk, and releases each source file once no unfinished item reads it."""

    def __init__(self, plan: Plan, ckpt: Checkpoint, folder: OutputFolder, reader: TensorReader, fingerprint: str,
                 block_bytes: int, *, resume: bool, progress: Optional[Progress],
                 stream: Optional[Union["ShardStream", "RangeStream"]], sink: Optional[ShardSink]):
        self.ckpt, self.folder, self.reader, self.fingerprint = ckpt, folder, reader, fingerprint
        self.block_bytes, self.resume, self.progress = block_bytes, resume, progress
        self.stream, self.sink = stream, sink
        self.users = source_users(plan, ckpt)
        self.position = 0  # items finished so far, in the order they finish
        self.written = self.reused = 0

    def item_done(self, item: PlanItem) -> None:
        """Release the source files no unfinished item reads any more, report progress."""
        for f in item_files(item, self.ckpt):
            waiting = self.users[f]
            waiting.discard(item.name)
            if not waiting:
                self.reader.release(f)
        if self.progress:
            self.progress(item, self.position)
        self.position += 1

    def make(self, shard_name: str, items: List[PlanItem], streams, quantizers) -> None:
        """Reuse the shard or write it, then hand it to the sink (the MTP sidecar stays: it is linked and checked)."""
        if self._reused(shard_name, items):
            return
        path = self.folder.path(shard_name)
        specs = [spec for item in items for spec in item.outputs()]
        writer = StreamingShardWriter(path, specs, {"format": "mlx"})
        try:
            blocks = (b for item in items for b in item_blocks(item, self.block_bytes))
            write_blocks(blocks, self.ckpt, self.reader, writer, streams, self.item_done, quantizers, feed=self.stream)
            writer.close()
            self.written += writer.size
            record = {"fingerprint": self.fingerprint, "size": writer.size, "sha256": writer.digest()}
            (self.folder.path(RESUME_DIR) / f"{shard_name}.json").write_text(json.dumps(record))
        except BaseException:
            writer.abort()
            raise
        if self.sink is not None and shard_name != MTP_FILE:
            self.sink.finished(shard_name, path, self.fingerprint)

    def _reused(self, shard_name: str, items: List[PlanItem]) -> bool:
        """Whether an earlier run of this plan delivered the shard to the sink, or left it here intact."""
        path = self.folder.path(shard_name)
        # asked first: a delivered shard may be a header stub, which must not be re-hashed
        delivered = self.sink.delivered(shard_name, self.fingerprint) if self.sink and self.resume else None
        kept = delivered is None and self.resume and reusable(self.folder, shard_name, self.fingerprint)
        if kept:
            delivered = path.stat().st_size
        if delivered is None:
            return False
        self.reused += 1
        self.written += delivered
        for item in items:
            if self.stream is not None:  # its blocks will not be made: nothing to fetch for them
                for b in item_blocks(item, self.block_bytes):
                    self.stream.done(b.key)
            self.item_done(item)
        if kept and self.sink is not None and shard_name != MTP_FILE:
            self.sink.finished(shard_name, path, self.fingerprint)  # its bytes are here: the sink reads them too
        return True


def execute(
    plan: Plan,
    ckpt: Checkpoint,
    out: Path,
    options: ExecuteOptions = ExecuteOptions(),
    *,
    progress: Optional[Progress] = None,
    check: Optional[Callable[[Path], None]] = None,
    stream: Optional[Union["ShardStream", "RangeStream"]] = None,
    sink: Optional[ShardSink] = None,
) -> ConvertResult:
    """Write the plan's output folder atomically; ``check`` runs on the finished temp folder.

    With ``options.resume``, shards finished by an interrupted run of the same plan are kept when
    their recorded sha256 still matches; everything else is rewritten. With ``stream``,
    source data is fetched when first read and deleted after its last use (whole shards, or each
    block's byte ranges: ``stream.expect`` is told every block in order first). With ``sink``,
    every finished model shard is handed to it (the MTP sidecar stays: it is linked and checked).
    ``progress(item, position)`` runs as each item is on disk.
    """
    shards = shard_order(plan)
    block_bytes = options.block_bytes or DEFAULT_BLOCK_BYTES
    fingerprint = plan_fingerprint(plan, ckpt)
    with OutputFolder(out, overwrite=options.overwrite, resume=options.resume) as folder:
        folder.path(RESUME_DIR).mkdir(exist_ok=True)
        try:  # first: a sink may read the folder while shards arrive (the streamed smoke: config, tokenizer)
            folder.write_json("config.json", plan.config)
            copy_sidecars(ckpt.root, folder, plan.options.keep_vision)
        except OSError as e:
            raise describe_os_error(e, out) from e
        reader = TensorReader(stream.ensure, stream.release, stream.admits) if stream else TensorReader()
        if stream is not None:
            stream.expect((b.key, block_ranges(b, ckpt)) for items in shards.values() for item in items
                          for b in item_blocks(item, block_bytes))
        output = OutputShards(plan, ckpt, folder, reader, fingerprint, block_bytes, resume=options.resume,
                              progress=progress, stream=stream, sink=sink)
        streams = compute_streams(options.workers)
        with quantizer_pool(plan, streams, block_bytes) as quantizers:
            try:
                for shard_name, items in shards.items():
                    output.make(shard_name, items, streams, quantizers)
            except OSError as e:
                raise describe_os_error(e, out) from e
            finally:
                reader.close()
        try:
            folder.write_json("model.safetensors.index.json", index_json(plan, options.extra_metadata), indent=2)
            if MTP_FILE in shards:
                link_head(folder, plan.config)
        except OSError as e:
            raise describe_os_error(e, out) from e
        if check is not None:
            check(folder.tmp)
        shutil.rmtree(folder.path(RESUME_DIR))  # after the checks: a failing check leaves the records for --resume
        folder.commit()
    return ConvertResult(out, list(shards), sum(len(i.outputs()) for i in plan.items), output.written, output.reused)
