"""End to end on the trained fixture: convert -> verify -> MTP acceptance; broken conversions collapse."""

import pytest
from typer.testing import CliRunner

from tests.checkpoints import convert_folder, without_shift
from mtpconvert.cli import app
from mtpconvert.demo import fixture_prompts
from mtpconvert.execute import execute
from mtpconvert.fixture import fixture_path
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.runtime.smoke.decode import smoke
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.verify import verify

# Measured on the fixtures: 100% greedy acceptance when converted correctly (the
# language's most likely successor is deterministic given two words of context).
FLOOR = 0.80
BROKEN_CEILING = 0.30


def convert(tmp_path, name, variant="dense", mutate=None, **quant):
    convert_folder(fixture_path(variant), tmp_path / name, edit=mutate, dtype="bfloat16", **quant)
    return tmp_path / name


def rate(folder):
    return smoke(folder, fixture_prompts(3), max_tokens=32).acceptance


@pytest.mark.parametrize("quant", [dict(), dict(bits=4, group_size=32), dict(bits=8, group_size=32, mtp="match"),
                                   dict(bits=4, group_size=32, mtp="match")])
def test_fixture_acceptance_above_floor(tmp_path, quant):
    out = convert(tmp_path, "o", **quant)
    assert verify(out).ok
    assert rate(out) >= FLOOR


def test_missing_norm_shift_collapses_acceptance(tmp_path):
    out = convert(tmp_path, "noshift", mutate=without_shift())
    assert rate(out) <= BROKEN_CEILING


@pytest.mark.parametrize("hidden, which", [("post-norm", 1), ("pre-norm", 0)])
def test_mtp_hidden_feeds_that_state_to_the_head(tmp_path, hidden, which):
    """--mtp-hidden decides which backbone state the head's first draft reads."""
    import mlx.core as mx

    from mtpconvert.runtime.smoke.decode import encode_prompts
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate

    folder = convert(tmp_path, "o")
    m = load(folder)
    prompt = encode_prompts(folder, fixture_prompts(1))[0]
    seen = []
    real = type(m.head).__call__

    def spy(self, hidden_states, *a, **k):
        seen.append(hidden_states)
        return real(self, hidden_states, *a, **k)

    type(m.head).__call__ = spy
    try:
        mtp_generate(m, prompt, 2, hidden=hidden)
    finally:
        type(m.head).__call__ = real
    states = m.backbone.forward(mx.array([prompt]), m.backbone.make_cache())
    assert mx.array_equal(seen[0], states[which]).item()
    assert not mx.array_equal(seen[0], states[1 - which]).item()


def test_smoke_cli_fails_without_mtp(tmp_path):
    out = convert(tmp_path, "dropped", mtp="drop")
    result = CliRunner().invoke(app, ["smoke", str(out)])
    assert result.exit_code != 0 and "no MTP head" in result.output


def _per_expert_moe_fixture(tmp_path):
    """The MoE fixture re-exported the way transformers' save_pretrained writes it: every expert separate."""
    import shutil

    import mlx.core as mx

    from tools.rawexport import to_raw

    src = fixture_path("moe")
    mlx_dir = convert(tmp_path, "moe-mlx", variant="moe")  # same bf16 weights, renamed and shifted
    weights = {}
    for f in sorted(mlx_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    raw = tmp_path / "moe-per-expert"
    raw.mkdir()
    mx.save_safetensors(str(raw / "model.safetensors"), to_raw(weights, experts="per_expert"))
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copy(f, raw / f.name)
    return raw


def test_moe_fixture_and_wrong_expert_order(tmp_path):
    # mlx's CPU gather_mm is float32-only, so the MoE runs here use quantized experts
    # (gather_qmm); bf16 unquantized MoE is exercised on Apple silicon / CUDA.
    out = convert(tmp_path, "moe", variant="moe", bits=4, group_size=32, mtp="match")
    assert verify(out).ok and rate(out) >= FLOOR

    raw = _per_expert_moe_fixture(tmp_path)
    q = QuantOptions(bits=8, group_size=32, mtp="match")

    def build(name, reverse):
        ckpt = open_checkpoint(raw)
        plan = build_plan(ckpt, ConvertOptions(dtype="bfloat16", quant=q))
        stacks = [it for it in plan.items if it.gather == "stack"]
        assert len(stacks) == 15  # 4 backbone + 1 MTP layers x gate/up/down
        if reverse:  # the classic bug: experts stacked in the wrong order
            for it in stacks:
                it.sources = tuple(reversed(it.sources))
        execute(plan, ckpt, tmp_path / name)
        return tmp_path / name

    good, bad = rate(build("pe-ok", False)), rate(build("pe-rev", True))
    print("per-expert MoE acceptance", good, "reversed experts", bad)
    assert good >= FLOOR and bad <= BROKEN_CEILING


@pytest.mark.parametrize("args", [["--bits", "4", "--group-size", "32"], []])
def test_float_moe_experts_smoke_on_the_cpu(tmp_path, args):
    """A bf16 MoE head (or whole model) smokes on MLX's CPU backend: float experts run in float32 there."""
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["convert", str(fixture_path("moe")), str(out), *args])
    assert result.exit_code == 0, result.output
    assert "pass" in result.output and "skipped" not in result.output
