"""What a plan writes besides its tensors' values: which output shard each item goes to, and config.json."""

from __future__ import annotations

import copy
import re
from typing import List, Tuple

from ..io.checkpoint import MTP_FILE, Checkpoint
from .items import PlanItem


def natural_key(name: str) -> Tuple:
    """``name`` with its digit runs as numbers: ``layers.2`` sorts before ``layers.10``."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name)))


def order_and_shard(ckpt: Checkpoint, items: List[PlanItem], max_bytes: int) -> None:
    """Order work by source shard (so each raw shard is finished early) and assign output shards."""
    shard_index = {name: i for i, name in enumerate(ckpt.shards)}

    def key(item: PlanItem):
        # within a source shard, by name with numbers compared as numbers (layers 2 before 10): the
        # output shards then hold layers in order, so the streamed smoke (runtime.smoke.streamed) can run
        # each layer as its shard is finished instead of holding shards for a layer to come
        return (max(shard_index[s.file] for s in item.sources), natural_key(item.name))

    items.sort(key=key)
    groups: List[List[PlanItem]] = [[]]
    size = 0
    for item in items:
        if item.shard == MTP_FILE:
            continue
        b = item.out_bytes
        if groups[-1] and size + b > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += b
    n = len(groups)
    for i, group in enumerate(groups):
        for item in group:
            item.shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def output_config(config: dict, spec, mtp_layers: int, quantization, keep_vision: bool, mtp_count_key: str) -> dict:
    """config.json for the output: loadable by stock mlx-lm, honest about MTP and quantization."""
    out = copy.deepcopy(config)
    # a converted source's head placement is re-decided by this conversion's layout
    for k in ("quantization", "quantization_config", "mlx_lm_extra_tensors"):
        out.pop(k, None)
    tc = out["text_config"] if "text_config" in out else out
    tc.pop("quantization_config", None)
    tc.pop("mtp_hidden_state_mode", None)
    tc[mtp_count_key] = mtp_layers
    tc["tie_word_embeddings"] = spec.tie_word_embeddings
    if "text_config" in out:
        out["tie_word_embeddings"] = spec.tie_word_embeddings
        if not keep_vision:
            out.pop("vision_config", None)
    out["model_type"] = spec.model_type
    if quantization is not None:
        out["quantization"] = quantization
        out["quantization_config"] = copy.deepcopy(quantization)
    return out
