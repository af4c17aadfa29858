"""Quantized sources: FP8 and MXFP4 weights read through their scales, the other FP4 formats refused by name.

A quantized weight ``W`` has one scale, found beside it:

* FP8 block: an F8_E4M3 ``W`` with ``W_scale_inv`` (``X.weight_scale_inv``, or ``experts.down_proj_scale_inv`` for
  the fused expert tensors transformers 5 writes) or ``X.scale`` (DeepSeek-V4's name) of shape
  ``[..., ceil(out/128), ceil(in/128)]``: BF16/F16/F32 as Qwen's FP8 releases store it, or F8_E8M0 (one
  power-of-two exponent a byte, ``2^(byte - 127)``, DeepSeek's ``ue8m0``); despite the name ``_inv`` the scale
  multiplies: ``W[i, j] = e4m3(W_q[i, j]) * s[i // 128, j // 128]``;
* FP8 per tensor: one scalar ``weight_scale`` (shape ``[]`` or ``[1]``) of ``X`` itself, or of a module that
  encloses it (a table stored in parts, ``P.shard_i.weight``, under one ``P.weight_scale``): ``W = e4m3(W_q) * s``;
* MXFP4: an I8 (or U8) ``W`` of shape ``[..., out, in / 2]`` holding two E2M1 codes a byte (element ``2j`` in the
  low nibble), with an F8_E8M0 ``X.scale`` ``[..., out, in / 32]``: ``W[i, j] = e2m1(code) * 2^(s[i, j // 32] - 127)``,
  exactly MLX's ``mxfp4`` layout (``mx.quantize(mode="mxfp4")``: the bytes viewed as uint32, the scales as uint8).

Whether a tensor is quantized, and how, is decided from its own dtype and its scale's dtype and shape, never from
the family, ``quantization_config`` or a name alone: an F32 ``attn_hc.scale`` beside no weight is a parameter.

Two of these formats are MLX's own: MXFP4 is ``mxfp4``, and FP8 with E8M0 block scales is ``mxfp8`` (the same E4M3
bytes, each block's exponent repeated over its 128 rows and its four 32-wide groups). Where the conversion
quantizes such a tensor (``carried``), its bytes are carried over as they are; elsewhere every format is dequantized
exactly (an E4M3 or E2M1 value times a power of two or a float scale fits float32) and transformed like a float
tensor. FP8 with float scales is never carried: its scale is no power of two, so no MLX format holds it exactly.

NVIDIA ModelOpt's per-tensor FP8 (W8A8) stores two more scalars that the MLX output has no use for, dropped
with their reason (``IGNORED``, docs/transforms.md): ``X.input_scale``, the static activation scale of the FP8
matmul (MLX multiplies float activations by the dequantized weight, as mlx-vlm does after consuming the same
scale in its ModelOpt transform), and ``k_proj.k_scale`` / ``v_proj.v_scale``, the FP8 KV-cache scales (MLX's KV
caches hold the activation dtype; mlx-vlm drops both).
"""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Set, Tuple

from ..errors import LayoutError

BLOCK = 128  # the scale grid of the block-FP8 releases (quantization_config.weight_block_size)
MX_GROUP = 32  # the inputs one MXFP4 scale covers
SCALE_SUFFIX = "_scale_inv"  # W -> W_scale_inv (X.weight -> X.weight_scale_inv)
MODULE_SCALE = ".scale"  # X.weight -> X.scale (DeepSeek-V4)
TENSOR_SCALE = "weight_scale"  # X.weight_scale, or an enclosing P.weight_scale: one scalar for the tensor
FP8 = "F8_E4M3"
E8M0 = "F8_E8M0"
FP4_PACKED = ("I8", "U8")  # two E2M1 codes a byte
MLX_COMPANIONS = (".scales", ".biases", ".global_scale")
SCALE_DTYPES = ("BF16", "F16", "F32")  # the float scales of FP8 weights (E8M0 besides)

# source forms (``form_of``)
FP8_BLOCK = "fp8-block"
FP8_TENSOR = "fp8-tensor"
MXFP4 = "mxfp4"

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


def _beside(weight_key: str) -> List[str]:
    """The names a scale stored beside ``weight_key`` may have."""
    names = [weight_key + SCALE_SUFFIX]
    if weight_key.endswith(".weight"):
        names.append(weight_key[: -len(".weight")] + MODULE_SCALE)
    return names


def may_be_quantized(key: str, info) -> bool:
    """A tensor whose dtype a quantized weight has (F8_E4M3, or I8/U8 packing FP4 codes) and that is not an MLX
    folder's own companion of one (``.scales`` / ``.biases``: uint8 for its mx modes)."""
    return info.dtype == FP8 or (info.dtype in FP4_PACKED and not key.endswith(MLX_COMPANIONS))


def scale_key(weight_key: str, tensors: Mapping) -> Optional[str]:
    """The scale of a quantized weight among ``tensors``: one stored beside it, else (F8_E4M3 only) the nearest
    per-tensor ``weight_scale`` of it or of an enclosing module; None when it has none. An I8/U8 tensor has a scale
    only as MXFP4: an F8_E8M0 one beside it."""
    for name in _beside(weight_key):
        if name in tensors and (tensors[weight_key].dtype == FP8 or tensors[name].dtype == E8M0):
            return name
    if tensors[weight_key].dtype != FP8:
        return None
    module = weight_key[: -len(".weight")] if weight_key.endswith(".weight") else weight_key
    while module:
        if f"{module}.{TENSOR_SCALE}" in tensors:
            return f"{module}.{TENSOR_SCALE}"
        module = module.rpartition(".")[0]
    return None


def scale_keys(tensors: Mapping, absent: Mapping = ()) -> Set[str]:
    """Every key of ``tensors`` (and of ``absent``, keys without a header: by name) that is a scale: the scale of a
    quantized weight, or a tensor named as a scale whose weight is missing (``scale_problems`` names those). A
    ``.scale`` beside no ``.weight`` (a hyper-connection's F32 ``attn_hc.scale``) is not one."""
    found = {scale_key(k, tensors) for k, info in tensors.items() if may_be_quantized(k, info)} - {None}
    every = set(tensors) | set(absent)
    for key in every:
        if key.endswith((SCALE_SUFFIX, "." + TENSOR_SCALE)):
            found.add(key)
        elif key.endswith(MODULE_SCALE) and key[: -len(MODULE_SCALE)] + ".weight" in every and (
                key not in tensors or tensors[key].dtype == E8M0):
            found.add(key)
    return found


def form_of(source) -> Optional[str]:
    """How a source (``plan.items.SourceRef``) is stored: FP8_BLOCK, FP8_TENSOR, MXFP4, or None (float)."""
    if source.scale is None:
        return None
    if source.dtype in FP4_PACKED:
        return MXFP4
    return FP8_TENSOR if source.scale.key.endswith("." + TENSOR_SCALE) else FP8_BLOCK


def block_of(source) -> int:
    """The dequantization step's block size for an FP8 source: 128 for a block scale, 0 for one scalar."""
    return BLOCK if form_of(source) == FP8_BLOCK else 0


def carried(source, quant) -> Optional[object]:
    """The MLX quantization that holds ``source``'s bytes as they are, where the conversion quantizes it (``quant``:
    its ``plan.quant.QuantSpec`` under the options, None for a float output): MXFP4 always (as ``mxfp4``, whatever
    the options' bits: a requantization could only lose), FP8 with E8M0 block scales where ``mxfp8`` is asked;
    None where the source is dequantized instead."""
    from .quant import QuantSpec

    form = form_of(source)
    if quant is None or form is None:
        return None
    if form == MXFP4:
        return QuantSpec(4, MX_GROUP, "mxfp4")
    if form == FP8_BLOCK and source.scale.dtype == E8M0 and quant == QuantSpec(8, MX_GROUP, "mxfp8"):
        return quant
    return None


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
            hint="convert the BF16 release, a block-FP8 one (F8_E4M3 + weight_scale_inv or E8M0 .scale), a per-tensor "
                 "FP8 one (ModelOpt's weight_scale) or an MXFP4 one (I8 + E8M0 .scale) of the model",
        )


def scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The scale grid of an FP8 tensor: its last two axes in 128-blocks (ceil), leading axes kept."""
    return (*shape[:-2], *(math.ceil(d / BLOCK) for d in shape[-2:]))


def stored_shape(key: str, tensors: Mapping, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape a source of the logical ``shape`` is stored in: MXFP4 packs two codes a byte."""
    if tensors[key].dtype in FP4_PACKED and scale_key(key, tensors) is not None:
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def mx_scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The scales of an MXFP4 tensor stored as ``shape`` (two codes a byte): one per 32 inputs of each row."""
    return (*shape[:-1], shape[-1] * 2 // MX_GROUP)


def scale_rows(shape: Tuple[int, ...], start: int, stop: int, block: int = BLOCK) -> Tuple[int, int, int]:
    """(first, last, offset): the scale rows ``first:last`` that rows ``start:stop`` of a quantized tensor's
    leading axis need, and how far ``start`` lies into the first one's rows: ``block``-row blocks of a matrix
    (128 for block FP8, 1 for MXFP4's per-row scales), or the same expert rows (offset 0) of a stack."""
    if len(shape) == 2:
        first = start // block
        return first, math.ceil(stop / block), start - first * block
    return start, stop, 0


def check_scales(tensors: Mapping, file_of: Mapping) -> None:
    """Raises the first of ``scale_problems``."""
    problems = scale_problems(tensors, file_of)
    if problems:
        raise problems[0]


def _scale_problem(key: str, info, scale: str, tensors: Mapping, file_of: Mapping) -> Optional[LayoutError]:
    """What is wrong with the scale ``scale`` of the quantized weight ``key`` (``info``), or None."""
    s = tensors[scale]
    if info.dtype in FP4_PACKED:
        want = mx_scale_shape(info.shape)
        if len(info.shape) < 2 or info.shape[-1] * 2 % MX_GROUP or tuple(s.shape) != want:
            return LayoutError(f"MXFP4 scale of shape {list(s.shape)} for codes of shape {list(info.shape)} (expected "
                               f"{list(want)}: one F8_E8M0 per {MX_GROUP} inputs)", file=file_of[scale], key=scale)
        return None
    if s.dtype not in SCALE_DTYPES + (E8M0,):
        return LayoutError(f"FP8 scale of dtype {s.dtype} (expected one of {', '.join(SCALE_DTYPES + (E8M0,))})",
                           file=file_of[scale], key=scale)
    if scale.endswith("." + TENSOR_SCALE):
        if math.prod(s.shape) != 1:
            return LayoutError(f"per-tensor FP8 scale of shape {list(s.shape)} (expected one value)",
                               file=file_of[scale], key=scale)
    elif len(info.shape) < 2:
        return LayoutError(f"F8_E4M3 tensor of shape {list(info.shape)}: block scales need two axes",
                           file=file_of[key], key=key)
    elif tuple(s.shape) != scale_shape(info.shape):
        return LayoutError(f"FP8 scale of shape {list(s.shape)} for a weight of shape {list(info.shape)} (expected "
                           f"{list(scale_shape(info.shape))}: 128x128 blocks)", file=file_of[scale], key=scale)
    return None


def scale_problems(tensors: Mapping, file_of: Mapping) -> List[LayoutError]:
    """Every F8_E4M3 tensor needs its scale (``scale_key``) of a float or E8M0 dtype and the right shape (the
    128-block grid, or one value), every MXFP4 one its per-32 E8M0 scales, every scale a quantized weight; one
    error naming the tensor per problem."""
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
        if not may_be_quantized(key, info):
            continue
        scale = scale_key(key, tensors)
        if scale is None:
            if info.dtype == FP8:
                problems.append(LayoutError("F8_E4M3 weight without its scale", file=file_of[key], key=key,
                                            hint=f"FP8 releases store {key}{SCALE_SUFFIX} (128x128 blocks) or a "
                                                 f"per-tensor {TENSOR_SCALE} beside every F8_E4M3 weight"))
            else:
                problems.append(LayoutError(f"{info.dtype} weight without an F8_E8M0 scale", file=file_of[key], key=key,
                                            hint="MXFP4 releases store X.scale (one E8M0 exponent per 32 inputs) "
                                                 "beside every packed X.weight"))
            continue
        used.add(scale)
        problem = _scale_problem(key, info, scale, tensors, file_of)
        if problem is not None:
            problems.append(problem)
    for key in sorted(scale_keys(tensors) - used):
        if key.rpartition(".")[0] in refused:
            continue
        weight = next((w for w in tensors if key in _beside(w)), None)
        if weight is not None and (key.endswith(SCALE_SUFFIX) or tensors[key].dtype in SCALE_DTYPES + (E8M0,)):
            problems.append(LayoutError(f"a {key.rpartition('.')[2]} beside a {tensors[weight].dtype} weight (only "
                                        "F8_E4M3 and MXFP4 weights have one)", file=file_of[key], key=key))
        elif key.endswith("." + TENSOR_SCALE) and key[: -len(TENSOR_SCALE)] + "weight" in tensors:
            w = tensors[key[: -len(TENSOR_SCALE)] + "weight"]
            problems.append(LayoutError(f"a {TENSOR_SCALE} beside a {w.dtype} weight (only F8_E4M3 weights have "
                                        "one)", file=file_of[key], key=key))
        else:
            problems.append(LayoutError("FP8 scale without its F8_E4M3 weight", file=file_of[key], key=key))
    return problems
