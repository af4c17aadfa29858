"""Tiny raw Nemotron-H checkpoints in the release layout, made with transformers' own ``NemotronHForCausalLM`` (5.24)
plus an MTP head, and their NVIDIA ModelOpt FP8 / NVFP4 twins.

The backbone is transformers' ``save_pretrained`` (``backbone.*``, per-expert ``mixer.experts.{e}.{up,down}_proj``,
``[C, 1, K]`` conv1d); the head is ``mtp.layers.{j}.*`` in the pattern's block kinds with ``enorm`` / ``hnorm`` /
``eh_proj`` on block 0 and ``final_layernorm`` on the last, alone in the last shard (the layout every consumer reads:
``/work/shared/layouts/Nemotron-H-MTP/README.md``). Every tensor is random around its kind's scale (norm gains
around 1, the router's bias around 0), so a dropped, shifted, swapped or reordered tensor moves the logits.

The ModelOpt containers follow what the consumers read (mlx-vlm's ``quantization/checkpoint.py``, vLLM's ModelOpt
loader): per-tensor FP8 ``X.weight`` F8_E4M3 + ``X.weight_scale`` F32 [] + ``X.input_scale`` F32 [], FP8 KV-cache
``k_proj.k_scale`` / ``v_proj.v_scale``; NVFP4 ``X.weight`` U8 [N, K/2] (two E2M1 codes a byte, low nibble first) +
``X.weight_scale`` F8_E4M3 [N, K/16] + ``X.weight_scale_2`` F32 []; ``quantization_config`` of ``quant_method``
modelopt in config.json and ``hf_quant_config.json``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch

from tests.checkpoints import VOCAB, Built, _saved, _write_release

NEMOTRON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
                max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LEGACY_NAMES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
KEEP_F32 = ("e_score_correction_bias",)  # stored F32 in the releases; every other tensor in the release dtype


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm gains and D around 1, dt_bias and the router bias around 0, matrices scaled by their fan-in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)


def random_head(config: dict, seed: int) -> Dict[str, np.ndarray]:
    """The head's tensors in the release's raw names, from the family's own slot table (per-expert experts)."""
    from mtpconvert.families.nemotron_h import FAMILY, model_spec

    rng = np.random.default_rng(seed)
    out = {}
    for name, slot in FAMILY.expected_slots(model_spec(config), 1).items():
        if slot.group != "mtp":
            continue
        if slot.kind == "norm":
            w = 1 + 0.2 * rng.standard_normal(slot.shape)
        elif len(slot.shape) == 1:
            w = 0.1 * rng.standard_normal(slot.shape)
        else:
            w = rng.standard_normal(slot.shape) / max(slot.shape[-1], 1) ** 0.5
        w = w.astype(np.float32)
        if m := re.match(r"^(.+\.mixer)\.switch_mlp\.(fc1|fc2)\.weight$", name):
            proj = {"fc1": "up_proj", "fc2": "down_proj"}[m[2]]
            out.update({f"{m[1]}.experts.{e}.{proj}.weight": w[e] for e in range(w.shape[0])})
        else:
            out[name] = w
    return out


def build_nemotron(folder: Path, *, pattern: str = "M*ME-E", mtp_pattern: str = "*E", dtype: str = "bfloat16",
                   seed: int = 0, shards: int = 2, config_style: str = "release", mtp: bool = True) -> Built:
    """A raw release: ``config_style`` ``release`` (Super's pattern strings), ``ultra`` (Ultra's legacy
    ``layers_block_type`` / ``mtp_layers_block_type`` lists) or ``transformers`` (what ``save_pretrained`` writes:
    transformers 5 block names, no pattern strings). The torch model holds the weights as stored."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    cfg = NemotronHConfig(**NEMOTRON, hybrid_override_pattern=pattern, num_nextn_predict_layers=int(mtp),
                          mtp_hybrid_override_pattern=mtp_pattern)
    model = NemotronHForCausalLM(cfg).float().eval()
    _randomise(model, seed)
    config, raw = _saved(model, folder)
    if config_style != "transformers":
        config.pop("layers_block_type", None)
        config.pop("mtp_layers_block_type", None)
    if config_style == "release":
        config.update(hybrid_override_pattern=pattern, mtp_hybrid_override_pattern=mtp_pattern)
    elif config_style == "ultra":
        config.update(layers_block_type=[LEGACY_NAMES[c] for c in pattern],
                      mtp_layers_block_type=[LEGACY_NAMES[c] for c in mtp_pattern])
    config.update(num_hidden_layers=len(pattern), num_nextn_predict_layers=int(mtp), dtype=dtype)
    head = random_head(config, seed + 7) if mtp else {}
    everything = _write_release(folder, raw, head, config, shards, dtype, keep_f32=lambda k: k.endswith(KEEP_F32))
    with torch.no_grad():  # the reference holds what was stored (the router bias is a buffer, stored F32)
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).to(torch.float32))
    return Built(folder, model, everything)


# ------------------------------------------------------------------ NVIDIA ModelOpt twins

LINEAR = re.compile(r"\.(in_proj|out_proj|[qkvo]_proj|up_proj|down_proj|fc[12]_latent_proj)\.weight$")


def _fp8(w: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Per-tensor FP8 as ModelOpt stores it: codes of w / s, s = amax / 448; and the exact value e4m3(q) * s."""
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    s = (t.abs().max() / 448.0).float()
    q = (t / s).to(torch.float8_e4m3fn)
    return q, s.reshape(()), (q.float() * s).numpy()


def _nvfp4(w: np.ndarray):
    """NVFP4: E2M1 codes (low nibble = even column), E4M3 scales per 16 columns, one F32 scale per tensor."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    n, k = t.shape
    ws2 = (t.abs().max() / (6.0 * 448.0)).float()
    blocks = t.reshape(n, k // 16, 16)
    bs = (blocks.abs().amax(-1) / 6.0 / ws2).to(torch.float8_e4m3fn)
    scale = bs.float() * ws2
    x = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    mag = (x.abs()[..., None] - e2m1).abs().argmin(-1)
    code = (mag | ((x < 0).long() << 3)).reshape(n, k).to(torch.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8), bs, ws2.reshape(())


def modelopt_twin(raw: Path, out: Path, algo: str = "FP8", head: bool = False) -> Dict[str, np.ndarray]:
    """``raw``'s ModelOpt twin in ``out``: ``FP8`` quantizes every Linear of the backbone (and of the head with
    ``head``) per tensor with its activation and KV-cache scales; ``NVFP4`` stores the routed experts in NVFP4 and
    the rest of the Linears in FP8 (ModelOpt's MIXED_PRECISION). Returns the exact float value of every FP8 weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(raw, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    exact = {}
    for file in sorted(set(index["weight_map"].values())):
        stored = load_file(str(out / file))
        written = {}
        for key, t in stored.items():
            module = key[: -len(".weight")]
            if not LINEAR.search(key) or (key.startswith("mtp.") and not head):
                written[key] = t
                continue
            if algo == "NVFP4" and ".experts." in key and ".shared_experts." not in key:
                written[key], written[module + ".weight_scale"], written[module + ".weight_scale_2"] = _nvfp4(
                    t.float().numpy())
            else:
                written[key], written[module + ".weight_scale"], exact[key] = _fp8(t.float().numpy())
            written[module + ".input_scale"] = torch.tensor(0.02)
            if key.endswith(("k_proj.weight", "v_proj.weight")):
                kv = key.split(".")[-2][0]
                written[f"{module}.{kv}_scale"] = torch.tensor(1.0)
        save_file(written, str(out / file), metadata={"format": "pt"})
        index["weight_map"].update({k: file for k in written})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    quant = {"quant_method": "modelopt", "quant_algo": "FP8" if algo == "FP8" else "MIXED_PRECISION",
             "kv_cache_quant_algo": "FP8"}
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    return exact
