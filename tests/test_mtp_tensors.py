"""MTP tensors in the output equal the source after exactly the documented transforms."""

import mlx.core as mx
import numpy as np
import pytest

from mtpconvert.execute import execute
from mtpconvert.plan import ConvertOptions, build_plan
from mtpconvert.rawexport import is_shifted_norm
from mtpconvert.safetensors_io import read_all
from mtpconvert.source import open_checkpoint


def load_out(folder):
    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        out.update(read_all(f))
    return out


@pytest.mark.parametrize("layout", ["moe-published35", "moe-fused", "moe-per-expert", "dense-vlm"])
def test_mtp_tensors_exact(layout, raw_checkpoints, tmp_path):
    built = raw_checkpoints(layout)
    ckpt = open_checkpoint(built.path)
    execute(build_plan(ckpt, ConvertOptions(dtype="float32")), ckpt, tmp_path / "o")
    out = load_out(tmp_path / "o")
    raw = {k: v for k, v in built.raw.items()}
    stored_bf16 = layout == "moe-published35"

    def src(key):
        v = raw[key]
        if stored_bf16:
            v = np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32))
        return v

    mtp_out = {k: np.array(v) for k, v in out.items() if k.startswith("language_model.mtp.")}
    assert mtp_out, "MTP dropped"
    for name, got in mtp_out.items():
        rest = name[len("language_model."):]
        if ".switch_mlp." in rest:
            mlp, proj = rest.split(".switch_mlp.")
            proj = proj[: -len(".weight")]
            per_expert = [f"{mlp}.experts.{e}.{proj}.weight" for e in range(got.shape[0])]
            if per_expert[0] in raw:
                want = np.stack([src(k) for k in per_expert])  # expert e at row e
            elif proj == "down_proj":
                want = src(f"{mlp}.experts.down_proj")
            else:
                fused = src(f"{mlp}.experts.gate_up_proj")
                half = fused.shape[1] // 2
                want = fused[:, :half] if proj == "gate_proj" else fused[:, half:]
        elif is_shifted_norm(name):
            want = src(rest) + 1.0  # shifted exactly once
        else:
            want = src(rest)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_wrong_expert_order_would_be_caught(raw_checkpoints, tmp_path):
    """Guard for the test above: permuting experts changes the stacked tensor."""
    built = raw_checkpoints("moe-per-expert")
    w = np.stack([built.raw[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
    assert not np.array_equal(w, w[[1, 0, 2, 3]])
