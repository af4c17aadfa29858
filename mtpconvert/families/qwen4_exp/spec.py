"""Qwen3.8-Flash-Next's config.json, validated into the numbers the converter needs (``ModelSpec``), and the
n-gram ("PLE") tables' row counts, which the config implies rather than states.

The row count of a PLE layer's n-gram table is computed as transformers 5.24 builds the table
(``models/qwen4_exp/modeling_qwen4_exp.py:1097-1130``; mlx-vlm 0.7.10 ``models/qwen4_exp/language.py:1306-1367``
does the same): head ``h`` of the ``p``-th PLE layer hashes into the ``(p * heads + h + 1)``-th prime after
``ngram_vocab_size_base - 1`` rows, the heads' rows are concatenated and padded to a multiple of
``make_ngram_vocab_size_divisible_by``, and the table is stored in ``split_ngram_parts`` equal shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

from ...errors import ConfigError
from ..base import config_bool, config_int, config_model_type, resolve_tie, text_config

MODEL_TYPES = {"qwen4_exp": "qwen4_exp"}
LINEAR_ATTENTION = "linear_attention"
# the full-attention layer's names: the release's, transformers' own (it renames the release's on load) and
# mlx-vlm's (which renames the release's to it)
FULL_ATTENTION = ("full_attention", "indexed_attention", "qwen_sparse_attention")
INDEXER_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    nested: bool
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
    linear_layers: Tuple[bool, ...]  # per backbone layer: True where its attention is the GatedDeltaNet
    num_experts: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    hc_count: int
    hc_lowrank: int
    indexer_heads: int
    indexer_head_dim: int
    ple_layers: Tuple[int, ...]  # 0-based indices of the backbone layers with an n-gram embedding
    ple_embed_dim: int
    ple_conv_kernel: int
    ngram_size: int
    ngram_heads: int  # (ngram_size - 1) * heads_per_ngram: the n-gram hash heads of one PLE layer
    ngram_shards: int  # split_ngram_parts
    ngram_rows: Tuple[int, ...]  # per PLE layer (in ple_layers order): the padded rows of its table
    tie_word_embeddings: bool
    mtp_layers: Optional[int]

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_num_k_heads * self.lin_k_dim + self.lin_num_v_heads * self.lin_v_dim

    @property
    def hc_hidden(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def ngram_row_width(self) -> int:
        return self.ple_embed_dim // self.ngram_heads


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


@lru_cache(maxsize=None)
def primes_after(start: int, count: int) -> Tuple[int, ...]:
    """The first ``count`` primes greater than ``start``."""
    out: List[int] = []
    value = start
    while len(out) < count:
        value += 1
        if _is_prime(value):
            out.append(value)
    return tuple(out)


def ngram_table_rows(base: int, heads: int, ple_index: int, divisor: int) -> int:
    """Padded rows of the ``ple_index``-th PLE layer's n-gram table (module doc)."""
    primes = primes_after(base - 1, (ple_index + 1) * heads)
    total = sum(primes[ple_index * heads:(ple_index + 1) * heads])
    return math.ceil(total / divisor) * divisor


def _layer_kinds(tc: dict, num_layers: int) -> Tuple[bool, ...]:
    kinds = tc.get("layer_types")
    if kinds is None:
        interval = config_int(tc, "full_attention_interval", 4, minimum=1)
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ConfigError(f"layer_types must list {num_layers} entries", file="config.json",
                          key="text_config.layer_types")
    unknown = sorted({k for k in kinds if k != LINEAR_ATTENTION and k not in FULL_ATTENTION}, key=str)
    if unknown:
        raise ConfigError(f"layer_types holds {unknown[0]!r}; expected {LINEAR_ATTENTION!r} or "
                          f"{FULL_ATTENTION[0]!r}", file="config.json", key="text_config.layer_types")
    return tuple(k == LINEAR_ATTENTION for k in kinds)


def _ple_layers(tc: dict, linear: Tuple[bool, ...]) -> Tuple[int, ...]:
    ids = tc.get("ple_layer_ids") or []
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError("ple_layer_ids must list layer numbers", file="config.json", key="text_config.ple_layer_ids")
    layers = tuple(sorted({i - 1 for i in ids}))  # the config counts layers from 1
    for i in layers:
        if not 0 <= i < len(linear) or not linear[i]:
            raise ConfigError(f"ple_layer_ids names layer {i + 1}, which is not a linear-attention layer of "
                              f"{len(linear)}", file="config.json", key="text_config.ple_layer_ids")
    return layers


def _ngram_rows(tc: dict, layers: Tuple[int, ...], heads: int, shards: int) -> Tuple[int, ...]:
    base = config_int(tc, "ngram_vocab_size_base", 20_000_000, minimum=2)
    divisor = config_int(tc, "make_ngram_vocab_size_divisible_by", 128, minimum=1)
    rows = tuple(ngram_table_rows(base, heads, p, divisor) for p in range(len(layers)))
    for p, n in enumerate(rows):
        if n % shards:
            # transformers cuts a table into ceil-sized parts, mlx-vlm into near-equal ones: only an even cut
            # is read the same by both
            raise ConfigError(f"split_ngram_parts={shards} does not divide the {n} rows of layer {layers[p] + 1}'s "
                              "n-gram table", file="config.json", key="text_config.split_ngram_parts")
    return rows


def model_spec(config: dict) -> ModelSpec:
    """Validate config.json (the release's nested form) and extract the numbers the converter needs."""
    if config_model_type(config) not in MODEL_TYPES:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not qwen4_exp", file="config.json",
                          key="model_type")
    if not isinstance(config.get("text_config"), dict):
        raise ConfigError("a qwen4_exp config nests the text model's settings in text_config (mlx-vlm reads them "
                          "there)", file="config.json", key="text_config")
    tc = text_config(config)
    if config_bool(tc, "mtp_use_dedicated_embeddings"):
        raise ConfigError("mtp_use_dedicated_embeddings=true is not supported (mlx-vlm's drafter reads the "
                          "target's embedding)", file="config.json", key="text_config.mtp_use_dedicated_embeddings")
    missing = [k for k in INDEXER_KEYS if tc.get(k) is None]
    if missing:
        raise ConfigError(f"config is missing {missing[0]}: mlx-vlm's qwen4_exp attention always has the sparse "
                          "indexer", file="config.json", key=f"text_config.{missing[0]}")
    if config_int(tc, "indexer_kv_heads", minimum=1) != 1:
        raise ConfigError("indexer_kv_heads must be 1 (one key head of the sparse indexer)", file="config.json",
                          key="text_config.indexer_kv_heads")
    hidden = config_int(tc, "hidden_size", minimum=1)
    num_layers = config_int(tc, "num_hidden_layers", minimum=1)
    num_heads = config_int(tc, "num_attention_heads", minimum=1)
    linear = _layer_kinds(tc, num_layers)
    ple = _ple_layers(tc, linear)
    ngram_heads = (config_int(tc, "ngram_size", 3, minimum=2) - 1) * config_int(tc, "heads_per_ngram", 8, minimum=1)
    ple_dim = config_int(tc, "ple_embed_dim", hidden, minimum=1) if tc.get("ple_embed_dim") is not None else hidden
    if ple and ple_dim % ngram_heads:
        raise ConfigError(f"ple_embed_dim={ple_dim} is not a multiple of the {ngram_heads} n-gram heads",
                          file="config.json", key="text_config.ple_embed_dim")
    shards = config_int(tc, "split_ngram_parts", 512, minimum=1)  # transformers' default when unstated
    return ModelSpec(
        model_type=config_model_type(config),
        nested=True,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=config_int(tc, "vocab_size", minimum=1),
        num_heads=num_heads,
        num_kv_heads=config_int(tc, "num_key_value_heads", minimum=1),
        head_dim=config_int(tc, "head_dim", minimum=1) if tc.get("head_dim") is not None else hidden // num_heads,
        lin_num_k_heads=config_int(tc, "linear_num_key_heads", minimum=1),
        lin_num_v_heads=config_int(tc, "linear_num_value_heads", minimum=1),
        lin_k_dim=config_int(tc, "linear_key_head_dim", minimum=1),
        lin_v_dim=config_int(tc, "linear_value_head_dim", minimum=1),
        conv_kernel=config_int(tc, "linear_conv_kernel_dim", minimum=1),
        linear_layers=linear,
        num_experts=config_int(tc, "num_experts", minimum=1),
        moe_intermediate_size=config_int(tc, "moe_intermediate_size", minimum=1),
        shared_expert_intermediate_size=config_int(tc, "shared_expert_intermediate_size", minimum=1),
        hc_count=config_int(tc, "hc_count", 4, minimum=2),
        hc_lowrank=config_int(tc, "hc_lowrank", 320, minimum=1),
        indexer_heads=config_int(tc, "indexer_n_heads", minimum=1),
        indexer_head_dim=config_int(tc, "indexer_head_dim", minimum=1),
        ple_layers=ple,
        ple_embed_dim=ple_dim,
        ple_conv_kernel=config_int(tc, "ple_conv_kernel_size", 4, minimum=1),
        ngram_size=config_int(tc, "ngram_size", 3, minimum=2),
        ngram_heads=ngram_heads,
        ngram_shards=shards,
        ngram_rows=_ngram_rows(tc, ple, ngram_heads, shards) if ple else (),
        tie_word_embeddings=resolve_tie(config),
        mtp_layers=config_int(tc, "mtp_num_hidden_layers") if "mtp_num_hidden_layers" in tc else None,
    )
