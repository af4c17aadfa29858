"""Read individual tensors (or row ranges of them) through a memory map.

A caller holds only what it is working on; pages of a finished tensor are dropped so
they stop counting toward RSS.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import SafetensorsError
from .header import DTYPES, TensorInfo, leading_rows, read_header


def _advise(mm: mmap.mmap, advice_name: str, start: int, end: int) -> None:
    """madvise a byte range of a mapping, where the platform has that advice (a hint: errors ignored)."""
    advice = getattr(mmap, advice_name, None)
    if advice is None or not hasattr(mm, "madvise") or end <= start:
        return
    lo = start - start % mmap.PAGESIZE
    try:
        mm.madvise(advice, lo, end - lo)
    except (OSError, ValueError):
        pass


def _drop_pages(mm: mmap.mmap, start: int, end: int) -> None:
    """Tell the kernel we are done with a tensor's file pages, so they stop counting toward RSS.

    Without this a tensor is resident twice while it is transformed (page cache mapping + array).
    """
    _advise(mm, "MADV_DONTNEED", start, end)


class TensorReader:
    """Reads individual tensors by memory-mapping their files on first use.

    ``on_open(file)`` runs before a file is first mapped (a streamed shard is fetched
    there) and ``on_release(file)`` after it is unmapped for good (a streamed shard is
    deleted there). ``admits(file)`` says whether opening ``file`` now stays within the
    stream's budget of raw shards (False: finish what is in flight first, so that the
    shards it reads are released).
    """

    def __init__(self, on_open: Optional[Callable[[Path], None]] = None,
                 on_release: Optional[Callable[[Path], None]] = None,
                 admits: Optional[Callable[[Path], bool]] = None):
        self._maps: Dict[Path, Tuple[object, mmap.mmap]] = {}
        self._on_open, self._on_release, self._admits = on_open, on_release, admits

    def admits(self, file: Path) -> bool:
        return file in self._maps or self._admits is None or self._admits(file)

    def read(self, info: TensorInfo) -> mx.array:
        return self.read_rows(info, 0, leading_rows(info.shape))

    def read_rows(self, info: TensorInfo, start: int, stop: int,
                  part: Optional[Tuple[int, int]] = None) -> mx.array:
        """Rows ``start:stop`` of the tensor's leading axis (the whole tensor for a scalar).

        Only those rows' bytes are copied out of the mapping, and their pages are dropped
        right after, so reading a large tensor a block at a time keeps one block resident.
        ``part=(i, n)`` keeps the i-th of n equal slices of axis 1 (one half of a fused
        gate_up), gathered on the numpy side where a strided copy is cheap.
        """
        _, mx_dtype, _ = DTYPES[info.dtype]
        buf = self.view_rows(info, start, stop)
        if buf.size == 0:
            return mx.zeros(buf.shape, dtype=mx_dtype)
        if part is not None:
            i, n = part
            shape = buf.shape
            if len(shape) < 2 or shape[1] % n:
                raise ValueError(f"{info.key}: axis 1 of {list(info.shape)} does not split in {n}")
            buf = np.ascontiguousarray(buf.reshape(shape[0], n, shape[1] // n, *shape[2:])[:, i])
        arr = mx.array(buf)  # a copy: the mapped pages are no longer needed
        del buf
        self.drop_rows(info, start, stop)
        if info.dtype == "BF16":
            arr = arr.view(mx.bfloat16)
        return arr

    def view_rows(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as a numpy view of the mapped file (bfloat16 as its uint16 bits):
        every read of the main thread goes through here (``read_rows`` copies it, then calls
        ``drop_rows``; a file with views alive cannot be unmapped). The next rows of the
        tensor are read ahead from disk meanwhile.
        """
        np_dtype, _, _ = DTYPES[info.dtype]
        rows = leading_rows(info.shape)
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"{info.key}: rows {start}:{stop} outside {rows}")
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype=np_dtype)
        begin, end = self._byte_range(info, start, stop)
        mm = self.ensure(info)
        _advise(mm, "MADV_WILLNEED", end, min(info.end, 2 * end - begin))
        return np.frombuffer(mm, dtype=np_dtype, count=count, offset=begin).reshape(shape)

    def drop_rows(self, info: TensorInfo, start: int, stop: int) -> None:
        """Done with these rows: their file pages stop counting toward RSS."""
        entry = self._maps.get(info.file)
        if entry is not None and stop > start:
            _drop_pages(entry[1], *self._byte_range(info, start, stop))

    @staticmethod
    def _byte_range(info: TensorInfo, start: int, stop: int) -> Tuple[int, int]:
        row_bytes = info.nbytes // leading_rows(info.shape)
        return info.start + start * row_bytes, info.start + stop * row_bytes

    def fileno(self, info: TensorInfo) -> int:
        """The open file holding the tensor (mapped and checked by ``ensure``), for ``pread_into``."""
        self.ensure(info)
        return self._maps[info.file][0].fileno()

    def ensure(self, info: TensorInfo) -> mmap.mmap:
        """Map the tensor's file (a streamed shard is fetched first) and check the file still
        holds the tensor's bytes; also before a worker process reads them."""
        mm = self._map(info.file)
        if info.end > len(mm):
            raise SafetensorsError(
                "tensor data runs past the end of the file (was it truncated after "
                "the header was read?)",
                file=info.file,
                key=info.key,
            )
        return mm

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            if self._on_open is not None:
                self._on_open(file)
            try:
                f = open(file, "rb")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise SafetensorsError(f"cannot map file: {e}", file=file) from e
            self._maps[file] = (f, mm)
        return self._maps[file][1]

    def release(self, file: Path) -> None:
        """Unmap one file after its last tensor was used (and tell ``on_release``)."""
        self._unmap(file)
        if self._on_release is not None:
            self._on_release(file)

    def _unmap(self, file: Path) -> None:
        entry = self._maps.pop(file, None)
        if entry is not None:
            f, mm = entry
            mm.close()
            f.close()

    def close(self) -> None:
        """Unmap everything; files not released stay as they are (a failed run may resume)."""
        for file in list(self._maps):
            self._unmap(file)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def pread_into(fd: int, offset: int, dest: memoryview) -> None:
    """Read ``len(dest)`` bytes at ``offset`` straight into ``dest`` (no mapping, no page faults
    on the source; the GIL is released while the kernel copies, so threads read in parallel)."""
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            raise SafetensorsError(f"file ends inside a tensor (byte {offset + done})")
        done += n


def read_all(path: Path) -> Dict[str, mx.array]:
    """Load every tensor of a (validated) file; for tests and small files only."""
    header = read_header(path)
    with TensorReader() as reader:
        return {k: reader.read(t) for k, t in header.tensors.items()}

