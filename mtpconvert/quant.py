"""Which output tensors get quantized, and how the config records it.

Rules (docs/transforms.md gives the reasons):
- backbone linear, embedding and stacked-expert weights: ``--bits``/``--group-size``/``--q-mode``;
- routers (``mlp.gate``, ``shared_expert_gate``): 8-bit affine, group 64, as mlx-lm does;
- a weight whose input dimension is not a multiple of the group size stays unquantized;
- MTP: ``keep`` leaves every ``mtp.*`` tensor at ``--dtype``; ``match`` uses the
  backbone rules; ``bits`` uses ``--mtp-bits`` (affine); ``mtp.fc`` is never quantized;
- vision tensors are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from .errors import OptionsError
from .schema import FC, MTP, QUANTIZABLE, ROUTER, VISION, Slot

# mode -> (allowed bits, default group size, allowed group sizes)
MODES = {
    "affine": ((2, 3, 4, 5, 6, 8), 64, (32, 64, 128)),
    "mxfp4": ((4,), 32, (32,)),
    "nvfp4": ((4,), 16, (16,)),
    "mxfp8": ((8,), 32, (32,)),
}
MTP_POLICIES = ("keep", "match", "bits", "drop")
ROUTER_SPEC_BITS, ROUTER_SPEC_GROUP = 8, 64


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


@dataclass(frozen=True)
class QuantOptions:
    bits: Optional[int] = None  # None: no quantization at all
    group_size: Optional[int] = None
    mode: str = "affine"
    mtp: str = "keep"
    mtp_bits: Optional[int] = None

    def validated(self) -> "QuantOptions":
        if self.mode not in MODES:
            raise OptionsError(f"--q-mode must be one of {sorted(MODES)}, got {self.mode!r}")
        allowed_bits, default_group, allowed_groups = MODES[self.mode]
        group = self.group_size
        if self.bits is not None:
            if self.bits not in allowed_bits:
                raise OptionsError(f"--bits {self.bits} is not valid for mode {self.mode} (allowed: {allowed_bits})")
            group = group or default_group
            if group not in allowed_groups:
                raise OptionsError(
                    f"--group-size {group} is not valid for mode {self.mode} (allowed: {allowed_groups})"
                )
        if self.mtp not in MTP_POLICIES:
            raise OptionsError(f"--mtp must be one of {MTP_POLICIES}, got {self.mtp!r}")
        mtp = self.mtp
        if self.mtp_bits is not None:
            if self.mtp_bits not in MODES["affine"][0]:
                raise OptionsError(f"--mtp-bits {self.mtp_bits} is not a valid affine bit width")
            if mtp not in ("keep", "bits"):
                raise OptionsError(f"--mtp-bits conflicts with --mtp {mtp}")
            mtp = "bits"
        elif mtp == "bits":
            raise OptionsError("--mtp bits needs --mtp-bits N")
        if mtp == "match" and self.bits is None:
            raise OptionsError("--mtp match needs --bits (there is no backbone quantization to match)")
        return QuantOptions(self.bits, group, self.mode, mtp, self.mtp_bits)

    @property
    def backbone(self) -> Optional[QuantSpec]:
        return QuantSpec(self.bits, self.group_size, self.mode) if self.bits is not None else None


def decide(slot: Slot, opts: QuantOptions) -> Optional[QuantSpec]:
    """The quantization of one output tensor, or None to keep it at --dtype."""
    if slot.kind not in QUANTIZABLE or slot.group == VISION or slot.kind == FC:
        return None
    if slot.group == MTP:
        if opts.mtp == "keep":
            return None
        if opts.mtp == "bits":
            spec = QuantSpec(opts.mtp_bits, opts.group_size if opts.mode == "affine" and opts.group_size else 64)
            if slot.kind == ROUTER:
                spec = QuantSpec(ROUTER_SPEC_BITS, ROUTER_SPEC_GROUP)
            return spec if slot.shape[-1] % spec.group_size == 0 else None
    base = opts.backbone
    if base is None:
        return None
    spec = QuantSpec(ROUTER_SPEC_BITS, ROUTER_SPEC_GROUP) if slot.kind == ROUTER else base
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
    default = opts.backbone or specs[0]
    block: Dict[str, Union[int, str, bool, dict]] = default.as_config()
    for slot, q in sorted(decisions.items(), key=lambda kv: kv[0].name):
        if slot.kind not in QUANTIZABLE or slot.group == VISION:
            continue
        if q is None:
            block[slot.module] = False
        elif q != default:
            block[slot.module] = q.as_config()
    return block
