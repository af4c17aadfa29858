"""Tiny raw Qwen3.8-Flash-Next (``qwen4_exp``) releases made with transformers 5.24's own classes, an MTP head in
the release's layout built from transformers' modules, and their float32 references.

transformers has no MTP module for this family (it drops ``mtp.*`` on load), so the head is composed the way the
release's head computes (mlx-vlm's drafter is the consumer that says so): ``Qwen4ExpTextRMSNorm`` over the
embedding and one over all hc streams, two ``Linear(H, H)``, one indexed-attention ``Qwen4ExpTextDecoderLayer``
with the backbone's MoE and hyper-connections, ``Qwen4ExpTextGatedResidual`` as its mixer, the backbone's
``lm_head``. Every parameter is randomised (norms zero-centred) so that a shifted norm, a wrong expert order or a
dropped tensor changes the logits.

Variants: ``experts`` "per-expert" (what ``save_pretrained`` writes) or "fused" (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj``), and ``fp8``: the FP8 release's form (experts per expert in F8_E4M3 with
128x128 ``weight_scale_inv`` blocks; each n-gram table's parts in F8_E4M3 under one scalar
``ngram_embedding.weight_scale``), written beside the exact float32 dequantization of the same codes, which is the
reference every FP8 check compares with.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

from mtpconvert.fixture.language import MarkovLanguage, write_tokenizer
from tests.checkpoints import VOCAB

TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    hc_count=4, hc_lowrank=32, ple_layer_ids=[1, 3], ple_embed_dim=128, ple_conv_kernel_size=4, ngram_size=3,
    heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4,
    seed=1234, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
    indexer_compress_ratio=4, output_gate_type="sigmoid", eos_token_id=1, rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    tie_word_embeddings=False,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
PER_EXPERT = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
FP8_MAX = 448.0


@dataclass
class Built:
    path: Path
    model: torch.nn.Module  # the backbone, float32 (transformers' Qwen4ExpForConditionalGeneration)
    head: torch.nn.Module  # the MTP head, float32
    tensors: Dict[str, torch.Tensor]  # every tensor written, by key, as stored
    reference: Optional[Path] = None  # fp8: the folder of the same release with every FP8 tensor dequantized


def _text_config(edit=None) -> dict:
    text = copy.deepcopy(TEXT)
    if edit:
        edit(text)
    return text


def _model(seed: int, text: dict):
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen4ExpConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    config.text_config._attn_implementation = "eager"
    model = Qwen4ExpForConditionalGeneration(config).float().eval()
    _randomise(model)
    return model


def _randomise(module: torch.nn.Module, matrices: bool = False) -> None:
    """Zero-centred noise on every vector (norms: transformers initialises them to 0, which would hide a shifted
    one) and on the PLE convolutions; with ``matrices`` (a module built outside ``from_pretrained``, whose
    parameters start uninitialised) small random matrices too."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1 or ".ple.conv1d" in name:
                p.normal_(0.0, 0.1)
            elif matrices:
                p.normal_(0.0, 0.05)


class Head(torch.nn.Module):
    """The release's MTP head, composed from transformers' own qwen4_exp modules (module doc)."""

    def __init__(self, text_config):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextDecoderLayer,
                                                                      Qwen4ExpTextGatedResidual,
                                                                      Qwen4ExpTextRMSNorm)

        super().__init__()
        cfg = copy.deepcopy(text_config)
        cfg.num_hidden_layers, cfg.layer_types, cfg.ple_layer_ids = 1, ["indexed_attention"], []
        cfg._attn_implementation = "eager"
        H, hc = cfg.hidden_size, cfg.hc_count
        self.config = cfg
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(hc * H, eps=cfg.rms_norm_eps)  # one norm over all streams
        self.fc_embedding = torch.nn.Linear(H, H, bias=False)
        self.fc_hidden = torch.nn.Linear(H, H, bias=False)
        self.layers = torch.nn.ModuleList([Qwen4ExpTextDecoderLayer(cfg, 0)])
        self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(cfg, use_combine=False)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The head's state before its mixer over every position (a fresh cache): ``embedded`` = embed(t+1),
        ``hidden`` = the backbone's last layer output before its mixer, [B, L, hc * H]."""
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

        H, hc = self.config.hidden_size, self.config.hc_count
        e = self.fc_embedding(self.pre_fc_norm_embedding(embedded))
        streams = self.pre_fc_norm_hidden(hidden).unflatten(-1, (hc, H))
        x = (e.unsqueeze(-2) + self.fc_hidden(streams)).flatten(-2)
        L = x.shape[1]
        positions = torch.arange(L).view(1, 1, -1).expand(4, 1, -1)
        rotary = Qwen4ExpTextRotaryEmbedding(self.config)(x, positions[1:])
        mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)[None, None]
        return self.layers[0](x, position_embeddings=rotary, attention_mask=mask, conv_mask=None, cache=None)


def reference_logits(built: Built, ids: torch.Tensor):
    """(backbone logits, the hidden the head reads, the head's logits for positions 0..L-2), float32."""
    captured = {}
    mixer = built.model.model.language_model.hyper_connection_mixer
    hook = mixer.register_forward_pre_hook(lambda m, args: captured.__setitem__("hidden", args[0]))
    with torch.no_grad():
        logits = built.model(input_ids=ids, use_cache=False).logits
        hook.remove()
        hidden = captured["hidden"]
        embedded = built.model.model.language_model.embed_tokens(ids[:, 1:])
        state = built.head(embedded, hidden[:, :-1])
        head_logits = built.model.lm_head(built.head.hyper_connection_mixer(state))
    return logits.numpy(), hidden.numpy(), head_logits.numpy()


def _fused(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per-expert experts -> the fused form transformers' qwen3_5_moe conversion writes."""
    out, groups = {}, {}
    for k, v in tensors.items():
        m = PER_EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault(m["mlp"], {})[(int(m["e"]), m["proj"])] = v
    for mlp, parts in groups.items():
        E = 1 + max(e for e, _ in parts)
        out[f"{mlp}.experts.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(E)])
        out[f"{mlp}.experts.down_proj"] = torch.stack([parts[e, "down"] for e in range(E)])
    return out


def _fp8_block(w: torch.Tensor):
    """(codes, scale_inv [ceil(out/128), ceil(in/128)], exact float32 dequantization) of one matrix."""
    out_dim, in_dim = w.shape
    rows, cols = math.ceil(out_dim / 128), math.ceil(in_dim / 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:out_dim, :in_dim] = w
    blocks = padded.reshape(rows, 128, cols, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).reshape(rows * 128, cols * 128)[:out_dim, :in_dim].to(torch.float8_e4m3fn)
    grid = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_dim, :in_dim]
    return codes, scale, codes.to(torch.float32) * grid


def _fp8_release(tensors: Dict[str, torch.Tensor]):
    """(the FP8 release's tensors, the same with every FP8 tensor replaced by its exact dequantization)."""
    fp8, exact = {}, {}
    tables: Dict[str, list] = {}
    for k, v in tensors.items():
        if PER_EXPERT.match(k):
            codes, scale, deq = _fp8_block(v)
            fp8[k], fp8[k + "_scale_inv"], exact[k] = codes, scale, deq
        elif ".ngram_embedding.shard_" in k:
            tables.setdefault(k.split(".ngram_embedding.shard_")[0], []).append(k)
        else:
            fp8[k] = exact[k] = v
    for table, keys in tables.items():
        scale = max(float(tensors[k].abs().max()) for k in keys) / FP8_MAX
        fp8[table + ".ngram_embedding.weight_scale"] = torch.tensor(scale, dtype=torch.float32)
        for k in keys:
            fp8[k] = (tensors[k] / scale).to(torch.float8_e4m3fn)
            exact[k] = fp8[k].to(torch.float32) * torch.tensor(scale, dtype=torch.float32)
    return fp8, exact


def _write(folder: Path, tensors: Dict[str, torch.Tensor], config: dict, shards: int = 2) -> None:
    """The release as the Hub has it: the backbone over the first shards, the head in the last, an index, config,
    generation config and a tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    head = sorted(k for k in tensors if k.startswith("mtp."))
    rest = sorted(k for k in tensors if not k.startswith("mtp."))
    chunks = [rest[i::shards - 1] for i in range(shards - 1)] + [head]
    weight_map = {}
    for i, chunk in enumerate(chunks):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in chunk}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                    indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 1}))
    write_tokenizer(folder, MarkovLanguage().words, VOCAB)


def _release_config(model, fp8: bool) -> dict:
    config = model.config.to_dict()
    tc = config["text_config"]
    tc["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in tc["layer_types"]]
    tc.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, dtype="float32")
    config.pop("dtype", None)
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128]}
    return config


def build(folder: Path, *, seed: int = 0, experts: str = "per-expert", fp8: bool = False, text_edit=None) -> Built:
    """A tiny raw qwen4_exp release (module doc)."""
    from safetensors.torch import load_file

    model = _model(seed, _text_config(text_edit))
    head = Head(model.config.text_config).float().eval()
    torch.manual_seed(seed + 1)
    _randomise(head, matrices=True)
    scratch = folder.parent / f".{folder.name}.save"
    model.save_pretrained(scratch, safe_serialization=True)
    tensors = {}
    for f in sorted(scratch.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors.update({f"mtp.{k}": v.detach().clone() for k, v in head.state_dict().items()})
    if experts == "fused":
        tensors = _fused(tensors)
    reference = None
    if fp8:
        tensors, exact = _fp8_release(tensors)
        reference = folder.parent / f"{folder.name}-dequantized"
        _write(reference, exact, _release_config(model, fp8=False))
    _write(folder, tensors, _release_config(model, fp8))
    return Built(folder, model, head, tensors, reference)
