"""The folder shapes other converters publish, built from the tiny fixture (issue #30 item 4).

Real tool where it installs here (mlx-vlm 0.7.10's ``convert --mtp`` in its interop venv; mlx-lm's
``convert`` in this venv); otherwise from the layout the tool documents, rebuilt from an mtpconvert
conversion (its head bytes, moved to where that tool puts them). Each builder names its source.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from mtpconvert.execute import execute
from mtpconvert.fixture import fixture_path
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.io.reader import read_all
from mtpconvert.io.shard_writer import write_all
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan

MLX_VLM_VENV = Path("/root/.cache/mtpconvert/interop/venvs/mlx-vlm-0.7.10")
RAW = "dense"  # mtpconvert/fixture/data/tiny-qwen35-mtp


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _write_config(folder: Path, cfg: dict) -> None:
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def mlx_vlm_pair(out: Path, quantize: bool = False) -> Path:
    """Real tool: ``python -m mlx_vlm.convert --hf-path RAW --mlx-path OUT --mtp`` (mlx-vlm 0.7.10) writes OUT
    (no head) and OUT-mtp (the ``qwen3_5_mtp`` drafter). Returns OUT; the caller skips when the venv is absent."""
    cmd = [str(MLX_VLM_VENV / "bin" / "python"), "-m", "mlx_vlm.convert", "--hf-path", str(fixture_path(RAW)),
           "--mlx-path", str(out), "--mtp"] + (["-q", "--q-bits", "4", "--q-group-size", "32"] if quantize else [])
    subprocess.run(cmd, check=True, capture_output=True, cwd=out.parent, timeout=300)
    return out


def mlx_lm_headless(out: Path) -> Path:
    """Real tool: ``mlx_lm.convert`` (0.32.2, this venv), the mlx-community folder without a head: config keeps
    mtp_num_hidden_layers, sanitize dropped every mtp.* weight."""
    from mlx_lm import convert

    convert(str(fixture_path(RAW)), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=32)
    return out


def ours(out: Path) -> Path:
    """mtpconvert's default folder (sidecar mtp.safetensors + mtp/ link, manifest, drafter config)."""
    ckpt = open_checkpoint(fixture_path(RAW))
    execute(build_plan(ckpt, ConvertOptions()), ckpt, out)
    return out


def _drop_our_extras(folder: Path) -> dict:
    shutil.rmtree(folder / "mtp")
    cfg = _config(folder)
    cfg.pop("mlx_lm_extra_tensors", None)
    return cfg


def mtplx_optimized(out: Path) -> Path:
    """Documented layout (MTPLX-Optimized releases as jundot/omlx#2497 and #2062 describe them): model shards whose
    index lists only the backbone, the head as bare ``mtp.*`` keys in a root ``mtp.safetensors`` side-car, and an
    ``mtplx_runtime.json`` contract (arch_id, base_hidden_variant, hidden_variant, concat_order, mtp_position_mode);
    no ``mtp/`` folder, no mlx_lm_extra_tensors."""
    ours(out)
    _write_config(out, _drop_our_extras(out))
    (out / "mtplx_runtime.json").write_text(json.dumps({
        "arch_id": "qwen3_5", "base_hidden_variant": "post_norm", "hidden_variant": "post_norm",
        "concat_order": "embedding_hidden", "mtp_position_mode": "shared", "mtp_depth_max": 1}))
    return out


def _head(folder: Path) -> dict:
    return read_all(folder / "mtp.safetensors")


def _index_add(folder: Path, keys, file: str) -> None:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))


def omlx_imported(out: Path) -> Path:
    """Documented layout (oMLX's ``import_mtplx_sidecar``, jundot/omlx#2497, its fallback): the side-car head
    remapped to ``language_model.mtp.*`` in a ``model-mtp.safetensors`` shard that the index's weight_map lists,
    so oMLX's loader reads it from the model files."""
    ours(out)
    head = {"language_model." + k: v for k, v in _head(out).items()}
    cfg = _drop_our_extras(out)
    (out / "mtp.safetensors").unlink()
    write_all(out / "model-mtp.safetensors", head, {"format": "mlx"})
    _index_add(out, head, "model-mtp.safetensors")
    _write_config(out, cfg)
    return out


def vllm_mlx_add_mtp_weights(out: Path) -> Path:
    """Documented layout (vllm-mlx's ``scripts/add_mtp_weights.py``; interop/notes-qwen3-next.md §3.3 and
    notes-mtplx-rapid-vllm.md): a root ``model-mtp.safetensors`` with ``mtp.*`` keys beside the mlx-lm shards,
    and ``num_nextn_predict_layers`` in config.json."""
    ours(out)
    head = _head(out)
    cfg = _drop_our_extras(out)
    (out / "mtp.safetensors").unlink()
    write_all(out / "model-mtp.safetensors", head, {"format": "mlx"})
    cfg.setdefault("text_config", cfg)["num_nextn_predict_layers"] = 1
    _write_config(out, cfg)
    return out


def vllm_mlx_extracted(out: Path) -> Path:
    """Documented layout (vllm-mlx 0.6.0's MTP file, notes-mtplx-rapid-vllm.md: ``mtp/weights.safetensors`` +
    ``mtp/manifest.json`` {artifact_schema_version 1, rmsnorm_weight_format mlx_gamma}): the head only under
    ``mtp/``, no root side-car."""
    ours(out)
    cfg = _config(out)
    cfg.pop("mlx_lm_extra_tensors", None)
    (out / "mtp" / "config.json").unlink()
    head = _head(out)
    (out / "mtp" / "weights.safetensors").unlink()
    (out / "mtp.safetensors").unlink()
    write_all(out / "mtp" / "weights.safetensors", head, {"format": "mlx"})
    _write_config(out, cfg)
    return out
