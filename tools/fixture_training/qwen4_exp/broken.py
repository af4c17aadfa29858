"""Broken qwen4_exp conversions made on purpose: a correct MLX folder edited the way a buggy converter would write it
(``check`` measures them, the tests show the smoke refuses them).

    fc_swapped          the head's ``fc_embedding`` and ``fc_hidden`` exchanged (the two inputs' projections mixed up)
    head_norms_plus_one every zero-centred RMS norm of the head shifted by +1
    all_norms_plus_one  every zero-centred RMS norm shifted by +1, backbone and head: Qwen3.5's rule applied to this
                        family, whose norms mlx-vlm shifts itself (the GatedDeltaNet's gated norm, stored as is, stays)

The head is edited in ``mtp.safetensors`` and its ``mtp/weights.safetensors`` twin, the backbone in its shards.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

EDITS = ("fc_swapped", "head_norms_plus_one", "all_norms_plus_one")
# transformers' Qwen4ExpTextRMSNorm / mlx-vlm's Qwen4ExpRMSNorm, the norms that compute x * (1 + w)
ZERO_CENTRED = re.compile(r"\.(hc_norm|q_norm|k_norm|q_layernorm|k_layernorm|norm_key|norm_query|norm_conv|"
                          r"pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$")


def _edit(weights: dict, edit: str, head: bool) -> int:
    """Apply ``edit`` to one file's tensors in place; the number of tensors changed."""
    if edit == "fc_swapped":
        keys = [next((k for k in weights if k.endswith(f"fc_{x}.weight")), None) for x in ("embedding", "hidden")]
        if None in keys:
            return 0
        a, b = keys
        weights[a], weights[b] = weights[b], weights[a]
        return 2
    if edit == "head_norms_plus_one" and not head:
        return 0
    touched = [k for k in weights if ZERO_CENTRED.search("." + k)]
    weights.update({k: weights[k] + 1 for k in touched})
    return len(touched)


def break_folder(base: Path, out: Path, edit: str) -> int:
    """Copy ``base`` to ``out`` with ``edit`` applied; returns how many tensors changed (the head's twin not
    counted)."""
    import mlx.core as mx

    if edit not in EDITS:
        raise ValueError(f"unknown edit {edit!r}; one of {EDITS}")
    shutil.copytree(base, out)
    changed = 0
    files = sorted(out.glob("model*.safetensors")) + [out / "mtp.safetensors", out / "mtp" / "weights.safetensors"]
    for f in files:
        if not f.exists():
            continue
        weights, meta = mx.load(str(f), return_metadata=True)
        n = _edit(weights, edit, head=f.name in ("mtp.safetensors", "weights.safetensors"))
        if n:
            mx.save_safetensors(str(f), weights, metadata=meta)
        changed += n if f.name != "weights.safetensors" else 0
    return changed
