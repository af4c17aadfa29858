"""Full or layerwise: what a converted folder weighs, by the unit the layerwise check holds at once,
against the memory this process can still use. ``smoke_mode`` is a pure decision the caller feeds
with those measured numbers (``mtpconvert.gate``); headers only, no tensor is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from ...families import family_for
from ...families.base import Family
from ...io.checkpoint import load_json
from ...io.files import contained
from ...io.head_files import SIDECAR_PREFIX
from ...io.header import read_header
from ..decoding.locate import MTP_FILE, shard_files


def weight_files(path: Path) -> List[Path]:
    """Every weight file the full smoke would load: the shards and the MTP sidecar."""
    path = Path(path)
    head = [contained(path, MTP_FILE, "MTP file")] if os.path.lexists(path / MTP_FILE) else []
    return [Path(f) for f in shard_files(path)] + head


def folder_weight_bytes(path: Path) -> int:
    """Bytes of every weight file the full smoke would load (shards and the MTP sidecar)."""
    return sum(os.path.getsize(f) for f in weight_files(path))


def unit_of(key: str, family: Family) -> str:
    """What the check holds a converted tensor of ``family``'s for: ``layer N``, ``mtp`` (the head, in the
    sidecar or in the shards), ``embed_tokens``, ``lm_head``, ``norm`` (the final one) or ``other``."""
    return family.module_paths.unit_of(key, (SIDECAR_PREFIX, family.sidecar_prefix, family.head_prefix))


def folder_family(path: Path) -> Family:
    return family_for(load_json(Path(path) / "config.json", "config.json"))


def stored_bytes_by_unit(path: Path) -> Dict[str, int]:
    """Stored bytes of each unit the layerwise check holds at once (``unit_of``; the final norm
    counts as ``other``; ``mtp`` is the whole head, of which the check holds the first layer). Headers
    only. The check's peak is about the largest layer or head plus ~0.3 GB of activations and runtime."""
    family = folder_family(path)
    units: Dict[str, int] = {}
    for f in weight_files(Path(path)):
        for k, t in read_header(Path(f)).tensors.items():
            unit = unit_of(k, family)
            unit = "other" if unit == "norm" else unit
            units[unit] = units.get(unit, 0) + t.nbytes
    return units


def available_memory_bytes() -> Optional[int]:
    """Memory this process can still use: MemAvailable, capped by a cgroup v2 limit (Linux);
    physical memory elsewhere. None when unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def smoke_mode(weight_bytes: int, available_bytes: Optional[int], *, full_runs_here: bool = True,
               headroom: float = 0.25, reserve_bytes: int = 1 << 30) -> str:
    """"full" when the whole model (plus ``headroom`` of it for the decode's caches and
    temporaries, plus ``reserve_bytes``) fits in ``available_bytes``, else "layerwise".
    ``full_runs_here=False`` (e.g. bf16 MoE experts on mlx's CPU backend) forces "layerwise",
    which can run them in float32 one layer at a time."""
    if not full_runs_here or available_bytes is None:
        return "layerwise"
    return "full" if weight_bytes * (1 + headroom) + reserve_bytes <= available_bytes else "layerwise"
