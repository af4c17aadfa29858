"""verify on the folder shapes other converters publish (issue #30 item 4): no crash, the right exit, the
right runtime rows, and a finding that says what is missing for which runtime and the command that fixes it."""

import pytest

from tests.competitor_shapes import (MLX_VLM_VENV, mlx_lm_headless, mlx_vlm_pair, mtplx_optimized, omlx_imported,
                               vllm_mlx_add_mtp_weights, vllm_mlx_extracted)
from mtpconvert.verify import verify


def rows(report):
    return {r.runtime: (r.backbone_exact.ok, r.head_usable.ok) for r in report.runtimes}


def finding(report, code):
    (f,) = [f for f in report.findings if f.code == code]
    return f


needs_mlx_vlm = pytest.mark.skipif(not (MLX_VLM_VENV / "bin" / "python").exists(), reason="mlx-vlm 0.7.10 venv absent")


@needs_mlx_vlm
@pytest.mark.parametrize("quantize", [False, True])
def test_mlx_vlm_drafter_and_its_target(tmp_path, quantize):
    out = mlx_vlm_pair(tmp_path / "vlm", quantize=quantize)
    drafter = verify(tmp_path / "vlm-mtp")
    assert drafter.layout == "head-only" and drafter.mtp_layout == "drafter" and drafter.mtp_complete
    assert drafter.model_type.startswith("qwen3_5_mtp") and drafter.norms == {"mtp": "shifted"}
    f = finding(drafter, "mlx-vlm-drafter")
    assert f.severity == "info" and "--draft-model" in f.message and str(out) in f.message and "add-mtp" in f.message
    r = rows(drafter)
    assert r["mlx-vlm"] == (None, True) and r["vllm-mlx"] == (None, False) and r["mtplx"] == (None, False)
    # mlx-vlm quantizes the drafter's fc; verify keeps its rule (fc mixes embedding and hidden state)
    assert {x.code for x in drafter.findings if x.severity == "error"} == ({"mtp-fc-quantized"} if quantize else set())
    target = verify(out)
    assert not target.ok and target.mtp_layout == "none"
    msg = finding(target, "mtp-missing").message
    assert "mtpconvert add-mtp" in msg and "vlm-mtp" in msg and "--draft-model" in msg
    assert not any(ok for _, ok in rows(target).values())


def test_mlx_community_headless(tmp_path):
    report = verify(mlx_lm_headless(tmp_path / "mlxc"))
    assert not report.ok and {f.code for f in report.findings if f.severity == "error"} == {"mtp-missing"}
    assert "mtpconvert add-mtp" in finding(report, "mtp-missing").message
    assert report.mtp_layout == "none" and not any(ok for _, ok in rows(report).values())


def test_mtplx_optimized_sidecar(tmp_path):
    report = verify(mtplx_optimized(tmp_path / "m"))
    assert report.ok and report.mtp_layout == "sidecar" and report.mtp_complete
    r = rows(report)
    assert r["mtplx"][1] and r["mlx-vlm"][1] and r["rapid-mlx"][1] and r["vllm-mlx"][1] is False
    assert "vllm-mlx" in finding(report, "runtime-gaps").message


def test_omlx_imported_model_mtp_shard(tmp_path):
    report = verify(omlx_imported(tmp_path / "o"))
    assert report.ok and report.mtp_layout == "sidecar:model-mtp.safetensors" and report.mtp_complete
    r = rows(report)
    assert r["mlx-vlm"][1] is False and r["rapid-mlx"][1] is False and r["mlx-lm-pr990"] == (True, True)
    assert r["mlx-lm<0.32"][0] is False  # model*.safetensors with mtp. keys: the second norm shift
    assert "mlx-vlm" in finding(report, "runtime-gaps").message


def test_vllm_mlx_add_mtp_weights(tmp_path):
    report = verify(vllm_mlx_add_mtp_weights(tmp_path / "v"))
    assert report.ok and report.mtp_complete and report.mtp_layout == "sidecar:model-mtp.safetensors"
    assert finding(report, "head-file").severity == "info"
    r = rows(report)
    assert r["vllm-mlx"] == (False, True) and r["mtplx"] == (False, True) and r["rapid-mlx"] == (True, True)
    assert "backbone" in finding(report, "runtime-gaps").message


def test_vllm_mlx_extracted(tmp_path):
    report = verify(vllm_mlx_extracted(tmp_path / "e"))
    assert report.ok and report.mtp_complete and report.mtp_layout == "sidecar:mtp/weights.safetensors"
    r = rows(report)
    assert r["vllm-mlx"] == (True, True) and r["mlx-vlm"][1] is False and r["rapid-mlx"][1] is False
    assert "rapid-mlx" in finding(report, "runtime-gaps").message
