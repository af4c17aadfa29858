"""A checkpoint folder seen through its headers: config, index, and tensor table.

Nothing here reads tensor data. Shard names come from the index (or a glob when
there is none) and are checked to stay inside the folder before they are opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Dict, List, Optional

from ..errors import ConfigError, LayoutError, SafetensorsError
from .files import contained
from .head_files import MTP_FILE, head_problems, read_named_header
from .header import Header, TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"

# Files copied next to the weights (tokenizer, chat template, generation defaults).
SIDECAR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
VISION_SIDECAR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")

# Weights in these formats are never opened: loading them would run pickle.
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl")


@dataclass
class Checkpoint:
    """Headers of every shard of one folder, plus its config and index."""

    root: Path
    config: dict
    shards: List[str]
    headers: Dict[str, Header]
    tensors: Dict[str, TensorInfo]
    index_map: Optional[Dict[str, str]] = None
    index_metadata: dict = field(default_factory=dict)
    # index entries whose shard the caller left out on purpose (a pull skips a shard holding only
    # tensors the conversion drops): key -> shard. Known to exist, never read: no header, no data.
    absent: Dict[str, str] = field(default_factory=dict)

    def shard_of(self, key: str) -> str:
        return self.tensors[key].file.name

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def load_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``, a file of a checkpoint folder checked by the folder rule before it is
    opened (a FIFO named config.json would block the read)."""
    path = Path(path)
    if os.path.lexists(path):
        contained(path.parent, path.name, what)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"{what} not found", file=path) from e
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e.strerror}", file=path) from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON ({e.msg} at line {e.lineno})", file=path) from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{what} must be a JSON object", file=path)
    return obj


def safe_member(root: Path, name: str, what: str, *, file: Path) -> Path:
    """``root / name`` after the folder rule (``io.files.contained``): a plain relative name resolving inside
    ``root`` or its hub blob store, and a regular file when something is there (``file``: where the
    name came from, named in the error). Whether it exists is the caller's question."""
    return contained(root, name, what, file=file, must_exist=False)


def list_shards(root: Path, index: Optional[dict], absent: Collection[str] = ()) -> List[str]:
    """The shards to read: the index's (less ``absent``, which need not exist), else every *.safetensors."""
    index_path = root / INDEX_NAME
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LayoutError("index has no weight_map", file=index_path)
        names = sorted(set(weight_map.values()), key=str)
        names = [n for n in names if n not in absent]  # never opened
        for n in names:
            safe_member(root, n, "shard", file=index_path)
        for n in names:
            if not (root / n).is_file():
                raise LayoutError(
                    f"index lists shard {n!r}, which is missing", file=index_path, code="shard-missing"
                )
        return names
    names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = (
            "pickle weights (" + ", ".join(pickles[:3]) + ") are never loaded; use a safetensors release"
            if pickles
            else None
        )
        raise LayoutError("no *.safetensors files and no index", file=root, hint=hint)
    for n in names:
        safe_member(root, n, "shard", file=root)
    return names


def head_sidecar(root: Path, config: dict, listed: List[str]) -> Optional[str]:
    """The root MTP sidecar of a converted folder, when the index does not list it: config's
    ``mlx_lm_extra_tensors.mtp_file``, else ``mtp.safetensors``; checked by the folder rule before it is read."""
    extra = config.get("mlx_lm_extra_tensors")
    named = extra.get("mtp_file") if isinstance(extra, dict) else None
    name = named if isinstance(named, str) and named else MTP_FILE
    if name in listed:
        return None
    if named:
        contained(root, name, "the MTP file named by config.json (mlx_lm_extra_tensors.mtp_file)",
                  file=root / "config.json")
        return name
    if not os.path.lexists(root / name):
        return None
    contained(root, name, "MTP file")
    return name


def open_checkpoint(root: Path, absent: Collection[str] = (), *, head_files: bool = True) -> Checkpoint:
    """Read config, index and all shard headers of a local folder.

    ``absent``: shard names a pull deliberately did not fetch (``PullPlan.skipped_shards``). The index's
    entries for them become ``Checkpoint.absent`` instead of a "shard-missing" error, and they are not
    read even when a file of that name is there (a cache snapshot may hold one from an earlier
    ``--keep-vision`` pull): what is converted depends on the pull's choice only. A folder given by the
    user is opened with none, so any shard its index lists must be there.

    ``head_files``: a converted folder's head files must agree (``runtime.decoding.locate.head_problems``)
    or the first disagreement is raised; verify passes False and reports every one as a finding.
    """
    root = Path(root)
    if not root.is_dir():
        raise ConfigError("checkpoint folder does not exist", file=root)
    config = load_json(root / "config.json", "config.json")
    index = load_json(root / INDEX_NAME, "index") if os.path.lexists(root / INDEX_NAME) else None
    absent = frozenset(absent) if index is not None else frozenset()  # without an index every file present is read
    shards = list_shards(root, index, absent)
    unindexed = []
    # every file the index names is a source shard, skipped ones included: a raw FP8 release's own
    # mtp.safetensors left in a cache by an earlier pull is not a converted folder's sidecar
    if index is not None and (sidecar := head_sidecar(root, config, sorted(set(index["weight_map"].values())))):
        unindexed = [sidecar]

    headers: Dict[str, Header] = {}
    tensors: Dict[str, TensorInfo] = {}
    for name in shards + unindexed:
        header = read_named_header(root, name, config) if name in unindexed else read_header(root / name)
        headers[name] = header
        for key, info in header.tensors.items():
            if key in tensors:
                raise SafetensorsError(
                    f"tensor appears in two shards ({tensors[key].file.name} and {name})",
                    file=root / name,
                    key=key,
                    code="duplicate-tensor",
                )
            tensors[key] = info
    if head_files and (unindexed or "mlx_lm_extra_tensors" in config):
        # a converted folder: its head files must agree (one head, every name of the sidecar the same bytes,
        # config's mtp_file / mtp_tensor_count true) before one of them is taken for the head
        problems = head_problems(root, [headers[n] for n in shards], config)[1]
        if problems:
            raise problems[0]

    index_map = None
    absent_keys: Dict[str, str] = {}
    if index is not None:
        index_map = index["weight_map"]
        index_path = root / INDEX_NAME
        for key, shard in index_map.items():
            if shard in absent and key not in tensors:
                absent_keys[key] = shard
                continue
            if key not in tensors:
                raise LayoutError(
                    f"index maps the tensor to {shard}, which does not contain it",
                    file=index_path,
                    key=key,
                    code="index-mismatch",
                )
            if tensors[key].file.name != shard:
                raise LayoutError(
                    f"index maps the tensor to {shard}, but it is in {tensors[key].file.name}",
                    file=index_path,
                    key=key,
                    code="index-mismatch",
                )
        for key, info in tensors.items():
            if key not in index_map and info.file.name not in unindexed:
                raise LayoutError(
                    "shard holds a tensor the index does not list", file=info.file, key=key,
                    code="index-mismatch",
                )
    return Checkpoint(
        root=root,
        config=config,
        shards=shards + unindexed,
        headers=headers,
        tensors=tensors,
        index_map=index_map,
        index_metadata=(index or {}).get("metadata", {}) or {},
        absent=absent_keys,
    )
