"""Source key -> MLX key, and the expert patterns that stack or split.

Raw Hugging Face keys come in three namespaces: ``model.language_model.*`` (VLM
wrapper), ``model.*`` (text-only save), and top-level ``lm_head`` / ``mtp.*``.
MLX folders already use ``language_model.*``. Both map onto one canonical MLX name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .errors import LayoutError
from .schema import LM

RAW_VLM = "raw-vlm"  # model.language_model.* (published Qwen3.5/3.6)
RAW_TEXT = "raw-text"  # model.* (text-only save_pretrained)
MLX = "mlx"  # language_model.* (mlx-lm / mlx-vlm output)

PER_EXPERT = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_GATE_UP = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.gate_up_proj$")
FUSED_DOWN = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.down_proj$")
QUANT_AUX = re.compile(r"\.(scales|biases|global_scale)$")


@dataclass(frozen=True)
class Mapped:
    """Where one source tensor goes.

    ``part`` says how it contributes to ``target``: ``whole``; ``expert`` (row
    ``index`` of a stack); ``gate_half`` / ``up_half`` of a fused gate_up tensor.
    ``target`` is None for vision tensors (``vision`` holds the MLX name then).
    """

    source: str
    target: Optional[str]
    part: str = "whole"
    index: int = 0
    vision: Optional[str] = None


def key_style(key: str) -> str:
    if key.startswith(LM) or key.startswith("vision_tower."):
        return MLX
    if key.startswith("model.language_model.") or key.startswith("model.visual."):
        return RAW_VLM
    if key.startswith("model."):
        return RAW_TEXT
    return ""  # lm_head.weight / mtp.*: shared by both raw styles


def canonical(key: str) -> Mapped:
    """Map one source key; raise for keys outside every known namespace."""
    if key.startswith("model.visual."):
        return Mapped(key, None, vision="vision_tower." + key[len("model.visual."):])
    if key.startswith("vision_tower."):
        return Mapped(key, None, vision=key)
    if key.startswith(LM):
        name = key
    elif key.startswith("model.language_model."):
        name = LM + "model." + key[len("model.language_model."):]
    elif key.startswith("mtp."):
        name = LM + key
    elif key == "lm_head.weight":
        name = LM + "lm_head.weight"
    elif key.startswith("model."):
        name = LM + key
    else:
        raise LayoutError("tensor is outside every Qwen3.5 namespace", key=key)

    if m := PER_EXPERT.match(name):
        return Mapped(key, f"{m['mlp']}.switch_mlp.{m['proj']}.weight", "expert", int(m["e"]))
    if m := FUSED_GATE_UP.match(name):
        # gate_up_proj is [E, 2I, H]; split along axis 1 into the two halves.
        return Mapped(key, f"{m['mlp']}.switch_mlp.gate_proj.weight", "gate_up")
    if m := FUSED_DOWN.match(name):
        return Mapped(key, f"{m['mlp']}.switch_mlp.down_proj.weight", "whole")
    return Mapped(key, name)


def source_name(mlx_name: str, style: str) -> str:
    """The key a source of ``style`` would use for an MLX name (for error messages)."""
    if style == MLX:
        return mlx_name
    rest = mlx_name[len(LM):] if mlx_name.startswith(LM) else mlx_name
    if rest.startswith("model."):
        inner = rest[len("model."):]
        return ("model.language_model." if style == RAW_VLM else "model.") + inner
    return rest  # lm_head.weight, mtp.*
