"""Nemotron-H with its native MTP head (``nemotron_h``: NVIDIA Nemotron-3 Super 120B-A12B and Ultra 550B-A55B):
the family's rules.

The release is text-only with flat keys: ``backbone.embeddings``, ``backbone.layers.{i}.{norm, mixer.*}``,
``backbone.norm_f``, ``lm_head`` and the head under ``mtp.``, which are also mlx-lm's names
(``mlx_lm/models/nemotron_h.py``), so the raw and MLX namespaces coincide but for two things decided
from the tensors: per-expert ``mixer.experts.{e}.{up,down}_proj`` against mlx-lm's stacked
``mixer.switch_mlp.{fc1,fc2}`` (relu² experts: no gate_proj), and the depthwise conv1d, ``[C, 1, K]`` raw and
``[C, K, 1]`` in MLX. Each layer is one block of a kind the pattern names (``hybrid_override_pattern`` or a
``layers_block_type`` list): ``M`` Mamba2, ``*`` attention (no RoPE), ``E`` latent MoE, ``-`` relu² MLP.

The head is ONE prediction module of ``len(mtp_hybrid_override_pattern)`` blocks (``"*E"`` on Super; Ultra
states ``mtp_layers_block_type``), ``mtp.layers.{j}.*`` under the backbone block's names, with ``enorm``,
``hnorm`` and ``eh_proj`` [H, 2H] on block 0 and ``final_layernorm`` on the last; it borrows the backbone's
``embeddings`` and ``lm_head``. Its forward and its reuse at depth > 1 are in ``head.py``. All norms are plain
RMSNorm gains (no +1). ``num_nextn_predict_layers`` counts prediction modules (every release: 1), so the
head's blocks are one MTP layer to the plan, verify and the decode loop (``single_layer_head``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Dict, List, Mapping, Optional

from ...errors import ConfigError, LayoutError
from ..base import (A_LOG, BACKBONE, CONV, EMBEDDING, FC, GATED_NORM, LINEAR, MLX, MTP, NORM, PARAM, RAW_TEXT,
                    ROUTER_BIAS, SWITCH, Capabilities, Family, Gather, HeadDesign, Mapped, ModulePaths, Slot, config_bool,
                    config_int, config_model_type)

HEAD_PREFIX = "mtp."
LM_HEAD = "lm_head.weight"
MODEL_TYPES = {"nemotron_h": "nemotron_h"}
COUNT_KEY = "num_nextn_predict_layers"
# block names -> pattern characters, as mlx-lm's ModelArgs maps them (transformers 5 names and the legacy ones)
BLOCK_CHARS = {"full_attention": "*", "linear_attention": "M", "moe": "E", "mlp": "-",
               "attention": "*", "mamba": "M", "conv": "M"}
BLOCKS = "M*E-"
# the head pattern transformers gives a config that states none (configuration_nemotron_h.py:190-191)
DEFAULT_MTP_PATTERN = "*E"
PER_EXPERT = re.compile(r"^(?P<mixer>.+\.mixer)\.experts\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")
SWITCH_OF = {"up_proj": "fc1", "down_proj": "fc2"}  # mlx-lm's sanitize: up_proj -> fc1, down_proj -> fc2
# legacy config names transformers maps onto the ones mlx-lm reads (configuration_nemotron_h.py:156-166)
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
          "mamba_chunk_size": "chunk_size"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    vocab_size: int
    pattern: str  # the backbone's blocks, one character each (BLOCKS)
    mtp_pattern: str  # the head's blocks
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    mamba_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    mamba_proj_bias: bool
    intermediate_size: int
    mlp_bias: bool
    num_experts: int
    moe_intermediate_size: int
    shared_intermediate_size: Optional[int]  # None: no shared expert (mlx-lm builds one iff n_shared_experts is set)
    latent_size: Optional[int]  # moe_latent_size; None: the experts read the hidden state itself
    tie_word_embeddings: bool
    mtp_layers: Optional[int]  # num_nextn_predict_layers; None where the config does not say
    nested: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and "E" in self.pattern + self.mtp_pattern

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size


def _pattern(config: dict, string_key: str, list_keys, default: Optional[str] = None) -> Optional[str]:
    """A block pattern: ``string_key`` (a string, or a list of characters), else the first list of block names."""
    value = config.get(string_key)
    if value is not None:
        if isinstance(value, list) and all(isinstance(c, str) and len(c) == 1 for c in value):
            value = "".join(value)
        if not isinstance(value, str) or not value or set(value) - set(BLOCKS):
            raise ConfigError(f"{string_key} must be a string of {BLOCKS!r} characters, got {value!r}",
                              file="config.json", key=string_key)
        return value
    for key in list_keys:
        names = config.get(key)
        if names is None:
            continue
        if not isinstance(names, list) or not names or any(n not in BLOCK_CHARS for n in names):
            raise ConfigError(f"{key} must be a list of block names ({', '.join(sorted(BLOCK_CHARS))}), got "
                              f"{names!r}", file="config.json", key=key)
        return "".join(BLOCK_CHARS[n] for n in names)
    return default


def _optional_int(config: dict, key: str, minimum: int = 1) -> Optional[int]:
    return None if config.get(key) is None else config_int(config, key, minimum=minimum)


def model_spec(config: dict) -> ModelSpec:
    """Validate config.json (flat, as released) and extract the numbers the converter needs."""
    if config_model_type(config) not in MODEL_TYPES:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not a {FAMILY.name} type",
                          file="config.json", key="model_type")
    if "text_config" in config:
        raise ConfigError("a nemotron_h config is flat; this one has text_config", file="config.json",
                          key="text_config")
    c = dict(config)
    for legacy, name in LEGACY.items():
        if legacy in c and name not in c:
            c[name] = c[legacy]
    pattern = _pattern(c, "hybrid_override_pattern", ("layers_block_type", "layer_types"))
    if pattern is None:
        raise ConfigError("config states no block pattern (hybrid_override_pattern or layers_block_type)",
                          file="config.json", key="hybrid_override_pattern")
    if c.get("num_hidden_layers") is not None and config_int(c, "num_hidden_layers") != len(pattern):
        raise ConfigError(f"num_hidden_layers={c['num_hidden_layers']} but the block pattern has {len(pattern)} "
                          "blocks", file="config.json", key="num_hidden_layers")
    mtp = None if c.get(COUNT_KEY) is None else config_int(c, COUNT_KEY)
    if mtp is not None and mtp > 1:
        raise ConfigError(f"{COUNT_KEY}={mtp}: every Nemotron-H release has one prediction module, and mlx-vlm's "
                          "drafter and vLLM run one", file="config.json", key=COUNT_KEY)
    mtp_pattern = _pattern(c, "mtp_hybrid_override_pattern", ("mtp_layers_block_type",), DEFAULT_MTP_PATTERN)
    if config_bool(c, "tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings=true: mlx-lm's nemotron_h always builds its own lm_head",
                          file="config.json", key="tie_word_embeddings")
    hidden = config_int(c, "hidden_size", minimum=1)
    num_heads = config_int(c, "num_attention_heads", minimum=1)
    blocks = pattern + mtp_pattern
    moe = "E" in blocks
    shared = c.get("n_shared_experts") is not None
    return ModelSpec(
        model_type=config_model_type(config),
        hidden_size=hidden,
        vocab_size=config_int(c, "vocab_size", minimum=1),
        pattern=pattern,
        mtp_pattern=mtp_pattern,
        num_heads=num_heads,
        num_kv_heads=config_int(c, "num_key_value_heads", minimum=1),
        head_dim=config_int(c, "head_dim", minimum=1) if c.get("head_dim") is not None else hidden // num_heads,
        attention_bias=config_bool(c, "attention_bias"),
        mamba_heads=config_int(c, "mamba_num_heads", minimum=1) if "M" in blocks else 0,
        mamba_head_dim=config_int(c, "mamba_head_dim", minimum=1) if "M" in blocks else 0,
        ssm_state_size=config_int(c, "ssm_state_size", minimum=1) if "M" in blocks else 0,
        n_groups=config_int(c, "n_groups", minimum=1) if "M" in blocks else 0,
        conv_kernel=config_int(c, "conv_kernel", minimum=1) if "M" in blocks else 0,
        use_conv_bias=config_bool(c, "use_conv_bias"),
        mamba_proj_bias=config_bool(c, "mamba_proj_bias"),
        intermediate_size=config_int(c, "intermediate_size", minimum=1) if "-" in blocks else 0,
        mlp_bias=config_bool(c, "mlp_bias"),
        num_experts=config_int(c, "n_routed_experts", minimum=1) if moe else 0,
        moe_intermediate_size=config_int(c, "moe_intermediate_size", minimum=1) if moe else 0,
        shared_intermediate_size=config_int(c, "moe_shared_expert_intermediate_size", minimum=1)
        if moe and shared else None,
        latent_size=_optional_int(c, "moe_latent_size") if moe else None,
        tie_word_embeddings=False,
        mtp_layers=mtp,
    )


# slots: the modules mlx-lm's nemotron_h builds, under its names


def _mamba(s: ModelSpec) -> List[tuple]:
    H, I, nh = s.hidden_size, s.mamba_intermediate, s.mamba_heads
    table = [("in_proj.weight", (I + s.conv_dim + nh, H), LINEAR), ("conv1d.weight", (s.conv_dim, s.conv_kernel, 1), CONV),
             ("A_log", (nh,), A_LOG), ("D", (nh,), PARAM), ("dt_bias", (nh,), PARAM),
             ("norm.weight", (I,), GATED_NORM), ("out_proj.weight", (H, I), LINEAR)]
    if s.use_conv_bias:
        table.append(("conv1d.bias", (s.conv_dim,), PARAM))
    if s.mamba_proj_bias:
        table += [("in_proj.bias", (I + s.conv_dim + nh,), PARAM), ("out_proj.bias", (H,), PARAM)]
    return table


def _linears(pairs, bias: bool) -> List[tuple]:
    table = [(f"{name}.weight", shape, LINEAR) for name, shape in pairs]
    return table + [(f"{name}.bias", shape[:1], PARAM) for name, shape in pairs] if bias else table


def _moe(s: ModelSpec) -> List[tuple]:
    H, E, I = s.hidden_size, s.num_experts, s.moe_intermediate_size
    L = s.latent_size or H
    table = [("gate.weight", (E, H), PARAM),  # mlx-lm's MoEGate holds a bare array: never quantized
             ("gate.e_score_correction_bias", (E,), ROUTER_BIAS),
             ("switch_mlp.fc1.weight", (E, I, L), SWITCH), ("switch_mlp.fc2.weight", (E, L, I), SWITCH)]
    if s.shared_intermediate_size is not None:
        S = s.shared_intermediate_size
        table += _linears((("shared_experts.up_proj", (S, H)), ("shared_experts.down_proj", (H, S))), s.mlp_bias)
    if s.latent_size is not None:
        table += _linears((("fc1_latent_proj", (L, H)), ("fc2_latent_proj", (H, L))), s.mlp_bias)
    return table


def block_slots(prefix: str, kind: str, s: ModelSpec, group: str) -> Dict[str, Slot]:
    """One block ``prefix`` (``backbone.layers.{i}.``, ``mtp.layers.{j}.``) of kind ``kind``: its norm and mixer."""
    H = s.hidden_size
    if kind == "M":
        table = _mamba(s)
    elif kind == "*":
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        table = _linears((("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, q))),
                         s.attention_bias)
    elif kind == "-":
        table = _linears((("up_proj", (s.intermediate_size, H)), ("down_proj", (H, s.intermediate_size))), s.mlp_bias)
    else:
        table = _moe(s)
    out = {prefix + "norm.weight": Slot(prefix + "norm.weight", (H,), NORM, group)}
    out.update({prefix + "mixer." + n: Slot(prefix + "mixer." + n, tuple(shape), k, group) for n, shape, k in table})
    return out


def head_slots(s: ModelSpec) -> Dict[str, Slot]:
    """The prediction module: its blocks in pattern order, ``enorm``/``hnorm``/``eh_proj`` on the first,
    ``final_layernorm`` on the last."""
    H, last = s.hidden_size, len(s.mtp_pattern) - 1
    out: Dict[str, Slot] = {}
    for j, kind in enumerate(s.mtp_pattern):
        p = f"{HEAD_PREFIX}layers.{j}."
        out.update(block_slots(p, kind, s, MTP))
        if j == 0:
            out[p + "enorm.weight"] = Slot(p + "enorm.weight", (H,), NORM, MTP)
            out[p + "hnorm.weight"] = Slot(p + "hnorm.weight", (H,), NORM, MTP)
            out[p + "eh_proj.weight"] = Slot(p + "eh_proj.weight", (H, 2 * H), FC, MTP)
        if j == last:
            out[p + "final_layernorm.weight"] = Slot(p + "final_layernorm.weight", (H,), NORM, MTP)
    return out


def expected_slots(s: ModelSpec, mtp_layers: int) -> Dict[str, Slot]:
    H, V = s.hidden_size, s.vocab_size
    out = {"backbone.embeddings.weight": Slot("backbone.embeddings.weight", (V, H), EMBEDDING, BACKBONE)}
    for i, kind in enumerate(s.pattern):
        out.update(block_slots(f"backbone.layers.{i}.", kind, s, BACKBONE))
    out["backbone.norm_f.weight"] = Slot("backbone.norm_f.weight", (H,), NORM, BACKBONE)
    out[LM_HEAD] = Slot(LM_HEAD, (V, H), LINEAR, BACKBONE)
    if mtp_layers:
        out.update(head_slots(s))
    return out


# source keys


def key_style(key: str) -> str:
    """Raw (per-expert experts) or MLX (``switch_mlp`` stacks); every other name is the same in both."""
    if ".switch_mlp." in key:
        return MLX
    if PER_EXPERT.match(key):
        return RAW_TEXT
    return ""


def contributions(key: str) -> List[Mapped]:
    """Every output tensor one source key contributes to: a per-expert weight is its row of mlx-lm's stack, any
    other key goes whole under its own name."""
    if not (key.startswith(("backbone.", HEAD_PREFIX)) or key == LM_HEAD):
        raise LayoutError("tensor is outside every Nemotron-H namespace (backbone.*, mtp.*, lm_head)", key=key)
    if (m := PER_EXPERT.match(key)) is not None:
        return [Mapped(key, f"{m['mixer']}.switch_mlp.{SWITCH_OF[m['proj']]}.weight", Gather.STACK, int(m["e"]))]
    return [Mapped(key, key)]


def source_name(mlx_name: str, style: str) -> str:
    """The key a source of ``style`` would use (the plan turns ``switch_mlp`` into ``experts.0`` for raw sources)."""
    if style == MLX:
        return mlx_name
    for proj, fc in SWITCH_OF.items():
        mlx_name = mlx_name.replace(f".switch_mlp.{fc}.", f".switch_mlp.{proj}.")
    return mlx_name


def convs_raw(tensors: Mapping) -> bool:
    """Whether the Mamba conv1d weights are raw ``[C, 1, K]`` (mlx-lm's sanitize moves every one whose last axis
    is not 1); decided once for the checkpoint, so a partly converted folder is refused, naming two of them."""
    flags = {k: len(t.shape) == 3 and t.shape[-1] != 1 for k, t in tensors.items() if k.endswith("conv1d.weight")}
    if len(set(flags.values())) > 1:
        raw_one = next(k for k, v in flags.items() if v)
        mlx_one = next(k for k, v in flags.items() if not v)
        raise LayoutError(f"conv1d weights disagree on layout: {raw_one} is raw [C,1,K] but {mlx_one} is MLX "
                          "[C,K,1]; the checkpoint was partly converted", file=tensors[raw_one].file, key=raw_one)
    return any(flags.values())


def loadable_config(config: dict) -> dict:
    """The output config, completed for the loaders that read it: the block patterns as the strings every reader
    takes (mlx-vlm 0.7.10's ``ModelConfig`` maps only the legacy block names, ``models/nemotron_h/config.py:49``,
    and a transformers 5 list of ``linear_attention`` / ``full_attention`` fails there), ``num_hidden_layers``, and
    the mlx-lm names of the legacy Mamba keys."""
    spec = model_spec(config)
    out = copy.deepcopy(config)
    for legacy, name in LEGACY.items():
        if legacy in out:
            out.setdefault(name, out.pop(legacy))
    for key in ("layers_block_type", "layer_types", "mtp_layers_block_type"):
        out.pop(key, None)
    out.update(hybrid_override_pattern=spec.pattern, num_hidden_layers=spec.num_layers,
               mtp_hybrid_override_pattern=spec.mtp_pattern)
    return out


HEAD = HeadDesign(
    forward="nemotron-h-mtp",
    projection="mtp.layers.0.eh_proj [H, 2H]",
    concat=("enorm(embed(t+1))", "hnorm(h_t)"),
    layer="one prediction module: the blocks of mtp_hybrid_override_pattern in order (Super: attention with its "
          "own KV cache, then the latent MoE), reused at every depth",
    output="lm_head(final_layernorm(h))",
    hidden_state="post_norm",
    shares=("embeddings", "lm_head"),
    norms_zero_centred=False,
)

FAMILY = Family(
    name="nemotron_h",
    title="Nemotron-H with an MTP head (Nemotron-3 Super 120B-A12B, Ultra 550B-A55B)",
    model_types=MODEL_TYPES,
    head=HEAD,
    backbone_runtimes=("mlx-lm<0.32", "mlx-lm>=0.32", "mlx-vlm", "mlx-vlm-drafter"),
    head_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    mtp_layouts=("sidecar",),
    head_prefix=HEAD_PREFIX,
    lm_head=LM_HEAD,
    capabilities=Capabilities(batched=True, pre_norm_hidden=False),
    backbone="mtpconvert.families.nemotron_h.backbone:NemotronHBackbone",
    compat="mtpconvert.families.nemotron_h.compat:rows",
    modules=ModulePaths("backbone.embeddings", "backbone.layers", "backbone.norm_f", "lm_head"),
    spec=model_spec,
    expected_slots=expected_slots,
    contributions=contributions,
    key_style=key_style,
    source_name=source_name,
    is_zero_centred_norm=lambda name: False,
    norms_zero_centred=lambda tensors: False,
    convs_raw=convs_raw,
    default_style=RAW_TEXT,
    loadable_config=loadable_config,
    drafter_folder_type="nemotron_h_mtp",
    mtp_count_keys=(COUNT_KEY,),
    single_layer_head=True,
)
