"""The folder as the rules see it, and the facts every runtime contract asks of it.

A :class:`Folder` is a snapshot of ``config.json``, the index, every safetensors *header* at the root
and under ``mtp/``, and the manifests next to the head files; it is read from disk
(:func:`read_folder`) or from a conversion plan (:func:`planned_folder`), never from tensor data.
The helpers below answer what the contracts share: which files a glob finds, which keys they hold,
where the head sits (:func:`layout_of`), and the verdicts every contract gives alike.
"""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import LayoutError
from ..io.files import contained, contained_glob, special_file
from ..io.head_files import sidecar_prefixes
from ..plan.head import MTP_DRAFTER_CONFIG
from .report import Verdict

MAX_HEADER = 100 * 1024 * 1024  # a safetensors header is JSON; refuse absurd lengths
BARE_HEAD_STARTS = ("fc.", "pre_fc_norm", "layers.", "norm.")  # head keys with no prefix at all
SIDECAR = "mtp.safetensors"
SIDECAR_LINK = "mtp/weights.safetensors"
MODEL_MTP = "model-mtp.safetensors"


@dataclass
class Folder:
    """What the rules look at. ``headers`` maps a path relative to the folder (``model-00001-of-
    00002.safetensors``, ``mtp.safetensors``, ``mtp/weights.safetensors``) to its parsed header
    (tensor name -> {dtype, shape, data_offsets}, plus ``__metadata__``)."""

    config: dict
    headers: Dict[str, dict]
    index: Optional[dict] = None
    manifests: Dict[str, dict] = field(default_factory=dict)  # e.g. {"mtp/manifest.json": {...}}
    path: str = ""
    drafter_config: Optional[dict] = None  # mtp/config.json: what makes mtp/ a drafter folder


# --------------------------------------------------------------------------- reading (I/O)


class UnreadableFile(ValueError):
    """A file the runtimes would read that is not what it should be; ``file`` names it."""

    def __init__(self, file: Path, message: str):
        super().__init__(f"{file}: {message}")
        self.file = str(file)
        self.detail = message


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file: 8-byte little-endian length, then JSON."""
    if kind := special_file(path):
        raise UnreadableFile(path, f"is {kind}, not a regular safetensors file")
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UnreadableFile(path, "not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise UnreadableFile(path, f"header length {n} is not plausible")
        data = f.read(n)
        if len(data) != n:
            raise UnreadableFile(path, "truncated header")
    try:
        header = json.loads(data)
    except ValueError as e:
        raise UnreadableFile(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise UnreadableFile(path, "header is not a JSON object")
    return header


# vllm-mlx reads the manifest next to its head file; mtplx reads mtplx_runtime.json at the root
MANIFESTS = ("manifest.json", "mtp/manifest.json", "mtplx_runtime.json")
DRAFTER_CONFIG = MTP_DRAFTER_CONFIG


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError:
        return {"__unreadable__": True}
    return value if isinstance(value, dict) else {"__unreadable__": True}


def read_folder(path: Path) -> Folder:
    """The folder's config, index, manifests and the headers of every root and ``mtp/`` safetensors file
    (and the file config.json names as the MTP file), each checked by the folder rule
    (``io.files.contained``) before it is opened: a FIFO, or a link out of the folder, raises ``LayoutError``."""
    path = Path(path)
    config = json.loads(contained(path, "config.json").read_text())
    for where in (config, config.get("text_config")):
        if isinstance(where, dict) and where.get("quantization") is not None \
                and not isinstance(where["quantization"], dict):
            raise LayoutError(f"the quantization block must be a JSON object, not {where['quantization']!r}",
                              file=path / "config.json", key="quantization", code="quant-config-invalid")
    files = contained_glob(path, "*.safetensors") + contained_glob(path, "mtp/*.safetensors")
    named = _named_mtp_file(config)
    if named and os.path.lexists(path / named):
        f = contained(path, named, "the MTP file named by config.json (mlx_lm_extra_tensors.mtp_file)",
                      file=path / "config.json")
        if f not in files:
            files.append(f)
    headers = {f.relative_to(path).as_posix(): read_header(f) for f in files}  # keep link names
    index = None
    if os.path.lexists(path / "model.safetensors.index.json"):
        index = json.loads(contained(path, "model.safetensors.index.json").read_text())
    manifests = {m: _read_json(contained(path, m)) for m in MANIFESTS if os.path.lexists(path / m)}
    drafter = _read_json(contained(path, DRAFTER_CONFIG)) if os.path.lexists(path / DRAFTER_CONFIG) else None
    return Folder(config=config, headers=headers, index=index, manifests=manifests, path=str(path),
                  drafter_config=drafter)


def planned_folder(plan) -> Folder:
    """The folder ``plan`` will write, as the rules see it (headers from the plan's output specs):
    the compat table of a conversion before any data is read."""
    from ..execute.run import index_json, shard_order
    from ..io.checkpoint import MTP_FILE
    from ..io.shard_writer import shard_header
    from ..plan.head import MTP_LINK, MTP_MANIFEST, MTP_MANIFEST_BODY

    headers = {shard: shard_header([spec for item in items for spec in item.outputs()], {"format": "mlx"})
               for shard, items in shard_order(plan).items()}
    manifests, drafter = {}, None
    if MTP_FILE in headers:
        headers[MTP_LINK] = headers[MTP_FILE]
        manifests[MTP_MANIFEST] = dict(MTP_MANIFEST_BODY)
        drafter = plan.config
    return Folder(config=plan.config, headers=headers, index=index_json(plan), manifests=manifests, path="(planned)",
                  drafter_config=drafter)


# --------------------------------------------------------------------------- folder facts


def _tensors(header: dict) -> Dict[str, dict]:
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _metadata(header: dict) -> dict:
    m = header.get("__metadata__")
    return m if isinstance(m, dict) else {}


def _text(config: dict) -> dict:
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def _mtp_layers(config: dict) -> int:
    tc = _text(config)
    return int(tc.get("mtp_num_hidden_layers") or tc.get("num_nextn_predict_layers")
               or config.get("num_nextn_predict_layers") or 0)


def _is_drafter(config: dict) -> bool:
    """mlx-vlm's head-only drafter folder (``mlx_vlm.convert --mtp``) of some family's head."""
    from ..families import drafter_family

    return drafter_family(config) is not None


def _named_mtp_file(config: dict) -> Optional[str]:
    extra = config.get("mlx_lm_extra_tensors")
    named = extra.get("mtp_file") if isinstance(extra, dict) else None
    return named if isinstance(named, str) and named else None


def _root(folder: Folder) -> List[str]:
    return [n for n in folder.headers if "/" not in n]


def _glob_model(folder: Folder) -> List[str]:
    """The files mlx-lm's ``load_model`` reads: ``glob(model_path / "model*.safetensors")``."""
    return sorted(n for n in _root(folder) if fnmatch.fnmatchcase(n, "model*.safetensors"))


def _backbone_shards(folder: Folder) -> List[str]:
    """The model shards proper: the glob less the head-only ``model-mtp.safetensors``."""
    return [n for n in _glob_model(folder) if n != MODEL_MTP]


def _keys_with(folder: Folder, files: List[str], pred: Callable[[str], bool]) -> List[Tuple[str, str]]:
    return [(f, k) for f in files for k in _tensors(folder.headers[f]) if pred(k)]


def fp8_files(folder: Folder) -> List[str]:
    """The files holding block-FP8 weights (F8_E4M3 beside a ``weight_scale_inv``): a release to convert,
    whatever the files are named (a raw FP8 release has its own root ``mtp.safetensors``)."""
    return [f for f, header in folder.headers.items()
            if any(v.get("dtype") == "F8_E4M3" for v in _tensors(header).values())]


def _conv_raw(folder: Folder, files: List[str]) -> bool:
    """A raw (PyTorch-layout) checkpoint: some ``conv1d.weight`` is ``[C, 1, K]`` with K > 1."""
    for f in files:
        for k, v in _tensors(folder.headers[f]).items():
            if "conv1d.weight" in k and (v.get("shape") or [1])[-1] != 1:
                return True
    return False


def _is_bare_head_key(key: str) -> bool:
    return key.startswith(BARE_HEAD_STARTS)


def _has_bare_head(folder: Folder, file: str) -> bool:
    return any(_is_bare_head_key(k) for k in _tensors(folder.headers.get(file, {})))


def _is_moe(config: dict) -> bool:
    return int(_text(config).get("num_experts", 0) or 0) > 0


def _files_str(files: List[str]) -> str:
    return ", ".join(files[:3]) + (f" (+{len(files) - 3})" if len(files) > 3 else "")


# --------------------------------------------------------------------------- layout


def _places(folder: Folder) -> List[str]:
    """Where head tensors sit: ``in-model`` (keys with ``mtp.`` in the model shards) and each
    other file holding head keys (prefixed or bare)."""
    places = ["in-model"] if _keys_with(folder, _backbone_shards(folder), lambda k: "mtp." in k) else []
    shards = set(_backbone_shards(folder))
    # a family may name its sidecar's keys otherwise (Family.sidecar_prefix: GLM-5.3-Flash's nextn layer)
    own = tuple(p for p in sidecar_prefixes(folder.config) if "mtp." not in p)
    for name in sorted(folder.headers):
        keys = _tensors(folder.headers[name])
        if name not in shards and any("mtp." in k or _is_bare_head_key(k) or k.startswith(own) for k in keys):
            places.append(name)
    return places


def layout_of(folder: Folder) -> str:
    """``sidecar``: the head in root mtp.safetensors (with or without the same header again at
    mtp/weights.safetensors); ``sidecar:<file>``: one other head file; ``in-model``; ``drafter``
    (mlx-vlm's drafter folder); ``none``; ``mixed:<a>+<b>``: the head in more than one place."""
    if _is_drafter(folder.config):
        return "drafter"
    places = _places(folder)
    primary = _named_mtp_file(folder.config) or SIDECAR
    for alias in (SIDECAR_LINK, SIDECAR):  # the link vllm-mlx reads, the root name config does not give
        if alias != primary and primary in places and alias in places \
                and folder.headers[primary] == folder.headers[alias]:
            places.remove(alias)  # one head, two names (verify checks the bytes: locate.head_problems)
    if not places:
        return "none"
    if len(places) > 1:
        return "mixed:" + "+".join(places)
    if places == ["in-model"]:
        return "in-model"
    return "sidecar" if places == [SIDECAR] else "sidecar:" + places[0]


# --------------------------------------------------------------------------- shared verdicts

NO_BACKBONE = Verdict(None, "drafter folder (mlx-vlm's head-only folder): the head only, no backbone")


def _no_head(layout: str) -> Optional[Verdict]:
    if layout == "none":
        return Verdict(False, "the folder has no MTP tensors")
    return None


def _drafter_head(runtime: str) -> Verdict:
    return Verdict(False, f"drafter folder (mlx-vlm's head-only folder): {runtime} reads the head from the model "
                          "folder it serves, not from a separate drafter")


def _no_mtp_layers(folder: Folder) -> Optional[Verdict]:
    if _mtp_layers(folder.config) == 0:
        return Verdict(False, "config declares no MTP layers (mtp_num_hidden_layers is 0): nothing is injected")
    return None
