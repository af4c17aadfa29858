"""Quantized sources: block-FP8 read through its scales, the FP4 and per-tensor formats refused by name.

Qwen's FP8 releases store a quantized Linear as ``X.weight`` (F8_E4M3) plus
``X.weight_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]`` (BF16, F32 elsewhere); despite its
name the scale multiplies: ``W[i, j] = e4m3(W_q[i, j]) * s[i // 128, j // 128]``. Whether a tensor is
FP8 is decided from its own dtype and scale, never from the family or ``modules_to_not_convert``.
"""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Tuple

from ..errors import LayoutError

BLOCK = 128  # the scale grid of the block-FP8 releases (quantization_config.weight_block_size)
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8 = "F8_E4M3"
SCALE_DTYPES = ("BF16", "F16", "F32")

# Companions of quantized weights in formats that are not converted; the first key seen names the format.
REFUSED = (
    (".weight_scale_2", "NVFP4 (NVIDIA ModelOpt)"),
    (".weight_packed", "FP4 (compressed-tensors)"),
    (".weight_global_scale", "NVFP4 (compressed-tensors)"),
    (".input_global_scale", "NVFP4 (compressed-tensors)"),
    (".weight_scale", "per-tensor FP8 / NVFP4 (NVIDIA ModelOpt)"),
    (".input_scale", "per-tensor FP8 / NVFP4 (NVIDIA ModelOpt)"),
)


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


def is_scale(key: str) -> bool:
    return key.endswith(".weight" + SCALE_SUFFIX)


def refused_format(key: str) -> Optional[str]:
    """The quantization format a key belongs to when it is one mtpconvert does not read, else None."""
    for suffix, name in REFUSED:
        if key.endswith(suffix):
            return name
    return None


def refuse(key: str, file) -> None:
    """A clear error for a checkpoint in a quantized format that is not converted."""
    name = refused_format(key)
    if name is not None:
        raise LayoutError(
            f"{name} checkpoint: its quantized weights are not converted (no lossless path to MLX's own "
            "formats is implemented)", file=file, key=key,
            hint="convert the BF16 release or Qwen's block-FP8 release (F8_E4M3 + weight_scale_inv) of the model",
        )


def scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The scale grid of an FP8 tensor: its last two axes in 128-blocks (ceil), leading axes kept."""
    return (*shape[:-2], *(math.ceil(d / BLOCK) for d in shape[-2:]))


def scale_rows(shape: Tuple[int, ...], start: int, stop: int) -> Tuple[int, int, int]:
    """(first, last, offset): the scale rows ``first:last`` that rows ``start:stop`` of an FP8 tensor's
    leading axis need, and how far ``start`` lies into the first one's rows: 128-row blocks of a matrix,
    or the same expert rows (offset 0) of a stack."""
    if len(shape) == 2:
        first = start // BLOCK
        return first, math.ceil(stop / BLOCK), start - first * BLOCK
    return start, stop, 0


def check_scales(tensors: Mapping, file_of: Mapping) -> None:
    """Raises the first of ``scale_problems``."""
    problems = scale_problems(tensors, file_of)
    if problems:
        raise problems[0]


def scale_problems(tensors: Mapping, file_of: Mapping) -> List[LayoutError]:
    """Every F8_E4M3 tensor needs a scale of a float dtype and the 128-block shape, every scale its weight;
    one error naming the tensor per problem."""
    problems = []
    for key, info in tensors.items():
        if is_scale(key):
            if key[: -len(SCALE_SUFFIX)] not in tensors:
                problems.append(LayoutError("FP8 scale without its weight", file=file_of[key], key=key))
            continue
        scale = scale_key(key)
        if info.dtype != FP8:
            if scale in tensors:
                problems.append(LayoutError(f"a weight_scale_inv beside a {info.dtype} weight (only F8_E4M3 "
                                            "weights have one)", file=file_of[scale], key=scale))
            continue
        if scale not in tensors:
            problems.append(LayoutError("F8_E4M3 weight without its weight_scale_inv", file=file_of[key], key=key,
                                        hint=f"block-FP8 releases store {scale} beside every F8_E4M3 weight"))
        elif len(info.shape) < 2:
            problems.append(LayoutError(f"F8_E4M3 tensor of shape {list(info.shape)}: block scales need two axes",
                                        file=file_of[key], key=key))
        elif tensors[scale].dtype not in SCALE_DTYPES:
            problems.append(LayoutError(f"FP8 scale of dtype {tensors[scale].dtype} (expected one of "
                                        f"{', '.join(SCALE_DTYPES)})", file=file_of[scale], key=scale))
        elif tuple(tensors[scale].shape) != scale_shape(info.shape):
            problems.append(LayoutError(f"FP8 scale of shape {list(tensors[scale].shape)} for a weight of shape "
                                        f"{list(info.shape)} (expected {list(scale_shape(info.shape))}: 128x128 "
                                        "blocks)", file=file_of[scale], key=scale))
    return problems
