"""The fused-expert FP8 form transformers 5 writes: a tiny Qwen3.5-MoE quantized with transformers' own FP8 modules
(``FP8Experts``: ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I] in F8_E4M3, each with its
``..._scale_inv`` [E, ceil(rows / 128), ceil(cols / 128)], float32 or E8M0) and saved by ``save_pretrained(...,
save_original_format=False)`` converts exactly: byte for byte what its independent dequantization converts to. The
default save (``save_original_format=True``) splits the FP8 weights per expert but leaves their scales fused; that
form is refused naming the weight."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mtpconvert import api
from mtpconvert.gate import Gate
from mtpconvert.options import ConvertOptions, QuantOptions
from tests.checkpoints import VOCAB, _randomise, tree_digest

TEXT = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, full_attention_interval=2,
            layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=128, patch_size=8,
              spatial_merge_size=2, temporal_patch_size=2)
FUSED = ("gate_up_proj", "down_proj")
NO_CHECKS = Gate(verify=True, smoke=False)
OPTIONS = {"float32": ConvertOptions(dtype="float32"),
           "q4": ConvertOptions(dtype="bfloat16", quant=QuantOptions(bits=4, group_size=32))}


def _fp8_model(scale_fmt: str, seed: int = 0):
    """(the model with its experts as transformers' FP8Experts, filled by transformers' own FP8 quantizer; the
    quantization config)."""
    from transformers import FineGrainedFP8Config, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, Fp8Quantize, replace_with_fp8_linear

    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)).eval()
    _randomise(model, seed)
    floats = copy.deepcopy(model)
    quant = FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt=scale_fmt)
    replace_with_fp8_linear(model, quantization_config=quant, pre_quantized=True)
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": quant})())
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8Experts):
            for proj in FUSED:
                key = f"{name}.{proj}"
                out = quantize._quantize_one(key, floats.get_parameter(key).detach())
                setattr(module, proj, torch.nn.Parameter(out[key], requires_grad=False))
                setattr(module, proj + "_scale_inv", torch.nn.Parameter(out[key + "_scale_inv"], requires_grad=False))
        elif isinstance(module, FP8Linear):  # only the experts are FP8 here
            model.set_submodule(name, floats.get_submodule(name))
    model.config.quantization_config = quant
    return model


def _dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(codes) * scale over each 128x128 block of the last two axes, in float32 (the formats' definition)."""
    rows, cols = codes.shape[-2:]
    grid = scale.to(torch.float32).repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    return codes.to(torch.float32) * grid


def _release(folder: Path, scale_fmt: str, original_format: bool = False) -> Path:
    model = _fp8_model(scale_fmt)
    model.save_pretrained(folder, save_original_format=original_format)
    return folder


def _twin(fp8: Path, folder: Path) -> Path:
    """The release with every fused FP8 tensor replaced by its dequantization (float32) and no scales."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    (shard,) = fp8.glob("*.safetensors")
    tensors = load_file(str(shard))
    out = {}
    for key, value in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        out[key] = _dequantized(value, tensors[key + "_scale_inv"]) if key + "_scale_inv" in tensors else value
    save_file(out, str(folder / shard.name), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(fp8 / "generation_config.json", folder)
    return folder


@pytest.fixture(scope="module", params=["float", "ue8m0"])
def releases(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fused-fp8-{request.param}")
    fp8 = _release(root / "fp8", request.param)
    return fp8, _twin(fp8, root / "dequantized"), request.param


def test_transformers_writes_the_fused_form(releases):
    from mtpconvert.io.header import read_header

    fp8, _, scale_fmt = releases
    (shard,) = fp8.glob("*.safetensors")
    tensors = read_header(shard).tensors
    fused = {k: t for k, t in tensors.items() if k.endswith(FUSED) or k.endswith(tuple(p + "_scale_inv" for p in FUSED))}
    assert len(fused) == 4 * TEXT["num_hidden_layers"] and not any(".experts.0." in k for k in tensors)
    E, I, H = TEXT["num_experts"], TEXT["moe_intermediate_size"], TEXT["hidden_size"]
    for key, t in fused.items():
        rows, cols = (2 * I, H) if "gate_up" in key else (H, I)
        want = (E, rows, cols) if key.endswith(FUSED) else (E, math.ceil(rows / 128), math.ceil(cols / 128))
        dtype = "F8_E4M3" if key.endswith(FUSED) else {"float": "F32", "ue8m0": "F8_E8M0"}[scale_fmt]
        assert t.shape == want and t.dtype == dtype, key


@pytest.mark.parametrize("option", list(OPTIONS))
def test_the_fused_fp8_release_converts_to_what_its_dequantization_converts_to(releases, tmp_path, option):
    fp8, twin, _ = releases
    plan = api.plan(fp8, OPTIONS[option])
    scaled = [it for it in plan.items if it.sources[0].scale is not None]
    assert scaled and all(it.sources[0].scale.key.endswith(FUSED[0] + "_scale_inv") for it in scaled
                          if "gate_proj" in it.name or "up_proj" in it.name)
    a = api.convert(fp8, tmp_path / "fp8", OPTIONS[option], checks=NO_CHECKS).out
    b = api.convert(twin, tmp_path / "twin", OPTIONS[option], checks=NO_CHECKS).out
    index = "model.safetensors.index.json"  # its metadata records the source folder's name
    assert {k: v for k, v in tree_digest(a).items() if k != index} == {k: v for k, v in tree_digest(b).items()
                                                                        if k != index}


def test_the_default_save_with_its_scales_fused_apart_from_its_weights_is_refused(tmp_path, capsys):
    """save_original_format=True splits the F8_E4M3 experts per expert and leaves their scales fused: no weight has its
    own scale, and the first such weight is named."""
    from mtpconvert.cli import run

    folder = _release(tmp_path / "hybrid", "float", original_format=True)
    code = run(["convert", str(folder), str(tmp_path / "out"), "--no-smoke"])
    err = capsys.readouterr().err
    assert code == 2 and "F8_E4M3 weight without its scale" in err and ".mlp.experts.0." in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
