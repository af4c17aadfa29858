"""Resume records: a shard an interrupted run finished is reused only when its record and bytes check out."""

from __future__ import annotations

import hashlib
import json

from ..io.checkpoint import Checkpoint
from ..io.output_folder import RESUME_DIR, OutputFolder
from ..io.shard_writer import shard_digest
from ..plan import Plan

__all__ = ["RESUME_DIR", "plan_fingerprint", "reusable"]


def plan_fingerprint(plan: Plan, ckpt: Checkpoint) -> str:
    """Identifies what a shard was made from: the full plan plus each source file's size and mtime."""
    h = hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode())
    for f in sorted({t.file for t in ckpt.tensors.values()}):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def reusable(folder: OutputFolder, shard: str, fingerprint: str) -> bool:
    """A shard left by an interrupted run is reused only if its record and its bytes check out."""
    record, path = folder.path(RESUME_DIR) / f"{shard}.json", folder.path(shard)
    try:
        done = json.loads(record.read_text())
        return (done.get("fingerprint") == fingerprint and path.stat().st_size == done.get("size")
                and shard_digest(path) == done.get("sha256"))
    except (OSError, ValueError, AttributeError):
        return False
