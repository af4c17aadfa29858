"""Tiny raw GLM-5.3-Flash (``glm5_next``) releases made with transformers 5.24's own classes, the nextn layer in the
release's layout built from transformers' modules, and their float32 references.

transformers ignores the nextn layer on load (``layers.45.``, ``shared_head``), so the layer is composed the way
the release's head computes (mlx-vlm's drafter is the consumer that says so): ``enorm`` and ``hnorm``
(``Glm5NextTextRMSNorm``), ``eh_proj`` ``Linear(2H, H)`` over ``[enorm(e); hnorm(h)]`` with ``e`` zero at position
0, one ``Glm5NextTextAttention`` with its own full indexer, one ``Glm5NextTextMoE``, ``shared_head.norm``, the
backbone's ``lm_head``. It is stored as ``model.language_model.layers.{num_hidden_layers}.*`` with per-expert
experts and no embedding or output projection of its own (the release's 25 non-expert tensors + 3 per expert).

The release is BF16 but for what transformers keeps in float32 (``_keep_in_fp32_modules_strict``: the router,
its bias, the short convolutions, ``A_log``, ``dt_bias``, the hyper-connections' base and scale); the torch
models hold the stored values (rounded to BF16 where stored so), so float32 references are what a lossless
conversion must reproduce. Every parameter is randomised: norms around 1 (plain RMSNorm gains), so a shifted
norm, a wrong expert order or a dropped tensor changes the logits.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from mtpconvert.fixture.language import MarkovLanguage, write_tokenizer
from tests.checkpoints import VOCAB

# layer_types / indexer_types: a shared indexer layer right after a full one (transformers hands the top-k over
# from layer i-1 only); the nextn layer gets a full indexer and a sparse MoE
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=0, v_head_dim=16,
    qk_nope_head_dim=16, n_group=1, topk_group=1, index_topk=8, index_head_dim=16, index_n_heads=2, index_kpool=4,
    layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1,
    num_nextn_predict_layers=1,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, image_size=28,
              patch_size=14, projection_intermediate_size=64)
# stored float32 in the release, by raw key (transformers' _keep_in_fp32_modules_strict under the release's names)
KEEP_F32 = ("e_score_correction_bias", "mlp.gate.weight", "conv1d", "dt_bias", "A_log", "hc_attn_base",
            "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")
# the same, by transformers' module names
KEEP_F32_MODULES = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log", "hc.base", "hc.scale")


@dataclass
class Built:
    path: Path
    model: torch.nn.Module  # Glm5NextForConditionalGeneration, float32, holding the stored values
    head: torch.nn.Module  # the nextn layer (NextN), float32, holding the stored values
    tensors: Dict[str, torch.Tensor]  # every tensor written, by key, as stored
    config: dict


def _keep_f32(name: str, patterns=KEEP_F32) -> bool:
    return any(p in name for p in patterns)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Norm gains around 1, hyper-connection base/scale, gates and biases around their working values, matrices
    small and random; then every value rounded to BF16 where the release stores BF16."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if not p.is_floating_point():
                continue
            if name.endswith("hc.scale"):
                value = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif p.ndim == 1 and name.endswith("weight"):
                value = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif "kpool_compress" in name or name.endswith("e_score_correction_bias"):
                value = 0.05 * torch.randn(p.shape, generator=g)
            elif p.ndim == 1:
                value = 0.1 * torch.randn(p.shape, generator=g)
            else:
                value = torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5
            if not _keep_f32(name, KEEP_F32_MODULES):
                value = value.to(torch.bfloat16).to(torch.float32)
            p.copy_(value)


class NextN(torch.nn.Module):
    """The release's nextn layer from transformers' own glm5_next modules (module doc)."""

    def __init__(self, text_config):
        from transformers.models.glm5_next.modeling_glm5_next import (Glm5NextTextAttention, Glm5NextTextMoE,
                                                                      Glm5NextTextRMSNorm)

        super().__init__()
        n = text_config.num_hidden_layers
        cfg = copy.deepcopy(text_config)
        cfg.num_hidden_layers = n + 1
        cfg.layer_types = list(text_config.layer_types) + ["indexed_attention"]
        cfg.indexer_types = list(text_config.indexer_types) + ["full"]
        cfg.mlp_layer_types = list(text_config.mlp_layer_types) + ["sparse"]
        cfg._attn_implementation = "eager"
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = Glm5NextTextRMSNorm(H, eps), Glm5NextTextRMSNorm(H, eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = Glm5NextTextRMSNorm(H, eps)
        self.post_attention_layernorm = Glm5NextTextRMSNorm(H, eps)
        self.self_attn = Glm5NextTextAttention(cfg, n)
        self.mlp = Glm5NextTextMoE(cfg)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = Glm5NextTextRMSNorm(H, eps)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The head's state (after ``shared_head.norm``) at every position from a fresh cache: ``embedded`` =
        embed(t+1) (zeroed at position 0, as mlx-vlm's drafter does), ``hidden`` = the backbone's post-norm
        hidden at t."""
        e = embedded.clone()
        e[:, 0] = 0.0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], -1))
        mask = torch.ones(1, x.shape[1], dtype=torch.bool)
        attn, _, _ = self.self_attn(self.input_layernorm(x), attention_mask=mask, cache=None)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)


def reference_logits(built: Built, ids: torch.Tensor):
    """(backbone logits, the post-norm hidden the head reads, the head's logits for positions 0..L-2), float32."""
    with torch.no_grad():
        logits = built.model(input_ids=ids, use_cache=False).logits
        lm = built.model.model.language_model
        hidden = lm(input_ids=ids, use_cache=False).last_hidden_state
        state = built.head(lm.embed_tokens(ids[:, 1:]), hidden[:, :-1])
        head_logits = built.model.lm_head(state)
    return logits.numpy(), hidden.numpy(), head_logits.numpy()


def _per_expert(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' fused 3D experts (``mlp.experts.gate_up_proj`` / ``down_proj``) -> the release's per expert."""
    out = {}
    for k, v in tensors.items():
        if k == "mlp.experts.gate_up_proj":
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, 0)
                out[f"mlp.experts.{e}.gate_proj.weight"], out[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def _stored(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: (v.float() if _keep_f32(k) else v.to(torch.bfloat16)).contiguous() for k, v in tensors.items()}


def _write(folder: Path, tensors: Dict[str, torch.Tensor], config: dict, head_prefix: str, shards: int) -> None:
    """The release as the Hub has it: the backbone over the first shards, the nextn layer alone in the last, an
    index, config, generation config and a tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    head = sorted(k for k in tensors if k.startswith(head_prefix))
    rest = sorted(k for k in tensors if not k.startswith(head_prefix))
    per = -(-len(rest) // (shards - 1))  # consecutive keys per shard, as the releases are cut
    chunks = [rest[i * per:(i + 1) * per] for i in range(shards - 1)] + [head]
    weight_map = {}
    for i, chunk in enumerate(chunks):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                    indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 1}))
    write_tokenizer(folder, MarkovLanguage().words, VOCAB)


def _release_config(model) -> dict:
    config = model.config.to_dict()
    tc = config["text_config"]
    # transformers names the MLA layers indexed_attention; the release (and mlx-vlm) full_attention
    tc["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in tc["layer_types"]]
    tc["num_nextn_predict_layers"] = 1
    tc.pop("dtype", None)
    config["dtype"] = "bfloat16"
    return config


def build(folder: Path, *, seed: int = 0, shards: int = 2, text_edit=None) -> Built:
    """A tiny raw glm5_next release (module doc)."""
    from safetensors.torch import load_file
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = copy.deepcopy(TEXT)
    if text_edit:
        text_edit(text)
    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config=text, vision_config=VISION)
    cfg.text_config._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(cfg).float().eval()
    _randomise(model, seed)
    head = NextN(model.config.text_config).float().eval()
    _randomise(head, seed + 1)
    scratch = folder.parent / f".{folder.name}.save"
    model.save_pretrained(scratch, safe_serialization=True)
    tensors = {}
    for f in sorted(scratch.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    n = model.config.text_config.num_hidden_layers
    prefix = f"model.language_model.layers.{n}."
    tensors.update({prefix + k: v.detach().clone() for k, v in _per_expert(head.state_dict()).items()})
    tensors = _stored(tensors)
    config = _release_config(model)
    _write(folder, tensors, config, prefix, shards)
    return Built(folder, model, head, tensors, config)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A stored tensor as float32 numpy (BF16 included)."""
    return t.to(torch.float32).numpy()
