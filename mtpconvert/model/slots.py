"""The tensor table mlx-lm expects for a config, plus our MTP head.

Each ``Slot`` is one output tensor before quantization: its MLX name, shape and the
kind that decides its transforms (norms shift, conv moves an axis, A_log stays fp32,
linear weights may be quantized). The plan maps source tensors onto these slots;
``verify`` compares folders against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from .spec import ModelSpec

LM = "language_model."

# Slot kinds
EMBEDDING = "embedding"  # nn.Embedding (quantizable)
LINEAR = "linear"  # nn.Linear weight (quantizable)
SWITCH = "switch"  # stacked experts, SwitchLinear (quantizable)
ROUTER = "router"  # mlp.gate / shared_expert_gate (quantized at 8 bits like mlx-lm)
FC = "fc"  # mtp.fc (never quantized)
NORM = "norm"  # zero-centred RMSNorm in the source: +1 on raw weights
GATED_NORM = "gated_norm"  # linear-attention RMSNormGated: not shifted
CONV = "conv"  # depthwise conv1d: [C,1,K] raw -> [C,K,1]
A_LOG = "a_log"  # stays float32
PARAM = "param"  # dt_bias and biases: cast only

QUANTIZABLE = (EMBEDDING, LINEAR, SWITCH, ROUTER, FC)

# The zero-centred RMSNorms (y = x * (1 + w) in the source, +1 once on raw weights): every
# decoder layer's two layer norms and q/k norms, the final norm, and the MTP head's three.
# Not the gated norm of linear attention (linear_attn.norm), nor A_log / dt_bias.
ZERO_CENTRED_NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight",
                              "self_attn.q_norm.weight", "self_attn.k_norm.weight")
ZERO_CENTRED_NORMS = ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.pre_fc_norm_embedding.weight")

BACKBONE = "backbone"
MTP = "mtp"
VISION = "vision"


@dataclass(frozen=True)
class Slot:
    name: str
    shape: Tuple[int, ...]
    kind: str
    group: str

    @property
    def module(self) -> str:
        """Module path as mlx-lm's quantization config names it."""
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name


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
