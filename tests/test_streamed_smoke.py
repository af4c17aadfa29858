"""The layerwise smoke fed shard by shard (runtime/streamed.py): the post-hoc check's numbers, shards
freed as they go, and a broken head stops the streamed publish before its commit."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from broken_heads import editor
from mtpconvert import api
from mtpconvert.checks import Checks
from mtpconvert.cli import app
from mtpconvert.fixture.text import text_fixture_path
from mtpconvert.options import ConvertOptions, QuantOptions
from mtpconvert.runtime.layerwise import layerwise_acceptance
from mtpconvert.runtime.streamed import SMOKE_DIR, StreamedLayerwise
from test_hub import hub, shards_holding_data  # noqa: F401  (the loopback Hub fixture)

runner = CliRunner()
SHARD_BYTES = 300_000  # 6-7 output shards of the 4-bit text fixtures; a layer spans two or three
PUBLISH_ARGS = ["--bits", "4", "--group-size", "32", "--max-shard-size", "0.0003"]
PROMPT_TOKENS = 48


def converted(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    api.convert(text_fixture_path(name), out, ConvertOptions(quant=QuantOptions(bits=4, group_size=32),
                                                             max_shard_bytes=SHARD_BYTES),
                checks=Checks(verify=False, smoke=False))
    return out


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_streamed_equals_the_post_hoc_check_and_releases_shards_in_order(tmp_path, name):
    out = converted(tmp_path, name)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))  # model-0000k-of-N: the order execute writes them
    assert len(shards) >= 5, shards
    posthoc = layerwise_acceptance(out, max_prompt_tokens=PROMPT_TOKENS)

    streamed = StreamedLayerwise(weight_map, max_prompt_tokens=PROMPT_TOKENS)
    released = []
    for k, shard in enumerate(shards):
        released += streamed.feed(shard, out / shard)
        assert set(shards[:max(0, k - 1)]) <= set(released), (shard, released)  # at most the last two are still needed
    assert released == shards  # each once, in order
    assert (out / SMOKE_DIR / shards[0]).is_file()  # lm_head (first shard) copied out: read after the last layer
    result = streamed.finish()
    assert not (out / SMOKE_DIR).exists()
    assert (result.agreed, result.compared) == (posthoc.agreed, posthoc.compared)
    assert result.backbone_next == posthoc.backbone_next and result.head_next == posthoc.head_next
    assert result.head_next_without_mlp == posthoc.head_next_without_mlp
    assert result.mlp_gain_paired == posthoc.mlp_gain_paired
    # acceptance only: the MLP gain over 141 positions (48-token prompts) is too noisy to gate on here
    assert result.compared > 100 and result.acceptance_ok


def test_feed_order_is_free_but_holds_shards_until_their_layers_ran(tmp_path):
    """Shards fed last-first: no layer runs until the embedding and layer 0 arrive (the second shard), so
    every shard fed before it is held; the numbers are the same."""
    out = converted(tmp_path, "dense")
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    streamed = StreamedLayerwise(weight_map, max_prompt_tokens=PROMPT_TOKENS)
    released = [streamed.feed(s, out / s) for s in reversed(shards)]
    assert released[:-2] == [[]] * (len(shards) - 2) and streamed.most_held == len(shards) - 2
    assert streamed.finish().agreed == layerwise_acceptance(out, max_prompt_tokens=PROMPT_TOKENS).agreed


def serve_text_fixture(server, tmp_path: Path, repo: str, edit=None) -> str:
    """The dense text fixture on the loopback Hub; ``edit``: a tools/broken_heads.py edit applied to the raw
    weights, so that a correct conversion of them has a broken head."""
    src = tmp_path / f"served-{repo.replace('/', '-')}"
    shutil.copytree(text_fixture_path("dense"), src)
    if edit:
        fn, f = editor(edit, {}), src / "model.safetensors"
        weights = dict(mx.load(str(f)))
        changed = {k: v for k in weights if (v := fn(k, weights[k])) is not None}
        assert changed, edit
        mx.save_safetensors(str(f), {**weights, **changed}, metadata={"format": "pt"})
    server.add_folder(repo, src)
    return repo


def watch_publisher(monkeypatch):
    """("finished" | "stub", shard, shards holding data in the partial folder) at each hand-over and stub."""
    from mtpconvert.hub import publish

    events = []
    real_finished, real_stub = publish.ShardPublisher.finished, publish.stub_in_place

    def finished(self, shard, path, fingerprint):
        events.append(("finished", shard, shards_holding_data(Path(path).parent)))
        real_finished(self, shard, path, fingerprint)

    def stub(path):
        events.append(("stub", Path(path).name, shards_holding_data(Path(path).parent)))
        real_stub(path)

    monkeypatch.setattr(publish.ShardPublisher, "finished", finished)
    monkeypatch.setattr(publish, "stub_in_place", stub)
    return events


def test_streamed_publish_with_the_smoke_frees_shards_as_it_goes(hub, tmp_path, monkeypatch):  # noqa: F811
    repo = serve_text_fixture(hub, tmp_path, "Qwen/Text-MTP")
    events = watch_publisher(monkeypatch)
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", repo, str(out), "--stream", "--upload-repo", "me/text",
                                 *PUBLISH_ARGS])
    assert result.exit_code == 0, result.output
    published = hub.repos["me/text"]
    shards = sorted(n for n in published.files if n.startswith("model-"))
    assert len(shards) >= 5 and len(published.commits) == 1
    kinds = [e[0] for e in events]
    assert kinds.count("stub") == len(shards)
    assert kinds.index("stub") < len(kinds) - 1 - kinds[::-1].index("finished")  # freed before the last was written
    assert max(n for *_, n in events) <= 2, events
    assert "layerwise" in result.output and not list(out.glob("model-*.safetensors"))
    assert not (tmp_path / ".out.partial").exists()
    card = published.files["README.md"].decode()
    assert "| smoke (greedy MTP draft acceptance, depth 1) | not run |" not in card and "%" in card


def test_broken_head_fails_the_streamed_smoke_and_nothing_is_committed(hub, tmp_path, monkeypatch):  # noqa: F811
    repo = serve_text_fixture(hub, tmp_path, "Qwen/Text-Broken", edit="fc_swapped")
    events = watch_publisher(monkeypatch)
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", repo, str(out), "--stream", "--upload-repo", "me/broken",
                                 *PUBLISH_ARGS])
    assert result.exit_code == 2, result.output
    assert "MTP smoke test failed (layerwise, teacher-forced, streamed)" in result.output
    assert "resume with: mtpconvert pull-and-quantize" in result.output and "--resume" in result.output
    assert "Traceback" not in result.output
    assert hub.repos["me/broken"].commits == [] and not out.exists()
    assert [e for e in events if e[0] == "stub"]  # the bounded-disk path ran: shards were freed before the end
    partial = tmp_path / ".out.partial"
    assert partial.is_dir() and not (partial / SMOKE_DIR).exists()
