"""MLX-named weights -> the raw Hugging Face layout (the inverse of convert).

Used to publish the bundled fixture in exactly the form the hub serves, and by the
tests to build raw MTP tensors. Expert layouts:
``per_expert`` (transformers' save_pretrained), ``fused`` (Qwen3.6: backbone and MTP
fused) and ``published35`` (Qwen3.5 MoE: fused backbone, per-expert MTP).
"""

from __future__ import annotations

import re
from typing import Dict

import mlx.core as mx

from mtpconvert.families.base import RAW_TEXT, RAW_VLM
from mtpconvert.families.qwen3_5 import LM, is_zero_centred_norm, source_name

SWITCH = re.compile(r"^(?P<mlp>.+\.mlp)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
EXPERT_LAYOUTS = ("per_expert", "fused", "published35")


def to_raw(weights: Dict[str, mx.array], *, experts: str = "per_expert", text_only: bool = False) -> Dict[str, mx.array]:
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}")
    style = RAW_TEXT if text_only else RAW_VLM
    out: Dict[str, mx.array] = {}
    fused_parts: Dict[str, Dict[str, mx.array]] = {}
    for name, w in weights.items():
        if is_zero_centred_norm(name):
            w = (w.astype(mx.float32) - 1.0).astype(w.dtype)
        if name.endswith("conv1d.weight") and w.ndim == 3 and w.shape[-1] == 1:
            w = mx.moveaxis(w, 2, 1)
        m = SWITCH.match(name)
        if m is None:
            out[source_name(name, style)] = w
            continue
        is_mtp = name.startswith(LM + "mtp.")
        fuse = experts == "fused" or (experts == "published35" and not is_mtp)
        mlp = source_name(m["mlp"], style)
        if not fuse:
            for e in range(w.shape[0]):
                out[f"{mlp}.experts.{e}.{m['proj']}.weight"] = w[e]
        elif m["proj"] == "down_proj":
            out[f"{mlp}.experts.down_proj"] = w
        else:
            parts = fused_parts.setdefault(mlp, {})
            parts[m["proj"]] = w
            if len(parts) == 2:
                out[f"{mlp}.experts.gate_up_proj"] = mx.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
    return out
