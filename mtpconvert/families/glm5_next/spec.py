"""GLM-5.3-Flash's config.json, validated into the numbers the converter needs (``ModelSpec``).

The per-layer lists are read as transformers 5.24 reads them (``models/glm5_next/configuration_glm5_next.py:154-201``)
and written out in full (``loadable_config``), because mlx-vlm 0.7.10 fills an absent list its own way
(``models/glm5_next/config.py:78-128``: ``mlp_layer_types`` from ``first_k_dense_replace``, which transformers
ignores). A config that mlx-vlm would refuse or silently misread is refused here, naming its key: a flat config
(mlx-vlm then builds its 45-layer default), RoPE in the sparse attention, key heads other than the query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...errors import ConfigError
from ..base import config_bool, config_int, config_model_type, resolve_tie, text_config

MODEL_TYPES = {"glm5_next": "glm5_next"}
LINEAR_ATTENTION = "linear_attention"
# the sparse-attention layer's names: the release's, transformers' own and mlx-vlm's
SPARSE_ATTENTION = ("full_attention", "indexed_attention", "deepseek_sparse_attention")
INDEXER_TYPES = ("full", "shared")
MLP_TYPES = ("dense", "sparse")
FILE = "config.json"


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    nested: bool
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_kpool: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    n_shared_experts: int
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int
    hc_mult: int
    linear_layers: Tuple[bool, ...]  # per backbone layer: True where its attention is the linear (KDA) one
    full_indexer: Tuple[bool, ...]  # per backbone layer: True where a sparse-attention layer has its own indexer
    sparse_mlp: Tuple[bool, ...]  # per backbone layer: True where its MLP is the MoE
    tie_word_embeddings: bool
    mtp_layers: Optional[int]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _key(name: str) -> str:
    return "text_config." + name


def _listed(tc: dict, name: str, n: int, allowed: Tuple[str, ...], default: List[str]) -> List[str]:
    """A per-layer list of the config, or ``default`` where it has none; one entry per layer, each allowed."""
    value = tc.get(name)
    if value is None:
        return default
    if not isinstance(value, list) or len(value) != n:
        raise ConfigError(f"{name} must list {n} entries (one per layer of num_hidden_layers)", file=FILE,
                          key=_key(name))
    bad = [v for v in value if v not in allowed]
    if bad:
        raise ConfigError(f"{name} holds {bad[0]!r}; expected one of {list(allowed)}", file=FILE, key=_key(name))
    return list(value)


def _indexer_default(tc: dict, n: int) -> List[str]:
    """transformers' schedule where the config lists no indexer types: a pattern, else every ``index_topk_freq``-th
    layer from ``index_skip_topk_offset`` on has a full indexer."""
    pattern = tc.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, (str, list)) or len(pattern) != n or any(
                c not in ("F", "S", *INDEXER_TYPES) for c in pattern):
            raise ConfigError(f"index_topk_pattern must give one of F/S per layer ({n})", file=FILE,
                              key=_key("index_topk_pattern"))
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    freq = max(config_int(tc, "index_topk_freq", 1), 1)
    offset = config_int(tc, "index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _layer_lists(tc: dict, n: int) -> Tuple[Tuple[bool, ...], Tuple[bool, ...], Tuple[bool, ...]]:
    kinds = _listed(tc, "layer_types", n, (LINEAR_ATTENTION, *SPARSE_ATTENTION),
                    [LINEAR_ATTENTION if i % 4 != 3 else "full_attention" for i in range(n)])
    indexers = _listed(tc, "indexer_types", n, INDEXER_TYPES, _indexer_default(tc, n))
    mlps = _listed(tc, "mlp_layer_types", n, MLP_TYPES, ["dense"] * min(3, n) + ["sparse"] * (n - 3))
    linear = tuple(k == LINEAR_ATTENTION for k in kinds)
    seen_full = False
    for i, (is_linear, indexer) in enumerate(zip(linear, indexers)):
        if is_linear:
            continue
        if indexer == "shared" and not seen_full:
            raise ConfigError(f"layer {i} shares the indexer of an earlier sparse-attention layer, but none before "
                              "it has one of its own", file=FILE, key=_key("indexer_types"))
        seen_full = seen_full or indexer == "full"
    full = tuple(not is_linear and indexer == "full" for is_linear, indexer in zip(linear, indexers))
    return linear, full, tuple(m == "sparse" for m in mlps)


def _refuse_unsupported(tc: dict) -> None:
    if config_int(tc, "qk_rope_head_dim", 0) != 0:
        raise ConfigError("qk_rope_head_dim must be 0: GLM-5.3-Flash's sparse attention has no RoPE, and mlx-vlm's "
                          "refuses any", file=FILE, key=_key("qk_rope_head_dim"))
    heads = config_int(tc, "num_attention_heads", minimum=1)
    if config_int(tc, "num_key_value_heads", heads, minimum=1) != heads:
        raise ConfigError("num_key_value_heads must equal num_attention_heads (the latent attention has one key head "
                          "per query head)", file=FILE, key=_key("num_key_value_heads"))
    if tc.get("q_lora_rank") is None:
        raise ConfigError("config is missing q_lora_rank (the indexer reads the query's low-rank projection)",
                          file=FILE, key=_key("q_lora_rank"))
    if config_bool(tc, "attention_bias"):
        raise ConfigError("attention_bias=true is not supported: the release has none", file=FILE,
                          key=_key("attention_bias"))
    topk, kpool = config_int(tc, "index_topk", 2048, minimum=1), config_int(tc, "index_kpool", 16, minimum=1)
    if topk % kpool:
        raise ConfigError(f"index_topk={topk} is not a multiple of index_kpool={kpool}", file=FILE,
                          key=_key("index_topk"))


def _linear_sizes(tc: dict) -> Tuple[int, int, int]:
    """(heads, head dim, conv kernel) of the linear attention; ``linear_attn_config`` overrides, as both read it."""
    la = tc.get("linear_attn_config") or {}
    if not isinstance(la, dict):
        raise ConfigError("linear_attn_config must be an object", file=FILE, key=_key("linear_attn_config"))
    merged = {"linear_num_heads": la.get("num_heads", tc.get("linear_num_heads", 64)),
              "linear_head_dim": la.get("head_dim", tc.get("linear_head_dim", 128)),
              "linear_conv_kernel_dim": la.get("short_conv_kernel_size", tc.get("linear_conv_kernel_dim", 4))}
    return tuple(config_int(merged, k, minimum=1) for k in merged)  # type: ignore[return-value]


def _mtp_layers(tc: dict) -> Optional[int]:
    if "num_nextn_predict_layers" not in tc:
        return None
    n = config_int(tc, "num_nextn_predict_layers")
    if n > 1:
        raise ConfigError(f"num_nextn_predict_layers={n}: GLM-5.3-Flash has one nextn layer, and mlx-vlm's drafter "
                          "runs one", file=FILE, key=_key("num_nextn_predict_layers"))
    return n


def model_spec(config: dict) -> ModelSpec:
    """Validate config.json (the release's nested form) and extract the numbers the converter needs."""
    if config_model_type(config) not in MODEL_TYPES:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not glm5_next", file=FILE, key="model_type")
    if not isinstance(config.get("text_config"), dict):
        raise ConfigError("a glm5_next config nests the text model's settings in text_config (mlx-vlm reads them "
                          "there, and builds its 45-layer default from a flat config)", file=FILE, key="text_config")
    tc = text_config(config)
    _refuse_unsupported(tc)
    n = config_int(tc, "num_hidden_layers", minimum=1)
    linear, full, sparse = _layer_lists(tc, n)
    heads, head_dim, kernel = _linear_sizes(tc)
    return ModelSpec(
        model_type=config_model_type(config), nested=True,
        hidden_size=config_int(tc, "hidden_size", minimum=1),
        num_layers=n,
        vocab_size=config_int(tc, "vocab_size", minimum=1),
        num_heads=config_int(tc, "num_attention_heads", minimum=1),
        q_lora_rank=config_int(tc, "q_lora_rank", minimum=1),
        kv_lora_rank=config_int(tc, "kv_lora_rank", minimum=1),
        qk_nope_head_dim=config_int(tc, "qk_nope_head_dim", minimum=1),
        v_head_dim=config_int(tc, "v_head_dim", minimum=1),
        index_n_heads=config_int(tc, "index_n_heads", minimum=1),
        index_head_dim=config_int(tc, "index_head_dim", minimum=1),
        index_kpool=config_int(tc, "index_kpool", 16, minimum=1),
        intermediate_size=config_int(tc, "intermediate_size", minimum=1),
        moe_intermediate_size=config_int(tc, "moe_intermediate_size", minimum=1),
        num_experts=config_int(tc, "n_routed_experts", minimum=1),
        n_shared_experts=config_int(tc, "n_shared_experts", 1, minimum=1),
        linear_num_heads=heads, linear_head_dim=head_dim, conv_kernel=kernel,
        hc_mult=config_int(tc, "hc_mult", 4, minimum=1),
        linear_layers=linear, full_indexer=full, sparse_mlp=sparse,
        tie_word_embeddings=resolve_tie(config),
        mtp_layers=_mtp_layers(tc),
    )
