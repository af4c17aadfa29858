"""Qwen3-Next (``qwen3_next``, e.g. Qwen3-Next-80B-A3B): the family's rules.

A text-only release with flat keys: ``model.*``, ``lm_head.weight`` and a top-level ``mtp.*``
head, which are also mlx-lm's names, so the raw and MLX namespaces coincide. What tells a raw
folder from a converted one is in the tensors: per-expert ``experts.{e}.*`` against stacked
``switch_mlp.*``, and the conv1d layout (``[C, 1, K]`` raw) that decides the norm shift, as for
Qwen3.5. The linear attention keeps its fused ``in_proj_qkvz`` / ``in_proj_ba`` projections
(mlx-lm's ``Qwen3NextGatedDeltaNet`` holds them fused too). Experts are MoE on every layer
``decoder_sparse_step`` names, except ``mlp_only_layers``.

The head is Qwen3.5's design (``fc`` over [embedding, hidden], one full-attention decoder layer
with the backbone's MoE, ``mtp.norm``, the shared ``lm_head``), with zero-centred norms. The
published config carries no MTP count: the tensors give it (``plan.build``), and the output
config says it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ...errors import ConfigError, LayoutError
from .. import qwen3_5
from ..base import (A_LOG, BACKBONE, CONV, EMBEDDING, FC, GATED_NORM, LINEAR, MLX, MTP, PARAM, RAW_TEXT, Capabilities, Family,
                   Mapped, Slot, config_bool, config_int, config_model_type, resolve_tie)
from ..qwen3_5 import FUSED_DOWN, FUSED_GATE_UP, PER_EXPERT

HEAD_PREFIX = "mtp."
LM_HEAD = "lm_head.weight"
MODEL_TYPES = {"qwen3_next": "qwen3_next"}


@dataclasses.dataclass(frozen=True)
class ModelSpec(qwen3_5.ModelSpec):
    sparse_layers: Tuple[bool, ...] = ()  # per backbone layer: True where its MLP is the MoE block
    rope_theta: Optional[float] = None
    partial_rotary_factor: Optional[float] = None

    @property
    def key_dim(self) -> int:
        return self.lin_num_k_heads * self.lin_k_dim

    @property
    def value_dim(self) -> int:
        return self.lin_num_v_heads * self.lin_v_dim


def model_spec(config: dict) -> ModelSpec:
    """Validate config.json (flat, as published) and extract the numbers the converter needs."""
    if config_model_type(config) not in MODEL_TYPES:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not a {FAMILY.name} type",
                          file="config.json", key="model_type")
    if "text_config" in config:
        raise ConfigError("a qwen3_next config is flat; this one has text_config", file="config.json",
                          key="text_config")
    tc = config
    hidden = config_int(tc, "hidden_size", minimum=1)
    num_layers = config_int(tc, "num_hidden_layers", minimum=1)
    num_heads = config_int(tc, "num_attention_heads", minimum=1)
    interval = config_int(tc, "full_attention_interval", 4, minimum=1)
    linear = tuple((i + 1) % interval != 0 for i in range(num_layers))
    layer_types = tc.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or
                                    tuple(t == "linear_attention" for t in layer_types) != linear):
        raise ConfigError("layer_types disagrees with full_attention_interval; mlx-lm builds layers from the "
                          "interval, so the weights would not load", file="config.json", key="layer_types")
    num_experts = config_int(tc, "num_experts", 0)
    step = config_int(tc, "decoder_sparse_step", 1, minimum=1)
    mlp_only = tc.get("mlp_only_layers", [])
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ConfigError(f"mlp_only_layers must be a list of layer numbers, got {mlp_only!r}", file="config.json",
                          key="mlp_only_layers")
    # mlx-lm's Qwen3NextDecoderLayer rule, so the slots are the modules it builds
    sparse = tuple(num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
    rope = tc.get("rope_parameters") if isinstance(tc.get("rope_parameters"), dict) else {}
    for key in ("rope_theta", "partial_rotary_factor"):
        value = tc.get(key, rope.get(key))
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config is missing {key} (top level or rope_parameters)", file="config.json", key=key)
    if any(not s for s in sparse) or not num_experts:
        config_int(tc, "intermediate_size", minimum=1)
    return ModelSpec(
        model_type=MODEL_TYPES[config_model_type(config)],
        nested=False,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=config_int(tc, "vocab_size", minimum=1),
        num_heads=num_heads,
        num_kv_heads=config_int(tc, "num_key_value_heads", minimum=1),
        head_dim=config_int(tc, "head_dim", hidden // num_heads, minimum=1),
        lin_num_k_heads=config_int(tc, "linear_num_key_heads", minimum=1),
        lin_num_v_heads=config_int(tc, "linear_num_value_heads", minimum=1),
        lin_k_dim=config_int(tc, "linear_key_head_dim", minimum=1),
        lin_v_dim=config_int(tc, "linear_value_head_dim", minimum=1),
        conv_kernel=config_int(tc, "linear_conv_kernel_dim", 4, minimum=1),
        full_attention_interval=interval,
        linear_layers=linear,
        intermediate_size=config_int(tc, "intermediate_size", 0),
        num_experts=num_experts,
        moe_intermediate_size=config_int(tc, "moe_intermediate_size", 0 if not num_experts else None, minimum=0),
        shared_expert_intermediate_size=config_int(tc, "shared_expert_intermediate_size", 0),
        tie_word_embeddings=resolve_tie(config),
        attention_bias=config_bool(tc, "attention_bias"),
        mtp_layers=_mtp_count(tc),
        sparse_layers=sparse,
        rope_theta=float(tc.get("rope_theta", rope.get("rope_theta"))),
        partial_rotary_factor=float(tc.get("partial_rotary_factor", rope.get("partial_rotary_factor"))),
    )


# the MTP count as mtpconvert writes it, and as vLLM-lineage tools add it to this family's config
MTP_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def _mtp_count(config: dict) -> Optional[int]:
    """The config's MTP count, None where it has none (the published config: the tensors decide)."""
    counts = {k: config_int(config, k) for k in MTP_COUNT_KEYS if k in config}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"MTP counts disagree: {counts}", file="config.json", key=MTP_COUNT_KEYS[0])
    return next(iter(counts.values()), None)


def _linear_attention(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H, nv = s.hidden_size, s.lin_num_v_heads
    p = prefix + "linear_attn."
    table = [
        ("in_proj_qkvz.weight", (2 * s.key_dim + 2 * s.value_dim, H), LINEAR),
        ("in_proj_ba.weight", (2 * nv, H), LINEAR),
        ("conv1d.weight", (s.conv_dim, s.conv_kernel, 1), CONV),
        ("dt_bias", (nv,), PARAM),
        ("A_log", (nv,), A_LOG),
        ("norm.weight", (s.lin_v_dim,), GATED_NORM),
        ("out_proj.weight", (H, s.value_dim), LINEAR),
    ]
    return {p + k: Slot(p + k, shape, kind, group) for k, shape, kind in table}


def _mlp(prefix: str, s: ModelSpec, sparse: bool, group: str) -> Dict[str, Slot]:
    if sparse:
        return qwen3_5._mlp(prefix, s, group)
    return qwen3_5._mlp(prefix, dataclasses.replace(s, num_experts=0), group)


def _decoder_layer(prefix: str, s: ModelSpec, linear: bool, sparse: bool, group: str) -> Dict[str, Slot]:
    out = {}
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[prefix + name] = qwen3_5._norm(prefix + name, s.hidden_size, group)
    out.update(_linear_attention(prefix, s, group) if linear else qwen3_5._attention(prefix, s, group))
    out.update(_mlp(prefix, s, sparse, group))
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    H, V = s.hidden_size, s.vocab_size
    out = {"model.embed_tokens.weight": Slot("model.embed_tokens.weight", (V, H), EMBEDDING, BACKBONE)}
    for i, (linear, sparse) in enumerate(zip(s.linear_layers, s.sparse_layers)):
        out.update(_decoder_layer(f"model.layers.{i}.", s, linear, sparse, BACKBONE))
    out["model.norm.weight"] = qwen3_5._norm("model.norm.weight", H, BACKBONE)
    if not s.tie_word_embeddings:
        out[LM_HEAD] = Slot(LM_HEAD, (V, H), LINEAR, BACKBONE)
    if mtp_layers:
        out["mtp.fc.weight"] = Slot("mtp.fc.weight", (H, 2 * H), FC, MTP)
        for name in ("pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight", "norm.weight"):
            out["mtp." + name] = qwen3_5._norm("mtp." + name, H, MTP)
        for j in range(mtp_layers):  # the head's layer carries the MoE block whenever the model has experts
            out.update(_decoder_layer(f"mtp.layers.{j}.", s, False, s.is_moe, MTP))
    return out


def key_style(key: str) -> str:
    """Raw and MLX names coincide here except for experts: per expert (or fused) is the release's,
    a ``switch_mlp`` stack is mlx-lm's."""
    if ".switch_mlp." in key:
        return MLX
    if PER_EXPERT.match(key) or FUSED_GATE_UP.match(key) or FUSED_DOWN.match(key):
        return RAW_TEXT
    return ""


def contributions(key: str) -> List[Mapped]:
    """Every output tensor one source key contributes to (the expert mapping is Qwen3.5's)."""
    if not (key.startswith(("model.", "mtp.")) or key == LM_HEAD):
        raise LayoutError("tensor is outside every Qwen3-Next namespace (model.*, mtp.*, lm_head)", key=key)
    return qwen3_5.mapped_experts(key, key)  # raw names are mlx-lm's here


def source_name(mlx_name: str, style: str) -> str:
    return mlx_name


def loadable_config(config: dict) -> dict:
    """The output config, completed for the loaders that read it.

    mlx-lm's ``qwen3_next`` ModelArgs requires ``rope_theta`` and ``partial_rotary_factor`` at the top
    level (a transformers 5.x ``save_pretrained`` keeps them in ``rope_parameters`` only). mtplx builds
    the head from qwen3_5's args, whose default ``rope_parameters`` would give it RoPE base 100000
    instead of the model's, and mlx-vlm's drafter config needs ``rope_parameters`` with ``type``,
    ``rope_theta``, ``partial_rotary_factor`` and ``mrope_section``: so ``rope_parameters`` says the
    model's RoPE in all four (text-only: the whole rotary section on the first axis).
    """
    rope = dict(config["rope_parameters"]) if isinstance(config.get("rope_parameters"), dict) else {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in config and key in rope:
            config[key] = rope[key]
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = int(head_dim * config["partial_rotary_factor"])
    rope.update({k: v for k, v in scaling.items() if k not in rope})
    rope.setdefault("type", rope.get("rope_type", "default"))
    rope.update(rope_theta=config["rope_theta"], partial_rotary_factor=config["partial_rotary_factor"],
                mrope_section=rope.get("mrope_section", [rotary // 2, 0, 0]))
    config["rope_parameters"] = rope
    return config


HEAD = dataclasses.replace(qwen3_5.HEAD, layer="one full-attention Qwen3-Next decoder layer (the backbone's MoE "
                                               "with its shared expert) with its own KV cache")

FAMILY = Family(
    name="qwen3_next",
    title="Qwen3-Next (80B-A3B Instruct / Thinking)",
    model_types=MODEL_TYPES,
    head=HEAD,
    backbone_runtimes=("mlx-lm<0.32", "mlx-lm>=0.32", "mlx-vlm", "mlx-vlm-drafter", "mtplx", "rapid-mlx", "vllm-mlx",
                       "mlx-lm-pr990"),
    head_runtimes=("mtplx",),
    # mlx-lm's qwen3_next sanitize keeps mtp.* keys of a converted folder and its strict load then
    # refuses them: the head can only live outside the model shards
    mtp_layouts=("sidecar",),
    head_prefix=HEAD_PREFIX,
    lm_head=LM_HEAD,
    capabilities=Capabilities(batched=True, pre_norm_hidden=True),
    backbone="mtpconvert.families.qwen3_next.backbone:Qwen3NextBackbone",
    compat="mtpconvert.families.qwen3_next.compat:rows",
    spec=model_spec,
    expected_slots=expected_slots,
    contributions=contributions,
    key_style=key_style,
    source_name=source_name,
    is_zero_centred_norm=qwen3_5.is_zero_centred_norm,
    norms_zero_centred=qwen3_5.norms_zero_centred,
    default_style=RAW_TEXT,
    loadable_config=loadable_config,
    forward_misfit=qwen3_5.forward_misfit,
    mtp_count_keys=MTP_COUNT_KEYS,
    mtplx_arch=qwen3_5.MTPLX_ARCH,
)
