"""GLM with a nextn head (the DeepSeek-V3 MTP design): ``glm4_moe_lite`` (GLM-4.7-Flash), ``glm_moe_dsa``
(GLM-5.x) and ``glm4_moe`` (GLM-4.5 / 4.6 / 4.7): the families' rules.

Text-only releases with flat keys (``model.*``, ``lm_head.weight``). The MTP head is one more decoder
layer, ``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H],
``shared_head.norm``, a full decoder block (the backbone's attention and its MoE) and, in GLM-4.x, its own
``embed_tokens`` and ``shared_head.head``; GLM-5.x ships neither and borrows the backbone's. Stock
mlx-lm's sanitize drops every layer from ``num_hidden_layers`` on, raw or converted.

MLX names are what mlx-lm's sanitize makes of a raw folder: experts stacked into ``switch_mlp``, an MLA
``kv_b_proj`` split into the per-head ``embed_q`` / ``unembed_out`` it attends with. The head's MLX names
are ``mtp.`` + its module path as mlx-vlm's ``glm_moe_dsa_mtp`` drafter holds it (``mtp.enorm``,
``mtp.self_attn.*``, ``mtp.mlp.*``, ``mtp.shared_head_norm``; ``mtp.embed_tokens`` and
``mtp.shared_head.head`` where the release ships them). Norms are plain RMSNorm gains: nothing is
shifted. A router's ``e_score_correction_bias`` stays float32 and its weight is a bare parameter (never
quantized), as in mlx-lm. Raw vs converted is decided from the tensors (per-expert ``experts.{e}`` and
``kv_b_proj`` against ``switch_mlp`` and ``embed_q``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from functools import partial
from typing import Dict, List, Optional

from ...errors import ConfigError, LayoutError
from ..base import (BACKBONE, Capabilities, EMBEDDING, FC, LINEAR, MLX, MTP, MULTI, NORM, PARAM, RAW_TEXT, ROUTER_BIAS, SWITCH,
                   Family, Gather, HeadDesign, Mapped, Slot, config_bool, config_int, config_model_type, resolve_tie)

HEAD_PREFIX = "mtp."
LM_HEAD = "lm_head.weight"
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
PER_EXPERT = re.compile(r"^(?P<mlp>(?:.*\.)?mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
KV_B = "self_attn.kv_b_proj.weight"
# the head's own names for two of its modules (raw suffix under model.layers.N. -> head-local name)
HEAD_RENAMES = {"shared_head.norm.weight": "shared_head_norm.weight"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    attention: str  # "mla" | "mla-dsa" (MLA with the sparse-attention indexer) | "gqa"
    head_dim: int  # gqa
    q_lora_rank: Optional[int]  # mla: None = a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    attention_bias: bool
    use_qk_norm: bool
    intermediate_size: int
    num_experts: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    tie_word_embeddings: bool
    head_own_vocab: bool  # the nextn layer ships its own embed_tokens and shared_head.head
    mtp_layers: Optional[int]  # num_nextn_predict_layers; None where the config does not say
    nested: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """mlx-lm's rule for the MoE block (the nextn layer's index included)."""
        return self.is_moe and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


@dataclasses.dataclass(frozen=True)
class Variant:
    attention: str
    head_own_vocab: bool


VARIANTS = {
    "glm4_moe_lite": Variant("mla", True),
    "glm_moe_dsa": Variant("mla-dsa", False),
    "glm4_moe": Variant("gqa", True),
}


def model_spec(config: dict, model_type: str) -> ModelSpec:
    """Validate config.json (flat, as published) and extract the numbers the converter needs."""
    if config_model_type(config) != model_type:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not {model_type!r}", file="config.json",
                          key="model_type")
    if "text_config" in config:
        raise ConfigError(f"a {model_type} config is flat; this one has text_config", file="config.json",
                          key="text_config")
    v = VARIANTS[model_type]
    c = config
    mla = v.attention.startswith("mla")
    num_heads = config_int(c, "num_attention_heads", minimum=1)
    hidden = config_int(c, "hidden_size", minimum=1)
    q_lora = c.get("q_lora_rank")
    if mla and q_lora is not None:
        q_lora = config_int(c, "q_lora_rank", minimum=1)
    if v.attention == "mla-dsa" and q_lora is None:
        raise ConfigError("glm_moe_dsa needs q_lora_rank (its indexer reads the q_a projection)", file="config.json",
                          key="q_lora_rank")
    mtp = c.get("num_nextn_predict_layers")
    if mtp is not None:
        mtp = config_int(c, "num_nextn_predict_layers")
        if mtp > 1:
            raise ConfigError(f"num_nextn_predict_layers={mtp}: every GLM release has one nextn layer, and "
                              "its consumers run one", file="config.json", key="num_nextn_predict_layers")
    num_experts = config_int(c, "n_routed_experts", 0)
    return ModelSpec(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=config_int(c, "num_hidden_layers", minimum=1),
        vocab_size=config_int(c, "vocab_size", minimum=1),
        num_heads=num_heads,
        num_kv_heads=config_int(c, "num_key_value_heads", num_heads, minimum=1),
        attention=v.attention,
        head_dim=config_int(c, "head_dim", hidden // num_heads, minimum=1) if not mla else 0,
        q_lora_rank=q_lora if mla else None,
        kv_lora_rank=config_int(c, "kv_lora_rank", minimum=1) if mla else 0,
        qk_nope_head_dim=config_int(c, "qk_nope_head_dim", minimum=1) if mla else 0,
        qk_rope_head_dim=config_int(c, "qk_rope_head_dim", minimum=1) if mla else 0,
        v_head_dim=config_int(c, "v_head_dim", minimum=1) if mla else 0,
        index_n_heads=config_int(c, "index_n_heads", minimum=1) if v.attention == "mla-dsa" else 0,
        index_head_dim=config_int(c, "index_head_dim", minimum=1) if v.attention == "mla-dsa" else 0,
        attention_bias=config_bool(c, "attention_bias"),
        use_qk_norm=config_bool(c, "use_qk_norm") if not mla else False,
        intermediate_size=config_int(c, "intermediate_size", minimum=1),
        num_experts=num_experts,
        moe_intermediate_size=config_int(c, "moe_intermediate_size", 0 if not num_experts else None),
        n_shared_experts=config_int(c, "n_shared_experts", 0),
        first_k_dense_replace=config_int(c, "first_k_dense_replace", 0),
        moe_layer_freq=config_int(c, "moe_layer_freq", 1, minimum=1),
        tie_word_embeddings=resolve_tie(config),
        head_own_vocab=v.head_own_vocab,
        mtp_layers=mtp,
    )


# slots: the modules mlx-lm builds, under its names


def _slot(name: str, shape, kind: str, group: str) -> Slot:
    return Slot(name, tuple(shape), kind, group)


def _attention(p: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H, nh = s.hidden_size, s.num_heads
    p += "self_attn."
    bias = s.attention_bias
    if s.attention == "gqa":
        hd, nkv = s.head_dim, s.num_kv_heads
        table = [("q_proj", (nh * hd, H)), ("k_proj", (nkv * hd, H)), ("v_proj", (nkv * hd, H)), ("o_proj", (H, nh * hd))]
        out = {p + n + ".weight": _slot(p + n + ".weight", shape, LINEAR, group) for n, shape in table}
        if bias:
            for n, shape in table[:3]:
                out[p + n + ".bias"] = _slot(p + n + ".bias", shape[:1], PARAM, group)
        if s.use_qk_norm:
            for n in ("q_norm", "k_norm"):
                out[p + n + ".weight"] = _slot(p + n + ".weight", (hd,), NORM, group)
        return out
    qd = s.qk_nope_head_dim + s.qk_rope_head_dim
    out: Dict[str, Slot] = {}

    def add(name, shape, kind):
        out[p + name] = _slot(p + name, shape, kind, group)

    if s.q_lora_rank is None:
        add("q_proj.weight", (nh * qd, H), LINEAR)
    else:
        add("q_a_proj.weight", (s.q_lora_rank, H), LINEAR)
        add("q_a_layernorm.weight", (s.q_lora_rank,), NORM)
        add("q_b_proj.weight", (nh * qd, s.q_lora_rank), LINEAR)
        if bias:
            add("q_a_proj.bias", (s.q_lora_rank,), PARAM)
    add("kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, H), LINEAR)
    add("kv_a_layernorm.weight", (s.kv_lora_rank,), NORM)
    add("embed_q.weight", (nh, s.kv_lora_rank, s.qk_nope_head_dim), MULTI)
    add("unembed_out.weight", (nh, s.v_head_dim, s.kv_lora_rank), MULTI)
    add("o_proj.weight", (H, nh * s.v_head_dim), LINEAR)
    if bias:
        add("kv_a_proj_with_mqa.bias", (s.kv_lora_rank + s.qk_rope_head_dim,), PARAM)
        add("o_proj.bias", (H,), PARAM)
    if s.attention == "mla-dsa":
        add("indexer.wq_b.weight", (s.index_n_heads * s.index_head_dim, s.q_lora_rank), LINEAR)
        add("indexer.wk.weight", (s.index_head_dim, H), LINEAR)
        add("indexer.k_norm.weight", (s.index_head_dim,), PARAM)  # a LayerNorm: weight and bias, cast only
        add("indexer.k_norm.bias", (s.index_head_dim,), PARAM)
        add("indexer.weights_proj.weight", (s.index_n_heads, H), LINEAR)
    return out


def _mlp(p: str, s: ModelSpec, sparse: bool, group: str) -> Dict[str, Slot]:
    H = s.hidden_size
    p += "mlp."
    if not sparse:
        I = s.intermediate_size
        shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        return {p + n + ".weight": _slot(p + n + ".weight", shape, LINEAR, group) for n, shape in shapes.items()}
    E, I = s.num_experts, s.moe_intermediate_size
    out = {
        p + "gate.weight": _slot(p + "gate.weight", (E, H), PARAM, group),  # mlx-lm's MoEGate holds a bare array
        p + "gate.e_score_correction_bias": _slot(p + "gate.e_score_correction_bias", (E,), ROUTER_BIAS, group),
    }
    for n, shape in {"gate_proj": (E, I, H), "up_proj": (E, I, H), "down_proj": (E, H, I)}.items():
        out[f"{p}switch_mlp.{n}.weight"] = _slot(f"{p}switch_mlp.{n}.weight", shape, SWITCH, group)
    if s.n_shared_experts:
        Is = I * s.n_shared_experts
        for n, shape in {"gate_proj": (Is, H), "up_proj": (Is, H), "down_proj": (H, Is)}.items():
            out[f"{p}shared_experts.{n}.weight"] = _slot(f"{p}shared_experts.{n}.weight", shape, LINEAR, group)
    return out


def _decoder_block(p: str, s: ModelSpec, layer: int, group: str) -> Dict[str, Slot]:
    out = {p + n: _slot(p + n, (s.hidden_size,), NORM, group)
           for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    out.update(_attention(p, s, group))
    out.update(_mlp(p, s, s.is_sparse(layer), group))
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    H, V = s.hidden_size, s.vocab_size
    out = {"model.embed_tokens.weight": _slot("model.embed_tokens.weight", (V, H), EMBEDDING, BACKBONE)}
    for i in range(s.num_layers):
        out.update(_decoder_block(f"model.layers.{i}.", s, i, BACKBONE))
    out["model.norm.weight"] = _slot("model.norm.weight", (H,), NORM, BACKBONE)
    if not s.tie_word_embeddings:
        out[LM_HEAD] = _slot(LM_HEAD, (V, H), LINEAR, BACKBONE)
    if mtp_layers:
        p = HEAD_PREFIX
        out[p + "eh_proj.weight"] = _slot(p + "eh_proj.weight", (H, 2 * H), FC, MTP)
        for n in ("enorm.weight", "hnorm.weight", "shared_head_norm.weight"):
            out[p + n] = _slot(p + n, (H,), NORM, MTP)
        if s.head_own_vocab:
            out[p + "embed_tokens.weight"] = _slot(p + "embed_tokens.weight", (V, H), EMBEDDING, MTP)
            out[p + "shared_head.head.weight"] = _slot(p + "shared_head.head.weight", (V, H), LINEAR, MTP)
        out.update(_decoder_block(p, s, s.num_layers, MTP))
    return out


# source keys


def key_style(key: str) -> str:
    """Raw (per-expert experts, a whole kv_b_proj) or MLX (switch_mlp, embed_q / unembed_out); the other
    names are the same in both."""
    if ".switch_mlp." in key or key.endswith(("self_attn.embed_q.weight", "self_attn.unembed_out.weight")):
        return MLX
    if PER_EXPERT.match(key) or key.endswith(KV_B):
        return RAW_TEXT
    return ""


def _module_contributions(key: str, target_prefix: str, rest: str) -> List[Mapped]:
    """One layer's key (``rest`` under its layer) -> its MLX target(s) under ``target_prefix``."""
    if (m := PER_EXPERT.match(rest)) is not None:
        mlp = m["mlp"]
        return [Mapped(key, f"{target_prefix}{mlp}.switch_mlp.{m['proj']}.weight", Gather.STACK, int(m["e"]))]
    if rest == KV_B:
        return [Mapped(key, target_prefix + "self_attn.embed_q.weight", Gather.EMBED_Q),
                Mapped(key, target_prefix + "self_attn.unembed_out.weight", Gather.UNEMBED_OUT)]
    return [Mapped(key, target_prefix + HEAD_RENAMES.get(rest, rest))]


def contributions(key: str, num_layers: int) -> List[Mapped]:
    """Every output tensor one source key contributes to; layer ``num_layers`` is the head."""
    if key.startswith(HEAD_PREFIX):  # our own sidecar, read back (add-mtp, re-convert)
        return [Mapped(key, key)]
    if key in (LM_HEAD, "model.embed_tokens.weight", "model.norm.weight"):
        return [Mapped(key, key)]
    m = LAYER.match(key)
    if m is None:
        raise LayoutError("tensor is outside every GLM namespace (model.*, lm_head, the nextn layer)", key=key)
    layer, rest = int(m[1]), m[2]
    if layer > num_layers:
        raise LayoutError(f"layer {layer} is past the nextn layer ({num_layers} = num_hidden_layers)", key=key)
    if layer == num_layers:
        return _module_contributions(key, HEAD_PREFIX, rest)
    return _module_contributions(key, f"model.layers.{layer}.", rest)


def source_name(mlx_name: str, style: str, num_layers: int) -> str:
    """The key a source of ``style`` would use for ``mlx_name`` (error messages)."""
    name = mlx_name
    if name.startswith(HEAD_PREFIX):
        rest = name[len(HEAD_PREFIX):]
        rest = {v: k for k, v in HEAD_RENAMES.items()}.get(rest, rest)
        name = f"model.layers.{num_layers}.{rest}"
    if style != MLX and name.endswith(("self_attn.embed_q.weight", "self_attn.unembed_out.weight")):
        name = name.rsplit("self_attn.", 1)[0] + KV_B
    return name


def loadable_config(config: dict, model_type: str) -> dict:
    """The output config, completed for the loaders that read it.

    mlx-lm's ``glm4_moe_lite`` and ``glm4_moe`` take ``rope_theta`` from the top level (lite defaults it to
    1e6), ``glm_moe_dsa`` from ``rope_parameters``; a transformers 5.x ``save_pretrained`` writes only
    ``rope_parameters``. ``glm_moe_dsa`` and ``glm4_moe`` require the router fields that transformers
    implies (``noaux_tc``, sigmoid scores, every layer past the dense ones sparse) and the RoPE fields
    GLM-4.x publishes.
    """
    out = copy.deepcopy(config)
    rope = out.get("rope_parameters") if isinstance(out.get("rope_parameters"), dict) else {}
    theta = out.get("rope_theta", rope.get("rope_theta"))
    if theta is not None:
        out.setdefault("rope_theta", theta)
        if model_type == "glm_moe_dsa":
            out["rope_parameters"] = {"rope_type": "default", **rope, "rope_theta": theta}
    if model_type != "glm4_moe_lite":
        out.setdefault("topk_method", "noaux_tc")
        out.setdefault("scoring_func", "sigmoid")
    if model_type == "glm_moe_dsa":
        out.setdefault("moe_layer_freq", 1)
    if model_type == "glm4_moe":
        out.setdefault("rope_scaling", None)
        out.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        out.setdefault("use_qk_norm", False)
    return out


# what mlx-vlm's drafter config drops from the model's config: the quantization is restated for the head
_NOT_IN_DRAFTER = ("quantization", "quantization_config", "mlx_lm_extra_tensors")


def drafter_config(config: dict, model_type: str) -> dict:
    """mtp/config.json: the drafter folder ``--draft-model OUT/mtp`` loads in mlx-vlm (its
    ``<model_type>_mtp`` drafter, built from the whole text config; one draft per round)."""
    text = {k: v for k, v in config.items() if k not in _NOT_IN_DRAFTER}
    out = {"model_type": f"{model_type}_mtp", "text_config": text, "block_size": 2,
           "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}
    if "quantization" in config:
        out["quantization"] = copy.deepcopy(config["quantization"])
        out["quantization_config"] = copy.deepcopy(config["quantization"])
    return out


def _bind(family: Family, config: dict) -> Family:
    """The nextn layer's index is the config's num_hidden_layers: the key hooks take it from here."""
    n = config.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_hidden_layers must be an integer >= 1, got {n!r}", file="config.json",
                          key="num_hidden_layers")
    return dataclasses.replace(family, contributions=partial(contributions, num_layers=n),
                               source_name=partial(source_name, num_layers=n), bind=None)


def _head(shares_vocab: bool) -> HeadDesign:
    return HeadDesign(
        forward="nextn",
        projection="mtp.eh_proj [H, 2H]",
        concat=("enorm(embed(t+1))", "hnorm(h_t)"),
        layer="one backbone decoder layer (its attention and MoE) with its own KV cache",
        output="lm_head(shared_head_norm(h))" if shares_vocab else "shared_head.head(shared_head_norm(h))",
        hidden_state="post_norm",
        shares=("embed_tokens", "lm_head") if shares_vocab else (),
        norms_zero_centred=False,
    )


TITLES = {
    "glm4_moe_lite": "GLM-4.7-Flash (MLA + MoE), nextn head",
    "glm_moe_dsa": "GLM-5.x (MLA + sparse-attention indexer + MoE), nextn head",
    "glm4_moe": "GLM-4.5 / 4.6 / 4.7 (GQA + MoE), nextn head",
}
# mlx-vlm 0.7.10 drafts only glm_moe_dsa (its glm4_moe_lite drafter has no model class, glm4_moe none at all)
HEAD_RUNTIMES = {"glm_moe_dsa": ("mlx-vlm-drafter",)}


def _family(model_type: str) -> Family:
    v = VARIANTS[model_type]
    return Family(
        name=model_type,
        title=TITLES[model_type],
        model_types={model_type: model_type},
        head=_head(shares_vocab=not v.head_own_vocab),
        backbone_runtimes=("mlx-lm<0.32", "mlx-lm>=0.32", "mlx-vlm", "mlx-vlm-drafter"),
        head_runtimes=HEAD_RUNTIMES.get(model_type, ()),
        mtp_layouts=("sidecar",),
        head_prefix=HEAD_PREFIX,
        lm_head=LM_HEAD,
        capabilities=Capabilities(batched=True, pre_norm_hidden=False),
        backbone="mtpconvert.families.glm.backbone:GlmBackbone",
        compat="mtpconvert.families.glm.compat:rows",
        spec=partial(model_spec, model_type=model_type),
        expected_slots=expected_slots,
        contributions=partial(contributions, num_layers=-1),  # bound to the config by family_for
        key_style=key_style,
        source_name=partial(source_name, num_layers=-1),
        is_zero_centred_norm=lambda name: False,
        norms_zero_centred=lambda tensors: False,
        default_style=RAW_TEXT,
        loadable_config=partial(loadable_config, model_type=model_type),
        drafter_config=partial(drafter_config, model_type=model_type),
        mtp_count_keys=("num_nextn_predict_layers",),
        single_layer_head=True,
        bind=_bind,
    )


GLM4_MOE_LITE = _family("glm4_moe_lite")
GLM_MOE_DSA = _family("glm_moe_dsa")
GLM4_MOE = _family("glm4_moe")
FAMILIES = (GLM4_MOE_LITE, GLM_MOE_DSA, GLM4_MOE)
