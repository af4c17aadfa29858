"""Qwen3.5 / Qwen3.6 (dense and MoE): the family's rules.

Raw keys come in three namespaces: ``model.language_model.*`` (the VLM wrapper of the
releases), ``model.*`` (a text-only ``save_pretrained``), and top-level ``lm_head`` /
``mtp.*``; MLX folders use ``language_model.*``. All map onto one canonical MLX name.
Configs come nested (``text_config``) or flat; ``tie_word_embeddings`` may sit at the top
level only. MoE experts come per expert or fused (``gate_up_proj`` [E, 2I, H]).

The head: ``fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``, one
full-attention decoder layer with its own KV cache, ``mtp.norm``, the backbone's ``lm_head``;
``h_t`` is the post-final-norm state. Its RMSNorms, like the backbone's, are zero-centred in
the raw release (docs/transforms.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

from ...errors import ConfigError, LayoutError
from ..base import (A_LOG, BACKBONE, CONV, EMBEDDING, FC, GATED_NORM, LINEAR, MLX, MTP, NORM, PARAM, RAW_TEXT,
                   RAW_VLM, ROUTER, SWITCH, Capabilities, Family, Gather, HeadDesign, Mapped, Slot, config_bool, config_int,
                   config_model_type, resolve_tie, text_config)

LM = "language_model."
HEAD_PREFIX = LM + "mtp."

# config model_type (top level or text_config) -> mlx-lm module name
MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}

PER_EXPERT = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_GATE_UP = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.gate_up_proj$")
FUSED_DOWN = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.down_proj$")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # mlx-lm module: qwen3_5 or qwen3_5_moe
    nested: bool  # config has text_config (VLM wrapper)
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    lin_num_k_heads: int
    lin_num_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    full_attention_interval: int
    linear_layers: tuple  # per backbone layer: True if linear attention
    intermediate_size: int
    num_experts: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    mtp_layers: Optional[int]  # what the config claims; None where it does not say (the tensors decide)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_num_k_heads * self.lin_k_dim + self.lin_num_v_heads * self.lin_v_dim




def model_spec(config: dict) -> ModelSpec:
    """Validate config.json and extract the numbers the converter needs."""
    tc = text_config(config)
    mtype = MODEL_TYPES.get(config_model_type(config))
    if mtype is None:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not a {FAMILY.name} type",
                          file="config.json", key="model_type")
    if tc.get("mtp_use_dedicated_embeddings"):
        raise ConfigError(
            "mtp_use_dedicated_embeddings=true is not supported (no published checkpoint uses it)",
            file="config.json",
        )

    hidden = config_int(tc, "hidden_size", minimum=1)
    num_layers = config_int(tc, "num_hidden_layers", minimum=1)
    num_heads = config_int(tc, "num_attention_heads", minimum=1)
    head_dim = config_int(tc, "head_dim", minimum=1) if tc.get("head_dim") is not None else hidden // num_heads
    interval = config_int(tc, "full_attention_interval", 4, minimum=1)
    linear = tuple((i + 1) % interval != 0 for i in range(num_layers))
    layer_types: Optional[List[str]] = tc.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ConfigError(
                f"layer_types must list {num_layers} entries", file="config.json", key="layer_types"
            )
        declared = tuple(t == "linear_attention" for t in layer_types)
        if declared != linear:
            raise ConfigError(
                "layer_types disagrees with full_attention_interval; mlx-lm builds layers "
                "from the interval, so the weights would not load",
                file="config.json",
                key="layer_types",
            )
    num_experts = config_int(tc, "num_experts", 0)
    if mtype == "qwen3_5_moe" and num_experts == 0:
        raise ConfigError("a MoE model_type needs num_experts > 0", file="config.json", key="num_experts")
    if mtype == "qwen3_5" and num_experts:
        raise ConfigError("dense model_type qwen3_5 with num_experts > 0", file="config.json", key="num_experts")
    if tc.get("attn_output_gate", True) is False:
        raise ConfigError(
            "attn_output_gate=false is not supported by mlx-lm's Qwen3.5 attention",
            file="config.json",
            key="attn_output_gate",
        )

    return ModelSpec(
        model_type=mtype,
        nested="text_config" in config,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=config_int(tc, "vocab_size", minimum=1),
        num_heads=num_heads,
        num_kv_heads=config_int(tc, "num_key_value_heads", minimum=1),
        head_dim=head_dim,
        lin_num_k_heads=config_int(tc, "linear_num_key_heads", 16, minimum=1),
        lin_num_v_heads=config_int(tc, "linear_num_value_heads", 64, minimum=1),
        lin_k_dim=config_int(tc, "linear_key_head_dim", 192, minimum=1),
        lin_v_dim=config_int(tc, "linear_value_head_dim", 128, minimum=1),
        conv_kernel=config_int(tc, "linear_conv_kernel_dim", 4, minimum=1),
        full_attention_interval=interval,
        linear_layers=linear,
        intermediate_size=config_int(tc, "intermediate_size", 0) if not num_experts else 0,
        num_experts=num_experts,
        moe_intermediate_size=config_int(tc, "moe_intermediate_size", 0) if num_experts else 0,
        shared_expert_intermediate_size=config_int(tc, "shared_expert_intermediate_size", 0) if num_experts else 0,
        tie_word_embeddings=resolve_tie(config),
        attention_bias=config_bool(tc, "attention_bias"),
        mtp_layers=config_int(tc, "mtp_num_hidden_layers") if "mtp_num_hidden_layers" in tc else None,
    )


# The zero-centred RMSNorms (y = x * (1 + w) in the source, +1 once on raw weights): every
# decoder layer's two layer norms and q/k norms, the final norm, and the MTP head's three.
# Not the gated norm of linear attention (linear_attn.norm), nor A_log / dt_bias.
ZERO_CENTRED_NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight",
                              "self_attn.q_norm.weight", "self_attn.k_norm.weight")
ZERO_CENTRED_NORMS = ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.pre_fc_norm_embedding.weight")



def forward_misfit(config: dict) -> Optional[str]:
    """mlx-lm's forward indexes a full-attention layer (every ``full_attention_interval``-th): a model cut to
    fewer layers has none."""
    tc = text_config(config)
    interval, layers = tc.get("full_attention_interval"), tc.get("num_hidden_layers")
    if isinstance(interval, int) and isinstance(layers, int) and 0 < layers < interval:
        return (f"mlx-lm's forward needs a full-attention layer (every {interval}th) that these {layers} "
                "layers lack")
    return None


def is_zero_centred_norm(mlx_name: str) -> bool:
    """Whether an MLX-named weight is one of the zero-centred RMSNorms (see above)."""
    rest = mlx_name[len(LM):] if mlx_name.startswith(LM) else mlx_name
    return rest in ZERO_CENTRED_NORMS or rest.endswith(ZERO_CENTRED_NORM_SUFFIXES)


def _norm(name: str, size: int, group: str) -> Slot:
    assert is_zero_centred_norm(name), name  # the one list above decides which norms shift
    return Slot(name, (size,), NORM, group)


def _attention(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H, q_out, kv_out = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    p = prefix + "self_attn."
    slots = {
        p + "q_proj.weight": (2 * q_out, H),
        p + "k_proj.weight": (kv_out, H),
        p + "v_proj.weight": (kv_out, H),
        p + "o_proj.weight": (H, q_out),
    }
    out = {k: Slot(k, v, LINEAR, group) for k, v in slots.items()}
    if s.attention_bias:
        for name, n in (("q_proj", 2 * q_out), ("k_proj", kv_out), ("v_proj", kv_out), ("o_proj", H)):
            k = f"{p}{name}.bias"
            out[k] = Slot(k, (n,), PARAM, group)
    for name in ("q_norm", "k_norm"):
        k = f"{p}{name}.weight"
        out[k] = _norm(k, s.head_dim, group)
    return out


def _linear_attention(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H, nv = s.hidden_size, s.lin_num_v_heads
    v_dim = nv * s.lin_v_dim
    p = prefix + "linear_attn."
    table = [
        ("in_proj_qkv.weight", (s.conv_dim, H), LINEAR),
        ("in_proj_z.weight", (v_dim, H), LINEAR),
        ("in_proj_b.weight", (nv, H), LINEAR),
        ("in_proj_a.weight", (nv, H), LINEAR),
        ("conv1d.weight", (s.conv_dim, s.conv_kernel, 1), CONV),
        ("dt_bias", (nv,), PARAM),
        ("A_log", (nv,), A_LOG),
        ("norm.weight", (s.lin_v_dim,), GATED_NORM),
        ("out_proj.weight", (H, v_dim), LINEAR),
    ]
    return {p + k: Slot(p + k, shape, kind, group) for k, shape, kind in table}


def _mlp(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H = s.hidden_size
    p = prefix + "mlp."
    if not s.is_moe:
        table = [
            ("gate_proj.weight", (s.intermediate_size, H), LINEAR),
            ("up_proj.weight", (s.intermediate_size, H), LINEAR),
            ("down_proj.weight", (H, s.intermediate_size), LINEAR),
        ]
    else:
        E, I, Is = s.num_experts, s.moe_intermediate_size, s.shared_expert_intermediate_size
        table = [
            ("gate.weight", (E, H), ROUTER),
            ("switch_mlp.gate_proj.weight", (E, I, H), SWITCH),
            ("switch_mlp.up_proj.weight", (E, I, H), SWITCH),
            ("switch_mlp.down_proj.weight", (E, H, I), SWITCH),
            ("shared_expert.gate_proj.weight", (Is, H), LINEAR),
            ("shared_expert.up_proj.weight", (Is, H), LINEAR),
            ("shared_expert.down_proj.weight", (H, Is), LINEAR),
            ("shared_expert_gate.weight", (1, H), ROUTER),
        ]
    return {p + k: Slot(p + k, shape, kind, group) for k, shape, kind in table}


def _decoder_layer(prefix: str, s: ModelSpec, linear: bool, group: str) -> Dict[str, Slot]:
    H = s.hidden_size
    out = {}
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[prefix + name] = _norm(prefix + name, H, group)
    out.update(_linear_attention(prefix, s, group) if linear else _attention(prefix, s, group))
    out.update(_mlp(prefix, s, group))
    return out


def backbone_slots(s: ModelSpec) -> Dict[str, Slot]:
    H, V = s.hidden_size, s.vocab_size
    m = LM + "model."
    out = {m + "embed_tokens.weight": Slot(m + "embed_tokens.weight", (V, H), EMBEDDING, BACKBONE)}
    for i, linear in enumerate(s.linear_layers):
        out.update(_decoder_layer(f"{m}layers.{i}.", s, linear, BACKBONE))
    out[m + "norm.weight"] = _norm(m + "norm.weight", H, BACKBONE)
    if not s.tie_word_embeddings:
        out[LM + "lm_head.weight"] = Slot(LM + "lm_head.weight", (V, H), LINEAR, BACKBONE)
    return out


def mtp_slots(s: ModelSpec, num_layers: int) -> Dict[str, Slot]:
    """The MTP head: fc over [embedding, hidden], pre-fc norms, decoder layers, final norm."""
    if num_layers == 0:
        return {}
    H = s.hidden_size
    p = LM + "mtp."
    out = {p + "fc.weight": Slot(p + "fc.weight", (H, 2 * H), FC, MTP)}
    for name in ("pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight", "norm.weight"):
        out[p + name] = _norm(p + name, H, MTP)
    for j in range(num_layers):
        out.update(_decoder_layer(f"{p}layers.{j}.", s, False, MTP))
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    out = backbone_slots(s)
    out.update(mtp_slots(s, mtp_layers))
    return out

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
    return mapped_experts(key, _target(key))


def mapped_experts(key: str, name: str) -> List[Mapped]:
    """Source ``key`` under its canonical MLX ``name``: an expert weight as its part of the ``switch_mlp`` stack
    (one row per expert, or a fused tensor's halves), anything else whole."""
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


def norms_zero_centred(tensors: Mapping) -> bool:
    """True when norms are zero-centred: the raw conv1d layout [C, 1, K] says so.

    Decided once for the whole checkpoint, from every conv1d tensor, exactly like
    mlx-lm's sanitize, so no shard is shifted differently from another.
    """
    convs = {k: t.shape for k, t in tensors.items() if k.endswith("linear_attn.conv1d.weight")}
    flags = {k: len(s) == 3 and s[-1] != 1 for k, s in convs.items()}
    if flags and len(set(flags.values())) > 1:
        raw_one = next(k for k, v in flags.items() if v)
        mlx_one = next(k for k, v in flags.items() if not v)
        raise LayoutError(
            f"conv1d weights disagree on layout: {raw_one} is raw [C,1,K] but {mlx_one} is "
            "MLX [C,K,1]; the checkpoint was partly converted",
            file=tensors[raw_one].file,
            key=raw_one,
        )
    return any(flags.values())


# the arch id mtplx 2.12.2 gives qwen3_5, qwen3_5_moe and qwen3_next folders (its registry.py:226)
MTPLX_ARCH = "qwen3-next-mtp"

HEAD = HeadDesign(
    forward="qwen-mtp",
    projection="mtp.fc [H, 2H]",
    concat=("pre_fc_norm_embedding(embed(t+1))", "pre_fc_norm_hidden(h_t)"),
    layer="one full-attention decoder layer (the backbone's MLP kind) with its own KV cache",
    output="lm_head(mtp.norm(h))",
    hidden_state="post_norm",
    shares=("embed_tokens", "lm_head"),
    norms_zero_centred=True,
)

FAMILY = Family(
    name="qwen3_5",
    title="Qwen3.5 / Qwen3.6, dense and MoE",
    model_types=MODEL_TYPES,
    head=HEAD,
    backbone_runtimes=("mlx-lm<0.32", "mlx-lm>=0.32", "mlx-vlm", "mlx-vlm-drafter", "mtplx", "rapid-mlx", "vllm-mlx",
                       "mlx-lm-pr990"),
    head_runtimes=("mlx-vlm", "mlx-vlm-drafter", "mtplx", "rapid-mlx", "vllm-mlx", "mlx-lm-pr990"),
    mtp_layouts=("sidecar", "in-model"),
    head_prefix=HEAD_PREFIX,
    lm_head=LM + "lm_head.weight",
    capabilities=Capabilities(batched=True, pre_norm_hidden=True),
    backbone="mtpconvert.families.qwen3_5.backbone:Qwen35Backbone",
    compat="mtpconvert.compat:contract_rows",  # the runtimes' contracts were measured on this family's folders
    spec=model_spec,
    expected_slots=expected_slots,
    contributions=contributions,
    key_style=key_style,
    source_name=source_name,
    is_zero_centred_norm=is_zero_centred_norm,
    norms_zero_centred=norms_zero_centred,
    text_prefix=LM,
    forward_misfit=forward_misfit,
    drafter_folder_type="qwen3_5_mtp",
    mtplx_arch=MTPLX_ARCH,
)
