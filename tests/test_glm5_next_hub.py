"""GLM-5.3-Flash (``glm5_next``) from a loopback Hub: the streamed pull (a shard at a time, or byte ranges within a
window) writes a local conversion's bytes, head included, within its disk bound; ``add-mtp`` grafts the nextn layer
onto a head-less folder, from a local release or from the Hub by the head's byte ranges only."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtpconvert.cli import app
from tests.checkpoints import convert_folder, tree_digest
from tests.checkpoints_glm5_next import build
from tests.hubserver import served_hub
from tests.test_hub import pull_by_ranges, shard_digests

pytest.importorskip("mlx_vlm", reason="the glm5_next backbone runs in mlx-vlm (pip install mtpconvert[vlm])")

runner = CliRunner()
REPO = "zai-org/GLM-5.3-Flash-Tiny"
ARGS = ["--bits", "4", "--group-size", "32", "--no-smoke"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The release in three shards, the nextn layer alone in the last."""
    return build(tmp_path_factory.mktemp("glm5_next_hub") / "raw", shards=3).path


@pytest.fixture()
def hub(tmp_path, monkeypatch, release):
    with served_hub(tmp_path, monkeypatch) as h:
        h.add_folder(REPO, release)
        yield h


@pytest.fixture(scope="module")
def local(release, tmp_path_factory):
    """The same options converted from the local release: what every pull must write, byte for byte."""
    out = tmp_path_factory.mktemp("glm5_next_local") / "q4"
    convert_folder(release, out, bits=4, group_size=32)
    return out


def _same_as_local(out, local) -> None:
    from mtpconvert.verify import verify

    report = verify(out)
    assert report.ok, [f.message for f in report.findings if f.severity == "error"]
    assert report.model_type == "glm5_next" and report.mtp_complete and report.mtp_layers_found == 1
    assert shard_digests(out) == shard_digests(local) and "mtp.safetensors" in shard_digests(out)
    assert tree_digest(out / "mtp") == tree_digest(local / "mtp")
    assert json.loads((out / "config.json").read_text()) == json.loads((local / "config.json").read_text())


def test_streamed_pull_holds_at_most_two_raw_shards_and_writes_the_local_bytes(hub, release, local, tmp_path,
                                                                                  monkeypatch):
    from mtpconvert.hub import pull as hub_mod
    from mtpconvert.hub import stream as streaming

    stage, usage = tmp_path / ".streamed.stream", []
    real_fetch, real_release = hub_mod.fetch_file, streaming.ShardStream.release

    def raw():  # the shards and stubs on disk (not the download's lock and metadata files beside them)
        return sum(p.stat().st_blocks * 512 for p in stage.rglob("*.safetensors") if p.is_file())

    def fetch(plan, name, dest, **kw):
        real_fetch(plan, name, dest, **kw)
        usage.append(raw())

    def release_(self, stub):
        real_release(self, stub)
        usage.append(raw())

    monkeypatch.setattr(hub_mod, "fetch_file", fetch)
    monkeypatch.setattr(streaming.ShardStream, "release", release_)
    result = runner.invoke(app, ["pull-and-quantize", REPO, str(tmp_path / "streamed"), "--stream", *ARGS])
    assert result.exit_code == 0, result.output
    sizes = sorted(p.stat().st_size for p in release.glob("*.safetensors"))
    assert usage and max(usage) > sizes[0]  # the measurement saw real shards
    assert max(usage) <= sizes[-1] + sizes[-2] + 3 * 8192, (usage, sizes)  # + each stub's header block
    assert not stage.exists()
    _same_as_local(tmp_path / "streamed", local)


def test_streamed_pull_by_byte_ranges_stays_within_its_window(hub, release, local, tmp_path, monkeypatch):
    """--raw-window: fetched ahead at most the window; what arrives is punched out once written, so the raw data on
    disk (tiny tensors: page-rounded) stays below the largest shard and the bytes held below a third of the
    release."""
    sizes = sorted(p.stat().st_size for p in release.glob("*.safetensors"))
    window = sizes[0] // 4
    run = pull_by_ranges(hub, monkeypatch, REPO, tmp_path / "ranged", window, ARGS)
    assert run.feed.punched and run.ahead <= window
    assert max(run.usage) < sizes[-1] and run.feed.peak_bytes < sum(sizes) / 3, (run.usage, run.feed.peak_bytes)
    _same_as_local(tmp_path / "ranged", local)


@pytest.fixture()
def headless(release, tmp_path):
    """The release converted with --mtp drop: the folder add-mtp exists for."""
    out = tmp_path / "headless"
    convert_folder(release, out, bits=4, group_size=32, mtp="drop")
    assert not (out / "mtp.safetensors").exists()
    return out


@pytest.mark.parametrize("head", [[], ["--mtp-bits", "8"]], ids=["keep", "mtp-bits"])
def test_add_mtp_from_a_local_release_gives_the_conversions_head(release, headless, tmp_path, head):
    """The head, its files and its quantization entries (with --mtp-bits: under the drafter's module paths too) are
    a conversion's with the same options."""
    local = tmp_path / "local"
    convert_folder(release, local, bits=4, group_size=32, mtp_bits=8 if head else None)
    result = runner.invoke(app, ["add-mtp", str(release), str(headless), "--no-smoke", *head])
    assert result.exit_code == 0, result.output
    assert (headless / "mtp.safetensors").read_bytes() == (local / "mtp.safetensors").read_bytes()
    assert tree_digest(headless / "mtp") == tree_digest(local / "mtp")
    config, reference = (json.loads((f / "config.json").read_text()) for f in (headless, local))
    assert config["quantization"] == reference["quantization"]
    assert config["text_config"]["num_nextn_predict_layers"] == 1
    again = runner.invoke(app, ["add-mtp", str(release), str(headless), "--no-smoke"])
    assert again.exit_code != 0 and "already has MTP tensors" in again.output


def test_add_mtp_names_the_head_under_the_drafters_paths_as_the_plan_does(release, headless, tmp_path):
    """The drafter's entries (``mtp_block.*``, ``eh_proj``) name no tensor of the folder; ones the folder's config
    still holds from an earlier float head (False: unquantized) are replaced by the grafted head's, else mlx-vlm's
    drafter would build the 8-bit head as float."""
    config = json.loads((headless / "config.json").read_text())
    for block in ("quantization", "quantization_config"):
        config[block].update({"mtp_block.self_attn.qkv_a_proj": False, "mtp_block.self_attn.o_proj": False})
    (headless / "config.json").write_text(json.dumps(config))
    local = tmp_path / "local"
    convert_folder(release, local, bits=4, group_size=32, mtp_bits=8)
    result = runner.invoke(app, ["add-mtp", str(release), str(headless), "--no-smoke", "--mtp-bits", "8"])
    assert result.exit_code == 0, result.output
    grafted, reference = (json.loads((f / "config.json").read_text()) for f in (headless, local))
    assert grafted["quantization"]["mtp_block.self_attn.qkv_a_proj"]["bits"] == 8
    for block in ("quantization", "quantization_config"):
        assert grafted[block] == reference[block]


def test_add_mtp_from_the_hub_reads_only_the_heads_byte_ranges(hub, release, local, headless):
    head_shard = sorted(p.name for p in release.glob("model-*.safetensors"))[-1]
    result = runner.invoke(app, ["add-mtp", REPO, str(headless), "--no-smoke"])
    assert result.exit_code == 0, result.output
    assert (headless / "mtp.safetensors").read_bytes() == (local / "mtp.safetensors").read_bytes()
    gets = [r for r in hub.log if r.method == "GET" and r.path.endswith(".safetensors")]
    assert gets and all(r.range for r in gets)  # headers and the nextn layer's ranges, never a whole shard
    headers = {p.name: 8 + int.from_bytes(p.read_bytes()[:8], "little") for p in release.glob("*.safetensors")}
    others = [r for r in gets if not r.path.endswith(head_shard)]
    assert all(int(r.range.split("-")[-1]) < headers[r.path.rsplit("/", 1)[-1]] for r in others)  # headers only
