"""Read and write safetensors files without trusting them.

The reader parses only the JSON header and checks every claim in it (header length,
dtypes, shapes against byte counts, offsets inside the file and not overlapping)
before any tensor byte is touched. Tensors are then read one at a time through a
memory map, so a caller holds only what it is working on.

The writer is the mirror image: the header is computed up front from the planned
tensor specs, then tensor bytes are appended in order as they are produced, so a
shard never has to sit in memory whole.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .errors import SafetensorsError

# Largest header we accept. Real checkpoints with ~80k tensors (Qwen3-Next) have
# headers of a few MB; anything near this is hostile or broken.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> (numpy dtype used for the raw bytes, mlx dtype, itemsize)
DTYPES: Dict[str, Tuple[np.dtype, mx.Dtype, int]] = {
    "F64": (np.dtype("<f8"), mx.float64, 8),
    "F32": (np.dtype("<f4"), mx.float32, 4),
    "F16": (np.dtype("<f2"), mx.float16, 2),
    "BF16": (np.dtype("<u2"), mx.bfloat16, 2),
    "I64": (np.dtype("<i8"), mx.int64, 8),
    "I32": (np.dtype("<i4"), mx.int32, 4),
    "I16": (np.dtype("<i2"), mx.int16, 2),
    "I8": (np.dtype("i1"), mx.int8, 1),
    "U64": (np.dtype("<u8"), mx.uint64, 8),
    "U32": (np.dtype("<u4"), mx.uint32, 4),
    "U16": (np.dtype("<u2"), mx.uint16, 2),
    "U8": (np.dtype("u1"), mx.uint8, 1),
    "BOOL": (np.dtype("?"), mx.bool_, 1),
}

MLX_TO_ST = {v[1]: k for k, v in DTYPES.items()}

# The writer starts the kernel's writeback after this many bytes, overlapping disk writes with compute.
WRITEBACK_BYTES = 256 << 20

# dtypes we recognise but cannot convert; named in the error.
UNSUPPORTED_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}


def dtype_itemsize(st_dtype: str) -> int:
    return DTYPES[st_dtype][2]


def mlx_dtype_name(st_dtype: str) -> str:
    """'BF16' -> 'bfloat16' (the names used in config files and plans)."""
    return str(DTYPES[st_dtype][1]).replace("mlx.core.", "")


def st_dtype_of(dtype_name: str) -> str:
    """'bfloat16' -> 'BF16'."""
    return MLX_TO_ST[getattr(mx, dtype_name)]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range inside ``file``."""

    key: str
    dtype: str
    shape: Tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    file: Path
    tensors: Dict[str, TensorInfo]
    metadata: Dict[str, str]
    data_start: int
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and validate the header of one safetensors file (no tensor data read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(
                    f"file is {size} bytes, too short to be safetensors", file=path
                )
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES:
                raise SafetensorsError(
                    f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit",
                    file=path,
                )
            if 8 + header_len > size:
                raise SafetensorsError(
                    f"header length {header_len} runs past the end of the file "
                    f"({size} bytes): truncated or not safetensors",
                    file=path,
                )
            raw = f.read(header_len)
    except OSError as e:
        raise SafetensorsError(f"cannot read: {e.strerror}", file=path) from e
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"header is not valid JSON ({e})", file=path) from e
    if not isinstance(obj, dict):
        raise SafetensorsError("header is not a JSON object", file=path)

    data_start = 8 + header_len
    data_len = size - data_start
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError("__metadata__ must map strings to strings", file=path)

    tensors: Dict[str, TensorInfo] = {}
    for key, entry in obj.items():
        tensors[key] = _tensor_info(path, key, entry, data_start, data_len)

    spans = sorted((t.start, t.end, t.key) for t in tensors.values() if t.end > t.start)
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SafetensorsError(
                f"byte ranges of {k0!r} and {k1!r} overlap", file=path, key=k1
            )
    return Header(path, tensors, dict(metadata), data_start, size)


def _tensor_info(path: Path, key: str, entry, data_start: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError("tensor entry is not an object", file=path, key=key)
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise SafetensorsError(f"dtype {dtype!r} is not a string", file=path, key=key)
    if dtype in UNSUPPORTED_DTYPES:
        raise SafetensorsError(
            f"dtype {dtype} is not supported (FP8/FP4 checkpoints must be converted "
            "from their BF16 release)",
            file=path,
            key=key,
        )
    if dtype not in DTYPES:
        raise SafetensorsError(f"unknown dtype {dtype!r}", file=path, key=key)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise SafetensorsError(f"invalid shape {shape!r}", file=path, key=key)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise SafetensorsError(f"invalid data_offsets {offsets!r}", file=path, key=key)
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise SafetensorsError(
            f"data_offsets {offsets} fall outside the {data_len}-byte data section",
            file=path,
            key=key,
        )
    expected = math.prod(shape) * DTYPES[dtype][2]
    if end - begin != expected:
        raise SafetensorsError(
            f"{dtype}{shape} needs {expected} bytes but data_offsets span {end - begin}",
            file=path,
            key=key,
        )
    return TensorInfo(key, dtype, tuple(shape), path, data_start + begin, data_start + end)


def leading_rows(shape: Sequence[int]) -> int:
    """Rows along the leading axis, the unit of block reads and writes (a scalar is one row)."""
    return shape[0] if shape else 1


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
    deleted there).
    """

    def __init__(self, on_open: Optional[Callable[[Path], None]] = None,
                 on_release: Optional[Callable[[Path], None]] = None):
        self._maps: Dict[Path, Tuple[object, mmap.mmap]] = {}
        self._on_open, self._on_release = on_open, on_release

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
        header = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        offsets = {}
        for spec in specs:
            header[spec.key] = {
                "dtype": st_dtype_of(spec.dtype),
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offsets[spec.key] = offset
            offset += spec.nbytes
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
        self.size = data_start + offset

    def write(self, key: str, arr: mx.array, row: int = 0) -> None:
        """Write ``arr`` as rows ``row:row + len(arr)`` of ``key`` (the whole tensor by default)."""
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
        self._hashes[key].update(data)
        self._next_row[key] = row + n
        self._unsynced += len(data)
        if self._unsynced >= WRITEBACK_BYTES:
            self._start_writeback()

    def _start_writeback(self) -> None:
        """Start writing dirty pages to disk now (async), so the fsync at close has little left."""
        self._unsynced = 0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

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
            os.ftruncate(self._file.fileno(), self.size)  # exact length even if the last tensor is empty
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
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


def read_all(path: Path) -> Dict[str, mx.array]:
    """Load every tensor of a (validated) file; for tests and small files only."""
    header = read_header(path)
    with TensorReader() as reader:
        return {k: reader.read(t) for k, t in header.tensors.items()}


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
