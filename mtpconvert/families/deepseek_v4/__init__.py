"""DeepSeek-V4-Flash (``deepseek_v4``): the family's rules.

The release (``deepseek-ai/DeepSeek-V4-Flash``) has flat keys without a ``model.`` prefix: ``embed.weight``,
``head.weight``, ``norm.weight``, ``hc_head_{fn,base,scale}``, ``layers.{i}.*`` and the MTP head ``mtp.0.*`` (one
full block, ``e_proj`` / ``h_proj``, ``enorm`` / ``hnorm`` / ``norm`` and its own ``hc_head_*``; no embedding or
output projection: it borrows the backbone's). mlx-lm has no module for it: mlx-vlm 0.7.10 loads the backbone
(``models/deepseek_v4``) and drafts with the head (``speculative/drafters/deepseek_v4_mtp``), and the rules below
are what its sanitizes make of a raw folder (``language.py:1297-1409``, ``deepseek_v4_mtp.py:124-213``):

* backbone: ``X`` -> ``language_model.model.X`` (``embed`` -> ``embed_tokens``, ``head`` -> ``language_model.lm_head``,
  ``hc_head_P`` -> ``hc_head.P``, ``layers.{i}.hc_{attn,ffn}_P`` -> ``{attn,ffn}_hc.P``);
* head: ``mtp.{d}.X`` (any stage index d: the index is data) -> ``mtp.X`` with the block's modules under
  ``decoder.`` (``attn``, ``attn_norm``, ``ffn``, ``ffn_norm``, the hyper-connections), as the drafter holds them;
* both: ``ffn.gate.bias`` -> ``ffn.gate.e_score_correction_bias``; shared experts ``w1/w2/w3`` ->
  ``gate/down/up_proj``; routed experts ``experts.{e}.w1/w2/w3`` stacked into ``switch_mlp.gate/down/up_proj``;
  ``attn.wo_a`` [o_groups * o_lora_rank, in] -> [o_groups, o_lora_rank, in] (``MultiLinear``).

The release stores its matrices as FP8 E4M3 with E8M0 128x128 block scales named ``.scale`` and its routed experts
as MXFP4 (``plan.fp8``): a float output dequantizes them exactly; a quantized one carries the experts over as MLX
``mxfp4`` byte for byte (and the FP8 matrices as ``mxfp8`` where ``--q-mode mxfp8`` is asked).
"""

from __future__ import annotations

import copy
import re
from typing import List

from ...errors import LayoutError
from ..base import MLX, RAW_TEXT, Capabilities, Family, Gather, HeadDesign, Mapped, ModulePaths
from .slots import HEAD_PREFIX, LM, LM_HEAD, MODEL, expected_slots
from .spec import MODEL_TYPES, model_spec

HEAD_INDEX = re.compile(r"^mtp\.(?:\d+\.)?")
EXPERT = re.compile(r"^(?P<ffn>.*\bffn)\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
TOP = {"embed.weight": "embed_tokens.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn",
       "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
BLOCK_PARTS = ("attn.", "attn_norm.", "ffn.", "ffn_norm.", "attn_hc.", "ffn_hc.")
# the head's modules at its top level, in the drafter's (MLX) names
HEAD_TOP = ("decoder.", "hc_head.", "enorm.", "hnorm.", "norm.", "e_proj.", "h_proj.")


def key_style(key: str) -> str:
    if key.startswith(LM):
        return MLX
    if key.startswith(("layers.", "embed.", "head.", "norm.", "hc_head_", "model.")):
        return RAW_TEXT
    return ""  # mtp.*: the sidecar's names and the release's share the prefix


def _block_key(rest: str) -> str:
    """A block's raw suffix (``attn.wq_a.weight``, ``ffn.gate.bias``, ``hc_attn_fn``) -> its MLX one."""
    rest = re.sub(r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2", rest)
    if rest == "ffn.gate.bias":
        return "ffn.gate.e_score_correction_bias"
    return re.sub(r"^ffn\.shared_experts\.(w[123])\.", lambda m: f"ffn.shared_experts.{PROJ[m[1]]}.", rest)


def _head_target(key: str) -> str:
    """``mtp.{d}.X`` (release) or ``mtp.X`` (an MLX sidecar) -> the canonical ``mtp.X``."""
    rest = key[HEAD_INDEX.match(key).end():]
    if rest.startswith(HEAD_TOP):
        return HEAD_PREFIX + rest
    if rest.startswith("hc_head_"):
        return HEAD_PREFIX + "hc_head." + rest[len("hc_head_"):]
    block = _block_key(rest)
    if not block.startswith(BLOCK_PARTS):
        raise LayoutError("tensor is not one of the MTP head's (enorm, hnorm, e_proj, h_proj, norm, hc_head_*, and "
                          "its block: attn, attn_norm, ffn, ffn_norm, hc_attn_*, hc_ffn_*)", key=key)
    return HEAD_PREFIX + "decoder." + block


def _target(key: str) -> str:
    """The canonical MLX name of a key before its experts are stacked."""
    if key.startswith(LM):
        return key
    if key.startswith("mtp."):
        return _head_target(key)
    if key.startswith("model.") or key == "lm_head.weight":
        raise LayoutError("transformers' save_pretrained names (model.*, lm_head): mlx-vlm reads DeepSeek-V4's release "
                          "names (embed, layers.N, head, hc_head_*) and its compress_ratios, which such a folder's "
                          "config does not state", key=key, hint="convert the release (deepseek-ai/DeepSeek-V4-Flash) "
                                                                 "layout")
    if key == "head.weight":
        return LM_HEAD
    if key in TOP:
        return MODEL + TOP[key]
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    if m is None:
        raise LayoutError("tensor is outside every deepseek_v4 namespace (embed, head, norm, hc_head_*, layers.N, "
                          "mtp.N)", key=key)
    return f"{MODEL}layers.{m[1]}.{_block_key(m[2])}"


def contributions(key: str) -> List[Mapped]:
    """Where one source key goes: a routed expert's ``w1/w2/w3`` is one row of its stack; ``wo_a`` of a raw
    folder is read as its groups."""
    target = _target(key)
    m = EXPERT.match(target)
    if m is not None:
        return [Mapped(key, f"{m['ffn']}.switch_mlp.{PROJ[m['w']]}.weight", Gather.STACK, int(m["e"]))]
    if target.endswith(".attn.wo_a.weight") and not key.startswith(LM) and not _is_mlx_head(key):
        return [Mapped(key, target, Gather.GROUPS)]
    return [Mapped(key, target)]


def _is_mlx_head(key: str) -> bool:
    """A head key in the drafter's (MLX) names: its wo_a is stored as the [G, R, C] the model holds."""
    return key.startswith(HEAD_PREFIX) and key[len(HEAD_PREFIX):].startswith(HEAD_TOP)


def source_name(mlx_name: str, style: str) -> str:
    """The key a source of ``style`` would use for an MLX name (error messages)."""
    if style == MLX or mlx_name.startswith(HEAD_PREFIX):
        return mlx_name
    if mlx_name == LM_HEAD:
        return "head.weight"
    name = mlx_name[len(MODEL):] if mlx_name.startswith(MODEL) else mlx_name
    for raw, mlx in TOP.items():
        if name == mlx:
            return raw
    name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
    name = name.replace(".ffn.gate.e_score_correction_bias", ".ffn.gate.bias")
    name = re.sub(r"\.shared_experts\.(gate|down|up)_proj\.",
                  lambda m: ".shared_experts." + {"gate": "w1", "down": "w2", "up": "w3"}[m[1]] + ".", name)
    return re.sub(r"\.switch_mlp\.(gate|down|up)_proj\.",
                  lambda m: ".experts.0." + {"gate": "w1", "down": "w2", "up": "w3"}[m[1]] + ".", name)


# what the output config drops: the source's FP8 description (mlx-vlm would run its FP8 loader on a converted
# folder), and what transformers moves into it
_SOURCE_ONLY = ("expert_dtype",)


def loadable_config(config: dict) -> dict:
    """The output config as mlx-vlm's ``ModelConfig`` reads it: the release's own fields (``compress_ratios`` with its
    MTP entry, which mlx-vlm truncates), less the source format's ``expert_dtype``."""
    return {k: v for k, v in config.items() if k not in _SOURCE_ONLY}


# what mlx-vlm's drafter config drops from the model's config: the quantization is restated for the head
_NOT_IN_DRAFTER = ("quantization", "quantization_config", "mlx_lm_extra_tensors")


def drafter_config(config: dict) -> dict:
    """mtp/config.json: the ``deepseek_v4_mtp`` drafter folder ``--draft-model OUT/mtp`` loads in mlx-vlm (built from
    the whole text config; one draft a round), its quantization the head's modules' entries under the drafter's own
    paths (``mtp.decoder.X`` -> ``decoder.X``): mlx-vlm's splitter would otherwise describe a quantized head by module
    name (mxfp4 experts, mxfp8 projections), whatever it holds."""
    text = {k: v for k, v in config.items() if k not in _NOT_IN_DRAFTER}
    out = {"model_type": "deepseek_v4_mtp", "text_config": text, "block_size": 2, "tie_word_embeddings": False}
    quant = config.get("quantization")
    if quant:
        head = {k: v for k, v in quant.items() if not isinstance(v, (dict, bool))}
        head.update({k[len(HEAD_PREFIX):]: copy.deepcopy(v) for k, v in quant.items() if k.startswith(HEAD_PREFIX)})
        out["quantization"] = head
        out["quantization_config"] = copy.deepcopy(head)
    return out


HEAD = HeadDesign(
    forward="deepseek-v4-hc-mtp",
    projection="mtp.e_proj [H, H] on enorm(embed(t+1)) + mtp.h_proj [H, H] on hnorm of each of the hc streams",
    concat=("enorm(embed(t+1))", "hnorm(h_t) on each hc stream"),
    layer="one sliding-window block (attention with sinks, score-routed MoE, hyper-connections) with its own KV cache",
    output="lm_head(mtp.norm(mtp.hc_head(h)))",
    hidden_state="pre_hc_head",
    shares=("embed_tokens", "lm_head"),
    norms_zero_centred=False,
)

FAMILY = Family(
    name="deepseek_v4",
    title="DeepSeek-V4-Flash (hyper-connections, compressed sparse attention, hash and score routed MoE)",
    model_types=MODEL_TYPES,
    head=HEAD,
    backbone_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    head_runtimes=("mlx-vlm", "mlx-vlm-drafter"),
    mtp_layouts=("sidecar",),
    head_prefix=HEAD_PREFIX,
    lm_head=LM_HEAD,
    capabilities=Capabilities(batched=True, pre_norm_hidden=False),
    backbone="mtpconvert.families.deepseek_v4.backbone:DeepseekV4Backbone",
    compat="mtpconvert.families.deepseek_v4.compat:rows",
    spec=model_spec,
    expected_slots=expected_slots,
    contributions=contributions,
    key_style=key_style,
    source_name=source_name,
    is_zero_centred_norm=lambda name: False,
    norms_zero_centred=lambda tensors: False,
    backbone_library="mlx-vlm",
    text_prefix=LM,
    # the final norm reads the streams through hc_head: both held at the end of the layerwise check
    modules=ModulePaths(MODEL + "embed_tokens", MODEL + "layers", MODEL + "norm", LM_HEAD[: -len(".weight")],
                        readout=(MODEL + "hc_head",)),
    default_style=RAW_TEXT,
    loadable_config=loadable_config,
    drafter_config=drafter_config,
    drafter_folder_type="deepseek_v4_mtp",
    mtp_count_keys=("num_nextn_predict_layers",),
    single_layer_head=True,
)
