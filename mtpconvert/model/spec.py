"""What config.json says about the architecture, resolved once.

Qwen3.5 configs come nested (``text_config`` inside a VLM wrapper) or flat (text-only
``save_pretrained``); ``tie_word_embeddings`` may sit at the top level only. Every
reader of the config goes through ``ModelSpec`` so these cases are handled in one
place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..errors import ConfigError

# config model_type (top level or text_config) -> mlx-lm module name
SUPPORTED_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
UNSUPPORTED_HINTS = {
    "qwen3_next": "Qwen3-Next uses fused in_proj_qkvz/in_proj_ba projections; only Qwen3.5/3.6 are supported",
}


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
    mtp_layers: int  # what the config claims

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_num_k_heads * self.lin_k_dim + self.lin_num_v_heads * self.lin_v_dim


def text_config(config: dict) -> dict:
    tc = config.get("text_config")
    if tc is None:
        return config
    if not isinstance(tc, dict):
        raise ConfigError("text_config must be an object", file="config.json")
    return tc


def resolve_tie(config: dict) -> bool:
    """text_config wins; published 9B/27B configs carry the key at the top level only."""
    tc = text_config(config)
    where = tc if "tie_word_embeddings" in tc else config
    return _bool(where, "tie_word_embeddings")


def _bool(tc: dict, key: str, default: bool = False) -> bool:
    value = tc.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}", file="config.json", key=key)
    return value


def _int(tc: dict, key: str, default: Optional[int] = None, *, minimum: int = 0) -> int:
    value = tc.get(key, default)
    if value is None:
        raise ConfigError(f"config is missing {key}", file="config.json", key=key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}", file="config.json", key=key)
    return value


def model_spec(config: dict) -> ModelSpec:
    """Validate config.json and extract the numbers the converter needs."""
    if not isinstance(config, dict):
        raise ConfigError("config must be a JSON object", file="config.json")
    tc = text_config(config)
    top_type = config.get("model_type")
    text_type = tc.get("model_type", top_type)
    for where, t in (("model_type", top_type), ("text_config.model_type", text_type)):
        if t is not None and not isinstance(t, str):
            raise ConfigError(f"{where} must be a string, not {t!r}", file="config.json", key=where)
    for t in (top_type, text_type):
        if t in UNSUPPORTED_HINTS:
            raise ConfigError(f"unsupported model_type {t!r}", file="config.json", hint=UNSUPPORTED_HINTS[t])
    # mlx-lm picks its module from the top-level model_type, so that one must be ours
    mtype = SUPPORTED_TYPES.get(top_type) if top_type is not None else SUPPORTED_TYPES.get(text_type)
    if mtype is None:
        raise ConfigError(
            f"unknown model_type {top_type!r}; expected one of {sorted(SUPPORTED_TYPES)}",
            file="config.json",
            key="model_type",
        )
    if tc.get("mtp_use_dedicated_embeddings"):
        raise ConfigError(
            "mtp_use_dedicated_embeddings=true is not supported (no published checkpoint uses it)",
            file="config.json",
        )

    hidden = _int(tc, "hidden_size", minimum=1)
    num_layers = _int(tc, "num_hidden_layers", minimum=1)
    num_heads = _int(tc, "num_attention_heads", minimum=1)
    head_dim = _int(tc, "head_dim", minimum=1) if tc.get("head_dim") is not None else hidden // num_heads
    interval = _int(tc, "full_attention_interval", 4, minimum=1)
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
    num_experts = _int(tc, "num_experts", 0)
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
        vocab_size=_int(tc, "vocab_size", minimum=1),
        num_heads=num_heads,
        num_kv_heads=_int(tc, "num_key_value_heads", minimum=1),
        head_dim=head_dim,
        lin_num_k_heads=_int(tc, "linear_num_key_heads", 16, minimum=1),
        lin_num_v_heads=_int(tc, "linear_num_value_heads", 64, minimum=1),
        lin_k_dim=_int(tc, "linear_key_head_dim", 192, minimum=1),
        lin_v_dim=_int(tc, "linear_value_head_dim", 128, minimum=1),
        conv_kernel=_int(tc, "linear_conv_kernel_dim", 4, minimum=1),
        full_attention_interval=interval,
        linear_layers=linear,
        intermediate_size=_int(tc, "intermediate_size", 0) if not num_experts else 0,
        num_experts=num_experts,
        moe_intermediate_size=_int(tc, "moe_intermediate_size", 0) if num_experts else 0,
        shared_expert_intermediate_size=_int(tc, "shared_expert_intermediate_size", 0) if num_experts else 0,
        tie_word_embeddings=resolve_tie(config),
        attention_bias=_bool(tc, "attention_bias"),
        mtp_layers=_int(tc, "mtp_num_hidden_layers", 0),
    )
