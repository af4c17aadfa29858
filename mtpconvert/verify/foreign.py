"""verify: the folder shapes other converters publish, read as what they are.

* mlx-vlm's drafter folder (``mlx_vlm.convert --mtp`` writes ``<out>-mtp``): ``config.json`` with the
  family's ``drafter_folder_type`` as ``model_type`` and the model's ``text_config``; the head's tensors unprefixed (``fc.weight``,
  ``layers.0.…``) in ``model.safetensors``; per-module quantization entries named ``<module>``. verify reads
  it as the head alone (the family of its ``text_config``, the keys as ``mtp.<key>``), like ``OUT/mtp``.
* A folder whose config declares MTP layers but holds no head (``mlx_lm.convert``, ``mlx_vlm.convert``,
  most mlx-community folders): the finding names the command that grafts the head, and the drafter folder
  ``mlx_vlm.convert --mtp`` left beside it, if any.
* A folder with a head that some runtimes cannot use (another converter's sidecar, ``model-mtp.safetensors``,
  in-model keys): one finding lists those runtimes and why, beside the table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Optional, Tuple

from ..families import drafter_family
from ..families.base import text_config
from ..io.checkpoint import Checkpoint
from ..io.files import contained
from ..io.header import read_header
from .report import INFO

HEAD_PREFIX = "mtp."
MAIN_RUNTIMES = ("mlx-vlm", "mtplx", "rapid-mlx", "vllm-mlx")  # stock mlx-lm has no MTP; PR #990 is a branch
HEAD_FILES = ("model-mtp.safetensors", "mtp/weights.safetensors")  # where vllm-mlx's tools put the head


def with_head_file(ckpt: Checkpoint) -> Tuple[Checkpoint, Optional[str]]:
    """A folder whose index (or shard set) leaves out the head, but which has one where another tool puts it
    (vllm-mlx's ``add_mtp_weights.py``: root ``model-mtp.safetensors``; vllm-mlx's extraction:
    ``mtp/weights.safetensors``): that file's tensors join the checkpoint, so verify checks the head the
    runtimes read. Returns the checkpoint and the file taken (None when nothing was added)."""
    if any(HEAD_PREFIX in k for k in ckpt.tensors):
        return ckpt, None
    for name in HEAD_FILES:
        if name in ckpt.headers or not os.path.lexists(ckpt.root / name):
            continue
        header = read_header(contained(ckpt.root, name, "MTP file"))
        tensors = dict(ckpt.tensors)
        for key, info in header.tensors.items():
            if key in tensors:
                return ckpt, None
            tensors[key] = info
        return dataclasses.replace(ckpt, headers={**ckpt.headers, name: header}, tensors=tensors), name
    return ckpt, None


def is_drafter(config: dict) -> bool:
    return drafter_family(config) is not None


def drafter_view(ckpt: Checkpoint) -> Tuple[Checkpoint, None]:
    """mlx-vlm's drafter folder as verify reads ``OUT/mtp``: the config is its ``text_config`` (with the
    drafter's quantization block, its ``<module>`` entries as ``mtp.<module>``), every key ``mtp.<key>``.
    Keys that already start with ``mtp.`` stay so (the compat row says mlx-vlm shifts their norms again)."""
    config = dict(text_config(ckpt.config))
    config.pop("text_config", None)
    quant = ckpt.config.get("quantization", config.get("quantization"))
    if isinstance(quant, dict):
        config["quantization"] = {(k if k in ("group_size", "bits", "mode") or k.startswith(HEAD_PREFIX)
                                   else HEAD_PREFIX + k): v for k, v in quant.items()}
    elif quant is not None:
        config["quantization"] = quant
    tensors = {(k if k.startswith(HEAD_PREFIX) else HEAD_PREFIX + k): info for k, info in ckpt.tensors.items()}
    return dataclasses.replace(ckpt, config=config, tensors=tensors), None


def drafter_finding(report, path: Path) -> None:
    """The head-only finding of a drafter folder says whose it is and how it is used."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    target = _target_beside(Path(path)) or "TARGET"
    drafter_type = config.get("model_type", "?")
    report.model_type = f"{drafter_type} (drafter of {report.model_type})"
    used = [r.runtime for r in report.runtimes if r.head_usable.ok]
    not_used = [r.runtime for r in report.runtimes if not r.head_usable.ok]
    for f in report.findings:
        if f.code == "head-only":
            f.code = "mlx-vlm-drafter"
            f.message = (f"mlx-vlm's drafter folder (model_type {drafter_type}, as `mlx_vlm.convert --mtp` writes "
                         f"it): the MTP head alone, {report.mtp_layers_found} layer(s), block_size "
                         f"{config.get('block_size', '?')}; used next to its target: `mlx_vlm.generate --model "
                         f"{target} --draft-model {path} --draft-kind mtp`. Usable by: {', '.join(used) or 'none'}. "
                         f"{', '.join(not_used)} read the head from the model folder itself: for them graft it "
                         "there (`mtpconvert add-mtp SOURCE_REPO MODEL_DIR`) or convert the release with "
                         "`mtpconvert convert`")


def _target_beside(path: Path) -> Optional[str]:
    """The target folder mlx_vlm.convert wrote next to ``<out>-mtp``."""
    name = path.resolve().name
    if name.endswith("-mtp"):
        target = path.resolve().parent / name[: -len("-mtp")]
        if (target / "config.json").is_file():
            return str(target)
    return None


def drafter_beside(path: Path) -> Optional[Path]:
    """The drafter folder ``mlx_vlm.convert --mtp`` wrote next to ``path`` (``<path>-mtp``), if any."""
    cand = Path(path).resolve().parent / (Path(path).resolve().name + "-mtp")
    try:
        return cand if is_drafter(json.loads((cand / "config.json").read_text())) else None
    except (OSError, ValueError):
        return None


def source_repo(root: Path) -> str:
    """The release a folder was converted from, where its README says (``base_model:``), else a placeholder."""
    try:
        text = (Path(root) / "README.md").read_text(encoding="utf-8", errors="replace")[:4000]
    except OSError:
        return "SOURCE_REPO"
    m = re.search(r"^base_model:\s*(?:\n\s*-\s*)?([\w.-]+/[\w.-]+)\s*$", text, re.M)
    return m.group(1) if m else "SOURCE_REPO"


def missing_head_message(root: Path, count_key: str, layers: int) -> str:
    """What a folder whose config declares MTP layers (under ``count_key``) but holds no head lacks, for which
    runtime, and the fix."""
    msg = (f"config.json says {count_key}={layers} but the folder has no mtp.* weights (mlx_lm.convert "
           "and mlx_vlm.convert drop them): no MTP runtime can draft with it, and the mlx-lm PR #990 branch refuses "
           f"to load it. Graft the head: `mtpconvert add-mtp {source_repo(root)} {root}`; or re-convert with "
           f"mtpconvert, or set {count_key} to 0")
    drafter = drafter_beside(root)
    if drafter is not None:
        msg += (f". A drafter folder from `mlx_vlm.convert --mtp` is beside it: mlx-vlm alone can use the pair "
                f"(`--model {root} --draft-model {drafter} --draft-kind mtp`)")
    return msg


def runtime_gaps(report) -> None:
    """One finding listing the runtimes whose table row cannot use a head the folder has, and why."""
    if report.layout != "mlx" or report.mtp_layout in ("none", "drafter", "unknown") \
            or report.mtp_layout.startswith("mixed:"):  # a raw release is a source to convert, not to run
        return
    gaps = [row for row in report.runtimes if row.head_usable.ok is False and not row.runtime.startswith("mlx-lm")]
    if not any(row.runtime in MAIN_RUNTIMES and (row in gaps or row.backbone_exact.ok is False)
               for row in report.runtimes):
        return
    usable = [row.runtime for row in report.runtimes if row.head_usable.ok]
    parts = [f"{row.runtime}: {row.head_usable.reason}" for row in gaps]
    parts += [f"{row.runtime} backbone: {row.backbone_exact.reason}" for row in report.runtimes
              if row.backbone_exact.ok is False and row.runtime in MAIN_RUNTIMES]
    report.add("runtime-gaps", INFO, f"head layout {report.mtp_layout}; its head is used by "
               f"{', '.join(usable) or 'no runtime'}; not by " + "; ".join(parts)
               + ". `mtpconvert convert` (or `add-mtp` onto the head-less folder) writes the layout every runtime "
               "here reads (see docs/interop.md)", file=report.path)
