"""What every family fills in, and the vocabulary the plan speaks for all of them.

A family (``families/<name>/``) is a ``Family`` value: declarative fields (the config
``model_type`` values it answers to and the backbone module that loads each, its head's design,
what each runtime does with its folders, its capabilities) and small hooks, each a pure function
over the config, a key or the checkpoint's headers. The plan, verify, compat, the hub and the
runtime ask the family; none of them branches on a model name or imports a family module.

Two parts of a family are named by reference (``"module:attribute"``) and imported only when asked
for, so that planning, verifying and listing families never import a runtime: its backbone adapter
(``Family.backbone``: how our runtime drives the loaded model, ``runtime.backbone.Backbone``) and its
runtime table (``Family.compat``: each runtime's row for its folders, ``compat.RuntimeCompat``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..errors import ConfigError, LayoutError

# Key styles: how a folder names its tensors, decided from the keys
RAW_VLM = "raw-vlm"  # model.language_model.* (a VLM wrapper's release)
RAW_TEXT = "raw-text"  # model.* (a text-only save_pretrained)
MLX = "mlx"  # language_model.* (mlx-lm / mlx-vlm output)

# the companions of a quantized weight in an MLX folder
QUANT_AUX = re.compile(r"\.(scales|biases|global_scale)$")

# Slot kinds: what decides a tensor's transforms
EMBEDDING = "embedding"  # nn.Embedding (quantizable)
LINEAR = "linear"  # nn.Linear weight (quantizable)
SWITCH = "switch"  # stacked experts, SwitchLinear (quantizable)
ROUTER = "router"  # mlp.gate / shared_expert_gate (quantized at 8 bits like mlx-lm)
FC = "fc"  # the head's input projection (never quantized)
NORM = "norm"  # zero-centred RMSNorm in the source: +1 on raw weights
GATED_NORM = "gated_norm"  # linear-attention RMSNormGated: not shifted
CONV = "conv"  # depthwise conv1d: [C,1,K] raw -> [C,K,1]
A_LOG = "a_log"  # stays float32
ROUTER_BIAS = "router_bias"  # a router's score-correction bias (e_score_correction_bias): stays float32
MULTI = "multi"  # per-head matrices of an MLA attention (embed_q / unembed_out), MultiLinear (quantizable)
# a table read a row at a time by index (n-gram embedding shards): quantizable, at the backbone's group size
# or, where its rows are not a multiple of it, at ROWS_FALLBACK_GROUP (as mlx-vlm quantizes them)
ROWS = "rows"
PARAM = "param"  # dt_bias, biases, a bare router weight, a LayerNorm: cast only
BUFFER = "buffer"  # an integer table the model computes from its config (n-gram hashing): kept as stored
# a parameter its model keeps in float32 whatever the weights' dtype (DeepSeek-V4's hyper-connection mixes and
# attention sinks: mlx-vlm's cast_predicate leaves them): cast only, to float32
F32_PARAM = "f32_param"

QUANTIZABLE = (EMBEDDING, LINEAR, SWITCH, ROUTER, FC, MULTI, ROWS)
FLOAT32_KINDS = (A_LOG, ROUTER_BIAS, F32_PARAM)  # kept float32 whatever --dtype says, as mlx-lm does

# Slot groups
BACKBONE = "backbone"
MTP = "mtp"
VISION = "vision"


@dataclass(frozen=True)
class Slot:
    """One output tensor before quantization: its MLX name, shape, kind and group."""

    name: str
    shape: Tuple[int, ...]
    kind: str
    group: str

    @property
    def module(self) -> str:
        """Module path as mlx-lm's quantization config names it."""
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name


class Gather(str, Enum):
    """How an item's source tensors become one array, before any step runs.

    The same values say how one source key contributes to its target (``Family.contributions``):
    a whole tensor, one row of an expert stack, or one half of a fused ``gate_up_proj``.
    """

    LOAD = "load"  # one source tensor, as it is
    STACK = "stack"  # one source per expert, stacked along a new leading axis
    GATE_HALF = "gate_half"  # first half of a fused [E, 2I, H] gate_up_proj along axis 1
    UP_HALF = "up_half"  # second half of it
    VISION_PATCH = "vision_patch"  # Conv3d patch embedding, moved to channels-last
    EMBED_Q = "embed_q"  # MLA kv_b_proj [heads*(nope+v), kv_lora] -> per head [heads, kv_lora, nope] (transposed)
    UNEMBED_OUT = "unembed_out"  # the same kv_b_proj -> per head [heads, v, kv_lora]
    GROUPS = "groups"  # a [G * R, C] matrix as [G, R, C]: the groups of a grouped projection (MultiLinear)

    @property
    def half(self) -> int:
        """0 or 1 for the halves of a fused gate_up tensor."""
        return (Gather.GATE_HALF, Gather.UP_HALF).index(self)


HALVES = (Gather.GATE_HALF, Gather.UP_HALF)
KV_B_PARTS = (Gather.EMBED_Q, Gather.UNEMBED_OUT)


def kv_b_fits(source: Tuple[int, ...], target: Tuple[int, ...], part: Gather) -> bool:
    """Whether a kv_b_proj of shape ``source`` [heads*(nope+v), kv_lora] splits into ``target``
    (embed_q [heads, kv_lora, nope] or unembed_out [heads, v, kv_lora]); the other part gets what remains."""
    heads = target[0]
    kv_lora, own = (target[1], target[2]) if part is Gather.EMBED_Q else (target[2], target[1])
    return len(source) == 2 and source[1] == kv_lora and source[0] % heads == 0 and source[0] // heads > own


@dataclass(frozen=True)
class Mapped:
    """Where one source tensor goes, and how it contributes to ``target``.

    ``part`` is LOAD (the whole tensor), STACK (row ``index`` of an expert stack) or
    GATE_HALF / UP_HALF (one half of a fused gate_up tensor). ``target`` is None for
    vision tensors (``vision`` holds the MLX name then).
    """

    source: str
    target: Optional[str]
    part: Gather = Gather.LOAD
    index: int = 0
    vision: Optional[str] = None

    @property
    def expert_layout(self) -> Optional[str]:
        """per-expert | fused | stacked for an expert weight, None otherwise."""
        if self.target is None or ".switch_mlp." not in self.target:
            return None
        if self.part is Gather.STACK:
            return "per-expert"
        if self.part in HALVES or ".experts." in self.source:
            return "fused"
        return "stacked"


@dataclass(frozen=True)
class HeadDesign:
    """How a family's MTP head drafts token t+2 from the backbone's state at t.

    The runtime builds the module named ``forward`` (``runtime.decoding.heads``); the other
    fields say, for people and for ``mtpconvert families``, what that forward computes.
    """

    forward: str  # the runtime's head module for this design
    projection: str  # the Linear over the concatenated inputs
    concat: Tuple[str, str]  # its two inputs, in order
    layer: str  # the decoder block after the projection
    output: str  # how logits are made
    hidden_state: str  # which backbone state feeds it: post_norm (after the final norm) or pre_norm
    shares: Tuple[str, ...]  # backbone weights it uses and does not store
    norms_zero_centred: bool  # its RMSNorms store w with y = x * (1 + w) in the raw release


@dataclass(frozen=True)
class Capabilities:
    """What mtpconvert's runtime does with a family's head beyond one-stream greedy and sampled decoding."""

    batched: bool  # batched MTP decoding of concurrent streams (runtime.decoding.batched, bench --concurrency)
    pre_norm_hidden: bool  # the head can be fed the backbone's pre-final-norm state (--mtp-hidden pre-norm)


@dataclass(frozen=True)
class ModulePaths:
    """Where the backbone's parts sit in the MLX model, and so the key prefix of their tensors: what the
    layerwise check streams by (headers only) and the adapter reaches (``runtime.backbone``)."""

    embed: str  # the input embedding
    layers: str  # the decoder layers: layer i is ``{layers}.{i}``
    norm: str  # the final norm
    lm_head: str  # the output projection (absent when tied to the embedding)
    # further modules between the last layer and the output projection, held with the final norm (DeepSeek-V4's
    # hc_head, which mixes the hyper-connection streams before it)
    readout: Tuple[str, ...] = ()

    @classmethod
    def text_model(cls, prefix: str) -> "ModulePaths":
        """mlx-lm's text-model layout under ``prefix`` (``language_model.`` or nothing): ``model.embed_tokens``,
        ``model.layers``, ``model.norm``, ``lm_head``."""
        return cls(prefix + "model.embed_tokens", prefix + "model.layers", prefix + "model.norm", prefix + "lm_head")

    def layer(self, i: int) -> str:
        return f"{self.layers}.{i}"

    def unit_of(self, key: str, head_prefixes: Iterable[str]) -> str:
        """What the layerwise check holds a stored tensor for: ``layer N``, ``mtp`` (the head), ``embed_tokens``,
        ``lm_head``, ``norm`` (the final one) or ``other``."""
        if key.startswith(tuple(head_prefixes)):  # first: a head may be stored under a layer's name (a nextn layer)
            return "mtp"
        if key.startswith(self.layers + "."):
            index = key[len(self.layers) + 1:].split(".", 1)[0]
            if index.isdigit():
                return f"layer {index}"
        for unit, path in (("embed_tokens", self.embed), ("lm_head", self.lm_head), ("norm", self.norm),
                           *(("norm", path) for path in self.readout)):
            if key.startswith(path + "."):
                return unit
        return "other"


# backbone library -> the package extra that installs it
EXTRAS = {"mlx-vlm": "vlm"}


def resolve(reference: str):
    """The object a ``"package.module:attribute"`` reference names, importing its module."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Family:
    """A model family's rules: declarative fields, then the hooks the pipeline calls."""

    name: str
    title: str  # the releases it covers, for people
    # config model_type -> the module of the backbone's library that loads it (``mlx_lm.models.<module>`` or
    # ``mlx_vlm.models.<module>``, per ``backbone_library``)
    model_types: Mapping[str, str]
    head: HeadDesign
    backbone_runtimes: Tuple[str, ...]  # compat.RUNTIMES that load the backbone
    head_runtimes: Tuple[str, ...]  # compat.RUNTIMES that run the head
    mtp_layouts: Tuple[str, ...]  # options.MTP_LAYOUTS this family writes
    head_prefix: str  # canonical MLX prefix of the head's tensors
    lm_head: str  # canonical MLX name of the output projection (absent when tied)
    capabilities: Capabilities
    backbone: str  # "module:Class" of its runtime.backbone.Backbone subclass: how our runtime drives the model
    compat: str  # "module:function" of its runtime table: (compat.Folder, layout) -> {runtime: RuntimeCompat}
    # hooks
    spec: Callable[[dict], object]  # config.json -> the family's ModelSpec (validated)
    expected_slots: Callable[[object, int], Dict[str, Slot]]  # (spec, MTP layers) -> every output slot
    contributions: Callable[[str], List[Mapped]]  # source key -> where it goes
    key_style: Callable[[str], str]  # RAW_VLM | RAW_TEXT | MLX | "" (shared by the raw styles)
    source_name: Callable[[str, str], str]  # (MLX name, style) -> the key such a source would use
    is_zero_centred_norm: Callable[[str], bool]  # MLX name -> whether +1 applies to it on raw weights
    norms_zero_centred: Callable[[Mapping], bool]  # headers -> raw layout? (decided once per checkpoint)
    backbone_library: str = "mlx-lm"  # the library whose model loads the backbone: mlx-lm or mlx-vlm
    text_prefix: str = ""  # MLX key prefix of the text model (``language_model.`` under a VLM wrapper)
    modules: Optional[ModulePaths] = None  # None: mlx-lm's text-model layout under text_prefix
    default_style: str = RAW_VLM  # the style of a folder none of whose keys tells (raw and MLX names coincide)
    loadable_config: Callable[[dict], dict] = lambda config: config  # output config -> what mlx-lm's loader needs
    # why the backbone library's forward cannot run a model of this config (None: it can); a decoding smoke is
    # then not attempted
    forward_misfit: Callable[[dict], Optional[str]] = lambda config: None
    # the output config -> mtp/config.json, the drafter folder's config (plan.head.MTP_DRAFTER_CONFIG)
    drafter_config: Callable[[dict], dict] = lambda config: config
    # the model_type of the head-only drafter folder mlx-vlm writes for this head (``mlx_vlm.convert --mtp``)
    drafter_folder_type: Optional[str] = None
    # where a config states the head's layer count: the first is what an output config writes, the others are
    # read too (a release that says it under another name)
    mtp_count_keys: Tuple[str, ...] = ("mtp_num_hidden_layers",)
    mtplx_arch: Optional[str] = None  # the arch id mtplx gives this family's folders (None: mtplx has none)
    # the head is one MTP layer whatever its keys: a nextn layer whose modules sit right under head_prefix, or one
    # prediction module of several blocks head_prefix.layers.{j} (Nemotron-H), not one layer per head_prefix.layers.{j}
    single_layer_head: bool = False
    # rules that depend on the config (the nextn layer's index): config -> the family with those hooks bound
    bind: Optional[Callable[["Family", dict], "Family"]] = None
    # the key prefix of the head's tensors in the sidecar (``mtp.X`` for head module ``X``); a family whose head
    # only mlx-vlm's splitter reads names them as that splitter selects them (GLM-5.3-Flash: the nextn layer's
    # ``language_model.model.layers.{N}.``, set by ``bind``)
    sidecar_prefix: str = "mtp."
    # headers -> whether the depthwise conv1d weights are raw [C, 1, K] (moved to MLX's [C, K, 1]); None: the answer of
    # norms_zero_centred (Qwen: the conv layout is what tells a raw checkpoint, whose norms are shifted, from MLX)
    convs_raw: Optional[Callable[[Mapping], bool]] = None

    @property
    def mtp_count_key(self) -> str:
        """The key an output config states the head's layer count under."""
        return self.mtp_count_keys[0]

    @property
    def module_paths(self) -> ModulePaths:
        return self.modules or ModulePaths.text_model(self.text_prefix)

    def mtp_layers_in(self, config: dict) -> int:
        """The head's layer count a config states (text_config first, then the top level), 0 when it states
        none or states it badly: for readers of any folder (compat, the model card); the plan validates it
        through ``spec``."""
        for where in (text_config(config) if isinstance(config.get("text_config"), dict) else config, config):
            for key in self.mtp_count_keys:
                value = where.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return 0

    def backbone_class(self):
        """The family's ``runtime.backbone.Backbone`` subclass (imports the runtime stack; a backbone library that
        is an optional extra, mlx-vlm, is named when it is missing)."""
        package = self.backbone_library.replace("-", "_")
        try:
            return resolve(self.backbone)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] != package:
                raise
            raise ConfigError(f"the {self.name} backbone runs in {self.backbone_library}, which is not installed",
                              hint=f"pip install 'mtpconvert[{EXTRAS.get(self.backbone_library, package)}]'") from None

    def runtime_rows(self, folder, layout: str) -> dict:
        """Each runtime's row for a folder of this family (``compat``)."""
        return resolve(self.compat)(folder, layout)

    def conv_layout_raw(self, tensors: Mapping) -> bool:
        """Whether a checkpoint's conv1d weights need moving to MLX's layout (decided once, from every header)."""
        return (self.convs_raw or self.norms_zero_centred)(tensors)

    def style_of(self, keys: Iterable[str]) -> str:
        """The one key style of a folder; a folder that mixes styles was partly converted."""
        styles = {self.key_style(k) for k in keys} - {""}
        if len(styles) > 1:
            raise LayoutError(
                f"checkpoint mixes key namespaces ({', '.join(sorted(styles))}); "
                "expected either raw Hugging Face or MLX names"
            )
        return styles.pop() if styles else self.default_style

    def is_head(self, mlx_name: str) -> bool:
        return mlx_name.startswith(self.head_prefix)

    def head_layers(self, targets: Iterable[str]) -> Tuple[int, bool]:
        """(number of head decoder layers, whether any head tensor exists) among MLX names."""
        if self.single_layer_head:
            any_head = any(t.startswith(self.head_prefix) for t in targets)
            return int(any_head), any_head
        layers = self.head_prefix + "layers."
        idx = set()
        any_head = False
        for t in targets:
            if t.startswith(self.head_prefix):
                any_head = True
                if t.startswith(layers):
                    number = t[len(layers):].split(".", 1)[0]
                    if number.isdigit():
                        idx.add(int(number))
        return (max(idx) + 1 if idx else 0), any_head

    def describe(self) -> dict:
        """What ``mtpconvert families --json`` prints for this family."""
        package = self.backbone_library.replace("-", "_")
        return {
            "family": self.name,
            "title": self.title,
            "model_types": sorted(self.model_types),
            "backbone_library": self.backbone_library,
            "backbone_modules": sorted({f"{package}.models.{m}" for m in self.model_types.values()}),
            "head": {
                "forward": self.head.forward,
                "projection": self.head.projection,
                "concat": list(self.head.concat),
                "layer": self.head.layer,
                "output": self.head.output,
                "hidden_state": self.head.hidden_state,
                "shares": list(self.head.shares),
                "norms_zero_centred": self.head.norms_zero_centred,
            },
            "mtp_count_key": self.mtp_count_key,
            "capabilities": {"batched": self.capabilities.batched,
                             "pre_norm_hidden": self.capabilities.pre_norm_hidden,
                             "in_model_layout": "in-model" in self.mtp_layouts},
            "backbone_runtimes": list(self.backbone_runtimes),
            "head_runtimes": list(self.head_runtimes),
            "mtp_layouts": list(self.mtp_layouts),
            "mtplx_arch": self.mtplx_arch,
        }


# config.json readers every family's spec hook uses


def text_config(config: dict) -> dict:
    """The text model's config: ``text_config`` of a VLM wrapper, else the config itself."""
    tc = config.get("text_config")
    if tc is None:
        return config
    if not isinstance(tc, dict):
        raise ConfigError("text_config must be an object", file="config.json")
    return tc


def config_bool(tc: dict, key: str, default: bool = False) -> bool:
    value = tc.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}", file="config.json", key=key)
    return value


def config_int(tc: dict, key: str, default: Optional[int] = None, *, minimum: int = 0) -> int:
    value = tc.get(key, default)
    if value is None:
        raise ConfigError(f"config is missing {key}", file="config.json", key=key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}", file="config.json", key=key)
    return value


def config_model_type(config: dict) -> Optional[str]:
    """The model_type that decides the family: the top level's (mlx-lm picks its module from it),
    else text_config's. Both are validated as strings."""
    if not isinstance(config, dict):
        raise ConfigError("config must be a JSON object", file="config.json")
    top = config.get("model_type")
    text = text_config(config).get("model_type", top)
    for where, t in (("model_type", top), ("text_config.model_type", text)):
        if t is not None and not isinstance(t, str):
            raise ConfigError(f"{where} must be a string, not {t!r}", file="config.json", key=where)
    return top if top is not None else text


def resolve_tie(config: dict) -> bool:
    """text_config wins; published 9B/27B configs carry the key at the top level only."""
    tc = text_config(config)
    where = tc if "tie_word_embeddings" in tc else config
    return config_bool(where, "tie_word_embeddings")
