"""GLM-5.3-Flash (``glm5_next``): the family's rules.

The release is a VLM wrapper: ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``; its text model
has Kimi delta (linear) attention in three layers of four and latent sparse attention with a pooled-key indexer
(shared by the next sparse layer where ``indexer_types`` says so) in the fourth, MoE past the first dense layers,
and four hyper-connection streams around every block. The MTP head is GLM's nextn design (``families/glm``):
one more decoder layer, ``model.language_model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``
[H, 2H], ``shared_head.norm``, a sparse-attention block with its own indexer and a MoE), which borrows the
backbone's embedding and ``lm_head``. mlx-lm has no module for it: mlx-vlm 0.7.10 loads the backbone
(``models/glm5_next``) and drafts with the head (``speculative/drafters/glm5_next_mtp``), and the rules follow
what its ``sanitize`` and splitter make of a raw folder:

* keys: ``model.language_model.X`` -> ``language_model.model.X``, ``lm_head`` -> ``language_model.lm_head``,
  ``model.visual.X`` -> ``vision_tower.X``; the nextn layer is the head (``mtp.X``, stored in the sidecar as
  ``language_model.model.layers.{N}.X``, the names mlx-vlm's splitter selects: ``Family.sidecar_prefix``);
* ``hc_{attn,ffn}_{fn,base,scale}`` -> ``{attn,ffn}_hc.{fn,base,scale}``; ``{q,k,v}_conv1d.weight`` [C, 1, K] ->
  ``{q,k,v}_conv.conv.weight`` [C, K, 1] (the raw layout told by the conv axis);
* experts per expert (or fused ``experts.gate_up_proj`` / ``down_proj``) stacked into ``switch_mlp``;
  ``kv_b_proj`` split per head into ``embed_q`` / ``unembed_out``;
* no norm is shifted (``slots``); the nextn layer's own ``embed_tokens`` / ``shared_head.head`` (GLM-4.x's) are
  refused: mlx-vlm's drafter has no parameter for them.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from functools import partial
from typing import List, Mapping

from ...errors import ConfigError, LayoutError
from ..base import MLX, RAW_VLM, Capabilities, Family, Gather, HeadDesign, Mapped, ModulePaths, text_config
from ..qwen3_5 import mapped_experts
from .slots import HEAD_PREFIX, LAYERS, LM, LM_HEAD, expected_slots
from .spec import LINEAR_ATTENTION, MODEL_TYPES, model_spec

RAW_LM = "model.language_model."
KV_B = "self_attn.kv_b_proj.weight"
CONV_RAW = re.compile(r"\.self_attn\.([qkv])_conv1d\.weight$")
CONV_MLX = re.compile(r"\.self_attn\.([qkv])_conv\.conv\.weight$")
HC_RAW = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")
HEAD_OWN_VOCAB = ("embed_tokens.", "shared_head.head.")


def key_style(key: str) -> str:
    if key.startswith((LM, "vision_tower.")):
        return MLX
    if key.startswith(("model.", "lm_head.")):
        return RAW_VLM
    return ""  # mtp.*: our own sidecar's canonical names


def _local(rest: str) -> str:
    """A layer's raw key (after ``layers.{i}.``) under mlx-vlm's name, experts not yet mapped."""
    rest = HC_RAW.sub(r".\1_hc.\2", "." + rest)[1:]
    return CONV_RAW.sub(r".self_attn.\1_conv.conv.weight", "." + rest)[1:]


def _layer(key: str, target: str, rest: str) -> List[Mapped]:
    """One layer's key under its target layer prefix: kv_b_proj split per head, experts stacked, the rest renamed."""
    if rest == KV_B:
        return [Mapped(key, target + "self_attn.embed_q.weight", Gather.EMBED_Q),
                Mapped(key, target + "self_attn.unembed_out.weight", Gather.UNEMBED_OUT)]
    return mapped_experts(key, target + _local(rest))


def contributions(key: str, num_layers: int) -> List[Mapped]:
    """Every output tensor one source key contributes to; layer ``num_layers`` is the head."""
    if key.startswith("model.visual."):
        return [Mapped(key, None, vision="vision_tower." + key[len("model.visual."):])]
    if key.startswith("vision_tower."):
        return [Mapped(key, None, vision=key)]
    if key.startswith(HEAD_PREFIX):  # our own canonical head names, read back
        return [Mapped(key, key)]
    if key == "lm_head.weight":
        return [Mapped(key, LM_HEAD)]
    if key == LM_HEAD:
        return [Mapped(key, key)]
    for top in (RAW_LM, LM + "model."):
        if not key.startswith(top):
            continue
        rest = key[len(top):]
        index, _, local = rest[len("layers."):].partition(".")
        if rest.startswith("layers.") and index.isdigit() and local:
            return _layer_key(key, int(index), local, num_layers)
        if rest in ("embed_tokens.weight", "norm.weight"):
            return [Mapped(key, LM + "model." + rest)]
    raise LayoutError("tensor is outside every glm5_next namespace (model.language_model.{embed_tokens, layers, "
                      "norm}, model.visual.*, lm_head, the nextn layer)", key=key)


def _layer_key(key: str, layer: int, rest: str, num_layers: int) -> List[Mapped]:
    if layer > num_layers:
        raise LayoutError(f"layer {layer} is past the nextn layer ({num_layers} = num_hidden_layers)", key=key)
    if layer < num_layers:
        return _layer(key, f"{LAYERS}{layer}.", rest)
    if rest.startswith(HEAD_OWN_VOCAB):
        raise LayoutError("the nextn layer has its own embed_tokens / shared_head.head (GLM-4.x's form): "
                          "GLM-5.3-Flash's borrows the backbone's, and mlx-vlm's glm5_next_mtp drafter has no "
                          "parameter for it", key=key)
    return _layer(key, HEAD_PREFIX, rest)


def source_name(mlx_name: str, style: str, num_layers: int) -> str:
    """The key a source of ``style`` would use for an MLX name (error messages)."""
    name = mlx_name
    if name.startswith(HEAD_PREFIX):
        name = f"{LAYERS}{num_layers}." + name[len(HEAD_PREFIX):]
    if style == MLX:
        return name
    if name == LM_HEAD:
        return "lm_head.weight"
    name = re.sub(r"\.self_attn\.(embed_q|unembed_out)\.weight$", "." + KV_B, name)
    name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
    name = CONV_MLX.sub(r".self_attn.\1_conv1d.weight", name)
    return RAW_LM + name[len(LM + "model."):] if name.startswith(LM + "model.") else name


def convs_raw(tensors: Mapping) -> bool:
    """True when the short convolutions are in the raw layout [C, 1, K] (the whole checkpoint, decided once)."""
    convs = {k: t.shape for k, t in tensors.items() if CONV_RAW.search(k) or CONV_MLX.search(k)}
    flags = {k: len(s) == 3 and s[-1] != 1 for k, s in convs.items()}
    if len(set(flags.values())) > 1:
        raw_one = next(k for k, v in flags.items() if v)
        raise LayoutError("short-convolution weights disagree on layout: some are raw [C, 1, K], some MLX [C, K, 1]; "
                          "the checkpoint was partly converted", file=tensors[raw_one].file, key=raw_one)
    return any(flags.values())


# the head's modules as mlx-vlm's drafter names them, where its splitter renames or its sanitize fuses them
# (``split.py:41-59``, ``glm5_next_mtp.py:334-370``); any other X is ``mtp_block.X``
DRAFTER_MODULES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "shared_head_norm",
                   "self_attn.q_a_proj": "mtp_block.self_attn.qkv_a_proj",
                   "self_attn.kv_a_proj_with_mqa": "mtp_block.self_attn.qkv_a_proj",
                   "mlp.shared_experts.gate_proj": "mtp_block.mlp.shared_experts.gate_up_proj",
                   "mlp.shared_experts.up_proj": "mtp_block.mlp.shared_experts.gate_up_proj"}


def drafter_module(local: str) -> str:
    """A head module (after ``layers.{N}.``) under the path mlx-vlm's drafter builds it at."""
    return DRAFTER_MODULES.get(local, "mtp_block." + local)


def drafter_entries(block: dict, num_layers: int) -> dict:
    """The head's per-module quantization entries again under the drafter's module paths: its loader looks an entry
    up by the module's own path only (``utils.py:272-295``), and takes the block's default for any other, so a head
    at other bits than the backbone (``--mtp-bits``) would be built at the backbone's."""
    prefix = f"{LAYERS}{num_layers}."
    return {drafter_module(k[len(prefix):]): v for k, v in block.items() if k.startswith(prefix)}


def loadable_config(config: dict) -> dict:
    """The output config as mlx-vlm reads it: every per-layer list written out for its ``TextConfig``
    (``models/glm5_next/config.py``: it fills an absent one otherwise than transformers), the sparse layers named
    ``full_attention`` as the release names them, and the head's quantization entries under its drafter's paths
    too (``drafter_entries``)."""
    out = copy.deepcopy(config)
    tc = out["text_config"]
    spec = model_spec(out)
    tc["layer_types"] = [LINEAR_ATTENTION if linear else "full_attention" for linear in spec.linear_layers]
    tc["indexer_types"] = ["full" if linear or full else "shared"
                           for linear, full in zip(spec.linear_layers, spec.full_indexer)]
    tc["mlp_layer_types"] = ["sparse" if sparse else "dense" for sparse in spec.sparse_mlp]
    for name in ("quantization", "quantization_config"):
        if isinstance(out.get(name), dict):
            out[name].update(drafter_entries(out[name], spec.num_layers))
    return out


def _bind(family: Family, config: dict) -> Family:
    """The nextn layer's index is text_config.num_hidden_layers: the key hooks and the sidecar's names take it."""
    n = text_config(config).get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_hidden_layers must be an integer >= 1, got {n!r}", file="config.json",
                          key="text_config.num_hidden_layers")
    return dataclasses.replace(family, contributions=partial(contributions, num_layers=n),
                               source_name=partial(source_name, num_layers=n), sidecar_prefix=f"{LAYERS}{n}.",
                               bind=None)


HEAD = HeadDesign(
    forward="glm5-next-nextn",
    projection="mtp.eh_proj [H, 2H]",
    concat=("enorm(embed(t+1)), zero at position 0", "hnorm(h_t)"),
    layer="one sparse-attention decoder layer (its own indexer) with the backbone's MoE, no hyper-connections, "
          "its own KV cache",
    output="lm_head(shared_head.norm(h))",
    hidden_state="post_norm",
    shares=("embed_tokens", "lm_head"),
    norms_zero_centred=False,
)

FAMILY = Family(
    name="glm5_next",
    title="GLM-5.3-Flash (linear + sparse attention, hyper-connections, MoE), nextn head",
    model_types=MODEL_TYPES,
    head=HEAD,
    backbone_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    head_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    mtp_layouts=("sidecar",),
    head_prefix=HEAD_PREFIX,
    lm_head=LM_HEAD,
    capabilities=Capabilities(batched=True, pre_norm_hidden=False),
    backbone="mtpconvert.families.glm5_next.backbone:Glm5NextBackbone",
    compat="mtpconvert.families.glm5_next.compat:rows",
    spec=model_spec,
    expected_slots=expected_slots,
    contributions=partial(contributions, num_layers=-1),  # bound to the config by family_for
    key_style=key_style,
    source_name=partial(source_name, num_layers=-1),
    is_zero_centred_norm=lambda name: False,  # plain RMSNorm gains: nothing is shifted
    norms_zero_centred=convs_raw,  # the raw layout (conv [C, 1, K]): the conv axis moves; no norm is NORM-kind
    backbone_library="mlx-vlm",
    text_prefix=LM,
    modules=ModulePaths.text_model(LM),
    loadable_config=loadable_config,
    drafter_folder_type="glm5_next_mtp",
    mtp_count_keys=("num_nextn_predict_layers",),
    single_layer_head=True,
    bind=_bind,
)
