"""Broken conversions made on purpose: a correct output folder edited the way a buggy converter would write it.

Used by the text-fixture tests and benchmarks/fixture_acceptance.py to show that acceptance (and
so ``smoke``) separates a broken head from a correct one. Each edit rewrites tensors of a copy:

    noshift_head     the MTP head's RMSNorm weights left zero-centred (the raw value, no +1)
    noshift_all      every zero-centred RMSNorm left unshifted, backbone too
    fc_swapped       the two input halves of mtp.fc (GLM: mtp.eh_proj) swapped (embedding/hidden concat order mixed up)
    experts_rev      (MoE) every layer's experts stacked in reverse order
    mtp_experts_rev  (MoE) only the MTP layer's experts reversed (its per-expert part of the raw layout)

The head may sit in the model shards (``language_model.mtp.*``, in-model layout) or in the root
``mtp.safetensors`` sidecar and its ``mtp/weights.safetensors`` twin (``mtp.*``): all are edited.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Dict, Optional

EDITS = ("noshift_head", "noshift_all", "fc_swapped", "experts_rev", "mtp_experts_rev")
MOE_ONLY = ("experts_rev", "mtp_experts_rev")
# RMSNorms stored zero-centred in the raw checkpoint (the converter adds 1); the GatedDeltaNet's
# own norm is not one of them
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
TOP_NORMS = ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
             "mtp.pre_fc_norm_embedding.weight")
WRAPPER = "language_model."


def weight_files(folder: Path):
    """Every safetensors file of a converted folder that can hold backbone or head tensors."""
    files = sorted(folder.glob("model*.safetensors")) + [folder / "mtp.safetensors", folder / "mtp/weights.safetensors"]
    return [f for f in files if f.exists()]


def raw_name(name: str, raw: Dict) -> str:
    """The raw Hugging Face key of a converted tensor name: Qwen3.5's ``model.language_model.`` backbone, or
    the same name where the release's keys are mlx-lm's (Qwen3-Next)."""
    name = name[len(WRAPPER):] if name.startswith(WRAPPER) else name
    vlm = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
    return vlm if vlm in raw else name


def is_zero_centred_norm(name: str) -> bool:
    name = name[len(WRAPPER):] if name.startswith(WRAPPER) else name
    return name.endswith(LAYER_NORMS) or name in TOP_NORMS


def in_head(name: str) -> bool:
    return (name[len(WRAPPER):] if name.startswith(WRAPPER) else name).startswith("mtp.")


def editor(edit: str, raw: Dict) -> Callable:
    """``fn(name, tensor) -> new tensor or None`` for one of ``EDITS``; ``raw`` holds the raw checkpoint."""
    import mlx.core as mx

    def fn(name, w) -> Optional["mx.array"]:
        if edit in ("noshift_head", "noshift_all") and is_zero_centred_norm(name):
            if edit == "noshift_all" or in_head(name):
                return raw[raw_name(name, raw)].astype(w.dtype)
        elif edit == "fc_swapped" and name.endswith(("mtp.fc.weight", "mtp.eh_proj.weight")) and w.dtype != mx.uint32:
            half = w.shape[1] // 2
            return mx.concatenate([w[:, half:], w[:, :half]], axis=1)
        elif edit in MOE_ONLY and ".switch_mlp." in name and (edit == "experts_rev" or in_head(name)):
            return w[::-1]
        return None

    return fn


def break_folder(base: Path, out: Path, raw_folder: Path, edit: str) -> int:
    """Copy ``base`` to ``out`` with ``edit`` applied; returns how many tensors changed (0: nothing to break)."""
    import mlx.core as mx

    if edit not in EDITS:
        raise ValueError(f"unknown edit {edit!r}; one of {EDITS}")
    shutil.copytree(base, out)
    raw = {}
    for f in sorted(Path(raw_folder).glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    fn = editor(edit, raw)
    changed = 0
    for shard in weight_files(out):
        weights, meta = mx.load(str(shard), return_metadata=True)
        touched = 0
        for name in list(weights):
            new = fn(name, weights[name])
            if new is not None:
                weights[name] = mx.contiguous(new)
                touched += 1
        if touched:
            mx.save_safetensors(str(shard), weights, metadata=meta)
        changed += touched if shard.name != "weights.safetensors" else 0  # the sidecar's twin counts once
    return changed
