"""Tiny raw checkpoints made with transformers' own Qwen3.5 classes (+ raw MTP weights).

Every parameter is randomised (norms get zero-centred noise) so a missing or doubled
+1 shift, a wrong expert order or a dropped tensor changes the logits.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx
import numpy as np
import torch

from mtpconvert.families import model_spec
from mtpconvert.fixture.language import MarkovLanguage, write_tokenizer
from tools.rawexport import to_raw
from mtpconvert.families.base import NORM
from mtpconvert.families.qwen3_5 import mtp_slots

VOCAB = 512

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    rms_norm_eps=1e-6,
)
DENSE = dict(intermediate_size=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=8,
              spatial_merge_size=2, temporal_patch_size=2)


@dataclass
class Built:
    path: Path
    model: torch.nn.Module
    raw: Dict[str, np.ndarray]  # every raw tensor written, by key (float32 copies)


def convert_folder(src: Path, out: Path, *, edit: Optional[Callable[[object], None]] = None,
                   dtype: Optional[str] = None, keep_vision: bool = False, mtp_layout: str = "sidecar", **quant):
    """Convert ``src`` into ``out`` with these options (``quant``: QuantOptions fields); return the plan.

    ``edit(plan)`` runs before execution: how a test makes a deliberately broken conversion
    (a step removed, experts reordered) that the checks must catch.
    """
    from mtpconvert.execute import execute
    from mtpconvert.io.checkpoint import open_checkpoint
    from mtpconvert.options import ConvertOptions, QuantOptions
    from mtpconvert.plan import build_plan

    ckpt = open_checkpoint(Path(src))
    plan = build_plan(ckpt, ConvertOptions(dtype=dtype, quant=QuantOptions(**quant), keep_vision=keep_vision,
                                           mtp_layout=mtp_layout))
    if edit is not None:
        edit(plan)
    execute(plan, ckpt, Path(out))
    return plan


def without_shift(group_prefix: str = ""):
    """An ``edit`` that drops the +1 norm shift from every item whose name starts with ``group_prefix``."""
    from mtpconvert.plan.steps import ShiftNorm

    def edit(plan) -> None:
        for it in plan.items:
            if it.name.startswith(group_prefix):
                it.steps = tuple(s for s in it.steps if not isinstance(s, ShiftNorm))

    return edit


def tree_digest(folder: Path) -> Dict[str, str]:
    """sha256 of every file directly in ``folder``, by name: two conversions compared byte for byte."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # zero-centred norms, dt_bias
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)


def _random_mtp(config: dict, seed: int, layers: int) -> Dict[str, mx.array]:
    """MTP tensors in MLX naming/convention (norms around 1, conv irrelevant)."""
    spec = model_spec(config)
    rng = np.random.default_rng(seed)
    out = {}
    for name, slot in mtp_slots(spec, layers).items():
        if slot.kind == NORM:
            w = 1 + 0.1 * rng.standard_normal(slot.shape)
        else:
            w = rng.standard_normal(slot.shape) / max(slot.shape[-1], 1) ** 0.5
        out[name] = mx.array(w.astype(np.float32))
    return out


def _save_shards(folder: Path, tensors: Dict[str, np.ndarray], shards: int, dtype: str, shard_style: str) -> None:
    from safetensors.torch import save_file

    keys = sorted(tensors)
    chunks = [keys[i::shards] for i in range(shards)] if shards > 1 else [keys]
    weight_map = {}
    for i, chunk in enumerate(chunks):
        if shards == 1 and shard_style == "single":
            name = "model.safetensors"
        elif shard_style == "qwen35":
            name = f"model.safetensors-{i + 1:05d}-of-{shards:05d}.safetensors"
        else:
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        td = {}
        for k in chunk:
            t = torch.from_numpy(np.ascontiguousarray(tensors[k]))
            keep_f32 = k.endswith("A_log") or (dtype == "bfloat16" and k.endswith("linear_attn.norm.weight"))
            td[k] = t if keep_f32 else t.to(getattr(torch, dtype))
            weight_map[k] = name
        save_file(td, str(folder / name), metadata={"format": "pt"})
    if shards > 1 or shard_style != "single":
        index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _saved(model: torch.nn.Module, folder: Path):
    """(config.json, every tensor as float32) of transformers' own ``save_pretrained`` of ``model``."""
    from safetensors.numpy import load_file

    tmp = folder.parent / (folder.name + ".hfsave")
    model.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    raw = {}
    for f in sorted(tmp.glob("*.safetensors")):
        raw.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    shutil.rmtree(tmp)
    return config, raw


def build(
    folder: Path,
    *,
    moe: bool = False,
    wrapper: str = "vlm",  # vlm | text
    experts: str = "per_expert",  # per_expert | fused | published35
    mtp_layers: int = 1,
    shards: int = 1,
    shard_style: str = "single",  # single | qwen35 | hf
    tie: bool = False,
    tie_top_level_only: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    config_mtp: Optional[int] = None,
    tokenizer: bool = True,
) -> Built:
    """Write a raw checkpoint to ``folder`` and return it with the torch reference model."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    torch.manual_seed(seed)
    text = dict(TEXT, **(MOE if moe else DENSE), tie_word_embeddings=tie)
    if wrapper == "vlm":
        cls, cfg_cls = (Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig) if moe else (
            Qwen3_5ForConditionalGeneration, Qwen3_5Config)
        cfg = cfg_cls(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    else:
        cls, cfg_cls = (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig) if moe else (Qwen3_5ForCausalLM, Qwen3_5TextConfig)
        cfg = cfg_cls(**text)
    model = cls(cfg).eval()
    _randomise(model, seed)
    if tie:
        model.tie_weights()

    config, raw = _saved(model, folder)

    tc = config.get("text_config", config)
    tc["mtp_num_hidden_layers"] = mtp_layers if config_mtp is None else config_mtp
    if tie_top_level_only and "text_config" in config:
        tc.pop("tie_word_embeddings", None)
        config["tie_word_embeddings"] = tie

    # Re-express the backbone's experts in the requested layout and add the MTP head.
    if moe and experts != "per_expert":
        raw = fused_experts(raw)
    if mtp_layers:
        mtp = to_raw(_random_mtp(config, seed + 7, mtp_layers), experts=experts, text_only=wrapper == "text")
        raw.update({k: np.array(v) for k, v in mtp.items()})

    folder.mkdir(parents=True, exist_ok=True)
    _save_shards(folder, raw, shards, dtype, shard_style)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    if tokenizer:
        write_tokenizer(folder, MarkovLanguage().words, VOCAB)
    return Built(folder, model, raw)


NEXT = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def _write_release(folder: Path, backbone: Dict[str, np.ndarray], head: Dict[str, np.ndarray], config: dict,
                   shards: int, dtype: str, keep_f32: Callable[[str], bool] = lambda key: False) -> Dict[str, np.ndarray]:
    """Write a raw release as the Hub has it: the backbone spread over the first shards, the head alone in the
    last (with everything in one shard when ``shards`` is 1), an index, the config and a tokenizer. Returns every
    tensor as stored (after the cast to ``dtype``), so references compare against what a converter reads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    spread = max(shards - 1, 1)
    chunks = [sorted(backbone)[i::spread] for i in range(spread)]
    if shards == 1:
        chunks[0] += sorted(head)
    else:
        chunks.append(sorted(head))
    everything = dict(backbone, **head)
    weight_map = {}
    for name, chunk in zip(names, chunks):
        stored = {k: torch.from_numpy(np.ascontiguousarray(everything[k])).to(
            torch.float32 if keep_f32(k) else getattr(torch, dtype)) for k in chunk}
        save_file(stored, str(folder / name), metadata={"format": "pt"})
        everything.update({k: t.to(torch.float32).numpy() for k, t in stored.items()})
        weight_map.update({k: name for k in chunk})
    index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    write_tokenizer(folder, MarkovLanguage().words, VOCAB)
    return everything


def build_next(folder: Path, *, mtp_layers: int = 1, shards: int = 2, dtype: str = "bfloat16", seed: int = 0,
               rope: str = "published", **text) -> Built:
    """A raw Qwen3-Next checkpoint in the published layout: flat ``model.*`` keys, per-expert experts, fused
    ``in_proj_qkvz`` / ``in_proj_ba``, every ``mtp.*`` tensor in the last shard, and a config with no MTP count.

    ``rope``: ``published`` (``rope_theta`` / ``partial_rotary_factor`` at the top level, as the release has
    them) or ``transformers`` (only ``rope_parameters``, as transformers 5.x saves it).
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from mtpconvert.families.qwen3_next import FAMILY, model_spec as next_spec

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**dict(NEXT, **text), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.25})
    model = Qwen3NextForCausalLM(cfg).eval()
    _randomise(model, seed)
    config, raw = _saved(model, folder)
    if rope == "published":
        params = config.pop("rope_parameters")
        config.update(rope_theta=params["rope_theta"], partial_rotary_factor=params["partial_rotary_factor"],
                      rope_scaling=None)
    config.pop("layer_types", None)  # the release has none (the interval decides)
    head = {}
    if mtp_layers:
        rng = np.random.default_rng(seed + 7)
        slots = FAMILY.expected_slots(next_spec(config), mtp_layers)
        mlx_head = {}
        for name, slot in slots.items():
            if slot.group != "mtp":
                continue
            w = 1 + 0.1 * rng.standard_normal(slot.shape) if slot.kind == NORM else \
                rng.standard_normal(slot.shape) / max(slot.shape[-1], 1) ** 0.5
            mlx_head[name] = mx.array(w.astype(np.float32))
        head = {k: np.array(v) for k, v in to_raw(mlx_head, text_only=True).items()}
    everything = _write_release(folder, raw, head, config, shards, dtype)
    return Built(folder, model, everything)


def fused_experts(raw: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The backbone's per-expert tensors fused into ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] (the
    head's ``mtp.*`` stay as they are)."""
    import re

    pat = re.compile(r"^(.+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: Dict[str, Dict[str, Dict[int, np.ndarray]]] = {}
    out = {}
    for k, v in raw.items():
        m = pat.match(k)
        if m is None or k.startswith("mtp."):
            out[k] = v
            continue
        groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = v
    for mlp, projs in groups.items():
        stack = {p: np.stack([e[i] for i in sorted(e)]) for p, e in projs.items()}
        out[f"{mlp}.experts.gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        out[f"{mlp}.experts.down_proj"] = stack["down_proj"]
    return out


def resume_command(output: str) -> list:
    """The arguments of the resume command an error message gives (after 'resume with: ')."""
    line = next(line for line in output.splitlines() if "resume with: " in line)
    words = shlex.split(line.split("resume with: ", 1)[1])
    assert words[0] == "mtpconvert"
    return words[1:]


# tiny GLM configs (transformers 5.x classes); layer 0 dense, the others MoE, as in the releases
GLM_LITE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, routed_scaling_factor=1.8, kv_lora_rank=32, q_lora_rank=48,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1,
                norm_topk_prob=True, first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-5,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GLM_DSA = dict(GLM_LITE, index_topk=4, index_head_dim=32, index_n_heads=4, routed_scaling_factor=2.5)
GLM_MOE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
               norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-5, attention_bias=True,
               use_qk_norm=False, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
GLM = {"glm4_moe_lite": ("Glm4MoeLite", GLM_LITE, 1.0),  # (transformers class prefix, config, partial rotary)
       "glm_moe_dsa": ("GlmMoeDsa", GLM_DSA, 1.0),
       "glm4_moe": ("Glm4Moe", GLM_MOE, 0.5)}


def _randomise_glm(model: torch.nn.Module, seed: int) -> None:
    """Plain RMSNorm gains around 1, small biases, scaled matrices: every tensor moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "rotary" in name:
                continue
            if p.ndim == 1 and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)


def glm_nextn_layer(raw: Dict[str, np.ndarray], num_layers: int, own_vocab: bool, seed: int) -> Dict[str, np.ndarray]:
    """The release's nextn layer ``model.layers.{num_layers}.*``: a decoder block shaped like the last (MoE)
    layer, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and, where ``own_vocab``, its own
    ``embed_tokens`` and ``shared_head.head`` (random, so a consumer that borrows the backbone's differs)."""
    rng = np.random.default_rng(seed)
    last, head = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    H = raw["model.norm.weight"].shape[0]
    V = raw["model.embed_tokens.weight"].shape[0]

    def rand(shape, norm=False):
        if norm:
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (rng.standard_normal(shape) / max(shape[-1], 1) ** 0.5).astype(np.float32)

    out = {head + k[len(last):]: rand(v.shape, v.ndim == 1 and k.endswith("weight") and "e_score" not in k)
           for k, v in raw.items() if k.startswith(last)}
    out.update({head + "enorm.weight": rand((H,), True), head + "hnorm.weight": rand((H,), True),
                head + "eh_proj.weight": rand((H, 2 * H)), head + "shared_head.norm.weight": rand((H,), True)})
    if own_vocab:
        out.update({head + "embed_tokens.weight": rand((V, H)), head + "shared_head.head.weight": rand((V, H))})
    return out


def build_glm(folder: Path, model_type: str, *, mtp: bool = True, dtype: str = "bfloat16", seed: int = 0,
              shards: int = 2, **overrides) -> Built:
    """A raw GLM checkpoint in the release layout: transformers' own model saved (per-expert experts, whole
    ``kv_b_proj``), the nextn layer in the last shard, a config as the release writes it (``rope_theta``
    at the top level, ``num_nextn_predict_layers``)."""
    import transformers

    from mtpconvert.families.glm import VARIANTS

    prefix, base, rotary = GLM[model_type]
    torch.manual_seed(seed)
    params = dict(base, **overrides)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if model_type == "glm4_moe":
        rope["partial_rotary_factor"] = rotary
    cfg = getattr(transformers, prefix + "Config")(**params, rope_parameters=rope)
    model = getattr(transformers, prefix + "ForCausalLM")(cfg).eval()
    _randomise_glm(model, seed)
    config, raw = _saved(model, folder)
    params_out = config.pop("rope_parameters", rope)
    config.update(rope_theta=params_out["rope_theta"], rope_scaling=None)
    if model_type == "glm4_moe":
        config["partial_rotary_factor"] = rotary
    config.pop("mlp_layer_types", None)
    config.setdefault("first_k_dense_replace", params["first_k_dense_replace"])
    if model_type == "glm_moe_dsa":
        config.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                      rope_parameters={"rope_type": "default", "rope_theta": params_out["rope_theta"]})
    config["num_nextn_predict_layers"] = 1 if mtp else 0
    config["dtype"] = dtype  # the stored dtype, as the releases say it
    head = glm_nextn_layer(raw, config["num_hidden_layers"], VARIANTS[model_type].head_own_vocab, seed + 7) if mtp else {}
    everything = _write_release(folder, raw, head, config, shards, dtype,
                                keep_f32=lambda k: k.endswith("e_score_correction_bias"))
    return Built(folder, model, everything)
