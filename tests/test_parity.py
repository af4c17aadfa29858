"""Converted folders reproduce transformers' logits and load in stock mlx-lm."""

import mlx.core as mx
import numpy as np
import pytest
import torch

import mlx_lm
from mlx_lm.utils import load_model
from tests.checkpoints import convert_folder, without_shift
from tests.conftest import LAYOUTS
from mtpconvert.verify import verify

# float32 end to end: differences are accumulation order only.
FP32_ATOL = 2e-4
IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 11]


def convert(src, out, **quant):
    return convert_folder(src, out, dtype="float32", **quant)


def torch_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def mlx_logits(folder, ids):
    model, _ = load_model(folder)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unquantized_logits_match_transformers(layout, raw_checkpoints, tmp_path):
    built = raw_checkpoints(layout)
    if LAYOUTS[layout].get("dtype") == "bfloat16":
        for name, p in built.model.named_parameters():  # compare against the weights as stored
            if not name.endswith(("A_log", "linear_attn.norm.weight")):  # stored as F32, like Qwen3.5
                p.data = p.data.to(torch.bfloat16).to(torch.float32)
    convert(built.path, tmp_path / "out")
    ref = torch_logits(built.model, IDS)
    got = mlx_logits(tmp_path / "out", IDS)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=FP32_ATOL, rtol=1e-3)
    assert verify(tmp_path / "out").ok


@pytest.mark.parametrize("layout", ["dense-vlm", "dense-text"])
def test_8bit_stays_close(layout, raw_checkpoints, tmp_path):
    built = raw_checkpoints(layout)
    convert(built.path, tmp_path / "q8", bits=8)
    ref = torch_logits(built.model, IDS)
    got = mlx_logits(tmp_path / "q8", IDS)
    # Random tiny models amplify weight noise through the gated-delta decay, so the
    # bound is on agreement (correlation, greedy choice), measured at 0.97-0.99 / 0.92 for
    # 8-bit against 0.59 / 0.17 for 4-bit on the dense layout.
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    assert corr > 0.95, corr
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


def test_skipping_the_shift_breaks_parity(raw_checkpoints, tmp_path):
    """The parity test can fail: without +1 on the norms the logits are far off."""
    built = raw_checkpoints("dense-vlm")
    convert_folder(built.path, tmp_path / "noshift", edit=without_shift(), dtype="float32")
    ref = torch_logits(built.model, IDS)
    got = mlx_logits(tmp_path / "noshift", IDS)
    assert np.abs(got - ref).max() > 100 * FP32_ATOL


@pytest.mark.parametrize("bits", [None, 4])
def test_stock_mlx_lm_loads_and_generates(raw_checkpoints, tmp_path, bits):
    built = raw_checkpoints("moe-published35")
    convert(built.path, tmp_path / "out", bits=bits)
    model, tokenizer = mlx_lm.load(str(tmp_path / "out"))
    text = mlx_lm.generate(model, tokenizer, prompt=" gizo vibe gizo", max_tokens=6)
    assert isinstance(text, str) and len(tokenizer.encode(text)) >= 1
