"""Run a plan: stream source tensors through their transforms into output shards.

One output item at a time is held in memory (plus the fused tensor shared by a
gate/up pair). Shards are written with their header fixed up front, so a tensor is
on disk as soon as it is made and then dropped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from . import __version__
from .plan import Plan, PlanItem
from .safetensors_io import StreamingShardWriter, TensorReader
from .source import SIDECAR_FILES, VISION_SIDECAR_FILES, Checkpoint, safe_member
from .transforms import apply_steps, gather
from .writer import OutputFolder, describe_os_error

Progress = Callable[[PlanItem, int], None]


RESUME_DIR = ".mtpconvert-resume"  # inside the partial folder; removed before commit


@dataclass
class ConvertResult:
    out: Path
    shards: List[str]
    tensors: int
    bytes_written: int
    shards_reused: int = 0


def plan_fingerprint(plan: Plan, ckpt: Checkpoint) -> str:
    """Identifies what a shard was made from: the full plan plus each source file's size and mtime."""
    h = hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode())
    for f in sorted({t.file for t in ckpt.tensors.values()}):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _reusable(folder: OutputFolder, shard: str, fingerprint: str) -> bool:
    """A shard left by an interrupted run is reused only if its record and its bytes check out."""
    record, path = folder.path(RESUME_DIR) / f"{shard}.json", folder.path(shard)
    try:
        done = json.loads(record.read_text())
        return (done.get("fingerprint") == fingerprint and path.stat().st_size == done.get("size")
                and file_sha256(path) == done.get("sha256"))
    except (OSError, ValueError, AttributeError):
        return False


def produce(item: PlanItem, ckpt: Checkpoint, reader: TensorReader, cache: Dict[str, mx.array]) -> List[mx.array]:
    """The output arrays of one plan item (evaluated)."""
    arrays = [cache[s.key] if s.key in cache else reader.read(ckpt.tensors[s.key]) for s in item.sources]
    # keep a fused gate_up around for its twin item
    cache.clear()
    if item.gather in ("gate_half", "up_half"):
        cache[item.sources[0].key] = arrays[0]
    outs = apply_steps(gather(arrays, item.gather), item.steps, item.quant)
    mx.eval(*outs)
    return outs


def index_json(plan: Plan, extra_metadata: Optional[dict] = None) -> dict:
    weight_map = {}
    total = 0
    for item in plan.items:
        for spec in item.outputs():
            weight_map[spec.key] = item.shard
            total += spec.nbytes
    meta = {
        "format": "mlx",
        "total_size": total,
        "mtpconvert": {
            "version": __version__,
            "source_layout": plan.style,
            "norm_shift_applied": plan.raw,
            "dtype": plan.dtype,
            "mtp_policy": plan.options.quant.mtp,
            "mtp_layers": plan.mtp_layers,
            **(extra_metadata or {}),
        },
    }
    return {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}


def copy_sidecars(src: Path, out: OutputFolder, keep_vision: bool) -> List[str]:
    names = list(SIDECAR_FILES) + (list(VISION_SIDECAR_FILES) if keep_vision else [])
    copied = []
    for name in names:
        p = src / name
        if not p.is_file():
            continue
        safe_member(src, name, "file", file=p)  # links only within the folder or its hub blob store
        shutil.copyfile(p, out.path(name))
        copied.append(name)
    return copied


def execute(
    plan: Plan,
    ckpt: Checkpoint,
    out: Path,
    *,
    overwrite: bool = False,
    progress: Optional[Progress] = None,
    extra_metadata: Optional[dict] = None,
    check: Optional[Callable[[Path], None]] = None,
    resume: bool = False,
) -> ConvertResult:
    """Write the plan's output folder atomically; ``check`` runs on the finished temp folder.

    With ``resume``, shards finished by an interrupted run of the same plan are kept when
    their recorded sha256 still matches; everything else is rewritten.
    """
    shards: Dict[str, List[PlanItem]] = {}
    for item in plan.items:
        shards.setdefault(item.shard, []).append(item)
    last_use: Dict[Path, int] = {}
    for i, item in enumerate(plan.items):
        for s in item.sources:
            last_use[ckpt.tensors[s.key].file] = i
    release_at: Dict[int, List[Path]] = {}
    for f, last in last_use.items():
        release_at.setdefault(last, []).append(f)

    written = reused = 0
    fingerprint = plan_fingerprint(plan, ckpt)
    with OutputFolder(out, overwrite=overwrite, resume=resume) as folder:
        folder.path(RESUME_DIR).mkdir(exist_ok=True)
        reader = TensorReader()
        cache: Dict[str, mx.array] = {}
        position = 0

        def item_done(item: PlanItem) -> None:
            """Unmap source files this item used last, report progress, move on."""
            nonlocal position
            for f in release_at.get(position, ()):
                reader.release(f)
            if progress:
                progress(item, position)
            position += 1

        try:
            for shard_name, items in shards.items():
                specs = [spec for item in items for spec in item.outputs()]
                path = folder.path(shard_name)
                if resume and _reusable(folder, shard_name, fingerprint):
                    reused += 1
                    written += path.stat().st_size
                    for item in items:
                        item_done(item)
                    continue
                writer = StreamingShardWriter(path, specs, {"format": "mlx"})
                try:
                    for item in items:
                        outs = produce(item, ckpt, reader, cache)
                        for spec, arr in zip(item.outputs(), outs):
                            writer.write(spec.key, arr)
                        del outs
                        item_done(item)
                    writer.close()
                    written += writer.size
                    record = {"fingerprint": fingerprint, "size": writer.size, "sha256": file_sha256(path)}
                    (folder.path(RESUME_DIR) / f"{shard_name}.json").write_text(json.dumps(record))
                except BaseException:
                    writer.abort()
                    raise
        except OSError as e:
            raise describe_os_error(e, out) from e
        finally:
            reader.close()
        try:
            folder.write_json("model.safetensors.index.json", index_json(plan, extra_metadata), indent=2)
            folder.write_json("config.json", plan.config)
            copy_sidecars(ckpt.root, folder, plan.options.keep_vision)
        except OSError as e:
            raise describe_os_error(e, out) from e
        shutil.rmtree(folder.path(RESUME_DIR))
        if check is not None:
            check(folder.tmp)
        folder.commit()
    return ConvertResult(out, list(shards), sum(len(i.outputs()) for i in plan.items), written, reused)
