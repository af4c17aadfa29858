"""Quantized sources: FP8 read through its scales, the FP4 formats refused by name.

An F8_E4M3 weight ``X.weight`` has one scale, found beside it:

* block: ``X.weight_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]`` (BF16, F32 elsewhere), as
  Qwen's FP8 releases store every quantized Linear; despite its name the scale multiplies:
  ``W[i, j] = e4m3(W_q[i, j]) * s[i // 128, j // 128]``;
* per tensor: one scalar ``weight_scale`` (shape ``[]`` or ``[1]``) of ``X`` itself, or of a module that
  encloses it (a table stored in parts, ``P.shard_i.weight``, under one ``P.weight_scale``):
  ``W = e4m3(W_q) * s``.

Whether a tensor is FP8 is decided from its own dtype and its scale, never from the family or
``modules_to_not_convert``.

NVIDIA ModelOpt's per-tensor FP8 (W8A8) stores two more scalars that the MLX output has no use for, dropped
with their reason (``IGNORED``, docs/transforms.md): ``X.input_scale``, the static activation scale of the FP8
matmul (MLX multiplies float activations by the dequantized weight, as mlx-vlm does after consuming the same
scale in its ModelOpt transform), and ``k_proj.k_scale`` / ``v_proj.v_scale``, the FP8 KV-cache scales (MLX's KV
caches hold the activation dtype; mlx-vlm drops both).
"""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Tuple

from ..errors import LayoutError

BLOCK = 128  # the scale grid of the block-FP8 releases (quantization_config.weight_block_size)
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
TENSOR_SCALE = "weight_scale"  # X.weight_scale, or an enclosing P.weight_scale: one scalar for the tensor
FP8 = "F8_E4M3"
SCALE_DTYPES = ("BF16", "F16", "F32")

# Companions of quantized weights in formats that are not converted, the most telling first: the first of
# these any key has names the format.
REFUSED = (
    (".weight_scale_2", "NVFP4 (NVIDIA ModelOpt)"),
    (".weight_packed", "FP4 (compressed-tensors)"),
    (".weight_global_scale", "NVFP4 (compressed-tensors)"),
    (".input_global_scale", "NVFP4 (compressed-tensors)"),
)
# Scalars of a quantized release that the MLX output does not carry: suffix -> why (see the module doc)
IGNORED = (
    (".input_scale", "activation scale of an FP8 matmul (MLX computes activations in float)"),
    (".k_scale", "FP8 KV-cache scale (MLX's KV cache holds the activation dtype)"),
    (".v_scale", "FP8 KV-cache scale (MLX's KV cache holds the activation dtype)"),
)


def scale_key(weight_key: str, tensors: Mapping) -> Optional[str]:
    """The scale of an F8_E4M3 weight among ``tensors``: its block scale, else the nearest per-tensor
    ``weight_scale`` of it or of an enclosing module; None when it has none."""
    if weight_key + SCALE_SUFFIX in tensors:
        return weight_key + SCALE_SUFFIX
    module = weight_key[: -len(".weight")] if weight_key.endswith(".weight") else weight_key
    while module:
        if f"{module}.{TENSOR_SCALE}" in tensors:
            return f"{module}.{TENSOR_SCALE}"
        module = module.rpartition(".")[0]
    return None


def is_scale(key: str) -> bool:
    return key.endswith((".weight" + SCALE_SUFFIX, "." + TENSOR_SCALE))


def is_block_scale(key: str) -> bool:
    return key.endswith(SCALE_SUFFIX)


def block_of(scale: str) -> int:
    """The step's block size for a scale: 128 for a block scale, 0 for one scalar over the tensor."""
    return BLOCK if is_block_scale(scale) else 0


def ignored(key: str) -> Optional[str]:
    """Why a quantized release's scalar is not carried into the output, or None for any other key."""
    return next((why for suffix, why in IGNORED if key.endswith(suffix)), None)


def refused_format(key: str) -> Optional[str]:
    """The quantization format a key belongs to when it is one mtpconvert does not read, else None."""
    for suffix, name in REFUSED:
        if key.endswith(suffix):
            return name
    return None


def refused_formats(keys) -> List[Tuple[str, str]]:
    """(format, its first key) for each format ``keys`` hold that is not converted, the most telling first."""
    keys = list(keys)
    found = []
    for suffix, name in REFUSED:
        key = next((k for k in keys if k.endswith(suffix)), None)
        if key is not None and name not in (n for n, _ in found):
            found.append((name, key))
    return found


def refuse(files: Mapping) -> None:
    """A clear error for a checkpoint in a quantized format that is not converted (``files``: key -> file)."""
    for name, key in refused_formats(files)[:1]:
        file = files[key]
        raise LayoutError(
            f"{name} checkpoint: its quantized weights are not converted (no lossless path to MLX's own "
            "formats is implemented)", file=file, key=key,
            hint="convert the BF16 release of the model, or an FP8 one (F8_E4M3 with block scales weight_scale_inv, "
                 "or ModelOpt's per-tensor weight_scale)",
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
    """Every F8_E4M3 tensor needs its scale (``scale_key``) of a float dtype and the right shape (the 128-block
    grid, or one value), every scale an F8_E4M3 weight; one error naming the tensor per problem."""
    problems = []
    used = set()
    # the weights of a refused format (refused_formats names it) carry scales of their own kind: not FP8's
    refused = {key.rpartition(".")[0] for key in tensors if refused_format(key)}
    for key, info in tensors.items():
        if key.rpartition(".")[0] in refused:
            continue
        if ignored(key):
            if math.prod(info.shape) != 1 or info.dtype not in SCALE_DTYPES:
                problems.append(LayoutError(f"{key.rpartition('.')[2]} of shape {list(info.shape)} and dtype "
                                            f"{info.dtype} (expected one {'/'.join(SCALE_DTYPES)} value)",
                                            file=file_of[key], key=key))
            continue
        if is_scale(key):
            continue
        scale = scale_key(key, tensors) if key.endswith(".weight") else None
        if info.dtype != FP8:
            if scale is not None and (is_block_scale(scale) or scale == key[: -len("weight")] + TENSOR_SCALE):
                problems.append(LayoutError(f"a {scale.rpartition('.')[2]} beside a {info.dtype} weight (only "
                                            "F8_E4M3 weights have one)", file=file_of[scale], key=scale))
            continue
        if scale is None:
            problems.append(LayoutError("F8_E4M3 weight without its scale", file=file_of[key], key=key,
                                        hint=f"FP8 releases store {key}{SCALE_SUFFIX} (128x128 blocks) or a per-tensor "
                                             f"{TENSOR_SCALE} beside every F8_E4M3 weight"))
            continue
        used.add(scale)
        if tensors[scale].dtype not in SCALE_DTYPES:
            problems.append(LayoutError(f"FP8 scale of dtype {tensors[scale].dtype} (expected one of "
                                        f"{', '.join(SCALE_DTYPES)})", file=file_of[scale], key=scale))
        elif not is_block_scale(scale):
            if math.prod(tensors[scale].shape) != 1:
                problems.append(LayoutError(f"per-tensor FP8 scale of shape {list(tensors[scale].shape)} (expected "
                                            "one value)", file=file_of[scale], key=scale))
        elif len(info.shape) < 2:
            problems.append(LayoutError(f"F8_E4M3 tensor of shape {list(info.shape)}: block scales need two axes",
                                        file=file_of[key], key=key))
        elif tuple(tensors[scale].shape) != scale_shape(info.shape):
            problems.append(LayoutError(f"FP8 scale of shape {list(tensors[scale].shape)} for a weight of shape "
                                        f"{list(info.shape)} (expected {list(scale_shape(info.shape))}: 128x128 "
                                        "blocks)", file=file_of[scale], key=scale))
    for key in tensors:
        if is_scale(key) and key not in used and key.rpartition(".")[0] not in refused:
            problems.append(LayoutError("FP8 scale without its F8_E4M3 weight", file=file_of[key], key=key))
    return problems
