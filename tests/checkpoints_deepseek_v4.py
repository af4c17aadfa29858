"""Tiny raw DeepSeek-V4-Flash (``deepseek_v4``) releases made with transformers 5.24's own classes, in the release's
layout (``shared/layouts/DeepSeek-V4-Flash``), with an MTP head ``mtp.0.*``, and their float32 references.

The backbone is ``DeepseekV4ForCausalLM`` (three layers: sliding, compressed sparse, heavily compressed; the first
hash-routed), saved and renamed to the release's keys (no ``model.`` prefix, ``embed`` / ``head``, ``hc_head_*``,
``attn.kv_norm``). transformers has no MTP module for this family (it drops ``mtp.*`` on load), so the head is
composed as the release's computes (DeepSeek's ``MTPBlock``, mlx-vlm's drafter): one sliding-window block with a
score-routed MoE, its own ``hc_head`` and ``norm`` -- taken from a one-layer ``DeepseekV4ForCausalLM`` -- plus
``e_proj`` / ``h_proj`` and ``enorm`` / ``hnorm``. Every vector is randomised (norms near 1, hyper-connection
parameters, sinks, router biases, the hash table) so that a dropped, shifted or misrouted tensor changes the logits.

Forms: ``bf16`` (the release's dtypes with every matrix in BF16) and ``fp8`` (its storage: attention projections,
the indexer's ``wq_b``, shared experts, ``e_proj`` / ``h_proj`` as F8_E4M3 with F8_E8M0 128x128 ``.scale`` blocks;
routed experts as MXFP4, I8 holding two E2M1 codes a byte with an F8_E8M0 ``.scale`` per 32 inputs), the latter
written beside its exact float32 dequantization (``reference``), computed here from the codes by the formats'
definitions. Dimensions are multiples of 128 wherever the release stores 128x128 blocks.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

from mtpconvert.fixture.language import MarkovLanguage, write_tokenizer
from tests.checkpoints import VOCAB

CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=128, q_lora_rank=128, qk_rope_head_dim=64, num_experts_per_tok=2,
    n_routed_experts=4, n_shared_experts=1, routed_scaling_factor=1.5, num_hash_layers=1, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=8, o_groups=2, o_lora_rank=64, index_n_heads=2,
    index_head_dim=64, index_topk=4, num_nextn_predict_layers=1, rms_norm_eps=1e-6, max_position_embeddings=4096,
    swiglu_limit=10.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    compress_ratios=[0, 4, 128, 0],  # the last entry is the MTP layer's, as the release's 44 for 43 + 1
)
# the release's config.json: the legacy fields mlx-vlm reads (transformers' save_pretrained writes layer_types)
RELEASE_KEYS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok",
                "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "num_hash_layers", "hc_mult",
                "hc_sinkhorn_iters", "hc_eps", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
                "index_head_dim", "index_topk", "num_nextn_predict_layers", "rms_norm_eps", "max_position_embeddings",
                "swiglu_limit", "tie_word_embeddings", "bos_token_id", "eos_token_id", "compress_ratios")
FP8_LAYOUT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
              "weight_block_size": [128, 128]}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MATRIX = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.indexer\.wq_b|\.shared_experts\.w[123]|\.[eh]_proj)\.weight$")
ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FLOAT32 = re.compile(r"(attn_sink|\.gate\.bias|hc_\w+|\.ape)$")


@dataclass
class Built:
    path: Path
    tensors: Dict[str, torch.Tensor]  # every tensor written, by key, as stored
    reference: Path  # the same release with every quantized tensor dequantized (float32); the bf16 form's own folder


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Vectors and hyper-connection parameters away from their initial values; a random hash table."""
    g = torch.Generator().manual_seed(seed)
    noise = lambda p, std: torch.randn(p.shape, generator=g) * std  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + noise(p, 0.2))
            elif name.endswith("sinks") or name.endswith(("hc_fn", ".fn")) or "position_bias" in name:
                p.copy_(noise(p, 0.3 if not name.endswith("sinks") else 0.5))
            elif name.endswith(("hc_base", ".base")):
                p.copy_(noise(p, 0.3))
            elif name.endswith(("hc_scale", ".scale")):
                p.copy_(1.0 + noise(p, 0.3))
        config = model.config
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(noise(b, 0.05))
            elif name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)]))


def _release_names(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' save_pretrained keys -> the release's."""
    out = {}
    for k, v in tensors.items():
        k = k.removeprefix("model.")
        k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
        k = re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", k)
        out[re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", k)] = v.detach().clone()
    return out


def _saved(model: torch.nn.Module, scratch: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(scratch, safe_serialization=True)
    tensors = {}
    for f in sorted(scratch.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    shutil.rmtree(scratch)
    return _release_names(tensors)


def _model(layers: int, ratios, hash_layers: int, seed: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**dict(CONFIG, num_hidden_layers=layers, compress_ratios=ratios,
                                     num_hash_layers=hash_layers))
    model = DeepseekV4ForCausalLM(config).float().eval()
    _randomise(model, seed)
    return model


def _head(scratch: Path, seed: int) -> Dict[str, torch.Tensor]:
    """The MTP head in the release's names: a one-layer model's block, hc_head and norm under ``mtp.0.``, and its
    own projections and norms."""
    one = _saved(_model(1, [0, 0], 0, seed), scratch)
    head = {f"mtp.0.{k[len('layers.0.'):]}": v for k, v in one.items() if k.startswith("layers.0.")}
    head.update({f"mtp.0.{k}": one[k] for k in ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight")})
    g = torch.Generator().manual_seed(seed + 1)
    H = CONFIG["hidden_size"]
    for name in ("e_proj", "h_proj"):
        head[f"mtp.0.{name}.weight"] = torch.randn(H, H, generator=g) * 0.05
    for name in ("enorm", "hnorm"):
        head[f"mtp.0.{name}.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    return head


def _e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """DeepSeek's scale: the power of two rounded up so that ``amax / scale`` stays within ``top``."""
    return torch.clamp(torch.ceil(torch.log2(torch.clamp(amax / top, min=2.0 ** -126))), -127, 127)


def fp8_block(w: torch.Tensor):
    """(E4M3 codes, E8M0 scales [ceil(N/128), ceil(K/128)], their exact float32 value) of a matrix."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:N, :K] = w
    blocks = padded.reshape(nb, 128, kb, 128)
    scale = torch.exp2(_e8m0(blocks.abs().amax(dim=(1, 3)), 448.0))
    codes = (blocks / scale[:, None, :, None]).reshape(nb * 128, kb * 128)[:N, :K].to(torch.float8_e4m3fn)
    grid = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    return codes, scale.to(torch.float8_e8m0fnu), codes.to(torch.float32) * grid


def mxfp4(w: torch.Tensor):
    """(I8 [N, K/2] two E2M1 codes a byte, the even input in the low nibble; E8M0 scales [N, K/32]; exact value)."""
    N, K = w.shape
    groups = w.reshape(N, K // 32, 32)
    scale = torch.exp2(_e8m0(groups.abs().amax(-1), 6.0))
    x = groups / scale[..., None]
    magnitude = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    code = (magnitude | ((x < 0).long() << 3)).reshape(N, K).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    value = (E2M1[magnitude] * torch.where(x < 0, -1.0, 1.0) * scale[..., None]).reshape(N, K)
    return packed, scale.to(torch.float8_e8m0fnu), value


def _stored(tensors: Dict[str, torch.Tensor], form: str):
    """(the release's tensors in ``form``, their exact float32 values under the same keys less the scales)."""
    stored, exact = {}, {}
    for k, v in sorted(tensors.items()):
        if k.endswith("tid2eid"):
            stored[k] = exact[k] = v.to(torch.int32)
        elif FLOAT32.search(k):
            stored[k] = exact[k] = v.float()
        elif form == "fp8" and (FP8_MATRIX.search(k) or ROUTED.search(k)):
            codes, scale, value = (mxfp4 if ROUTED.search(k) else fp8_block)(v.float())
            stored[k], stored[k[: -len(".weight")] + ".scale"], exact[k] = codes, scale, value
        else:
            stored[k] = v.to(torch.bfloat16)
            exact[k] = stored[k].float()
    return stored, exact


def release_config(form: str) -> dict:
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_act": "silu",
              "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "rope_theta": 10000,
              "compress_rope_theta": 160000, "rope_scaling": None, "attention_bias": False,
              "torch_dtype": "float32" if form == "float32" else "bfloat16", **{k: CONFIG[k] for k in RELEASE_KEYS}}
    if form == "fp8":
        config.update(expert_dtype="fp4", quantization_config=dict(FP8_LAYOUT))
    return config


def write(folder: Path, tensors: Dict[str, torch.Tensor], config: dict) -> None:
    """The release as the Hub has it: the backbone in the first shard, the head alone in the last, the index, config,
    generation config and a tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards = ([k for k in tensors if not k.startswith("mtp.")], [k for k in tensors if k.startswith("mtp.")])
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                    indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 1}))
    write_tokenizer(folder, MarkovLanguage().words, VOCAB)


def build(folder: Path, *, form: str = "bf16", seed: int = 0) -> Built:
    """A tiny raw deepseek_v4 release (module doc); ``form`` "bf16" or "fp8"."""
    model = _model(CONFIG["num_hidden_layers"], CONFIG["compress_ratios"], CONFIG["num_hash_layers"], seed)
    tensors = _saved(model, folder.parent / f".{folder.name}.save")
    tensors.update(_head(folder.parent / f".{folder.name}.head", seed + 7))
    stored, exact = _stored(tensors, form)
    write(folder, stored, release_config(form))
    reference = folder
    if form == "fp8":
        reference = folder.parent / f"{folder.name}-dequantized"
        write(reference, exact, release_config("float32"))
    return Built(folder, stored, reference)


# --- float32 references from transformers' own classes ------------------------------------------------------------


def transformers_model(folder: Path):
    """A float release (or a reference folder) loaded by transformers' own class in float32; it drops ``mtp.*``."""
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def reference_logits(folder: Path, ids) -> np.ndarray:
    """transformers' float32 logits [L, V] of a float release over ``ids`` (one whole pass)."""
    with torch.no_grad():
        return transformers_model(folder)(torch.tensor([list(ids)])).logits[0].numpy()


def head_model(folder: Path, scratch: Path):
    """(the head's block, hc_head and norm as a one-layer ``DeepseekV4ForCausalLM`` transformers loads from the head's
    tensors -- with the backbone's embed and head --, its e_proj / h_proj / enorm / hnorm tensors)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(folder).glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    head = {k[len("mtp.0."):]: v.float() for k, v in tensors.items() if k.startswith("mtp.0.")}
    own = {k: head.pop(k + ".weight") for k in ("e_proj", "h_proj", "enorm", "hnorm")}
    layer = {("layers.0." + k if not k.startswith(("hc_head_", "norm.")) else k): v for k, v in head.items()}
    layer.update({k: tensors[k].float() for k in ("embed.weight", "head.weight")})
    config = release_config("float32")
    config.update(num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0)
    write(scratch, layer, config)
    return transformers_model(scratch), own


def reference_head_logits(folder: Path, ids, scratch: Path) -> np.ndarray:
    """The head's float32 logits [L-1, V] for positions 0..L-2 (token t+2 from the backbone's hc streams at t and
    token t+1), composed of transformers' modules as DeepSeek's MTPBlock computes."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    target, (head, own) = transformers_model(folder), head_model(folder, scratch)
    captured = {}
    target.model.hc_head.register_forward_hook(lambda m, args, out: captured.__setitem__("streams", args[0]))
    eps = target.config.rms_norm_eps
    rms = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    with torch.no_grad():
        target(torch.tensor([list(ids)]))
        streams, next_ids = captured["streams"][:, :-1], torch.tensor([list(ids[1:])])
        e = rms(target.model.embed_tokens(next_ids), own["enorm"]) @ own["e_proj"].T
        x = e[:, :, None, :] + rms(streams, own["hnorm"]) @ own["h_proj"].T
        positions = torch.arange(x.shape[1])[None]
        first = x[:, :, 0, :]
        mask = create_sliding_window_causal_mask(config=head.config, inputs_embeds=first, attention_mask=None,
                                                 cache=None, position_ids=positions)
        rotary = {kind: head.model.rotary_emb(first, position_ids=positions, layer_type=kind)
                  for kind in ("main", "compress")}
        y = head.model.layers[0](x, position_embeddings=rotary, position_ids=positions, attention_mask=mask,
                                 input_ids=next_ids)
        return target.lm_head(head.model.norm(head.model.hc_head(y)))[0].numpy()


def reference_streams(folder: Path, ids) -> Optional[np.ndarray]:
    """The backbone's hc streams [L, hc, H] before its hc_head, float32 (what the head reads)."""
    target, captured = transformers_model(folder), {}
    target.model.hc_head.register_forward_hook(lambda m, args, out: captured.__setitem__("streams", args[0]))
    with torch.no_grad():
        target(torch.tensor([list(ids)]))
    return captured["streams"][0].numpy()
