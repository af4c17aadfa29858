"""Which output tensors get quantized, and how the config records it.

Rules (docs/transforms.md gives the reasons):
- backbone linear, embedding and stacked-expert weights: ``--bits``/``--group-size``/``--q-mode``;
- routers (``mlp.gate``, ``shared_expert_gate``): 8-bit affine, group 64, as mlx-lm does;
- a weight whose input dimension is not a multiple of the group size stays unquantized; a row table
  (n-gram embedding shards) takes group 32 then, as mlx-vlm quantizes it;
- MTP: ``keep`` leaves every ``mtp.*`` tensor at ``--dtype``; ``match`` uses the
  backbone rules; ``bits`` uses ``--mtp-bits`` (affine); ``mtp.fc`` and the head's routers are
  never quantized;
- vision tensors are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from ..families.base import FC, MTP, QUANTIZABLE, ROUTER, ROWS, VISION, Slot
from ..options import QuantOptions

ROUTER_SPEC_BITS, ROUTER_SPEC_GROUP = 8, 64
ROWS_FALLBACK_GROUP = 32  # mlx-vlm's fallback_group_size for a row table whose rows the group does not divide


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    mode: str = "affine"

    def as_config(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def packed_shape(self, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        return (*shape[:-1], shape[-1] * self.bits // 32)

    def scales_shape(self, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        return (*shape[:-1], shape[-1] // self.group_size)

    @property
    def has_biases(self) -> bool:
        return self.mode == "affine"


def backbone_spec(opts: QuantOptions) -> Optional[QuantSpec]:
    """The quantization ``--bits/--group-size/--q-mode`` give the backbone, or None."""
    return QuantSpec(opts.bits, opts.group_size, opts.mode) if opts.bits is not None else None


def decide(slot: Slot, opts: QuantOptions) -> Optional[QuantSpec]:
    """The quantization of one output tensor, or None to keep it at --dtype."""
    if slot.kind not in QUANTIZABLE or slot.group == VISION or slot.kind == FC:
        return None
    if slot.group == MTP:
        # mtplx and vllm-mlx dequantize a quantized head with one bits/group for every module: an
        # 8-bit router beside 4-bit experts fails to load there (vllm-mlx: the whole model); float
        # costs a few MB (E x hidden)
        if opts.mtp == "keep" or slot.kind == ROUTER:
            return None
        if opts.mtp == "bits":
            spec = QuantSpec(opts.mtp_bits, opts.group_size if opts.mode == "affine" and opts.group_size else 64)
            return spec if slot.shape[-1] % spec.group_size == 0 else None
    base = backbone_spec(opts)
    if base is None:
        return None
    spec = QuantSpec(ROUTER_SPEC_BITS, ROUTER_SPEC_GROUP) if slot.kind == ROUTER else base
    if slot.kind == ROWS and spec.mode == "affine" and slot.shape[-1] % spec.group_size:
        spec = QuantSpec(spec.bits, ROWS_FALLBACK_GROUP, spec.mode)
    return spec if slot.shape[-1] % spec.group_size == 0 else None


def quantization_block(
    decisions: Dict[Slot, Optional[QuantSpec]], opts: QuantOptions
) -> Optional[Dict[str, Union[int, str, bool, dict]]]:
    """The config.json ``quantization`` block describing every quantizable tensor.

    The top-level default is the backbone spec; every module that differs (routers,
    unquantized weights, MTP under its own policy) gets an explicit per-path entry, so
    loaders never have to guess from shapes.
    """
    specs = [q for q in decisions.values() if q is not None]
    if not specs:
        return None
    default = backbone_spec(opts) or specs[0]
    block: Dict[str, Union[int, str, bool, dict]] = default.as_config()
    for slot, q in sorted(decisions.items(), key=lambda kv: kv[0].name):
        if slot.kind not in QUANTIZABLE or slot.group == VISION:
            continue
        if q is None:
            block[slot.module] = False
        elif q != default:
            block[slot.module] = q.as_config()
    return block
