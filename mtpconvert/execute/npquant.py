"""Affine quantization in numpy, byte-identical to MLX's CPU ``mx.quantize`` and faster.

MLX's CPU kernel walks one group at a time with scalar code (~210-330 MB/s of bf16 per core
on the development machine), and it is what bounds a CPU conversion. Here a chunk of groups
is transposed so that groups run along columns, four adjacent values (two for float32) moved
together, and every step (widen, min/max, the scale/bias rule, round, clip, pack) is one
contiguous, vectorised numpy pass over a chunk that stays in L2. The arithmetic is the
kernel's, in its order of float32 operations (``tests/test_npquant.py`` compares bytes with
``mx.quantize`` for every supported dtype, width and group size, edge-case groups included).
A block holding a NaN or an infinity returns ``None``: the caller quantizes it with
``mx.quantize``, whose handling of those values we do not reproduce. Block-FP8 sources are
dequantized here first (``e4m3_table`` times the block scale, the float32 products MLX's path
computes), so an FP8 release quantizes at the speed of a BF16 one. Conversions run it in
one worker process per core (``quantize_file_rows_into``, driven by ``quantpool``): numpy
holds the GIL between passes.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from multiprocessing import shared_memory
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
SOURCE_DTYPES = ("BF16", "F16", "F32", "F8_E4M3")  # read as uint16 / float16 / float32; FP8 dequantized to float32
FP8_BLOCK = 128  # the block-FP8 scale grid (plan.fp8.BLOCK)
TARGET_DTYPES = ("bfloat16", "float16", "float32")  # the dtype the weight is quantized in
CHUNK_ELEMENTS = 1 << 18  # 1 MiB of float32 per pass: stays in a core's L2


def supports(source_dtype: str, target_dtype: str, bits: int, group_size: int, mode: str = "affine") -> bool:
    return (mode == "affine" and bits in BITS and group_size in GROUP_SIZES
            and source_dtype in SOURCE_DTYPES and target_dtype in TARGET_DTYPES)


def e4m3_table() -> np.ndarray:
    """The float32 value of each of the 256 float8_e4m3fn codes (no infinities; 0x7f/0xff are NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 0x7).astype(np.float64)
    normal = (1 + mantissa / 8) * np.exp2(exponent.astype(np.float64) - 7)
    subnormal = (mantissa / 8) * 2.0 ** -6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


def _as_float32_rows(lanes: np.ndarray, source_dtype: str, out: np.ndarray) -> np.ndarray:
    """(S, n) 8-byte lanes of source values -> float32 (S, lanes_per_word * n), exact."""
    if source_dtype == "BF16":
        np.left_shift(lanes.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    elif source_dtype == "F16":
        np.copyto(out, lanes.view(np.float16))
    else:
        np.copyto(out, lanes.view(np.float32))
    return out


def _round_to(x: np.ndarray, target_dtype: str, source_dtype: str) -> None:
    """Round float32 values in place as MLX's ``astype(target)`` would (round to nearest even)."""
    if target_dtype == "float32" or target_dtype == {"BF16": "bfloat16", "F16": "float16"}.get(source_dtype):
        return
    if target_dtype == "float16":
        np.copyto(x, x.astype(np.float16))
    else:  # bfloat16, kept as float32 with the low half cleared
        u = x.view(np.uint32)
        u[...] = _bf16_rounded(u) & np.uint32(0xFFFF0000)


def _store(values: np.ndarray, target_dtype: str) -> np.ndarray:
    """float32 -> the target dtype's bytes (bfloat16 as uint16, rounded to nearest even)."""
    if target_dtype == "float32":
        return values
    if target_dtype == "float16":
        return values.astype(np.float16)
    return (_bf16_rounded(values.view(np.uint32)) >> 16).astype(np.uint16)


def _bf16_rounded(u: np.ndarray) -> np.ndarray:
    """float32 bits rounded to nearest even at bit 16, as MLX converts float32 to bfloat16
    (the bfloat16 value is the top half)."""
    return u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))


def _across_lanes(op, v: np.ndarray, n: int, lanes: int) -> np.ndarray:
    """(lanes * n,) per-lane results -> (n,) per group (strided ufuncs: a length-4 reduce is slow)."""
    v = v.reshape(n, lanes)
    out = op(v[:, 0], v[:, 1])
    for l in range(2, lanes):
        op(out, v[:, l], out=out)
    return out


def _pack(q: np.ndarray, bits: int, lanes: int, out: np.ndarray) -> None:
    """(S, lanes * n) int16 codes, lane-major -> ``out`` (n, group_size * bits / 8) bytes, MLX's packing.

    MLX packs element k of each 32-bit word at bits ``k*bits`` (little-endian): for 4 bits,
    byte j holds elements 2j (low nibble) and 2j+1. A lane's codes are adjacent int16s of
    one 64- or 32-bit word here, so packing is shifts and ors on that word; the transposed
    copy back to row order also truncates it to the packed width.
    """
    if lanes == 4:
        if bits == 8:
            np.copyto(out.view(np.uint32), q.astype(np.uint8).view(np.uint32).T)
        elif bits == 4:  # pairs at bits 0 and 16 -> one byte e0 | e1 << 4 (the cast keeps the low byte)
            v = q.view(np.uint32)
            np.copyto(out.view(np.uint16), (v | (v >> 12)).astype(np.uint8).view(np.uint16).T)
        else:  # codes at bits 0, 16, 32, 48 -> e0 | e1 << 2 | e2 << 4 | e3 << 6
            v = q.view(np.uint64)
            t = v | (v >> 14)
            t |= t >> 28
            np.copyto(out, t.T, casting="unsafe")
        return
    v = q.view(np.uint32)  # float32 source: two codes per lane, at bits 0 and 16
    if bits == 8:
        np.copyto(out.view(np.uint16), (v | (v >> 8)).T, casting="unsafe")
    elif bits == 4:
        np.copyto(out, (v | (v >> 12)).T, casting="unsafe")
    else:
        nibbles = ((v | (v >> 14)) & np.uint32(0xF)).astype(np.uint8)
        np.copyto(out, (nibbles[0::2] | (nibbles[1::2] << 4)).T)


def quantize_rows(rows: Iterable[np.ndarray], source_dtype: str, target_dtype: str, bits: int, group_size: int,
                  out: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
                  ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Quantize consecutive row blocks, each C-contiguous ``(..., C)`` with C a multiple of
    ``group_size`` (bfloat16 given as its uint16 bits), cast to ``target_dtype`` first.

    Returns flat ``(packed bytes, scales, biases)`` for all rows in order (the caller
    reshapes them; written into ``out``, shaped as ``result_views`` makes them, if given),
    or ``None`` when a group holds a non-finite value.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite blocks are refused below
        return _quantize_rows([np.ascontiguousarray(r) for r in rows], source_dtype, target_dtype, bits, group_size,
                              out)


def _quantize_rows(rows, source_dtype, target_dtype, bits, group_size, out=None):
    total = sum(r.size for r in rows) // group_size
    lanes = 2 if source_dtype == "F32" else 4
    slabs = group_size // lanes
    n_bins = np.float32((1 << bits) - 1)
    eps, zero = np.float32(1e-7), np.float32(0)
    packed = np.empty((total, group_size * bits // 8), np.uint8) if out is None else out[0]
    scales = np.empty(total, np.float32)
    biases = np.empty(total, np.float32)
    chunk = max(1, CHUNK_ELEMENTS // group_size)
    lanes_buf = np.empty((slabs, chunk), np.uint64)
    x_buf = np.empty((slabs, lanes * chunk), np.float32)
    rep_buf = np.empty((2, chunk, lanes), np.float32)
    q_buf = np.empty((slabs, lanes * chunk), np.int16)
    top = np.full((slabs, lanes * chunk), (1 << bits) - 1, np.int16)
    g0 = 0
    for r in rows:
        groups = r.reshape(-1, group_size).view(np.uint64)  # (G, slabs): 8 bytes per lane
        for a in range(0, len(groups), chunk):
            n = min(chunk, len(groups) - a)
            lane = lanes_buf[:, :n]
            np.copyto(lane, groups[a:a + n].T)
            x = _as_float32_rows(lane, source_dtype, x_buf[:, :lanes * n])  # x[s, lanes*g + l]: element lanes*s + l
            _round_to(x, target_dtype, source_dtype)
            w_max = _across_lanes(np.maximum, x.max(axis=0), n, lanes)
            w_min = _across_lanes(np.minimum, x.min(axis=0), n, lanes)
            # the kernel's scale and bias, in its order of float32 operations
            mask = np.abs(w_min) > np.abs(w_max)
            span = w_max - w_min
            span /= n_bins
            np.maximum(span, eps, out=span)
            scale = np.where(mask, span, -span)
            edge = np.where(mask, w_min, w_max)
            q0 = np.rint(edge / scale)
            nonzero = q0 != 0
            np.divide(edge, q0, out=scale, where=nonzero)
            bias = np.where(nonzero, edge, zero)
            scales[g0 + a:g0 + a + n] = scale
            biases[g0 + a:g0 + a + n] = bias
            bias_rep, scale_rep = rep_buf[0, :n], rep_buf[1, :n]
            np.copyto(bias_rep, bias[:, None])
            np.copyto(scale_rep, scale[:, None])
            np.subtract(x, bias_rep.reshape(-1), out=x)
            np.divide(x, scale_rep.reshape(-1), out=x)
            np.rint(x, out=x)
            # The kernel clips to [0, n_bins]. Here x >= -0 already: the bias is the end of the
            # group's range that the scale's sign points away from (or 0 with |edge/scale| <=
            # 1/2), and float32 subtraction and division keep that order. x <= 2 * n_bins + 1
            # (q0 rounds edge/scale by at most half of it), so int16 holds it exactly; numpy
            # vectorises an int16 minimum against an array, not against a scalar.
            q = q_buf[:, :lanes * n]
            np.copyto(q, x, casting="unsafe")
            np.minimum(q, top[:, :lanes * n], out=q)
            _pack(q, bits, lanes, packed[g0 + a:g0 + a + n])
        g0 += len(groups)
    if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
        return None
    if out is None:
        return packed, _store(scales, target_dtype), _store(biases, target_dtype)
    np.copyto(out[1], _store(scales, target_dtype))
    np.copyto(out[2], _store(biases, target_dtype))
    return out


STORED = {"bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}
ALIGN = 64


def _result_layout(groups: int, bits: int, group_size: int, target_dtype: str):
    """Byte offset and size of packed, scales and biases for ``groups`` groups, each 64-byte aligned."""
    sizes = (groups * group_size * bits // 8,) + (groups * STORED[target_dtype].itemsize,) * 2
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // ALIGN) * ALIGN
    return list(zip(offsets, sizes)), at


def result_bytes(groups: int, bits: int, group_size: int, target_dtype: str) -> int:
    """Bytes a result of ``groups`` groups takes in a shared buffer (``result_views``)."""
    return _result_layout(groups, bits, group_size, target_dtype)[1]


def result_views(buf: np.ndarray, groups: int, bits: int, group_size: int,
                 target_dtype: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed, scales, biases) laid out at the start of ``buf`` (uint8): what ``quantize_rows``
    writes with ``out=`` and returns, so that a worker and its parent agree on the bytes."""
    (p, p_n), (s, s_n), (b, b_n) = _result_layout(groups, bits, group_size, target_dtype)[0]
    stored = STORED[target_dtype]
    return (buf[p:p + p_n].reshape(groups, group_size * bits // 8), buf[s:s + s_n].view(stored),
            buf[b:b + b_n].view(stored))


# ---------------------------------------------------------------- in a worker process


def quantize_file_rows(reads: Sequence[Tuple[str, int, Tuple[int, ...]]], source_dtype: str, target_dtype: str,
                       bits: int, group_size: int) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``quantize_rows`` over row runs read from their files.

    ``reads``: (file, byte offset, shape) per contiguous run, in output row order. Runs in
    a worker process: numpy holds the GIL between its passes, so threads would queue on
    it. Plain unbuffered reads into the rows' own arrays keep no streamed shard open after
    the call (a mapping would).
    """
    rows = _read_rows(reads, source_dtype, target_dtype)
    return None if rows is None else quantize_rows(rows, _quantized_as(source_dtype, target_dtype), target_dtype,
                                                   bits, group_size)


def _quantized_as(source_dtype: str, target_dtype: str) -> str:
    """The dtype the rows reach the quantizer in: FP8 arrives dequantized in the target dtype."""
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[target_dtype] if source_dtype == "F8_E4M3" \
        else source_dtype


def quantize_file_rows_into(reads: Sequence[Tuple[str, int, Tuple[int, ...]]], source_dtype: str, target_dtype: str,
                            bits: int, group_size: int, segment: str, offset: int, capacity: int) -> bool:
    """``quantize_file_rows`` writing its result into shared memory ``segment`` at ``offset``
    (laid out as ``result_views``, within ``capacity`` bytes), so that no output byte crosses
    a pipe: pickling, sending and unpickling ~4 MB per block cost both processes CPU time.
    False when a group holds a non-finite value (nothing usable was written)."""
    groups = task_groups(reads, group_size)
    size = result_bytes(groups, bits, group_size, target_dtype)
    if size > capacity:  # would spill into the next slot
        raise ValueError(f"a result of {size} bytes does not fit its {capacity}-byte slot")
    rows = _read_rows(reads, source_dtype, target_dtype)
    if rows is None:
        return False
    out = result_views(_attached(segment)[offset:offset + size], groups, bits, group_size, target_dtype)
    return quantize_rows(rows, _quantized_as(source_dtype, target_dtype), target_dtype, bits, group_size,
                         out) is not None


def task_groups(reads: Sequence[tuple], group_size: int) -> int:
    """Quantization groups in the rows ``reads`` names (what sizes and lays out its result)."""
    return sum(math.prod(read[2]) for read in reads) // group_size


READ_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}


def _read_rows(reads: Sequence[tuple], source_dtype: str, target_dtype: str) -> list:
    """The runs' rows as stored; an FP8 run ``(file, offset, shape, scale)`` with ``scale`` =
    (file, offset, shape, dtype, first row within the scale's first block) comes back dequantized
    and rounded to ``target_dtype`` (as MLX's cast after its dequantization), or None for all when
    a scale is not finite (the caller's MLX path names it)."""
    rows, files = [], {}
    try:
        for path, offset, shape, *scale in reads:
            row = _read(files, path, offset, shape, READ_DTYPES[source_dtype])
            if scale:
                stored = _read(files, *scale[0][:3], READ_DTYPES[scale[0][3]])
                row = dequantize_fp8(row, stored, *scale[0][3:], target_dtype)
                if row is None:
                    return None
            rows.append(row)
    finally:
        for f in files.values():
            f.close()
    return rows


def _read(files: dict, path: str, offset: int, shape: Tuple[int, ...], dtype) -> np.ndarray:
    if path not in files:
        files[path] = open(path, "rb", buffering=0)
    f = files[path]
    row = np.empty(shape, dtype)
    view = memoryview(row.reshape(-1).view(np.uint8))
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{path}: file ends inside a tensor (byte {offset + done})")
        done += n
    return row


E4M3 = e4m3_table()


def dequantize_fp8(codes: np.ndarray, scale: np.ndarray, scale_dtype: str, row_offset: int,
                   target_dtype: str) -> Optional[np.ndarray]:
    """``e4m3(codes) * scale`` per 128x128 block of the last two axes (a scale of fewer than two axes: one value
    for every code), stored as ``target_dtype``: the float32 products ``execute.ops.dequant_fp8`` computes,
    rounded as MLX's cast rounds them. A band of 128 rows is one lookup in the tables of its blocks' values (256
    per block, side by side), indexed by code + 256 * column block: two passes over the codes, no float32 copy
    of them."""
    scale = scale_floats(scale, scale_dtype)
    if not np.isfinite(scale).all():
        return None
    if scale.ndim < 2:  # one scale for the tensor: one table of 256 values
        return np.take(_store(E4M3 * scale.reshape(()), target_dtype), codes)
    out = np.empty(codes.shape, STORED[target_dtype])
    rows, cols = codes.shape[-2:]
    table_of_column = (np.arange(cols) // FP8_BLOCK * 256).astype(np.uint16 if cols <= 32768 else np.uint32)
    for lead in np.ndindex(*codes.shape[:-2]):  # experts of a stacked tensor (none for a matrix)
        band_codes, band_scales, band_out = codes[lead], scale[lead], out[lead]
        for band in range(band_scales.shape[0]):
            r0, r1 = max(band * FP8_BLOCK - row_offset, 0), min((band + 1) * FP8_BLOCK - row_offset, rows)
            if r0 >= r1:
                continue
            tables = _store(E4M3[None, :] * band_scales[band][:, None], target_dtype).reshape(-1)
            index = np.add(band_codes[r0:r1], table_of_column, dtype=table_of_column.dtype)
            np.take(tables, index, out=band_out[r0:r1])
    return out


def scale_floats(stored: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Stored FP8 scales -> float32: BF16 (as uint16 bits), F16, F32, or F8_E8M0 bytes, the exponents ``2^(b - 127)``
    (built from their bits as ``execute.ops.scale_values`` builds them: 0 is 2^-127, 255 NaN)."""
    if scale_dtype != "F8_E8M0":
        return _as_float32_rows(stored, scale_dtype, np.empty(stored.shape, np.float32))
    b = stored.astype(np.uint32)
    bits = np.where(b == 0, np.uint32(1 << 22), np.where(b == 255, np.uint32(0x7FC00000), b << np.uint32(23)))
    return bits.astype(np.uint32).view(np.float32)


_SEGMENTS: dict = {}  # shared memory this worker has attached, by name: kept for the pool's life


def _attached(segment: str) -> np.ndarray:
    if segment not in _SEGMENTS:
        # A spawned worker shares its parent's resource tracker: registering the segment
        # again is a no-op there, and the parent unlinks it once the pool is closed.
        shm = shared_memory.SharedMemory(segment)
        _SEGMENTS[segment] = (shm, np.ndarray((shm.size,), np.uint8, shm.buf))
    return _SEGMENTS[segment][1]


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def worker_init() -> None:
    """Worker initializer: Ctrl-C and SIGTERM are the parent's to handle (it shuts the pool down
    and keeps the finished shards). A CI runner or a terminal signals every process of the group,
    and a worker killed by it would surface in the parent as ``BrokenProcessPool`` instead of a
    clean interruption. A worker whose parent is killed outright exits instead of waiting for
    work forever (its exit also lets the resource tracker unlink the parent's shared memory)."""
    for sig in INTERRUPTS:
        signal.signal(sig, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()


def _exit_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # readable once the parent is gone
    os._exit(1)
