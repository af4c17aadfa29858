"""The plan's vocabulary: how an item's sources are gathered, and the steps that transform them.

Steps are small frozen values; execution dispatches on their type (``execute.ops``) and
the table, the JSON plan and the resume fingerprint show their ``label``. Nothing parses
a label back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..families.base import HALVES, KV_B_PARTS, Gather  # noqa: F401  (re-exported: the plan's vocabulary)
from .quant import QuantSpec


@dataclass(frozen=True)
class DequantFP8:
    """FP8 sources to float32: e4m3 codes times their ``block`` x ``block`` scale (``block`` 0: one scale for
    the tensor); done as each source is read (every expert with its own scale), before the gather."""

    block: int

    @property
    def label(self) -> str:
        return f"dequant:fp8e4m3/{self.block or 'tensor'}"


@dataclass(frozen=True)
class DequantMXFP4:
    """MXFP4 sources to float32: each E2M1 code (two a byte, the low nibble first) times ``2^(e - 127)`` of its
    32-input group's E8M0 scale; done as each source is read, before the gather."""

    @property
    def label(self) -> str:
        return "dequant:mxfp4/32"


@dataclass(frozen=True)
class CarryMX:
    """A source MLX holds as it is stored (plan.fp8.carried): its codes viewed as ``mode``'s uint32 words and its
    E8M0 scales as ``mode``'s uint8 scales (FP8's block scales repeated over the block's rows and 32-wide groups);
    done as the source is read, no value computed."""

    mode: str  # mxfp4 | mxfp8

    @property
    def label(self) -> str:
        return f"carry:{self.mode}"


@dataclass(frozen=True)
class StackExperts:
    """Expert e of the sources at row e (SwitchLinear layout); done by the gather."""

    @property
    def label(self) -> str:
        return "stack_experts"


@dataclass(frozen=True)
class SplitGateUp:
    """One half of a fused [E, 2I, H] gate_up_proj; done by the gather."""

    half: int

    @property
    def label(self) -> str:
        return f"split_gate_up[{self.half}]"


@dataclass(frozen=True)
class SplitKVB:
    """One part of an MLA kv_b_proj, per head (embed_q transposed, or unembed_out); done by the gather."""

    part: str  # Gather.EMBED_Q or Gather.UNEMBED_OUT's value

    @property
    def label(self) -> str:
        return f"split_kv_b[{self.part}]"


@dataclass(frozen=True)
class GroupRows:
    """A [G * R, C] matrix as [G, R, C] (the groups of a grouped projection, MultiLinear); done by the gather."""

    @property
    def label(self) -> str:
        return "group_rows"


@dataclass(frozen=True)
class PatchChannelsLast:
    """Vision Conv3d patch embedding [O, C, T, H, W] -> [O, T, H, W, C]; done by the gather."""

    @property
    def label(self) -> str:
        return "patch_channels_last"


@dataclass(frozen=True)
class ConvAxis:
    """Depthwise conv1d weight [C, 1, K] -> [C, K, 1]."""

    @property
    def label(self) -> str:
        return "conv_axis"


@dataclass(frozen=True)
class ShiftNorm:
    """Zero-centred RMSNorm weight w -> 1 + w (in float32)."""

    @property
    def label(self) -> str:
        return "norm+1"


@dataclass(frozen=True)
class Cast:
    dtype: str

    @property
    def label(self) -> str:
        return f"cast:{self.dtype}"


@dataclass(frozen=True)
class Quantize:
    spec: QuantSpec

    @property
    def label(self) -> str:
        q = self.spec
        return f"quantize:{q.bits}b/g{q.group_size}/{q.mode}"


Step = Union[DequantFP8, DequantMXFP4, CarryMX, StackExperts, SplitGateUp, SplitKVB, GroupRows, PatchChannelsLast,
             ConvAxis, ShiftNorm, Cast, Quantize]
# steps the read and the gather have already done when the chain runs
GATHER_STEPS = (DequantFP8, DequantMXFP4, CarryMX, StackExperts, SplitGateUp, SplitKVB, GroupRows, PatchChannelsLast)


def gather_step(gather: Gather):
    """The step that records a gather in the chain, or None for a plain load."""
    if gather is Gather.STACK:
        return StackExperts()
    if gather in HALVES:
        return SplitGateUp(gather.half)
    if gather is Gather.VISION_PATCH:
        return PatchChannelsLast()
    if gather in KV_B_PARTS:
        return SplitKVB(gather.value)
    if gather is Gather.GROUPS:
        return GroupRows()
    return None
