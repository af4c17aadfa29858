"""Where the MTP head is written (--mtp-layout), and that every layout reads back alike.

The default (sidecar) layout is the one every MTP runtime takes (docs/interop.md): no ``mtp.``
key in a ``model*.safetensors`` file or the index, because mlx-lm 0.30.7-0.31.x shifts every
backbone norm again when it loads one; the head in a root ``mtp.safetensors`` under ``mtp.*``
names, linked where vllm-mlx looks, with the manifest that makes vllm-mlx take its norms as
stored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tests.checkpoints import convert_folder
from typer.testing import CliRunner

from mtpconvert.cli import app
from mtpconvert.fixture import fixture_path
from mtpconvert.io.header import read_header
from mtpconvert.verify import verify


def _keys(path: Path):
    return set(read_header(path).tensors)


def _model_shard_keys(folder: Path):
    return {k for f in folder.glob("model*.safetensors") for k in _keys(f)}


def test_sidecar_layout_keeps_mtp_keys_out_of_the_model_shards(raw_checkpoints, tmp_path):
    out = tmp_path / "out"
    convert_folder(raw_checkpoints("moe-published35").path, out, dtype="float32", bits=4, mtp_bits=8)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if "mtp." in k]
    assert not [k for k in _model_shard_keys(out) if "mtp." in k]
    assert set(index["weight_map"].values()) == {f.name for f in out.glob("model*.safetensors")}

    head = read_header(out / "mtp.safetensors")
    assert head.tensors and all(k.startswith("mtp.") for k in head.tensors)
    assert "mtp.layers.0.mlp.switch_mlp.gate_proj.weight" in head.tensors  # stacked: what mlx-vlm/mtplx build
    assert head.metadata == {"format": "mlx"}
    assert os.path.samefile(out / "mtp.safetensors", out / "mtp" / "weights.safetensors")
    assert json.loads((out / "mtp" / "manifest.json").read_text()) == {
        "artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma"}

    config = json.loads((out / "config.json").read_text())
    assert config["mlx_lm_extra_tensors"] == {"mtp_file": "mtp.safetensors", "mtp_tensor_count": len(head.tensors)}
    assert config["text_config"]["mtp_hidden_state_mode"] == "post_norm"
    q = config["quantization"]
    assert q["mtp.layers.0.self_attn.q_proj"] == {"bits": 8, "group_size": 64, "mode": "affine"}
    assert q["mtp.fc"] is False
    assert not [k for k in q if k.startswith("language_model.mtp.")]
    report = verify(out)
    assert report.ok and report.mtp_complete, report.findings


def test_in_model_layout_writes_a_float_moe_head_in_the_raw_expert_form(raw_checkpoints, tmp_path):
    """The mlx-lm PR #990 branch stacks the head's experts itself and raises on a stacked head."""
    for layout, expect in [("moe-published35", "experts.3.gate_proj.weight"), ("moe-fused", "experts.gate_up_proj")]:
        out = tmp_path / layout
        convert_folder(raw_checkpoints(layout).path, out, dtype="float32", bits=4, mtp_layout="in-model")
        keys = _model_shard_keys(out)
        assert "language_model.mtp.layers.0.mlp." + expect in keys
        assert not [k for k in keys if ".mtp." in k and ".switch_mlp." in k]
        assert not (out / "mtp.safetensors").exists() and not (out / "mtp").exists()
        config = json.loads((out / "config.json").read_text())
        assert "mlx_lm_extra_tensors" not in config
        # the loader's module is the stacked one: the entry must keep it unquantized
        assert config["quantization"]["language_model.mtp.layers.0.mlp.switch_mlp.gate_proj"] is False
        report = verify(out)
        assert report.ok and report.mtp_complete, report.findings


def test_in_model_layout_keeps_a_quantized_moe_head_stacked(raw_checkpoints, tmp_path):
    out = tmp_path / "out"
    convert_folder(raw_checkpoints("moe-published35").path, out, dtype="float32", bits=4, mtp="match",
                   mtp_layout="in-model")
    keys = _model_shard_keys(out)
    assert "language_model.mtp.layers.0.mlp.switch_mlp.gate_proj.scales" in keys
    assert verify(out).ok


def _head_params(folder: Path) -> dict:
    from mlx.utils import tree_flatten

    from mtpconvert.runtime.decoding.load import load

    return {k: np.array(v) for k, v in tree_flatten(load(folder).head.parameters())}


def test_every_layout_loads_the_same_head(raw_checkpoints, tmp_path):
    for name in ("moe-published35", "moe-fused"):
        src = raw_checkpoints(name).path
        heads = []
        for layout in ("sidecar", "in-model"):
            out = tmp_path / f"{name}-{layout}"
            convert_folder(src, out, dtype="float32", mtp_layout=layout)
            heads.append(_head_params(out))
        sidecar, in_model = heads
        assert sidecar.keys() == in_model.keys()
        for k in sidecar:
            np.testing.assert_array_equal(sidecar[k], in_model[k], err_msg=f"{name}: {k}")


def test_a_converted_folder_converts_again_without_a_second_shift(raw_checkpoints, tmp_path):
    """An MLX folder in either layout as the source: its norms (backbone and head) are taken as stored."""
    first = tmp_path / "first"
    convert_folder(raw_checkpoints("dense-vlm").path, first, dtype="float32")
    for layout in ("sidecar", "in-model"):
        again = tmp_path / f"again-{layout}"
        plan = convert_folder(first, again, dtype="float32", mtp_layout=layout)
        assert not plan.raw and plan.mtp_layers == 1
        norm = "mtp.norm.weight"
        stored = mx.load(str(first / "mtp.safetensors"))[norm]
        head_file = again / "mtp.safetensors" if layout == "sidecar" else next(again.glob("model-*.safetensors"))
        key = norm if layout == "sidecar" else "language_model." + norm
        np.testing.assert_array_equal(np.array(mx.load(str(head_file))[key]), np.array(stored))
        report = verify(again)
        assert report.ok and report.norms == {"backbone": "shifted", "mtp": "shifted"}, report.findings


def test_add_mtp_writes_the_sidecar_onto_a_stock_mlx_lm_folder(tmp_path):
    from mlx_lm import convert as mlx_lm_convert

    folder = tmp_path / "mlx-lm-4bit"
    mlx_lm_convert(str(fixture_path("dense")), mlx_path=str(folder), quantize=True, q_bits=4, q_group_size=32)
    index_before = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    result = CliRunner().invoke(app, ["add-mtp", str(fixture_path("dense")), str(folder), "--no-smoke"])
    assert result.exit_code == 0, result.output
    assert json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"] == index_before
    assert not [k for k in _model_shard_keys(folder) if "mtp." in k]
    assert all(k.startswith("mtp.") for k in _keys(folder / "mtp.safetensors"))
    assert os.path.samefile(folder / "mtp.safetensors", folder / "mtp" / "weights.safetensors")
    assert (folder / "mtp" / "manifest.json").is_file()
    assert verify(folder).ok and verify(folder).mtp_complete


def test_add_mtp_in_model_lists_the_head_shard_in_the_index(tmp_path):
    from mlx_lm import convert as mlx_lm_convert

    folder = tmp_path / "mlx-lm-4bit"
    mlx_lm_convert(str(fixture_path("dense")), mlx_path=str(folder), quantize=True, q_bits=4, q_group_size=32)
    result = CliRunner().invoke(app, ["add-mtp", str(fixture_path("dense")), str(folder), "--no-smoke",
                                      "--mtp-layout", "in-model"])
    assert result.exit_code == 0, result.output
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["language_model.mtp.fc.weight"] == "model-mtp.safetensors"
    assert not (folder / "mtp.safetensors").exists()
    assert verify(folder).ok and verify(folder).mtp_complete


def test_a_config_naming_a_missing_mtp_file_is_refused(tmp_path):
    from mtpconvert.errors import LayoutError
    from mtpconvert.io.checkpoint import open_checkpoint

    out = tmp_path / "out"
    convert_folder(fixture_path("dense"), out, dtype="float32")
    (out / "mtp" / "weights.safetensors").unlink()
    (out / "mtp.safetensors").unlink()
    with pytest.raises(LayoutError, match="mtp_file"):
        open_checkpoint(out)


def test_unknown_mtp_layout_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(fixture_path("dense")), str(tmp_path / "o"), "--mtp-layout",
                                      "beside"])
    assert result.exit_code == 2 and "--mtp-layout" in result.output
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ mtp/ as a drafter folder (--draft-model OUT/mtp)


def test_mtp_folder_is_a_drafter_with_the_models_own_config(tmp_path):
    """mtp/ holds the model's config beside weights.safetensors: mlx-vlm's splitter for that model type reads the head
    there as written (format mlx). The table says so, and says why when the config is not the model's."""
    import json

    from mtpconvert.compat import check_folder
    from mtpconvert.verify import verify

    out = tmp_path / "o"
    convert_folder(fixture_path("dense"), out, dtype="float32")
    assert (out / "mtp" / "config.json").read_bytes() == (out / "config.json").read_bytes()
    row = check_folder(out).get("mlx-vlm-drafter")
    assert row.backbone_exact.ok and row.head_usable.ok, row
    assert verify(out / "mtp").layout == "head-only" and verify(out / "mtp").ok

    config = json.loads((out / "mtp" / "config.json").read_text())
    config["model_type"] = "qwen3_5_mtp"  # mlx-vlm's own drafter type: its sanitize would shift the norms again
    (out / "mtp" / "config.json").write_text(json.dumps(config))
    row = check_folder(out).get("mlx-vlm-drafter")
    assert not row.head_usable.ok and "second time" in row.head_usable.reason
    report = verify(out)
    assert report.ok and "drafter-config" in {f.code for f in report.findings}  # a warning: this route only
    assert check_folder(out).get("mlx-vlm").head_usable.ok  # the model folder's own route is unaffected
