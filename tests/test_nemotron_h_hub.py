"""Nemotron-H on the loopback Hub: a streamed pull keeps the whole prediction module and writes what a local convert
writes; add-mtp grafts the head onto stock mlx_lm.convert's folder, fetching only its byte ranges, and mlx-vlm and
our runtime then draft with it; the card states the head as stored."""

import json

import pytest
from typer.testing import CliRunner

from tests.checkpoints import convert_folder, tree_digest
from tests.nemotron import build_nemotron
from tests.test_hub import hub, shard_digests  # noqa: F401  (the loopback Hub fixture)
from mtpconvert.cli import app
from mtpconvert.verify import verify

runner = CliRunner()
REPO = "nvidia/Tiny-Nemotron-H-MTP"
ARGS = ["--bits", "4", "--group-size", "32", "--no-smoke"]  # an untrained head: nothing for the smoke to accept
IDS = [5, 17, 300, 42, 8, 99, 123, 7]


@pytest.fixture()
def release(hub, tmp_path):  # noqa: F811
    """A tiny raw Nemotron-H release served: backbone in the first shard, every mtp.* alone in the second."""
    src = build_nemotron(tmp_path / "raw", shards=2).path
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    head_shard = "model-00002-of-00002.safetensors"
    assert {k for k, s in weight_map.items() if s == head_shard} == {k for k in weight_map if k.startswith("mtp.")}
    hub.add_folder(REPO, src)
    return src, head_shard


@pytest.mark.parametrize("fetch", [[], ["--raw-window", "0.0002"]], ids=["shards", "ranges"])
def test_streamed_pull_keeps_the_whole_head(hub, release, tmp_path, fetch):  # noqa: F811
    src, head_shard = release
    out = tmp_path / "pulled"
    result = runner.invoke(app, ["pull-and-quantize", REPO, str(out), "--stream", *fetch, *ARGS])
    assert result.exit_code == 0, result.output
    got = [r for r in hub.log if r.method == "GET" and r.path.endswith(head_shard)]
    assert got and (all(r.range for r in got) if fetch else any(r.range is None for r in got))
    report = verify(out)
    assert report.ok and report.mtp_complete and report.mtp_layers_found == report.mtp_layers_config == 1
    convert_folder(src, tmp_path / "local", bits=4, group_size=32)
    assert shard_digests(out) == shard_digests(tmp_path / "local")
    assert tree_digest(out / "mtp") == tree_digest(tmp_path / "local" / "mtp")
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "local" / "config.json").read_text())


def test_add_mtp_onto_a_stock_mlx_lm_folder_by_byte_ranges(hub, release, tmp_path):  # noqa: F811
    """stock mlx_lm.convert's 4-bit folder (no head) gets the head of the release, only the head's byte ranges
    read; it verifies, our runtime's greedy MTP is plain greedy, and mlx-vlm drafts from OUT/mtp."""
    import mlx.core as mx
    from mlx_lm import convert as mlx_lm_convert
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate

    src, head_shard = release
    folder = tmp_path / "stock"
    mlx_lm_convert(str(src), mlx_path=str(folder), quantize=True, q_bits=4, q_group_size=32, dtype="float32")
    assert not verify(folder).mtp_complete
    result = runner.invoke(app, ["add-mtp", REPO, str(folder), "--no-smoke"])
    assert result.exit_code == 0, result.output
    ranges = [r.range for r in hub.log if r.path.endswith(head_shard) and r.method == "GET"]
    assert ranges and all(r and r.startswith("bytes=") for r in ranges)
    assert not [r for r in hub.log if r.path.endswith("model-00001-of-00002.safetensors") and r.method == "GET"
                and (r.range is None or int(r.range[6:].split("-")[1]) > 64 * 1024)]  # headers only
    report = verify(folder)
    assert report.ok and report.mtp_complete, [f.message for f in report.findings if f.severity == "error"]
    assert {r.runtime for r in report.runtimes if r.head_usable.ok} == {"mlx-vlm", "mlx-vlm-drafter"}
    m = load(folder)
    assert mtp_generate(m, IDS, 16, depth=2)[0] == plain_generate(m, IDS, 16)[0]
    target = load_model(folder)
    drafter, kind = load_drafter(str(folder / "mtp"), kind="mtp")
    prompt = mx.array([IDS])
    plain = [int(t) for t, _ in generate_step(prompt, target, None, None, max_tokens=12, temperature=0.0)]
    assert [int(t) for t, _ in generate_step(prompt, target, None, None, max_tokens=12, temperature=0.0,
                                             draft_model=drafter, draft_kind=kind)] == plain


def test_upload_card_states_the_head(hub, release, tmp_path):  # noqa: F811
    out = tmp_path / "nemotron-4bit"
    result = runner.invoke(app, ["pull-and-quantize", REPO, str(out), *ARGS, "--mtp", "match"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["upload", str(out), "me/nemotron-4bit", "--no-smoke"])
    assert result.exit_code == 0, result.output
    card = hub.repos["me/nemotron-4bit"].files["README.md"].decode()
    assert f"base_model: {REPO}" in card and "- nemotron_h" in card and "base_model_relation: quantized" in card
    stated = card.split("## MTP runtimes")[0]
    assert "| backbone | 4-bit, group 32, affine |" in stated and "| MTP layers | 1 |" in stated
    assert "e.g. norms and mtp.layers.0.eh_proj" in stated  # the head's own projection, float
    assert "| mlx-vlm-drafter | 0.7.10 | yes | yes |" in card
