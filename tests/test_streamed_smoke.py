"""The layerwise smoke fed shard by shard (runtime/smoke/streamed.py): the post-hoc check's numbers, each shard
freed as it is fed (what the check reads later is in memory, or for an in-model head in a copy), and a
broken head stops the streamed publish before its commit."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from tools.broken_heads import editor
from mtpconvert import api
from mtpconvert.gate import Gate
from mtpconvert.cli import app
from mtpconvert.fixture.text import text_fixture_path
from mtpconvert.options import ConvertOptions, QuantOptions
from mtpconvert.hub.publish import stub_in_place
from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
from mtpconvert.families import QWEN3_5
from mtpconvert.runtime.smoke.sizing import unit_of
from mtpconvert.runtime.smoke.streamed import SMOKE_DIR, StreamedLayerwise, shards_by_unit
from tests.test_hub import hub, shards_holding_data  # noqa: F401  (the loopback Hub fixture)

runner = CliRunner()
SHARD_BYTES = 300_000  # 6-7 output shards of the 4-bit text fixtures; a layer spans two or three
PUBLISH_ARGS = ["--bits", "4", "--group-size", "32", "--max-shard-size", "0.0003"]
PROMPT_TOKENS = 48


def converted(tmp_path: Path, name: str, mtp_layout: str = "sidecar") -> Path:
    out = tmp_path / name
    api.convert(text_fixture_path(name), out, ConvertOptions(quant=QuantOptions(bits=4, group_size=32),
                                                             max_shard_bytes=SHARD_BYTES, mtp_layout=mtp_layout),
                checks=Gate(verify=False, smoke=False))
    return out


@pytest.mark.parametrize("name, mtp_layout", [("dense", "sidecar"), ("moe", "sidecar"), ("moe", "in-model")])
def test_streamed_equals_the_post_hoc_check_with_each_shard_freed_as_it_is_fed(tmp_path, name, mtp_layout):
    """Each shard is stubbed (as the publisher frees it) as soon as feed returns it, and feed returns it at once:
    lm_head (written first, read last), the final norm and the parts of a layer spanning shards are read into
    memory; only an in-model head is copied to disk. The numbers are still the post-hoc check's."""
    out = converted(tmp_path, name, mtp_layout)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))  # model-0000k-of-N: the order execute writes them
    layer_spans = [len(v) for unit, v in shards_by_unit(weight_map, QWEN3_5).items() if unit.startswith("layer")]
    assert len(shards) >= 5 and max(layer_spans) >= (3 if name == "moe" else 2), shards  # a layer spans shards
    lm_head_shard = weight_map["language_model.lm_head.weight"]
    assert lm_head_shard == shards[0]
    head_shards = sorted({s for k, s in weight_map.items() if unit_of(k, QWEN3_5) == "mtp"})
    assert bool(head_shards) == (mtp_layout == "in-model")
    posthoc = layerwise_acceptance(out, max_prompt_tokens=PROMPT_TOKENS)

    streamed = StreamedLayerwise(weight_map, QWEN3_5, max_prompt_tokens=PROMPT_TOKENS)
    for shard in shards:
        assert streamed.feed(shard, out / shard) == [shard]
        stub_in_place(out / shard)
    assert streamed.most_held == 0
    stub = mx.load(str(out / lm_head_shard))
    assert not any(mx.any(v).item() for v in stub.values())  # lm_head's bytes are a hole: not readable from the file
    assert sorted(p.name for p in (out / SMOKE_DIR).glob("*")) == head_shards
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
    streamed = StreamedLayerwise(weight_map, QWEN3_5, max_prompt_tokens=PROMPT_TOKENS)
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
