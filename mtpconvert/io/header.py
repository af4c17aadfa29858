"""The safetensors header, parsed without trusting it.

Only the JSON header is read, and every claim in it (header length, dtypes, shapes
against byte counts, offsets inside the file and not overlapping) is checked before
any tensor byte is touched: readers (``reader``) and the plan work from what this
module returns.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import SafetensorsError
from .files import special_file

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
    # FP8 weights and their E8M0 (power-of-two) scales are read as their raw bytes; the plan dequantizes them
    # (or carries them into MLX's mx formats) with their scales (plan.fp8)
    "F8_E4M3": (np.dtype("u1"), mx.uint8, 1),
    "F8_E8M0": (np.dtype("u1"), mx.uint8, 1),
}
FP8_E4M3 = "F8_E4M3"

MLX_TO_ST = {v[1]: k for k, v in DTYPES.items() if k not in (FP8_E4M3, "F8_E8M0")}

# The writer starts the kernel's writeback after this many bytes, overlapping disk writes with compute.
WRITEBACK_BYTES = 256 << 20

# dtypes we recognise but cannot convert; named in the error.
UNSUPPORTED_DTYPES = {"F8_E5M2", "F4", "F6_E2M3", "F6_E3M2", "C64"}


def dtype_itemsize(st_dtype: str) -> int:
    return DTYPES[st_dtype][2]


def mlx_dtype_name(st_dtype: str) -> str:
    """'BF16' -> 'bfloat16' (the names used in config files and plans)."""
    if st_dtype == FP8_E4M3:
        return "float8_e4m3fn"
    if st_dtype == "F8_E8M0":
        return "float8_e8m0fnu"
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
        if kind := special_file(path):
            raise SafetensorsError(f"is {kind}, not a regular safetensors file", file=path)
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
            f"dtype {dtype} is not supported (F8_E4M3 weights with their scales and MXFP4 weights packed in I8 "
            "with F8_E8M0 scales are read; other FP4/FP6 checkpoints must be converted from their BF16 or FP8 "
            "release)",
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
