"""The plan's values: where each output tensor comes from, its steps, and the plan as a whole."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..families.base import MTP, Family, Gather, Slot
from ..io.checkpoint import MTP_FILE
from ..io.header import dtype_itemsize
from ..io.shard_writer import TensorSpec
from ..options import ConvertOptions
from .quant import QuantSpec
from .steps import ShiftNorm, Step


@dataclass(frozen=True)
class SourceRef:
    key: str
    file: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors dtype (BF16, F32, F8_E4M3, ...)
    scale: Optional["SourceRef"] = None  # the block scales of an F8_E4M3 source (plan.fp8)

    @property
    def nbytes(self) -> int:
        own = math.prod(self.shape) * dtype_itemsize(self.dtype)
        return own + (self.scale.nbytes if self.scale is not None else 0)


@dataclass
class PlanItem:
    """One output tensor (and its .scales/.biases when quantized)."""

    slot: Slot
    sources: Tuple[SourceRef, ...]
    gather: Gather
    steps: Tuple[Step, ...]  # the transform chain, in order
    dtype: str
    quant: Optional[QuantSpec]
    shard: str = ""

    @property
    def name(self) -> str:
        return self.slot.name

    def outputs(self) -> List[TensorSpec]:
        shape = self.slot.shape
        if self.quant is None:
            return [TensorSpec(self.name, self.dtype, shape)]
        q = self.quant
        scale_dtype = self.dtype if q.mode == "affine" else "uint8"
        module = self.slot.module
        out = [
            TensorSpec(module + ".weight", "uint32", q.packed_shape(shape)),
            TensorSpec(module + ".scales", scale_dtype, q.scales_shape(shape)),
        ]
        if q.has_biases:
            out.append(TensorSpec(module + ".biases", scale_dtype, q.scales_shape(shape)))
        return out

    @property
    def out_bytes(self) -> int:
        return sum(s.nbytes for s in self.outputs())

    @property
    def in_bytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


@dataclass
class Plan:
    source: Path
    family: Family
    spec: object  # the family's ModelSpec
    style: str  # raw-vlm / raw-text / mlx
    raw: bool  # the source in its raw layout, as the family decides once from the tensors (norms_zero_centred)
    dtype: str
    options: ConvertOptions
    items: List[PlanItem]
    dropped: List[Tuple[str, str]]  # (source key, reason)
    mtp_layers: int  # kept in the output
    config: dict  # config.json to write
    shards: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what the plan decided that the config did not say

    def by_group(self) -> Dict[str, List[PlanItem]]:
        out: Dict[str, List[PlanItem]] = defaultdict(list)
        for item in self.items:
            out[item.slot.group].append(item)
        return dict(out)

    @property
    def norms_shifted(self) -> bool:
        """Whether this conversion adds 1 to any RMSNorm gain. Not the same as ``raw``: a family whose runtime
        centres its zero-centred norms itself, or whose norms are plain gains, converts a raw source unshifted."""
        return any(isinstance(step, ShiftNorm) for item in self.items for step in item.steps)

    @property
    def head_items(self) -> List[PlanItem]:
        return [it for it in self.items if it.slot.group == MTP]

    @property
    def model_shards(self) -> List[str]:
        """The shards the index lists (everything but the MTP sidecar)."""
        return [s for s in self.shards if s != MTP_FILE]

    def source_files(self) -> List[str]:
        return sorted({s.file for it in self.items for s in it.sources})

    def to_json(self) -> dict:
        return {
            "source": str(self.source),
            "model_type": self.spec.model_type,
            "layout": self.style,
            "norm_shift": self.norms_shifted,
            "dtype": self.dtype,
            "mtp_layers": self.mtp_layers,
            "notes": list(self.notes),
            "mtp_policy": self.options.quant.mtp,
            "mtp_layout": self.options.mtp_layout if self.mtp_layers else None,
            "quantization": self.config.get("quantization"),
            "shards": self.shards,
            "dropped": [{"key": k, "reason": r} for k, r in self.dropped],
            "tensors": [
                {
                    "name": it.name,
                    "group": it.slot.group,
                    "kind": it.slot.kind,
                    "sources": [s.key for s in it.sources],
                    **({"scales": [s.scale.key for s in it.sources]} if it.sources[0].scale else {}),
                    "source_files": sorted({s.file for s in it.sources}),
                    "steps": [s.label for s in it.steps],
                    "shape": list(it.slot.shape),
                    "dtype": it.dtype,
                    "quant": it.quant.as_config() if it.quant else None,
                    "shard": it.shard,
                    "outputs": [{"key": o.key, "dtype": o.dtype, "shape": list(o.shape)} for o in it.outputs()],
                }
                for it in self.items
            ],
        }
