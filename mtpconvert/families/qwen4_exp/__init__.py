"""Qwen3.8-Flash-Next (``qwen4_exp``): the family's rules.

The release is a VLM wrapper like Qwen3.5's: ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` and
a top-level ``mtp.*`` head; its text model is Qwen3.5's GatedDeltaNet and gated attention (here with a sparse
indexer) under MoE on every layer, with four hyper-connection streams around every block and per-layer n-gram
("PLE") embeddings, whose tables (tens of billions of rows in all) are stored in ``shard_i`` row parts. mlx-lm
has no module for it: mlx-vlm 0.7.10 loads the backbone (``models/qwen4_exp``) and drafts with the head
(``speculative/drafters/qwen4_exp_mtp``), and every rule below follows what its ``sanitize`` makes of a raw
folder (``models/qwen4_exp/qwen4_exp.py:27-86``):

* keys: ``model.language_model.X`` -> ``language_model.model.X``, ``lm_head`` -> ``language_model.lm_head``,
  ``model.visual.X`` -> ``vision_tower.X``; the head stays ``mtp.X``;
* experts, backbone and head alike: per expert ``experts.{e}.{gate,up,down}_proj.weight`` stacked, or the fused
  ``experts.gate_up_proj`` [E, 2I, H] split along its rows (gate first) and ``experts.down_proj`` taken whole,
  into ``switch_mlp.{gate,up,down}_proj.weight``;
* ``ngram_embedding.shard_N.weight`` -> ``ngram_embedding.shards.N.weight``; the hashing buffers as stored;
* conv1d ``[C, 1, K]`` -> ``[C, K, 1]`` (the linear attention's and the PLE's), decided from the tensors;
* no norm is shifted (``slots``).

FP8 releases store the experts as block FP8 and each n-gram table's parts under one per-tensor scale
(``ngram_embedding.weight_scale``); both are dequantized exactly (``plan.fp8``).
"""

from __future__ import annotations

import copy
import re
from typing import List

from ...errors import LayoutError
from ..base import MLX, RAW_TEXT, RAW_VLM, Capabilities, Family, HeadDesign, Mapped, ModulePaths
from ..qwen3_5 import mapped_experts, norms_zero_centred
from .slots import HEAD_PREFIX, LM, LM_HEAD, expected_slots
from .spec import FULL_ATTENTION, MODEL_TYPES, model_spec

RAW_LM = "model.language_model."
NGRAM_PART = re.compile(r"\.ngram_embedding\.shard_(\d+)\.")


def key_style(key: str) -> str:
    if key.startswith((LM, "vision_tower.")):
        return MLX
    if key.startswith((RAW_LM, "model.visual.")):
        return RAW_VLM
    if key.startswith("model."):
        return RAW_TEXT
    return ""  # lm_head.weight, mtp.*: the same in every style


def _target(key: str) -> str:
    """The canonical MLX name of a key before its experts are mapped."""
    if key.startswith(LM) or key.startswith(HEAD_PREFIX):
        name = key
    elif key.startswith(RAW_LM):
        name = LM + "model." + key[len(RAW_LM):]
    elif key == "lm_head.weight":
        name = LM_HEAD
    else:
        raise LayoutError("tensor is outside every qwen4_exp namespace (model.language_model.*, model.visual.*, "
                          "lm_head, mtp.*)", key=key)
    return NGRAM_PART.sub(r".ngram_embedding.shards.\1.", name)


def contributions(key: str) -> List[Mapped]:
    """Every output tensor one source key contributes to (the expert mapping is Qwen3.5's: per expert, or the fused
    ``gate_up_proj`` split in halves)."""
    if key.startswith("model.visual."):
        return [Mapped(key, None, vision="vision_tower." + key[len("model.visual."):])]
    if key.startswith("vision_tower."):
        return [Mapped(key, None, vision=key)]
    return mapped_experts(key, _target(key))


def source_name(mlx_name: str, style: str) -> str:
    """The key a source of ``style`` would use for an MLX name (error messages)."""
    if style == MLX:
        return mlx_name
    name = re.sub(r"\.ngram_embedding\.shards\.(\d+)\.", r".ngram_embedding.shard_\1.", mlx_name)
    if name == LM_HEAD:
        return "lm_head.weight"
    if name.startswith(LM + "model."):
        return RAW_LM + name[len(LM + "model."):]
    return name


def loadable_config(config: dict) -> dict:
    """The output config, as mlx-vlm's ``TextConfig`` reads it (``models/qwen4_exp/config.py:24-112``): the
    full-attention layers named ``full_attention`` (transformers 5.24 saves ``indexed_attention``, which mlx-vlm
    refuses), and ``split_ngram_parts`` stated (mlx-vlm's default, 128, is not transformers', 512)."""
    out = copy.deepcopy(config)
    tc = out["text_config"]
    if isinstance(tc.get("layer_types"), list):
        tc["layer_types"] = ["full_attention" if t in FULL_ATTENTION else t for t in tc["layer_types"]]
    if tc.get("ple_layer_ids"):
        tc.setdefault("split_ngram_parts", 512)
    return out


HEAD = HeadDesign(
    forward="qwen4-hc-mtp",
    projection="mtp.fc_embedding [H, H] + mtp.fc_hidden [H, H] on each of the hc streams",
    concat=("pre_fc_norm_embedding(embed(t+1))", "pre_fc_norm_hidden(h_t) over all hc streams"),
    layer="one sparse-attention decoder layer (the backbone's MoE and hyper-connections) with its own KV cache",
    output="lm_head(mtp.hyper_connection_mixer(h))",
    hidden_state="pre_mixer",
    shares=("embed_tokens", "lm_head"),
    norms_zero_centred=True,
)

FAMILY = Family(
    name="qwen4_exp",
    title="Qwen3.8-Flash-Next (hyper-connections, n-gram embeddings, sparse attention, MoE)",
    model_types=MODEL_TYPES,
    head=HEAD,
    backbone_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    head_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    mtp_layouts=("sidecar",),
    head_prefix=HEAD_PREFIX,
    lm_head=LM_HEAD,
    capabilities=Capabilities(batched=True, pre_norm_hidden=False),
    backbone="mtpconvert.families.qwen4_exp.backbone:Qwen4ExpBackbone",
    compat="mtpconvert.families.qwen4_exp.compat:rows",
    spec=model_spec,
    expected_slots=expected_slots,
    contributions=contributions,
    key_style=key_style,
    source_name=source_name,
    is_zero_centred_norm=lambda name: False,  # zero-centred in both layouts: nothing to check for a +1
    norms_zero_centred=norms_zero_centred,  # the raw layout (conv1d [C, 1, K]): the conv axis moves
    backbone_library="mlx-vlm",
    text_prefix=LM,
    # no final norm: the mixer over the hyper-connection streams stands where it would
    modules=ModulePaths(LM + "model.embed_tokens", LM + "model.layers", LM + "model.hyper_connection_mixer",
                        LM + "lm_head"),
    loadable_config=loadable_config,
)
