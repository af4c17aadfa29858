"""Source key -> MLX key, and the expert patterns that stack or split.

Raw Hugging Face keys come in three namespaces: ``model.language_model.*`` (VLM
wrapper), ``model.*`` (text-only save), and top-level ``lm_head`` / ``mtp.*``.
MLX folders already use ``language_model.*``. Both map onto one canonical MLX name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

from ..errors import LayoutError
from .slots import LM

RAW_VLM = "raw-vlm"  # model.language_model.* (published Qwen3.5/3.6)
RAW_TEXT = "raw-text"  # model.* (text-only save_pretrained)
MLX = "mlx"  # language_model.* (mlx-lm / mlx-vlm output)

PER_EXPERT = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_GATE_UP = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.gate_up_proj$")
FUSED_DOWN = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.down_proj$")
QUANT_AUX = re.compile(r"\.(scales|biases|global_scale)$")


class Gather(str, Enum):
    """How an item's source tensors become one array, before any step runs.

    The same values say how one source key contributes to its target (``model.keys``):
    a whole tensor, one row of an expert stack, or one half of a fused ``gate_up_proj``.
    """

    LOAD = "load"  # one source tensor, as it is
    STACK = "stack"  # one source per expert, stacked along a new leading axis
    GATE_HALF = "gate_half"  # first half of a fused [E, 2I, H] gate_up_proj along axis 1
    UP_HALF = "up_half"  # second half of it
    VISION_PATCH = "vision_patch"  # Conv3d patch embedding, moved to channels-last

    @property
    def half(self) -> int:
        """0 or 1 for the halves of a fused gate_up tensor."""
        return (Gather.GATE_HALF, Gather.UP_HALF).index(self)


HALVES = (Gather.GATE_HALF, Gather.UP_HALF)


@dataclass(frozen=True)
class Mapped:
    """Where one source tensor goes, and how it contributes to ``target``.

    ``part`` is LOAD (the whole tensor), STACK (row ``index`` of an expert stack) or
    GATE_HALF / UP_HALF (one half of a fused gate_up tensor). ``target`` is None for
    vision tensors (``vision`` holds the MLX name then).
    """

    source: str
    target: Optional[str]
    part: Gather = Gather.LOAD
    index: int = 0
    vision: Optional[str] = None

    @property
    def expert_layout(self) -> Optional[str]:
        """per-expert | fused | stacked for an expert weight, None otherwise."""
        if self.target is None or ".switch_mlp." not in self.target:
            return None
        if self.part is Gather.STACK:
            return "per-expert"
        if self.part in HALVES or ".experts." in self.source:
            return "fused"
        return "stacked"


def key_style(key: str) -> str:
    if key.startswith(LM) or key.startswith("vision_tower."):
        return MLX
    if key.startswith("model.language_model.") or key.startswith("model.visual."):
        return RAW_VLM
    if key.startswith("model."):
        return RAW_TEXT
    return ""  # lm_head.weight / mtp.*: shared by both raw styles


def _target(key: str) -> Optional[str]:
    """The canonical MLX name of a key before expert handling; None for vision keys."""
    if key.startswith(("model.visual.", "vision_tower.")):
        return None
    if key.startswith(LM):
        return key
    if key.startswith("model.language_model."):
        return LM + "model." + key[len("model.language_model."):]
    if key.startswith("mtp.") or key == "lm_head.weight":
        return LM + key
    if key.startswith("model."):
        return LM + key
    raise LayoutError("tensor is outside every Qwen3.5 namespace", key=key)


def contributions(key: str) -> List[Mapped]:
    """Every output tensor one source key contributes to, and how.

    The one expert mapping, used by the plan and by verify: a per-expert weight is one row
    of its stack, a fused ``gate_up_proj`` [E, 2I, H] gives both the gate and the up stack
    (split along axis 1), a fused ``down_proj`` is the down stack whole. Raises for keys
    outside every known namespace.
    """
    if key.startswith("model.visual."):
        return [Mapped(key, None, vision="vision_tower." + key[len("model.visual."):])]
    if key.startswith("vision_tower."):
        return [Mapped(key, None, vision=key)]
    name = _target(key)
    if m := PER_EXPERT.match(name):
        return [Mapped(key, f"{m['mlp']}.switch_mlp.{m['proj']}.weight", Gather.STACK, int(m["e"]))]
    if m := FUSED_GATE_UP.match(name):
        return [Mapped(key, f"{m['mlp']}.switch_mlp.gate_proj.weight", Gather.GATE_HALF),
                Mapped(key, f"{m['mlp']}.switch_mlp.up_proj.weight", Gather.UP_HALF)]
    if m := FUSED_DOWN.match(name):
        return [Mapped(key, f"{m['mlp']}.switch_mlp.down_proj.weight")]
    return [Mapped(key, name)]


def source_name(mlx_name: str, style: str) -> str:
    """The key a source of ``style`` would use for an MLX name (for error messages)."""
    if style == MLX:
        return mlx_name
    rest = mlx_name[len(LM):] if mlx_name.startswith(LM) else mlx_name
    if rest.startswith("model."):
        inner = rest[len("model."):]
        return ("model.language_model." if style == RAW_VLM else "model.") + inner
    return rest  # lm_head.weight, mtp.*
