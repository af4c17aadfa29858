"""Sparse mirrors of Hub shards: each shard's header and only the wanted tensors' byte ranges (holes elsewhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional

from ..errors import LayoutError
from ..io.header import MAX_HEADER_BYTES, read_header
from .errors import endpoint, hub_error


def fetch_sparse(repo_id: str, sha: str, shards: Dict[str, int], dest: Path, want: Callable[[str], bool],
                 token: Optional[str] = None) -> int:
    """Mirror ``shards`` (name -> size) into ``dest`` with only headers and wanted tensors filled in."""
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem(endpoint=endpoint(), token=token)
    fetched = 0
    for name, size in shards.items():
        local = dest / name
        try:
            with fs.open(f"{repo_id}/{name}", "rb", revision=sha, block_size=1, cache_type="none") as src, \
                    open(local, "wb") as out:
                out.truncate(size)
                prefix = src.read(8)
                n = int.from_bytes(prefix, "little")
                if len(prefix) < 8 or n > MAX_HEADER_BYTES or 8 + n > size:
                    raise LayoutError(f"bad safetensors header length {n}", file=name)
                out.write(prefix + src.read(n))
                out.flush()
                fetched += 8 + n
                for key, info in sorted(read_header(local).tensors.items(), key=lambda kv: kv[1].start):
                    if want(key) and info.end > info.start:
                        src.seek(info.start)
                        out.seek(info.start)
                        out.write(src.read(info.end - info.start))
                        fetched += info.end - info.start
        except LayoutError:
            raise
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, repo_id, name) from e
    return fetched
