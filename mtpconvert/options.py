"""The options a conversion takes, and the one vocabulary of their choices.

The CLI builds its choices from these tuples, the recipes validate against them, the
plan checks them: a new mode or dtype is added here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import OptionsError

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# mode -> (allowed bits, default group size, allowed group sizes)
MODES = {
    "affine": ((2, 3, 4, 5, 6, 8), 64, (32, 64, 128)),
    "mxfp4": ((4,), 32, (32,)),
    "nvfp4": ((4,), 16, (16,)),
    "mxfp8": ((8,), 32, (32,)),
}
MTP_POLICIES = ("keep", "match", "bits", "drop")
# Where the MTP head is written (docs/interop.md says which runtime reads which):
#   sidecar   root mtp.safetensors (mtp.* keys) + mtp/weights.safetensors link + manifest; the
#             model shards hold no mtp.* key, so no mlx-lm version shifts the backbone twice
#   in-model  language_model.mtp.* inside the model shards (mlx-lm PR #990, oMLX)
MTP_LAYOUTS = ("sidecar", "in-model")
DEFAULT_MAX_SHARD_BYTES = 5 << 30


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
        if self.bits is None and self.mode != "affine":
            raise OptionsError(f"--q-mode {self.mode} needs --bits {allowed_bits[0]} (without --bits nothing is "
                               "quantized)")
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


@dataclass(frozen=True)
class ConvertOptions:
    dtype: Optional[str] = None  # None: the source's float dtype (config "dtype"/"torch_dtype")
    quant: QuantOptions = QuantOptions()
    keep_vision: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    mtp_layout: str = "sidecar"


@dataclass(frozen=True)
class ExecuteOptions:
    """How ``execute`` writes OUT: whether an existing OUT is replaced, whether shards an interrupted run of
    the same plan finished are reused, what the index records beside the plan, and the pipeline's sizes (the
    bytes written do not depend on ``workers`` or ``block_bytes``: tests and benchmarks vary them)."""

    overwrite: bool = False
    resume: bool = False
    extra_metadata: Optional[dict] = None  # entries of the index's metadata.mtpconvert beside the plan's
    workers: Optional[int] = None  # MLX CPU streams; None: one per core, at most 8
    block_bytes: Optional[int] = None  # a block's source bytes at most (one row at least); None: the default

    def __post_init__(self):
        for name, value in (("workers", self.workers), ("block_bytes", self.block_bytes)):
            if value is not None and value < 1:
                raise OptionsError(f"{name} must be 1 or more, not {value!r}")
