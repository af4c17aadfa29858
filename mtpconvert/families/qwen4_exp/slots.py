"""Every tensor an MLX qwen4_exp folder holds, under mlx-vlm 0.7.10's names (``models/qwen4_exp/language.py``:
``Qwen4ExpModel``, ``Qwen4ExpDecoderLayer``, ``Qwen4ExpPLELayer``, ``Qwen4ExpGatedResidual``) and its drafter's
(``speculative/drafters/qwen4_exp_mtp/qwen4_exp_mtp.py:31-62``), with the kind that decides its transforms.

No norm is shifted: ``Qwen4ExpRMSNorm`` multiplies by ``1 + w`` when it runs (``language.py:742-755``), so its
weights stay zero-centred in the MLX folder (kind ``PARAM``: cast only); the gated norm of the linear attention
multiplies by ``w`` itself.
"""

from __future__ import annotations

from typing import Dict

from ..base import (A_LOG, BACKBONE, BUFFER, CONV, EMBEDDING, FC, LINEAR, MTP, PARAM, ROUTER, ROWS, SWITCH, Slot)
from .spec import ModelSpec

LM = "language_model."
HEAD_PREFIX = "mtp."
LM_HEAD = LM + "lm_head.weight"


def _add(out: Dict[str, Slot], prefix: str, table, group: str) -> None:
    for name, shape, kind in table:
        out[prefix + name] = Slot(prefix + name, tuple(shape), kind, group)


def _hyper_connection(prefix: str, s: ModelSpec, group: str, inject: bool = True) -> Dict[str, Slot]:
    """``Qwen4ExpGatedResidual``: a grouped norm over the hc streams, the low-rank mix, the block's injection."""
    C, R = s.hc_hidden, s.hc_lowrank
    table = [("hc_norm.weight", (C,), PARAM), ("input_mix_weight_down.weight", (R, C), LINEAR),
             ("input_mix_weight_up.weight", (C, R), LINEAR)]
    if inject:
        table.append(("block_inject_weight.weight", (s.hc_count, C), LINEAR))
    out: Dict[str, Slot] = {}
    _add(out, prefix, table, group)
    return out


def _attention(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    """Gated attention (q_proj holds the query and its gate) with the sparse indexer."""
    H, hd = s.hidden_size, s.head_dim
    q_out, kv_out = s.num_heads * hd, s.num_kv_heads * hd
    table = [("q_proj.weight", (2 * q_out, H), LINEAR), ("k_proj.weight", (kv_out, H), LINEAR),
             ("v_proj.weight", (kv_out, H), LINEAR), ("o_proj.weight", (H, q_out), LINEAR),
             ("q_norm.weight", (hd,), PARAM), ("k_norm.weight", (hd,), PARAM),
             ("indexer.index_qk_proj.weight", ((s.indexer_heads + 1) * s.indexer_head_dim, H), LINEAR),
             ("indexer.q_layernorm.weight", (s.indexer_head_dim,), PARAM),
             ("indexer.k_layernorm.weight", (s.indexer_head_dim,), PARAM)]
    out: Dict[str, Slot] = {}
    _add(out, prefix + "self_attn.", table, group)
    return out


def _linear_attention(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H, nv = s.hidden_size, s.lin_num_v_heads
    v_dim = nv * s.lin_v_dim
    table = [("in_proj_qkv.weight", (s.conv_dim, H), LINEAR), ("in_proj_z.weight", (v_dim, H), LINEAR),
             ("in_proj_b.weight", (nv, H), LINEAR), ("in_proj_a.weight", (nv, H), LINEAR),
             ("conv1d.weight", (s.conv_dim, s.conv_kernel, 1), CONV), ("dt_bias", (nv,), PARAM),
             ("A_log", (nv,), A_LOG), ("norm.weight", (s.lin_v_dim,), PARAM), ("out_proj.weight", (H, v_dim), LINEAR)]
    out: Dict[str, Slot] = {}
    _add(out, prefix + "linear_attn.", table, group)
    return out


def _moe(prefix: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    H, E, I, Is = s.hidden_size, s.num_experts, s.moe_intermediate_size, s.shared_expert_intermediate_size
    table = [("gate.weight", (E, H), ROUTER), ("switch_mlp.gate_proj.weight", (E, I, H), SWITCH),
             ("switch_mlp.up_proj.weight", (E, I, H), SWITCH), ("switch_mlp.down_proj.weight", (E, H, I), SWITCH),
             ("shared_expert.gate_proj.weight", (Is, H), LINEAR), ("shared_expert.up_proj.weight", (Is, H), LINEAR),
             ("shared_expert.down_proj.weight", (H, Is), LINEAR), ("shared_expert_gate.weight", (1, H), ROUTER)]
    out: Dict[str, Slot] = {}
    _add(out, prefix + "mlp.", table, group)
    return out


def _ple(prefix: str, s: ModelSpec, rows: int) -> Dict[str, Slot]:
    """``Qwen4ExpPLELayer``: the n-gram table in ``split_ngram_parts`` row shards, its hashing buffers (int64,
    computed from the config: carried as stored), the gate's projections and norms, the dilated short conv."""
    C, D = s.hc_hidden, s.ple_embed_dim
    table = [("key_proj.weight", (C, D), LINEAR), ("value_proj.weight", (s.hidden_size, D), LINEAR),
             ("norm_key.weight", (C,), PARAM), ("norm_query.weight", (C,), PARAM), ("norm_conv.weight", (C,), PARAM),
             ("conv1d.weight", (C, s.ple_conv_kernel, 1), CONV),
             ("ple_embedding.layer_multipliers", (s.ngram_size,), BUFFER),
             ("ple_embedding.ngram_heads_vocab_sizes", (s.ngram_heads,), BUFFER),
             ("ple_embedding.ngram_heads_offsets", (s.ngram_heads,), BUFFER)]
    table += [(f"ple_embedding.ngram_embedding.shards.{i}.weight", (rows // s.ngram_shards, s.ngram_row_width), ROWS)
              for i in range(s.ngram_shards)]
    out: Dict[str, Slot] = {}
    _add(out, prefix + "ple.", table, BACKBONE)
    return out


def _decoder_layer(prefix: str, s: ModelSpec, linear: bool, group: str) -> Dict[str, Slot]:
    out = _linear_attention(prefix, s, group) if linear else _attention(prefix, s, group)
    out.update(_moe(prefix, s, group))
    out.update(_hyper_connection(prefix + "attn_hyper_connection.", s, group))
    out.update(_hyper_connection(prefix + "mlp_hyper_connection.", s, group))
    return out


def backbone_slots(s: ModelSpec) -> Dict[str, Slot]:
    H, V = s.hidden_size, s.vocab_size
    m = LM + "model."
    out = {m + "embed_tokens.weight": Slot(m + "embed_tokens.weight", (V, H), EMBEDDING, BACKBONE)}
    for i, linear in enumerate(s.linear_layers):
        out.update(_decoder_layer(f"{m}layers.{i}.", s, linear, BACKBONE))
    for p, i in enumerate(s.ple_layers):
        out.update(_ple(f"{m}layers.{i}.", s, s.ngram_rows[p]))
    out.update(_hyper_connection(m + "hyper_connection_mixer.", s, BACKBONE, inject=False))
    if not s.tie_word_embeddings:
        out[LM_HEAD] = Slot(LM_HEAD, (V, H), LINEAR, BACKBONE)
    return out


def mtp_slots(s: ModelSpec, num_layers: int) -> Dict[str, Slot]:
    """The head: a global norm over the hc streams and one over the embedding, their projections (never
    quantized: kind FC), one full-attention layer with the backbone's MoE and hyper-connections, its own mixer."""
    if num_layers == 0:
        return {}
    H, p = s.hidden_size, HEAD_PREFIX
    out: Dict[str, Slot] = {}
    _add(out, p, [("pre_fc_norm_embedding.weight", (H,), PARAM), ("pre_fc_norm_hidden.weight", (s.hc_hidden,), PARAM),
                  ("fc_embedding.weight", (H, H), FC), ("fc_hidden.weight", (H, H), FC)], MTP)
    for j in range(num_layers):
        out.update(_decoder_layer(f"{p}layers.{j}.", s, False, MTP))
    out.update(_hyper_connection(p + "hyper_connection_mixer.", s, MTP, inject=False))
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    out = backbone_slots(s)
    out.update(mtp_slots(s, mtp_layers))
    return out
