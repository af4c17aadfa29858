"""Write safetensors shards whose header is fixed before any data arrives.

The header is computed up front from the planned tensor specs, then tensor bytes arrive
in row blocks written at their own offsets, so a shard never sits in memory whole. Each
tensor is hashed as it is written, so a finished shard's digest needs no read-back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import SafetensorsError
from .header import WRITEBACK_BYTES, dtype_itemsize, leading_rows, read_header, st_dtype_of


class BF16Bits(np.ndarray):
    """A numpy uint16 array that holds bfloat16 values (numpy has no bfloat16), so that the
    writer checks it against a planned bfloat16 tensor."""


def array_dtype_name(arr) -> str:
    """'bfloat16', 'uint32', ... for an mlx array, a numpy array, or ``BF16Bits``."""
    if isinstance(arr, BF16Bits):
        return "bfloat16"
    if isinstance(arr, np.ndarray):
        return arr.dtype.name
    return str(arr.dtype).replace("mlx.core.", "")


def array_bytes(arr) -> memoryview:
    """Row-major bytes of an mlx or numpy array (bf16 goes through a uint16 view)."""
    if isinstance(arr, np.ndarray):
        return memoryview(np.ascontiguousarray(arr.view(np.ndarray))).cast("B")
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.array(arr, copy=False))).cast("B")


@dataclass(frozen=True)
class TensorSpec:
    """What the writer will receive for one key: dtype name ('bfloat16') and shape."""

    key: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(st_dtype_of(self.dtype))


class _Flusher:
    """Writes a file's dirty pages back to disk on its own thread while the file is still being
    written: ``kick`` after each stretch of writes, and a pass of ``fdatasync`` (then dropping
    the now clean pages from the cache) starts unless one is running, which then runs again.
    The disk stays busy from the first stretch on, the thread that writes never waits for it,
    and the fsync at close finds little left. An error is raised by ``stop``."""

    def __init__(self, fd: int):
        self._fd, self._stopping, self.error = fd, False, None
        self._kicked = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-flush", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._kicked.set()

    def _run(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)
        while True:
            self._kicked.wait()
            self._kicked.clear()
            if self._stopping:
                return
            try:
                sync(self._fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                self.error = e
                return

    def stop(self) -> None:
        """Wait for the pass under way (the file must stay open until then); re-raise its error."""
        self._stopping = True
        self._kicked.set()
        self._thread.join()
        if self.error is not None:
            raise self.error


def shard_header(specs: Sequence[TensorSpec], metadata: Optional[Dict[str, str]] = None) -> dict:
    """The safetensors header of a shard holding ``specs`` in this order (data offsets from 0)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.key] = {"dtype": st_dtype_of(spec.dtype), "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    return header


class StreamingShardWriter:
    """Writes one safetensors file whose header is fixed before any data arrives.

    Every tensor's byte range is known from the header, so data may arrive in row blocks
    (leading-axis slices) written at their own offsets: a tensor never has to be in memory
    whole. Each tensor's rows must arrive in order with exactly the declared dtype and
    trailing shape; ``close`` refuses to finish a file with any row missing.
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: Optional[Dict[str, str]] = None):
        self.path = Path(path)
        self.specs = {spec.key: spec for spec in specs}
        header = shard_header(specs, metadata)
        offsets = {k: t["data_offsets"][0] for k, t in header.items() if k != "__metadata__"}
        offset = sum(spec.nbytes for spec in specs)
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._header = len(raw).to_bytes(8, "little") + raw
        self._file = open(self.path, "wb")
        self._file.write(self._header)
        self._file.flush()
        data_start = len(self._header)
        self._offset = {k: data_start + o for k, o in offsets.items()}
        self._next_row = {k: 0 for k in self.specs}
        self._hashes = {k: hashlib.sha256() for k in self.specs}  # rows arrive in order per tensor
        self._unsynced = 0
        self._flusher = _Flusher(self._file.fileno())
        self.size = data_start + offset

    def write(self, key: str, arr: mx.array, row: int = 0, hash: bool = True) -> memoryview:
        """Write ``arr`` as rows ``row:row + len(arr)`` of ``key`` (the whole tensor by default).

        ``hash=False`` leaves the digest to ``hash_rows``, called with the bytes this returns,
        each tensor's in the order written (on another thread: sha256 and pwrite overlap)."""
        spec = self.specs.get(key)
        if spec is None:
            raise RuntimeError(f"{self.path.name}: unexpected tensor {key}")
        dtype = array_dtype_name(arr)
        shape = tuple(arr.shape)
        whole = row == 0 and shape == spec.shape
        if dtype != spec.dtype or not (whole or (spec.shape and shape[1:] == spec.shape[1:] and len(shape) == len(spec.shape))):
            raise RuntimeError(
                f"{self.path.name}: {key} planned as {spec.dtype}{list(spec.shape)}, "
                f"produced {dtype}{list(shape)}" + (f" at row {row}" if row else "")
            )
        n, rows = leading_rows(shape), leading_rows(spec.shape)
        if row != self._next_row[key] or row + n > rows:
            raise RuntimeError(
                f"{self.path.name}: {key} rows {row}:{row + n} out of order "
                f"(next expected row {self._next_row[key]} of {rows})"
            )
        position = self._offset[key] + (spec.nbytes // rows) * row if rows else self._offset[key]
        data = array_bytes(arr)
        done = 0
        while done < len(data):
            done += os.pwrite(self._file.fileno(), data[done:], position + done)
        if hash:
            self._hashes[key].update(data)
        self._next_row[key] = row + n
        self._unsynced += len(data)
        if self._unsynced >= WRITEBACK_BYTES:
            self._start_writeback()
        return data

    def hash_rows(self, key: str, data: memoryview) -> None:
        """Add bytes that ``write(..., hash=False)`` returned to ``key``'s digest (each
        tensor's rows in order)."""
        self._hashes[key].update(data)

    def _start_writeback(self) -> None:
        """Have the flusher write what is dirty back to disk now, while writing goes on."""
        self._unsynced = 0
        self._flusher.kick()

    def digest(self) -> str:
        """sha256 of the file in ``shard_digest``'s form, computed from the bytes as written."""
        return _combine(self._header, (self._hashes[k] for k in self.specs))

    @property
    def complete(self) -> bool:
        return all(self._next_row[k] == leading_rows(s.shape) for k, s in self.specs.items())

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            if not self.complete:
                missing = next(k for k, s in self.specs.items() if self._next_row[k] != leading_rows(s.shape))
                raise RuntimeError(f"{self.path.name}: closed before {missing} was written")
            self._flusher.stop()
            os.ftruncate(self._file.fileno(), self.size)  # exact length even if the last tensor is empty
            os.fsync(self._file.fileno())
        finally:
            self.abort()

    def abort(self) -> None:
        try:
            self._flusher.stop()
        except OSError:
            pass  # the write's own error is the one to report
        self._file.close()


def _combine(header: bytes, tensor_hashes) -> str:
    h = hashlib.sha256(header)
    for t in tensor_hashes:
        h.update(t.digest())
    return h.hexdigest()


def shard_digest(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 over the header and each tensor's own sha256, in file order.

    The same value ``StreamingShardWriter.digest`` computes while writing row blocks
    out of file order, so a finished shard is hashed without being read back.
    """
    header = read_header(path)
    with open(path, "rb") as f:
        prefix = f.read(header.data_start)
        hashes = []
        for t in sorted(header.tensors.values(), key=lambda t: (t.start, t.end)):
            h = hashlib.sha256()
            f.seek(t.start)
            left = t.nbytes
            while left:
                block = f.read(min(chunk, left))
                if not block:
                    raise SafetensorsError("file ends inside a tensor", file=path, key=t.key)
                h.update(block)
                left -= len(block)
            hashes.append(h)
    return _combine(prefix, hashes)


def write_all(path: Path, tensors: Dict[str, mx.array], metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a whole dict at once (small files: fixtures, tests)."""
    specs = [TensorSpec(k, str(v.dtype).replace("mlx.core.", ""), tuple(v.shape)) for k, v in tensors.items()]
    w = StreamingShardWriter(path, specs, metadata)
    try:
        for k, v in tensors.items():
            w.write(k, v)
        w.close()
    except BaseException:
        w.abort()
        raise
