"""Sparse mirrors of Hub shards: each shard's header and only the wanted tensors' byte ranges (holes elsewhere)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Dict, Optional

from ..errors import LayoutError
from ..io.header import MAX_HEADER_BYTES, read_header
from .errors import endpoint, hub_error


def fetch_sparse(repo_id: str, sha: str, shards: Dict[str, int], dest: Path, want: Callable[[str], bool],
                 token: Optional[str] = None, on_bytes: Optional[Callable[[int], None]] = None) -> int:
    """Mirror ``shards`` (name -> size) into ``dest`` with only headers and wanted tensors filled in;
    ``on_bytes(n)`` after each wanted tensor's ``n`` bytes arrived."""
    reader = RangeReader(repo_id, sha, token)
    fetched = 0
    try:
        for name, size in shards.items():
            local = dest / name
            with open(local, "wb") as out:
                out.truncate(size)
                prefix = reader.read(name, 0, 8)
                n = int.from_bytes(prefix, "little")
                if len(prefix) < 8 or n > MAX_HEADER_BYTES or 8 + n > size:
                    raise LayoutError(f"bad safetensors header length {n}", file=name)
                out.write(prefix + reader.read(name, 8, 8 + n))
                out.flush()
                fetched += 8 + n
                for key, info in sorted(read_header(local).tensors.items(), key=lambda kv: kv[1].start):
                    if want(key) and info.end > info.start:
                        out.seek(info.start)
                        out.write(reader.read(name, info.start, info.end))
                        fetched += info.end - info.start
                        if on_bytes:
                            on_bytes(info.end - info.start)
    finally:
        reader.close()
    return fetched


class RangeReader:
    """Byte ranges of one commit's files, each an HTTP range request through ``HfFileSystem`` (its
    retries and auth); a thread keeps its own open file per shard."""

    def __init__(self, repo_id: str, sha: str, token: Optional[str] = None):
        from huggingface_hub import HfFileSystem

        self.repo_id, self.sha = repo_id, sha
        self.fs = HfFileSystem(endpoint=endpoint(), token=token)
        self._local = threading.local()

    def read(self, name: str, start: int, end: int) -> bytes:
        files = self._local.__dict__.setdefault("files", {})
        try:
            src = files.get(name)
            if src is None:
                src = files[name] = self.fs.open(f"{self.repo_id}/{name}", "rb", revision=self.sha, block_size=1,
                                                 cache_type="none")
            src.seek(start)
            return src.read(end - start)
        except Exception as e:  # noqa: BLE001 - one clear HubError naming the file
            raise hub_error(e, self.repo_id, name) from e

    def close(self) -> None:
        """Close the calling thread's open files."""
        for src in self._local.__dict__.pop("files", {}).values():
            src.close()
