"""DeepSeek-V4's config.json, validated into the numbers the converter needs (``ModelSpec``).

The release states its layers in the fields mlx-vlm 0.7.10 reads (``models/deepseek_v4/config.py``): each layer's
attention by ``compress_ratios`` (0: sliding window only; 4: compressed, with the sparse indexer; 128: heavily
compressed; one entry more than the layers in the release, the MTP layer's, which mlx-vlm truncates) and the
hash-routed MoE layers by ``num_hash_layers`` (the first ones). transformers 5.24 reads the same fields but saves
``layer_types`` / ``mlp_layer_types`` in their place, which mlx-vlm ignores: it would build its default pattern
instead, so a config without ``compress_ratios`` is refused rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ...errors import ConfigError
from ..base import config_int, config_model_type, resolve_tie

MODEL_TYPES = {"deepseek_v4": "deepseek_v4"}
RATIOS = (0, 4, 128)  # sliding | compressed + indexer | heavily compressed
SPARSE = 4  # the ratio whose layers carry the indexer and whose compressor overlaps windows


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    n_shared_experts: int
    hash_layers: int  # the first layers route by token (gate.tid2eid) instead of by score
    compress_ratios: Tuple[int, ...]  # per backbone layer
    index_heads: int
    index_head_dim: int
    hc_mult: int
    tie_word_embeddings: bool
    mtp_layers: Optional[int]  # num_nextn_predict_layers; None where the config does not say
    nested: bool = False

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def hc_mix(self) -> int:
        """Rows of a hyper-connection's mixing projection: hc pre weights, hc post weights, hc x hc combination."""
        return (2 + self.hc_mult) * self.hc_mult


def _ratios(c: dict, num_layers: int) -> Tuple[int, ...]:
    ratios = c.get("compress_ratios")
    if ratios is None:
        hint = ("the config has transformers' layer_types instead: state compress_ratios (0 sliding, 4 compressed "
                "sparse, 128 heavily compressed) as the release does" if "layer_types" in c else None)
        raise ConfigError("config is missing compress_ratios (mlx-vlm builds each layer's attention from it and would "
                          "assume its own default pattern)", file="config.json", key="compress_ratios", hint=hint)
    if (not isinstance(ratios, list) or len(ratios) < num_layers
            or any(isinstance(r, bool) or r not in RATIOS for r in ratios)):
        raise ConfigError(f"compress_ratios must list one of {list(RATIOS)} for each of the {num_layers} layers, got "
                          f"{ratios!r}", file="config.json", key="compress_ratios")
    return tuple(ratios[:num_layers])


def _mtp_layers(c: dict) -> Optional[int]:
    if c.get("num_nextn_predict_layers") is None:
        return None
    n = config_int(c, "num_nextn_predict_layers")
    if n > 1:
        raise ConfigError(f"num_nextn_predict_layers={n}: mlx-vlm's deepseek_v4_mtp drafter and this head run one MTP "
                          "layer (multi-stage heads are DSpark's)", file="config.json", key="num_nextn_predict_layers")
    return n


def model_spec(config: dict) -> ModelSpec:
    """Validate config.json (flat, as released) and extract the numbers the converter needs."""
    if config_model_type(config) not in MODEL_TYPES:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not deepseek_v4", file="config.json",
                          key="model_type")
    if "text_config" in config:
        raise ConfigError("a deepseek_v4 config is flat; this one has text_config", file="config.json",
                          key="text_config")
    c = config
    num_layers = config_int(c, "num_hidden_layers", minimum=1)
    if "num_hash_layers" not in c and "mlp_layer_types" in c:
        raise ConfigError("config is missing num_hash_layers (it has transformers' mlp_layer_types, which mlx-vlm "
                          "does not read)", file="config.json", key="num_hash_layers")
    if config_int(c, "num_key_value_heads", 1, minimum=1) != 1:
        raise ConfigError("num_key_value_heads must be 1 (DeepSeek-V4 attends with one shared key/value head)",
                          file="config.json", key="num_key_value_heads")
    num_heads, o_groups = config_int(c, "num_attention_heads", minimum=1), config_int(c, "o_groups", minimum=1)
    head_dim = config_int(c, "head_dim", minimum=1)
    if num_heads * head_dim % o_groups:
        raise ConfigError(f"o_groups={o_groups} does not divide num_attention_heads * head_dim = {num_heads * head_dim}",
                          file="config.json", key="o_groups")
    if resolve_tie(c):
        raise ConfigError("tie_word_embeddings=true: mlx-vlm's deepseek_v4 model always holds its own lm_head",
                          file="config.json", key="tie_word_embeddings")
    return ModelSpec(
        model_type=config_model_type(c),
        hidden_size=config_int(c, "hidden_size", minimum=1),
        num_layers=num_layers,
        vocab_size=config_int(c, "vocab_size", minimum=1),
        num_heads=num_heads,
        head_dim=head_dim,
        q_lora_rank=config_int(c, "q_lora_rank", minimum=1),
        o_groups=o_groups,
        o_lora_rank=config_int(c, "o_lora_rank", minimum=1),
        num_experts=config_int(c, "n_routed_experts", minimum=1),
        experts_per_token=config_int(c, "num_experts_per_tok", minimum=1),
        moe_intermediate_size=config_int(c, "moe_intermediate_size", minimum=1),
        n_shared_experts=config_int(c, "n_shared_experts", 1, minimum=1),
        hash_layers=config_int(c, "num_hash_layers", 3),
        compress_ratios=_ratios(c, num_layers),
        index_heads=config_int(c, "index_n_heads", 64, minimum=1),
        index_head_dim=config_int(c, "index_head_dim", 128, minimum=1),
        hc_mult=config_int(c, "hc_mult", 4, minimum=1),
        tie_word_embeddings=False,
        mtp_layers=_mtp_layers(c),
    )
