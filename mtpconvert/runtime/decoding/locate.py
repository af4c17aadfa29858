"""Where a converted folder keeps its MTP head, from headers alone."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ...families import FAMILIES
from ...io.checkpoint import MTP_FILE
from ...io.header import Header, TensorInfo, read_header
from ...plan.head import SIDECAR_PREFIX

# a head inside the model shards is named by its family's head prefix (language_model.mtp. for Qwen3.5)
IN_MODEL_PREFIXES = tuple(dict.fromkeys(family.head_prefix for family in FAMILIES))
HEAD_PREFIXES = (SIDECAR_PREFIX, *IN_MODEL_PREFIXES)


@dataclass
class HeadTensors:
    """The MTP head's tensors: ``tensors`` maps the head-local name (``fc.weight``,
    ``layers.0.self_attn.q_proj.scales``...) to where it is stored."""

    source: str  # "sidecar" | "in-model"
    prefix: str  # key prefix inside the files
    tensors: Dict[str, TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def locate_mtp(path: Path, headers: Optional[Sequence[Header]] = None) -> Optional[HeadTensors]:
    """Find the MTP head of a converted folder: ``mtp.safetensors`` at the root (``mtp.*`` keys,
    or ``language_model.mtp.*``), else ``language_model.mtp.*`` inside ``model*.safetensors``.
    Headers only; None when there is no head."""
    path = Path(path)
    sidecar = path / MTP_FILE
    if sidecar.is_file():
        header = read_header(sidecar)
        for prefix in HEAD_PREFIXES:
            found = {k[len(prefix):]: t for k, t in header.tensors.items() if k.startswith(prefix)}
            if found:
                return HeadTensors("sidecar", prefix, found)
    headers = headers if headers is not None else [read_header(Path(f)) for f in shard_files(path)]
    for prefix in IN_MODEL_PREFIXES:
        found = {}
        for header in headers:
            found.update({k[len(prefix):]: t for k, t in header.tensors.items() if k.startswith(prefix)})
        if found:
            return HeadTensors("in-model", prefix, found)
    return None


def shard_files(path: Path) -> List[str]:
    return sorted(glob.glob(str(Path(path) / "model*.safetensors")))  # what mlx_lm's load_model reads
