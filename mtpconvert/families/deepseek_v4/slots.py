"""Every tensor an MLX deepseek_v4 folder holds, under mlx-vlm 0.7.10's names (``models/deepseek_v4/language.py``:
``DeepseekV4Model``, ``DeepseekV4Block``, ``LocalAttention`` / ``CompressedAttention`` / ``SparseCompressedAttention``,
``Compressor``, ``Indexer``, ``DeepseekV4MoE``, ``HyperConnection``, ``HyperHead``) and its drafter's
(``speculative/drafters/deepseek_v4_mtp/deepseek_v4_mtp.py:47-63``: ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``,
``decoder``, ``hc_head``, ``norm``), with the kind that decides its transforms.

Norms are plain RMSNorm gains (nothing shifted). The router's weight is a bare parameter of ``MoEGate`` (cast only,
never quantized); its score-correction bias, the attention sinks and every hyper-connection parameter stay
float32, as mlx-vlm's ``cast_predicate`` keeps them. ``wo_a`` is a ``MultiLinear`` over ``o_groups``.
"""

from __future__ import annotations

from typing import Dict

from ..base import (BACKBONE, BUFFER, EMBEDDING, F32_PARAM, LINEAR, MTP, MULTI, NORM, PARAM, ROUTER_BIAS, SWITCH,
                    Slot)
from .spec import SPARSE, ModelSpec

LM = "language_model."
MODEL = LM + "model."
HEAD_PREFIX = "mtp."
LM_HEAD = LM + "lm_head.weight"


def _add(out: Dict[str, Slot], prefix: str, table, group: str) -> None:
    for name, shape, kind in table:
        out[prefix + name] = Slot(prefix + name, tuple(shape), kind, group)


def _compressor(prefix: str, s: ModelSpec, ratio: int, head_dim: int, group: str) -> Dict[str, Slot]:
    """Gated softmax pooling of ``ratio`` tokens a window; a ratio-4 compressor also reads the window before."""
    width = (2 if ratio == SPARSE else 1) * head_dim
    out: Dict[str, Slot] = {}
    _add(out, prefix, [("wkv.weight", (width, s.hidden_size), LINEAR), ("wgate.weight", (width, s.hidden_size), LINEAR),
                       ("ape", (ratio, width), PARAM), ("norm.weight", (head_dim,), NORM)], group)
    return out


def _attention(prefix: str, s: ModelSpec, ratio: int, group: str) -> Dict[str, Slot]:
    H, nh, hd, ql = s.hidden_size, s.num_heads, s.head_dim, s.q_lora_rank
    table = [("wq_a.weight", (ql, H), LINEAR), ("q_norm.weight", (ql,), NORM), ("wq_b.weight", (nh * hd, ql), LINEAR),
             ("wkv.weight", (hd, H), LINEAR), ("kv_norm.weight", (hd,), NORM),
             ("wo_a.weight", (s.o_groups, s.o_lora_rank, nh * hd // s.o_groups), MULTI),
             ("wo_b.weight", (H, s.o_groups * s.o_lora_rank), LINEAR), ("attn_sink", (nh,), F32_PARAM)]
    out: Dict[str, Slot] = {}
    _add(out, prefix + "attn.", table, group)
    if ratio:
        out.update(_compressor(prefix + "attn.compressor.", s, ratio, hd, group))
    if ratio == SPARSE:
        _add(out, prefix + "attn.indexer.", [("wq_b.weight", (s.index_heads * s.index_head_dim, ql), LINEAR),
                                             ("weights_proj.weight", (s.index_heads, H), LINEAR)], group)
        out.update(_compressor(prefix + "attn.indexer.compressor.", s, ratio, s.index_head_dim, group))
    return out


def _moe(prefix: str, s: ModelSpec, hashed: bool, group: str) -> Dict[str, Slot]:
    H, E, I, Is = s.hidden_size, s.num_experts, s.moe_intermediate_size, s.moe_intermediate_size * s.n_shared_experts
    table = [("gate.weight", (E, H), PARAM),
             ("gate.tid2eid", (s.vocab_size, s.experts_per_token), BUFFER) if hashed
             else ("gate.e_score_correction_bias", (E,), ROUTER_BIAS),
             ("switch_mlp.gate_proj.weight", (E, I, H), SWITCH), ("switch_mlp.up_proj.weight", (E, I, H), SWITCH),
             ("switch_mlp.down_proj.weight", (E, H, I), SWITCH),
             ("shared_experts.gate_proj.weight", (Is, H), LINEAR), ("shared_experts.up_proj.weight", (Is, H), LINEAR),
             ("shared_experts.down_proj.weight", (H, Is), LINEAR)]
    out: Dict[str, Slot] = {}
    _add(out, prefix + "ffn.", table, group)
    return out


def _hyper(prefix: str, s: ModelSpec, rows: int, scales: int, group: str) -> Dict[str, Slot]:
    """A hyper-connection's (or HyperHead's) mixing projection over the flattened streams, its bias, its scales."""
    out: Dict[str, Slot] = {}
    _add(out, prefix, [("fn", (rows, s.hc_mult * s.hidden_size), F32_PARAM), ("base", (rows,), F32_PARAM),
                       ("scale", (scales,), F32_PARAM)], group)
    return out


def _block(prefix: str, s: ModelSpec, ratio: int, hashed: bool, group: str) -> Dict[str, Slot]:
    out = _attention(prefix, s, ratio, group)
    out.update(_moe(prefix, s, hashed, group))
    _add(out, prefix, [("attn_norm.weight", (s.hidden_size,), NORM), ("ffn_norm.weight", (s.hidden_size,), NORM)],
         group)
    out.update(_hyper(prefix + "attn_hc.", s, s.hc_mix, 3, group))
    out.update(_hyper(prefix + "ffn_hc.", s, s.hc_mix, 3, group))
    return out


def backbone_slots(s: ModelSpec) -> Dict[str, Slot]:
    H = s.hidden_size
    out: Dict[str, Slot] = {}
    _add(out, MODEL, [("embed_tokens.weight", (s.vocab_size, H), EMBEDDING), ("norm.weight", (H,), NORM)], BACKBONE)
    for i, ratio in enumerate(s.compress_ratios):
        out.update(_block(f"{MODEL}layers.{i}.", s, ratio, i < s.hash_layers, BACKBONE))
    out.update(_hyper(MODEL + "hc_head.", s, s.hc_mult, 1, BACKBONE))
    out[LM_HEAD] = Slot(LM_HEAD, (s.vocab_size, H), LINEAR, BACKBONE)
    return out


def mtp_slots(s: ModelSpec) -> Dict[str, Slot]:
    """The head: the drafter's modules, its block a sliding-window one with a score-routed MoE."""
    H, p = s.hidden_size, HEAD_PREFIX
    out: Dict[str, Slot] = {}
    _add(out, p, [("enorm.weight", (H,), NORM), ("hnorm.weight", (H,), NORM), ("norm.weight", (H,), NORM),
                  ("e_proj.weight", (H, H), LINEAR), ("h_proj.weight", (H, H), LINEAR)], MTP)
    out.update(_block(p + "decoder.", s, 0, False, MTP))
    out.update(_hyper(p + "hc_head.", s, s.hc_mult, 1, MTP))
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    out = backbone_slots(s)
    if mtp_layers:
        out.update(mtp_slots(s))
    return out
