"""`mtpconvert add-mtp`: give an existing MLX folder (made without MTP) the MTP head of its source release.

Only the bytes needed are fetched: each source shard's header, then the byte ranges of the
``mtp.*`` tensors, written at their own offsets into a *sparse* local mirror of the shard (same
size, holes elsewhere). The ordinary plan/transform code then runs on the mirror unchanged and
touches only the MTP items, so the head gets exactly the rules a full conversion would apply.
The folder is rebuilt beside itself (existing shards hard-linked, not copied), verified, and
swapped in atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from .errors import LayoutError
from .execute.blocks import produce
from .families import family_for
from .hub.sparse import fetch_sparse
from .io.checkpoint import INDEX_NAME, MTP_FILE, open_checkpoint
from .io.files import contained
from .io.output_folder import OutputFolder
from .io.reader import TensorReader
from .io.shard_writer import StreamingShardWriter
from .execute.run import link_head
from .families import family_for
from .families.base import Family
from .options import ConvertOptions, QuantOptions
from .plan import build_plan
from .progress import Counter, Progress
from .runtime.decoding.locate import HEAD_PREFIXES

IN_MODEL_SHARD = "model-mtp.safetensors"  # --mtp-layout in-model: a model shard the index lists
MLX_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _existing_dtype(ckpt, family) -> str:
    """The float dtype the folder keeps its unquantized tensors in: its final norm's, where the family puts it (with
    or without the ``language_model.`` prefix, as mlx-lm's text-only folders have it)."""
    norm = family.module_paths.norm
    prefixes = (norm + ".", norm.removeprefix("language_model.") + ".")
    for key, info in ckpt.tensors.items():
        if key.startswith(prefixes) and info.dtype in MLX_DTYPES:
            return MLX_DTYPES[info.dtype]
    return "bfloat16"


def _head_config(config: dict, plan) -> dict:
    """``config`` with the head's fields from the plan's config: layer count, the sidecar's
    extra-tensor record and hidden-state mode, and the head's quantization entries (those under the head's
    prefixes, and those the family adds for the head's modules as its runtime names them, which name no
    tensor of the plan: ``Family.loadable_config``)."""
    config = dict(config)
    tc = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    planned_tc = plan.config.get("text_config", plan.config)
    tc[plan.family.mtp_count_key] = plan.mtp_layers
    if "mtp_hidden_state_mode" in planned_tc:
        tc["mtp_hidden_state_mode"] = planned_tc["mtp_hidden_state_mode"]
    if "mlx_lm_extra_tensors" in plan.config:
        config["mlx_lm_extra_tensors"] = plan.config["mlx_lm_extra_tensors"]
    head = (plan.family.sidecar_prefix, *HEAD_PREFIXES)
    named = {it.slot.module for it in plan.items} | {"group_size", "bits", "mode"}
    for block in ("quantization", "quantization_config"):
        if block in config:
            config[block] = {**config[block], **{k: v for k, v in plan.config.get(block, {}).items()
                                                 if k.startswith(head) or k not in named}}
    return config


def _is_head_key(family: Family) -> Callable[[str], bool]:
    """Whether a source key is (a part of) one of the head's tensors, by the family's own mapping: ``mtp.*`` for
    Qwen, the nextn layer ``model.layers.{N}.*`` for GLM."""
    def is_head(key: str) -> bool:
        try:
            return any(m.target is not None and family.is_head(m.target) for m in family.contributions(key))
        except LayoutError:
            return False

    return is_head


def graft(source_dir: Path, mlx_dir: Path, *, mtp: str = "keep", mtp_bits: Optional[int] = None,
          mtp_layout: str = "sidecar", check: Optional[Callable[[Path], None]] = None,
          absent: Sequence[str] = (), progress: Optional[Progress] = None) -> List[str]:
    """Add the MTP head of the raw checkpoint at ``source_dir`` to ``mlx_dir`` in ``mtp_layout``;
    return the added tensor names. ``absent``: source shards left out on purpose (vision only);
    ``progress``: the head's tensors written (stage "add-mtp")."""
    mlx_dir = Path(mlx_dir)
    existing = open_checkpoint(mlx_dir)
    if any(k.startswith((family_for(existing.config).sidecar_prefix, *HEAD_PREFIXES)) for k in existing.tensors):
        raise LayoutError("the folder already has MTP tensors", file=mlx_dir, hint="nothing to add")
    q = existing.config.get("quantization") or {}
    quant = QuantOptions(q.get("bits"), q.get("group_size"), q.get("mode", "affine"), mtp, mtp_bits)
    raw = open_checkpoint(source_dir, absent=absent)
    dtype = _existing_dtype(existing, family_for(raw.config))
    plan = build_plan(raw, ConvertOptions(dtype=dtype, quant=quant, mtp_layout=mtp_layout))
    if plan.mtp_layers == 0:
        raise LayoutError("the source checkpoint has no MTP head", file=source_dir)
    items = plan.head_items
    for probe in (plan.family.module_paths.embed + ".weight", plan.family.module_paths.lm_head + ".weight"):
        mine = next((it for it in plan.items if it.name == probe), None)
        theirs = existing.tensors.get(probe)
        if mine and theirs and mine.quant is None and tuple(theirs.shape) != tuple(mine.slot.shape):
            raise LayoutError(f"the source's {probe} is {list(mine.slot.shape)}, the folder's {list(theirs.shape)}: "
                              "not the same model", file=mlx_dir, key=probe)

    sidecar = mtp_layout == "sidecar"
    head_file = MTP_FILE if sidecar else IN_MODEL_SHARD
    added: List[str] = []
    with OutputFolder(mlx_dir, overwrite=True) as folder:
        for p in sorted(mlx_dir.iterdir()):
            if p.is_dir() or p.name in ("config.json", INDEX_NAME):
                continue
            os.link(contained(mlx_dir, p.name), folder.path(p.name))  # never a FIFO or a file outside the folder
        specs = [s for it in items for s in it.outputs()]
        writer = StreamingShardWriter(folder.path(head_file), specs, {"format": "mlx"})
        reader = TensorReader()
        count = Counter(progress, "add-mtp", len(specs), "tensors")
        try:
            for it in items:
                count.at(it.name)
                for spec, arr in zip(it.outputs(), produce(it, raw, reader)):
                    writer.write(spec.key, arr)
                    added.append(spec.key)
                    count.add()
            writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            reader.close()

        config = _head_config(existing.config, plan)
        folder.write_json("config.json", config)
        index = json.loads((mlx_dir / INDEX_NAME).read_text()) if (mlx_dir / INDEX_NAME).exists() else {
            "metadata": {}, "weight_map": {k: s for s in existing.shards for k in existing.headers[s].tensors}}
        meta = index.setdefault("metadata", {})
        meta.setdefault("mtpconvert", {})["mtp_grafted"] = {"mtp_policy": quant.mtp, "mtp_layers": plan.mtp_layers,
                                                            "mtp_layout": mtp_layout}
        if sidecar:
            link_head(folder, config)
        else:
            meta["total_size"] = int(meta.get("total_size", 0)) + sum(s.nbytes for s in specs)
            index["weight_map"] = dict(sorted({**index["weight_map"], **{k: head_file for k in added}}.items()))
        folder.write_json(INDEX_NAME, index, indent=2)
        if check is not None:
            check(folder.tmp)
        folder.commit()
    return added


def add_mtp_from_hub(repo_id: str, mlx_dir: Path, *, revision: Optional[str] = None, token: Optional[str] = None,
                     mtp: str = "keep", mtp_bits: Optional[int] = None, mtp_layout: str = "sidecar",
                     check: Optional[Callable[[Path], None]] = None, progress: Optional[Progress] = None,
                     on_bytes: Optional[Callable[[int], None]] = None) -> dict:
    """Fetch headers + MTP byte ranges of ``repo_id`` into a sparse mirror, then graft. ``on_bytes``: each
    range's size as it arrives; ``progress``: see ``graft``."""
    from huggingface_hub import hf_hub_download

    from .hub import pull as hub

    pull = hub.plan_pull(repo_id, revision, token=token)
    sizes = {f.name: f.size for f in pull.files}
    shard_names = [n for n in sizes if n.endswith(".safetensors")]
    with tempfile.TemporaryDirectory(prefix="mtpconvert-graft-") as tmp:
        mirror = Path(tmp)
        for name in ("config.json", INDEX_NAME):
            if name in sizes:
                shutil.copyfile(hf_hub_download(repo_id, name, revision=pull.sha, token=token,
                                                endpoint=hub.endpoint(), cache_dir=hub.cache_dir()), mirror / name)
        family = family_for(json.loads((mirror / "config.json").read_text()))
        fetched = fetch_sparse(repo_id, pull.sha, {n: sizes[n] for n in shard_names}, mirror, _is_head_key(family),
                               token, on_bytes=on_bytes)
        added = graft(mirror, mlx_dir, mtp=mtp, mtp_bits=mtp_bits, mtp_layout=mtp_layout, check=check,
                      absent=pull.skipped_shards, progress=progress)
    return {"sha": pull.sha, "fetched_bytes": fetched, "source_bytes": sum(sizes[n] or 0 for n in shard_names),
            "added": len(added)}
