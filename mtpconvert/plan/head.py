"""Where the MTP head is written: the layouts its consumers read (docs/interop.md).

sidecar: the head in its own root file under ``mtp.*`` names, the same bytes linked where
vllm-mlx looks, and the manifest vllm-mlx reads to take the norms as stored. in-model: the
head's tensors in the model shards under their canonical names (mlx-lm PR #990, oMLX).
"""

from __future__ import annotations

import dataclasses
from typing import List

from ..families.base import LINEAR, MTP, SWITCH, Family, Gather, Slot
from ..io.checkpoint import MTP_FILE
from .items import PlanItem
from .steps import gather_step

# The sidecar file is never named model*.safetensors: mlx-lm 0.30.7-0.31.x loads that glob and
# shifts every backbone norm again when any of its keys contains "mtp.".
MTP_LINK = "mtp/weights.safetensors"
MTP_MANIFEST = "mtp/manifest.json"
# mtp/ is also a drafter folder (``--draft-model OUT/mtp`` in mlx-vlm) whose config the family writes
# (``Family.drafter_config``): for a Qwen head the model's own config, so that mlx-vlm's splitter for that
# model type reads mtp/weights.safetensors as written (format mlx: no shift); a config of mlx-vlm's own
# Qwen drafter type would send the head through that drafter's sanitize, which adds +1 to every mtp.*
# norm a second time.
MTP_DRAFTER_CONFIG = "mtp/config.json"
MTP_MANIFEST_BODY = {"artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma"}
SIDECAR_PREFIX = "mtp."


def place_head(items: List[PlanItem], layout: str, family: Family, num_experts: int) -> List[PlanItem]:
    """Name the head's items for ``layout``.

    sidecar: the family's head prefix (``language_model.mtp.X``) -> ``mtp.X`` in ``mtp.safetensors`` (what mlx-vlm, mtplx,
    rapid-mlx and vllm-mlx read). in-model: the names stay; a float MoE head is written in the
    raw per-expert form (one ``experts.{e}.{proj}.weight`` per expert), the only expert form the
    mlx-lm PR #990 branch stacks itself -- it raises on a stacked ``switch_mlp`` head.
    """
    out: List[PlanItem] = []
    for it in items:
        if it.slot.group != MTP:
            out.append(it)
        elif layout == "sidecar":
            out.append(dataclasses.replace(it, slot=sidecar_slot(it.slot, family), shard=MTP_FILE))
        elif it.slot.kind == SWITCH and it.quant is None:
            out.extend(_raw_experts(it, num_experts))
        else:
            out.append(it)
    return out


def sidecar_slot(slot: Slot, family: Family) -> Slot:
    """A head slot under its sidecar name (``mtp.X``, or the family's ``sidecar_prefix``)."""
    return dataclasses.replace(slot, name=family.sidecar_prefix + slot.name[len(family.head_prefix):])


def _raw_experts(item: PlanItem, num_experts: int) -> List[PlanItem]:
    """A float expert stack of the head in the source's raw form: per expert when the source is
    per expert, the fused ``experts.gate_up_proj`` / ``experts.down_proj`` when it is fused (the
    up half is dropped: the gate half's item writes the whole fused tensor). An MLX stack stays."""
    mlp = item.slot.name.rsplit(".switch_mlp.", 1)[0]
    (src, *_) = item.sources
    if item.gather is Gather.STACK:
        return _per_expert(item, num_experts)
    if item.gather is Gather.UP_HALF:
        return []
    if item.gather is Gather.GATE_HALF or ".experts.down_proj" in src.key:
        name = f"{mlp}.experts.{'gate_up_proj' if item.gather is Gather.GATE_HALF else 'down_proj'}"
        steps = tuple(s for s in item.steps if s != gather_step(item.gather))
        return [PlanItem(Slot(name, src.shape, LINEAR, MTP), (src,), Gather.LOAD, steps, item.dtype, None)]
    return [item]


def _per_expert(item: PlanItem, num_experts: int) -> List[PlanItem]:
    """A float stacked-expert item whose sources are per expert -> one item per expert."""
    mlp, proj = item.slot.name.rsplit(".switch_mlp.", 1)
    steps = tuple(s for s in item.steps if gather_step(Gather.STACK) != s)
    return [PlanItem(Slot(f"{mlp}.experts.{e}.{proj}", item.slot.shape[1:], LINEAR, MTP),
                     (item.sources[e],), Gather.LOAD, steps, item.dtype, None)
            for e in range(num_experts)]
