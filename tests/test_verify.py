"""verify: each kind of broken folder gets its own finding code."""

import json
import shutil

import mlx.core as mx
import pytest

from mtpconvert.execute import execute
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.reader import read_all
from mtpconvert.io.shard_writer import write_all
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.verify import verify


@pytest.fixture(scope="module")
def converted(raw_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    out = {}
    for layout, quant in [("moe-published35", dict(bits=4)), ("dense-vlm", dict())]:
        ckpt = open_checkpoint(raw_checkpoints(layout).path)
        execute(build_plan(ckpt, ConvertOptions(quant=QuantOptions(**quant))), ckpt, root / layout)
        out[layout] = root / layout
    return out


def copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def rewrite(folder, fn):
    """Apply fn(dict) to every tensor of a single-shard MLX folder and its MTP sidecar, under canonical
    names (the sidecar's mtp.X is seen as language_model.mtp.X), keeping index, sidecar and config in sync."""
    (shard,) = sorted(folder.glob("model-*.safetensors"))
    sidecar = folder / "mtp.safetensors"
    tensors = read_all(shard)
    if sidecar.exists():
        tensors.update({"language_model." + k: v for k, v in read_all(sidecar).items()})
    tensors = fn(tensors)
    head = {k[len("language_model."):]: v for k, v in tensors.items() if k.startswith("language_model.mtp.")}
    if sidecar.exists():
        tensors = {k: v for k, v in tensors.items() if not k.startswith("language_model.mtp.")}
        shutil.rmtree(folder / "mtp")
        sidecar.unlink()
        cfg = json.loads((folder / "config.json").read_text())
        if head:
            write_all(sidecar, head, {"format": "mlx"})
            cfg["mlx_lm_extra_tensors"]["mtp_tensor_count"] = len(head)
        else:
            cfg.pop("mlx_lm_extra_tensors")
        (folder / "config.json").write_text(json.dumps(cfg))
    write_all(shard, tensors, {"format": "mlx"})
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: shard.name for k in sorted(tensors)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))


def codes(folder):
    return {f.code for f in verify(folder).findings if f.severity == "error"}


def test_good_folders_pass(converted, raw_checkpoints):
    for folder in converted.values():
        report = verify(folder)
        assert report.ok, report.findings
        assert report.mtp_complete and report.norms["backbone"] == "shifted"
    raw = verify(raw_checkpoints("moe-published35").path)
    assert raw.ok and raw.layout == "raw-vlm" and raw.norms["mtp"] == "zero-centred"


def test_missing_mtp_weights(converted, tmp_path):
    f = copy(converted["dense-vlm"], tmp_path)
    rewrite(f, lambda t: {k: v for k, v in t.items() if ".mtp." not in k})
    assert codes(f) == {"mtp-missing"}


def test_missing_expert_and_unstacked_mtp(converted, tmp_path):
    f = copy(converted["moe-published35"], tmp_path)
    key = "language_model.mtp.layers.0.mlp.switch_mlp.gate_proj"

    def unstack(t):
        t = dict(t)
        w = mx.dequantize(t.pop(key + ".weight"), t.pop(key + ".scales"), t.pop(key + ".biases"), 64, 4) \
            if key + ".scales" in t else t.pop(key + ".weight")
        for e in range(w.shape[0]):
            if e != 2:
                t[f"language_model.mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = w[e]
        return t

    rewrite(f, unstack)
    assert codes(f) == {"expert-missing"}
    findings = verify(f).findings
    bad = [x for x in findings if x.code == "expert-missing"]
    assert bad[0].key == "mtp.layers.0.mlp.experts.2.gate_proj.weight"
    # per-expert head experts are the mlx-lm PR #990 form: reported, not an error (the table says who reads it)
    assert any(x.code == "mtp-moe-per-expert" and x.severity == "info" for x in findings)


def test_double_shifted_norm(converted, tmp_path):
    f = copy(converted["dense-vlm"], tmp_path)
    rewrite(f, lambda t: {k: (v + 1 if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight",
                                                      "q_norm.weight", "k_norm.weight")) else v)
                          for k, v in t.items()})
    assert codes(f) == {"norm-double-shift"}


def test_unshifted_norm(converted, tmp_path):
    f = copy(converted["dense-vlm"], tmp_path)
    rewrite(f, lambda t: {k: (v - 1 if ".mtp." in k and k.endswith("norm.weight") and "linear_attn" not in k else v)
                          for k, v in t.items()})
    assert codes(f) == {"norm-unshifted"}


def test_quantized_mtp_fc(converted, tmp_path):
    f = copy(converted["dense-vlm"], tmp_path)

    def quantize_fc(t):
        t = dict(t)
        w, s, b = mx.quantize(t.pop("language_model.mtp.fc.weight"), group_size=64, bits=4)
        t.update({"language_model.mtp.fc.weight": w, "language_model.mtp.fc.scales": s,
                  "language_model.mtp.fc.biases": b})
        return t

    rewrite(f, quantize_fc)
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    (f / "config.json").write_text(json.dumps(cfg))
    found = codes(f)
    assert "mtp-fc-quantized" in found


def test_quant_block_disagrees(converted, tmp_path):
    f = copy(converted["moe-published35"], tmp_path)
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization"]["bits"] = 8
    (f / "config.json").write_text(json.dumps(cfg))
    assert codes(f) == {"quant-config-mismatch"}
    cfg["quantization"]["bits"] = 4
    cfg["quantization"]["language_model.model.layers.0.mlp.gate"] = False
    (f / "config.json").write_text(json.dumps(cfg))
    assert codes(f) == {"quant-config-mismatch"}


def test_shard_listed_but_absent(converted, tmp_path):
    f = copy(converted["dense-vlm"], tmp_path)
    idx = json.loads((f / "model.safetensors.index.json").read_text())
    first = next(iter(idx["weight_map"]))
    idx["weight_map"][first] = "model-00009-of-00009.safetensors"
    (f / "model.safetensors.index.json").write_text(json.dumps(idx))
    report = verify(f)
    assert not report.ok and [x.code for x in report.findings] == ["shard-missing"]


def test_stock_mlx_convert_style_folder(converted, tmp_path):
    """What stock mlx_lm.convert leaves: config says MTP, weights have none."""
    f = copy(converted["moe-published35"], tmp_path)
    rewrite(f, lambda t: {k: v for k, v in t.items() if ".mtp." not in k})
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization"] = {k: v for k, v in cfg["quantization"].items() if not k.startswith(("mtp.", "language_model.mtp."))}
    (f / "config.json").write_text(json.dumps(cfg))
    assert codes(f) == {"mtp-missing"}
