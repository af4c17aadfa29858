"""MTP tensors in the output equal the source after exactly the documented transforms."""

import mlx.core as mx
import numpy as np
import pytest

from tests.checkpoints import convert_folder, without_shift
from mtpconvert.families.qwen3_5 import is_zero_centred_norm as is_shifted_norm
from mtpconvert.io.reader import read_all


def load_out(folder):
    """Every output tensor under its canonical name (the sidecar's mtp.X is language_model.mtp.X)."""
    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        out.update(read_all(f))
    if (folder / "mtp.safetensors").exists():
        out.update({"language_model." + k: v for k, v in read_all(folder / "mtp.safetensors").items()})
    return out


def head_mismatches(built, folder, stored_bf16: bool):
    """Names of the head's output tensors that differ from the raw source after the documented transforms."""
    out = load_out(folder)
    raw = built.raw

    def src(key):
        v = raw[key]
        if stored_bf16:
            v = np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32))
        return v

    mtp_out = {k: np.array(v) for k, v in out.items() if k.startswith("language_model.mtp.")}
    assert mtp_out, "MTP dropped"
    bad = []
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
        if got.shape != want.shape or not np.array_equal(got, want):
            bad.append(name)
    return bad


@pytest.mark.parametrize("mtp_layout", ["sidecar", "in-model"])
@pytest.mark.parametrize("layout", ["moe-published35", "moe-fused", "moe-per-expert", "dense-vlm"])
def test_mtp_tensors_exact(layout, mtp_layout, raw_checkpoints, tmp_path):
    built = raw_checkpoints(layout)
    convert_folder(built.path, tmp_path / "o", dtype="float32", mtp_layout=mtp_layout)
    assert head_mismatches(built, tmp_path / "o", stored_bf16=layout == "moe-published35") == []


def _reverse_head_experts(plan):
    for it in plan.items:
        if it.name.startswith("mtp.") and it.gather == "stack":
            it.sources = tuple(reversed(it.sources))


@pytest.mark.parametrize("edit, expect", [(_reverse_head_experts, "switch_mlp"), (without_shift(), "norm")])
def test_a_broken_head_is_caught(raw_checkpoints, tmp_path, edit, expect):
    """The comparison above can fail: reversed experts or a missing +1 make it name the tensors."""
    built = raw_checkpoints("moe-per-expert")
    convert_folder(built.path, tmp_path / "o", edit=edit, dtype="float32")
    bad = head_mismatches(built, tmp_path / "o", stored_bf16=False)
    assert bad and all(expect in name for name in bad), bad
