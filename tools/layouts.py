"""The published Qwen3.5/3.6 layouts vendored in tests/data/layouts: config and tensor table (no data).

Each folder holds ``config.json`` (or ``config.reconstructed.json``) and ``tensors.tsv.gz``
(key, shape, dtype, shard per line), copied from the steering repo's shared/layouts with
their provenance in SOURCE.md. Tests plan every layout from them; benchmarks/synth.py makes
synthetic checkpoints of their shapes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator, List, Tuple

LAYOUTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "layouts"


def models(root: Path = LAYOUTS) -> List[str]:
    return sorted(p.parent.name for p in root.glob("*/tensors.tsv*"))


def config(name: str, root: Path = LAYOUTS) -> dict:
    folder = root / name
    path = folder / "config.json" if (folder / "config.json").exists() else folder / "config.reconstructed.json"
    return json.loads(path.read_text())


def rows(name: str, root: Path = LAYOUTS) -> Iterator[Tuple[str, Tuple[int, ...], str, str]]:
    """(key, shape, dtype, shard) of every tensor in the table."""
    folder = root / name
    plain = folder / "tensors.tsv"
    text = plain.read_text() if plain.exists() else gzip.decompress((folder / "tensors.tsv.gz").read_bytes()).decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, shape, dtype, shard = line.split("\t")
            yield key, tuple(json.loads(shape)), dtype, shard
