"""Every tensor an MLX glm5_next folder holds, with the kind that decides its transforms.

The names are mlx-vlm 0.7.10's (``models/glm5_next/language.py``: ``DecoderLayer``, ``Glm5NextLinearAttention``,
``Glm5NextAttention``, ``Glm5NextIndexer``, ``Glm5NextMoE``, ``HyperConnection``) as its ``sanitize`` renames a raw
release, one stored tensor per source tensor: the projections its sanitize concatenates when it loads
(``q_a_proj`` + ``kv_a_proj_with_mqa``, ``gate_proj`` + ``up_proj``, the linear attention's q/k/v and f_a/b/g_a
projections and short convolutions) are stored apart, each quantized on its own rows, which are the rows of the
concatenation (``language.py:973-1053``). What it splits or stacks is stored split or stacked: ``kv_b_proj`` as
``embed_q`` / ``unembed_out``, experts as ``switch_mlp``.

No norm is shifted (plain RMSNorm gains: kind ``PARAM``, cast only). ``A_log``, ``dt_bias`` and the
hyper-connections' ``base`` / ``scale`` stay float32 (kind ``A_LOG``: transformers keeps them so, mlx-vlm never
casts them); the router's weight is a bare parameter (never quantized) and its bias float32; the
hyper-connections' ``fn`` and the indexer's pooling tables are never quantized (mlx-vlm's ``quant_predicate``).

The head (canonical prefix ``mtp.``) is the nextn layer under the names mlx-vlm's splitter takes after
``layers.{N}.`` (``speculative/drafters/glm5_next_mtp/split.py:41-59``): ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and the block's own (``self_attn`` with a full indexer, a sparse ``mlp``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple

from ..base import A_LOG, BACKBONE, CONV, EMBEDDING, FC, LINEAR, MTP, MULTI, PARAM, ROUTER_BIAS, SWITCH, Slot
from .spec import ModelSpec

LM = "language_model."
LAYERS = LM + "model.layers."
HEAD_PREFIX = "mtp."
LM_HEAD = LM + "lm_head.weight"

Table = Iterable[Tuple[str, Tuple[int, ...], str]]


def _add(out: Dict[str, Slot], prefix: str, table: Table, group: str) -> None:
    for name, shape, kind in table:
        out[prefix + name] = Slot(prefix + name, tuple(shape), kind, group)


def _hyper_connections(s: ModelSpec) -> Table:
    mix = (2 + s.hc_mult) * s.hc_mult
    for site in ("attn_hc", "ffn_hc"):
        yield f"{site}.fn", (mix, s.hc_mult * s.hidden_size), PARAM
        yield f"{site}.base", (mix,), A_LOG
        yield f"{site}.scale", (3,), A_LOG


def _linear_attention(s: ModelSpec) -> Table:
    """Kimi delta attention: q/k/v projections and their short convolutions, the low-rank forget gate, beta, the
    gated output."""
    H, nh, hd = s.hidden_size, s.linear_num_heads, s.linear_head_dim
    P = nh * hd
    for name in ("q", "k", "v"):
        yield f"{name}_proj.weight", (P, H), LINEAR
        yield f"{name}_conv.conv.weight", (P, s.conv_kernel, 1), CONV
    yield from (("f_a_proj.weight", (hd, H), LINEAR), ("f_b_proj.weight", (P, hd), LINEAR),
                ("b_proj.weight", (nh, H), LINEAR), ("g_a_proj.weight", (hd, H), LINEAR),
                ("g_b_proj.weight", (P, hd), LINEAR), ("A_log", (nh,), A_LOG), ("dt_bias", (P,), A_LOG),
                ("o_norm.weight", (hd,), PARAM), ("o_proj.weight", (H, P), LINEAR))


def _sparse_attention(s: ModelSpec, indexer: bool) -> Table:
    """Latent attention without RoPE; a layer with its own indexer also has the indexer's projections."""
    H, nh = s.hidden_size, s.num_heads
    yield from (("q_a_proj.weight", (s.q_lora_rank, H), LINEAR), ("q_a_layernorm.weight", (s.q_lora_rank,), PARAM),
                ("q_b_proj.weight", (nh * s.qk_nope_head_dim, s.q_lora_rank), LINEAR),
                ("kv_a_proj_with_mqa.weight", (s.kv_lora_rank, H), LINEAR),
                ("kv_a_layernorm.weight", (s.kv_lora_rank,), PARAM),
                ("embed_q.weight", (nh, s.kv_lora_rank, s.qk_nope_head_dim), MULTI),
                ("unembed_out.weight", (nh, s.v_head_dim, s.kv_lora_rank), MULTI),
                ("o_proj.weight", (H, nh * s.v_head_dim), LINEAR))
    if indexer:
        d, n = s.index_head_dim, s.index_n_heads
        yield from (("indexer.wq_b.weight", (n * d, s.q_lora_rank), LINEAR), ("indexer.wk.weight", (d, H), LINEAR),
                    ("indexer.k_norm.weight", (d,), PARAM), ("indexer.k_norm.bias", (d,), PARAM),
                    ("indexer.weights_proj.weight", (n, H), LINEAR),
                    ("indexer.index_kpool_compress_ape", (s.index_kpool, d), PARAM),
                    ("indexer.index_kpool_compress_gate", (d, H), PARAM))


def _mlp(s: ModelSpec, sparse: bool) -> Table:
    H = s.hidden_size
    if not sparse:
        I = s.intermediate_size
        yield from (("gate_proj.weight", (I, H), LINEAR), ("up_proj.weight", (I, H), LINEAR),
                    ("down_proj.weight", (H, I), LINEAR))
        return
    E, I = s.num_experts, s.moe_intermediate_size
    Is = I * s.n_shared_experts
    yield from (("gate.weight", (E, H), PARAM), ("gate.e_score_correction_bias", (E,), ROUTER_BIAS),
                ("switch_mlp.gate_proj.weight", (E, I, H), SWITCH), ("switch_mlp.up_proj.weight", (E, I, H), SWITCH),
                ("switch_mlp.down_proj.weight", (E, H, I), SWITCH),
                ("shared_experts.gate_proj.weight", (Is, H), LINEAR),
                ("shared_experts.up_proj.weight", (Is, H), LINEAR),
                ("shared_experts.down_proj.weight", (H, Is), LINEAR))


def _block(out: Dict[str, Slot], p: str, s: ModelSpec, linear: bool, indexer: bool, sparse: bool, group: str):
    H = s.hidden_size
    _add(out, p, [("input_layernorm.weight", (H,), PARAM), ("post_attention_layernorm.weight", (H,), PARAM)], group)
    _add(out, p + "self_attn.", _linear_attention(s) if linear else _sparse_attention(s, indexer), group)
    _add(out, p + "mlp.", _mlp(s, sparse), group)


def backbone_slots(s: ModelSpec) -> Dict[str, Slot]:
    H, V = s.hidden_size, s.vocab_size
    out: Dict[str, Slot] = {}
    _add(out, LM + "model.", [("embed_tokens.weight", (V, H), EMBEDDING), ("norm.weight", (H,), PARAM)], BACKBONE)
    for i in range(s.num_layers):
        p = f"{LAYERS}{i}."
        _block(out, p, s, s.linear_layers[i], s.full_indexer[i], s.sparse_mlp[i], BACKBONE)
        _add(out, p, _hyper_connections(s), BACKBONE)
    if not s.tie_word_embeddings:
        out[LM_HEAD] = Slot(LM_HEAD, (V, H), LINEAR, BACKBONE)
    return out


def head_slots(s: ModelSpec) -> Dict[str, Slot]:
    """The nextn layer: its input norms and projection (never quantized: kind FC), a sparse-attention block with
    its own full indexer and a MoE, no hyper-connections; ``shared_head.norm`` before the backbone's lm_head."""
    H = s.hidden_size
    out: Dict[str, Slot] = {}
    _add(out, HEAD_PREFIX, [("enorm.weight", (H,), PARAM), ("hnorm.weight", (H,), PARAM),
                            ("eh_proj.weight", (H, 2 * H), FC), ("shared_head.norm.weight", (H,), PARAM)], MTP)
    _block(out, HEAD_PREFIX, s, linear=False, indexer=True, sparse=True, group=MTP)
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    out = backbone_slots(s)
    if mtp_layers:
        out.update(head_slots(s))
    return out
