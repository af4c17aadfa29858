"""pull-and-quantize and upload against a loopback Hub (huggingface_hub's real download/upload code runs)."""

import functools
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.hubserver import served_hub
from mtpconvert.cli import app
from mtpconvert.fixture import fixture_path

runner = CliRunner()
SECRET = "hf_PRIVATEtoken0123456789abcdefXYZ"


@pytest.fixture()
def hub(tmp_path, monkeypatch, raw_checkpoints):
    with served_hub(tmp_path, monkeypatch) as h:
        # the fixture as the hub serves it, plus files a conversion must not fetch
        src = tmp_path / "served"
        shutil.copytree(fixture_path("dense"), src)
        (src / "pytorch_model.bin").write_bytes(b"pickle that must never be fetched")
        (src / "training.json").write_text("{}")
        h.add_folder("Qwen/Tiny-MTP", src)
        # a sharded MoE with a vision tower: only shards with kept tensors are needed
        h.add_folder("Qwen/Tiny-MoE", raw_checkpoints("moe-fused").path)
        h.add_folder("Org/Private", src, private_token=SECRET)
        yield h


def test_dry_run_lists_only_needed_files(hub, tmp_path):
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", "--bits", "4", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    names = {f["name"] for f in plan["download"]}
    assert "config.json" in names and "model.safetensors" in names and "tokenizer.json" in names
    assert "pytorch_model.bin" not in names and "training.json" not in names
    assert plan["sha"] == hub.repos["Qwen/Tiny-MTP"].sha
    assert hub.downloaded() == []  # --dry-run reads metadata only (no index in this single-shard repo)


def test_pull_and_quantize_end_to_end(hub, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    got = set(hub.downloaded())
    assert "pytorch_model.bin" not in got and "training.json" not in got and "model.safetensors" in got
    meta = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["mtpconvert"]
    assert meta["source_repo"] == "Qwen/Tiny-MTP" and meta["source_revision"] == hub.repos["Qwen/Tiny-MTP"].sha
    assert "identical to plain greedy" in result.output
    # second run: everything comes from the huggingface_hub cache
    before = len(hub.downloaded())
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(tmp_path / "o2"), "--no-smoke"])
    assert result.exit_code == 0 and len(hub.downloaded()) == before


def test_sharded_pull_skips_shards_without_kept_tensors(hub, tmp_path):
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MoE", "--mtp", "drop", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    index = json.loads(hub.repos["Qwen/Tiny-MoE"].files["model.safetensors.index.json"])
    needed = {s for k, s in index["weight_map"].items() if not k.startswith(("mtp.", "model.visual."))}
    assert {f["name"] for f in plan["download"] if f["name"].endswith(".safetensors")} == needed


def test_interrupted_download_resumes(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)  # the fixture is smaller than 10 MB chunks
    size = len(hub.repos["Qwen/Tiny-MTP"].files["model.safetensors"])
    hub.drop_after["model.safetensors"] = size // 2
    out = tmp_path / "out"
    runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--no-smoke"])
    if not out.exists():  # huggingface_hub gave up on this run: the next one resumes with a Range request
        result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--no-smoke"])
        assert result.exit_code == 0, result.output
    ranges = [r.range for r in hub.log if r.path.endswith("/model.safetensors") and r.method == "GET"]
    assert any(r and not r.startswith("bytes=0-") for r in ranges), ranges


@pytest.mark.parametrize("repo, token, expected", [
    ("Nobody/Missing", None, "not found"),
    ("Org/Private", None, "not found, or private"),
    ("Org/Private", "hf_wrong", "not found, or private"),
])
def test_hub_errors_are_clear_and_leave_nothing(hub, tmp_path, repo, token, expected):
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", repo, str(out)] + (["--token", token] if token else []))
    assert result.exit_code != 0 and expected in result.output, result.output
    assert not out.exists()


def test_private_repo_with_token_and_token_never_leaks(hub, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", "Org/Private", str(out), "--token", SECRET, "--bits", "8",
                                 "--group-size", "32", "--upload-repo", "me/tiny-mtp-8bit"])
    assert result.exit_code == 0, (result.output, [(r.method, r.path) for r in hub.log[-6:]])
    assert SECRET not in result.output
    assert all(r.auth in (None, f"Bearer {SECRET}") for r in hub.log)
    for p in (p for p in out.rglob("*") if p.is_file()):
        assert SECRET.encode() not in p.read_bytes()
    uploaded = hub.repos["me/tiny-mtp-8bit"].files
    assert SECRET.encode() not in b"".join(uploaded.values())
    card = uploaded["README.md"].decode()
    assert "library_name: mlx" in card and "base_model: Org/Private" in card and "- mtp" in card
    sha = hub.repos["Org/Private"].sha
    assert f"pull-and-quantize Org/Private tiny-mtp-8bit --revision {sha} --bits 8 --group-size 32" in card
    assert "--token" not in card, card
    assert "8-bit, group 32" in card and "%" in card
    assert hub.validated_yaml and "library_name: mlx" in hub.validated_yaml[0]


def test_upload_command_sends_the_folder_and_a_card(hub, tmp_path):
    out = tmp_path / "out"
    assert runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--no-smoke"]).exit_code == 0
    result = runner.invoke(app, ["upload", str(out), "me/tiny", "--no-smoke"])
    assert result.exit_code == 0, result.output
    repo = hub.repos["me/tiny"]
    assert set(repo.files) >= {"config.json", "model.safetensors.index.json", "README.md", "tokenizer.json"}
    assert any(n.startswith("model") and n.endswith(".safetensors") for n in repo.files)
    assert not any(n.startswith(".") for n in repo.files)
    assert hub.created and hub.created[0]["name"] in ("tiny", "me/tiny")


def test_unreachable_hub_gives_a_clear_error(tmp_path, monkeypatch):
    import socket

    closed = socket.socket()  # a port nobody listens on
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(tmp_path / "out")])
    assert result.exit_code != 0 and "Hub" in result.output
    assert not (tmp_path / "out").exists()


def test_recipe_run_against_the_hub(hub, tmp_path):

    hub.add_folder("Qwen/Qwen3.5-27B", fixture_path("dense"))  # the fixture stands in for the real release
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "Qwen3.5-27B-8bit-bf16.toml"
    result = runner.invoke(app, ["recipe", "run", str(recipe), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "pull-and-quantize Qwen/Qwen3.5-27B --revision main --bits 8" in result.output.replace("\n", "")
    assert "model.safetensors" in result.output


def test_recipe_run_by_bundled_name_outside_the_checkout(hub, tmp_path, monkeypatch):
    hub.add_folder("Qwen/Qwen3.5-27B", fixture_path("dense"))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["recipe", "run", "Qwen3.5-27B-8bit-bf16", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "pull-and-quantize Qwen/Qwen3.5-27B --revision main --bits 8" in result.output.replace("\n", "")


def test_recipe_run_exit_code_follows_the_conversion(hub, tmp_path):
    """A recipe whose conversion fails exits non-zero (the publish job must go red); one that works exits 0."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('repo = "Qwen/Qwen3.5-27B"\nbits = 4\ngroup_size = 32\nupload_repo = "me/out"\n')
    failed = runner.invoke(app, ["recipe", "run", str(recipe), "--out", str(tmp_path / "o"), "--no-upload"])
    assert failed.exit_code == 2 and "not found" in failed.output, failed.output  # no such repo on this hub
    hub.add_folder("Qwen/Qwen3.5-27B", fixture_path("dense"))
    ok = runner.invoke(app, ["recipe", "run", str(recipe), "--out", str(tmp_path / "o"), "--no-upload"])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "o" / "config.json").exists() and "me/out" not in hub.repos


def test_add_mtp_grafts_the_head_reading_only_its_byte_ranges(hub, tmp_path):
    from mtpconvert.execute import execute
    from mtpconvert.options import ConvertOptions
    from mtpconvert.plan import build_plan
    from mtpconvert.options import QuantOptions
    from mtpconvert.io.checkpoint import open_checkpoint
    from mtpconvert.verify import verify

    # what users have today: a 4-bit folder without MTP (like mlx_lm.convert makes)
    ckpt = open_checkpoint(fixture_path("dense"))
    folder = tmp_path / "mlx"
    plan = build_plan(ckpt, ConvertOptions(dtype="bfloat16", quant=QuantOptions(bits=4, group_size=32, mtp="drop")))
    execute(plan, ckpt, folder)
    assert not verify(folder).ok or verify(folder).mtp_layers_config == 0
    before = {p.name: p.stat().st_ino for p in folder.iterdir()}

    result = runner.invoke(app, ["add-mtp", "Qwen/Tiny-MTP", str(folder)])
    assert result.exit_code == 0, result.output
    assert "identical to plain greedy" in result.output
    report = verify(folder)
    assert report.ok and report.mtp_layers_config == 1
    # only headers and mtp.* byte ranges were read from the weights
    served = hub.repos["Qwen/Tiny-MTP"].files["model.safetensors"]
    ranges = [r.range for r in hub.log if r.path.endswith("/model.safetensors") and r.method == "GET"]
    assert ranges and all(r and r.startswith("bytes=") for r in ranges)
    fetched = sum(int(b) - int(a) + 1 for a, b in (r[6:].split("-") for r in ranges))
    assert fetched < len(served) / 3
    # existing shards were linked, not rewritten
    after = {p.name: p.stat().st_ino for p in folder.iterdir()}
    assert all(after[n] == ino for n, ino in before.items() if n.endswith(".safetensors"))
    # a second graft is refused and changes nothing
    result = runner.invoke(app, ["add-mtp", "Qwen/Tiny-MTP", str(folder)])
    assert result.exit_code != 0 and "already has MTP" in result.output


def test_add_mtp_from_a_release_with_a_vision_only_shard(hub, tmp_path):
    """Qwen3.6-27B keeps its vision tower in a shard of its own, which a pull skips: add-mtp from such a
    release grafts the head without asking for that shard (the index still names it)."""
    from tests.checkpoints import build

    from mtpconvert.verify import verify

    src = reshard(build(tmp_path / "one", dtype="bfloat16", seed=5).path, tmp_path / "five", 5)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    vision_only = sorted({s for s in index.values()} - {s for k, s in index.items() if "visual" not in k})
    assert vision_only, "the reshard must leave a shard holding only the vision tower"
    hub.add_folder("Qwen/Vision-Shard", src)
    folder = tmp_path / "mlx"
    made = runner.invoke(app, ["convert", str(src), str(folder), "--bits", "4", "--group-size", "32", "--mtp", "drop",
                               "--no-smoke"])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["add-mtp", "Qwen/Vision-Shard", str(folder), "--no-smoke"])
    assert result.exit_code == 0, result.output
    assert verify(folder).ok and verify(folder).mtp_layers_config == 1
    asked = {r.path.rsplit("/", 1)[-1] for r in hub.log if r.path.endswith(".safetensors")}
    assert asked and not asked & set(vision_only)


def test_silent_hub_times_out_with_a_clear_error(tmp_path, monkeypatch):
    import socket
    import time

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    t0 = time.monotonic()
    try:
        result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(tmp_path / "out"), "--timeout", "1"])
    finally:
        silent.close()
    assert result.exit_code != 0 and "could not reach the Hub" in result.output, result.output
    assert time.monotonic() - t0 < 30 and not (tmp_path / "out").exists()


def reshard(src, dst, n):
    """Split a checkpoint into ``n`` Qwen3.5-named shards of consecutive keys, as the Hub's releases are
    (MoE expert groups may straddle a boundary)."""
    from mtpconvert.io.reader import read_all
    from mtpconvert.io.shard_writer import write_all

    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors"):
            shutil.copy(p, dst / p.name)
    tensors = {}
    for p in sorted(src.glob("*.safetensors")):
        tensors.update(read_all(p))
    keys, total = sorted(tensors), sum(t.nbytes for t in tensors.values())
    weight_map, chunk, size, i = {}, {}, 0, 1
    for k in keys:
        chunk[k] = tensors[k]
        size += tensors[k].nbytes
        if size >= total * i / n or k == keys[-1]:
            name = f"model.safetensors-{i:05d}-of-{n:05d}.safetensors"
            write_all(dst / name, chunk, {"format": "pt"})
            weight_map.update({key: name for key in chunk})
            chunk, i = {}, i + 1
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def allocated(stage: Path) -> int:
    """Allocated bytes of the raw files in a streaming stage: holes (a stub's data, punched ranges) do not count."""
    return sum(p.stat().st_blocks * 512 for p in stage.rglob("*.safetensors*") if p.is_file())


def served_moe(hub, tmp_path, monkeypatch, quantizer: str, prefix: str, shards: int):
    """A bf16 MoE laid out as Qwen3.5 publishes it (fused backbone experts, per-expert head), in ``shards``
    consecutive-key shards on the loopback Hub under its own repo (a plain pull fills the cache), and the
    quantizer the conversion runs: "mlx" or "numpy workers". Returns (repo, source folder)."""
    from tests.checkpoints import build

    from mtpconvert.execute import pipeline as execute_mod

    if quantizer == "mlx":
        monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    else:
        monkeypatch.setattr(execute_mod, "NUMPY_MIN_BYTES", 0)
    src = reshard(build(tmp_path / "one", moe=True, experts="published35", dtype="bfloat16", seed=3).path,
                  tmp_path / f"{shards}-shards", shards)
    repo = prefix + quantizer.split()[0]
    hub.add_folder(repo, src)
    return repo, src


@pytest.mark.parametrize("quantizer", ["mlx", "numpy processes"])
def test_stream_keeps_at_most_two_raw_shards_on_disk(hub, tmp_path, monkeypatch, quantizer):
    """--stream: same bytes as a plain pull, each shard fetched once and deleted after use,
    raw data on disk never above the two largest shards; also when worker processes read
    the shards (each is fetched before a worker opens it)."""
    from mtpconvert.hub import pull as hub_mod

    repo, src = served_moe(hub, tmp_path, monkeypatch, quantizer, "Qwen/Five-", 5)
    shard_sizes = sorted(p.stat().st_size for p in src.glob("*.safetensors"))
    assert len(shard_sizes) == 5
    stage = tmp_path / ".streamed.stream"
    usage = []
    real_fetch, real_release = hub_mod.fetch_file, None
    from mtpconvert.hub import stream as streaming

    real_release = streaming.ShardStream.release

    def fetch(plan, name, dest, **kw):
        real_fetch(plan, name, dest, **kw)
        usage.append(allocated(stage))  # the sparse header stubs count only their header

    def release(self, stub):
        real_release(self, stub)
        usage.append(allocated(stage))

    monkeypatch.setattr(hub_mod, "fetch_file", fetch)
    monkeypatch.setattr(streaming.ShardStream, "release", release)
    args = ["--bits", "4", "--group-size", "32", "--no-smoke", "--max-shard-size", "0.00003"]
    result = runner.invoke(app, ["pull-and-quantize", repo, str(tmp_path / "streamed"), "--stream", *args])
    assert result.exit_code == 0, result.output
    whole = [r for r in hub.log if r.method == "GET" and r.range is None and r.path.endswith(".safetensors")]
    assert sorted(r.path.rsplit("/", 1)[-1] for r in whole) == sorted(p.name for p in src.glob("*.safetensors"))
    stubs = 5 * 8192  # each stub's header, rounded up to filesystem blocks
    assert usage and max(usage) <= shard_sizes[-1] + shard_sizes[-2] + stubs, (usage, shard_sizes)
    assert max(usage) > shard_sizes[0]  # the measurement saw real shards
    assert not stage.exists()

    result = runner.invoke(app, ["pull-and-quantize", repo, str(tmp_path / "plain"), *args])
    assert result.exit_code == 0, result.output
    plain = {p.name: p.read_bytes() for p in (tmp_path / "plain").glob("*.safetensors")}
    streamed = {p.name: p.read_bytes() for p in (tmp_path / "streamed").glob("*.safetensors")}
    assert len(plain) > 1 and streamed == plain


@pytest.mark.parametrize("prefetch", ["0", None])
def test_stream_with_no_prefetch_holds_one_raw_shard(hub, tmp_path, monkeypatch, prefetch):
    """--stream --prefetch-shards 0: every download starts with no other raw shard on disk (a dense model:
    no output tensor reads two shards), so raw data on disk never exceeds the largest shard; the output
    bytes are the default's, and the option is recorded for the card's command. The default (one shard
    ahead) starts a download while a shard is on disk: the measurement tells the two apart."""
    from tests.checkpoints import build

    from mtpconvert.hub import pull as hub_mod
    from mtpconvert.provenance import command_args

    # text-only: a reshard of the VLM wrapper puts the vision tower in a shard of its own, which a pull skips
    src = reshard(build(tmp_path / "one", wrapper="text", dtype="bfloat16", seed=3).path, tmp_path / "five", 5)
    hub.add_folder("Qwen/Five-Dense", src)
    sizes = sorted(p.stat().st_size for p in src.glob("*.safetensors"))
    stage, stubs = tmp_path / ".streamed.stream", 5 * 8192  # a stub's allocated header blocks
    assert sizes[0] > 2 * stubs  # a shard on disk shows above the stubs
    on_disk = functools.partial(allocated, stage)
    at_start, after, real_fetch = [], [], hub_mod.fetch_file

    def fetch(plan, name, dest, **kw):
        shard = name.endswith(".safetensors")  # not config, tokenizer, index
        if shard:
            at_start.append(on_disk())
        real_fetch(plan, name, dest, **kw)
        if shard:
            after.append(on_disk())

    monkeypatch.setattr(hub_mod, "fetch_file", fetch)
    args = ["--bits", "4", "--group-size", "32", "--no-smoke"]
    extra = ["--prefetch-shards", prefetch] if prefetch else []
    out = tmp_path / "streamed"
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Five-Dense", str(out), "--stream", *args, *extra])
    assert result.exit_code == 0, result.output
    assert len(at_start) == 5
    record = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["mtpconvert"]
    if prefetch == "0":
        assert max(at_start) <= stubs, at_start  # nothing else downloaded when a download starts
        assert sizes[0] < max(after) <= sizes[-1] + stubs, (after, sizes)
        assert record["stream"] == {"prefetch_shards": 0}
        assert command_args(record, "x")[-3:] == ["--stream", "--prefetch-shards", "0"]
        default = tmp_path / "default"
        assert runner.invoke(app, ["pull-and-quantize", "Qwen/Five-Dense", str(default), "--stream",
                                   *args]).exit_code == 0
        assert ({p.name: p.read_bytes() for p in out.glob("*.safetensors")}
                == {p.name: p.read_bytes() for p in default.glob("*.safetensors")})
    else:
        assert max(at_start) > sizes[0] + stubs // 2, at_start  # the next shard came while one was read
        assert "stream" not in record  # the default: the record of a plain pull


@pytest.mark.parametrize("args, expected", [
    (["--prefetch-shards", "0"], "--prefetch-shards needs --stream"),
    (["--stream", "--prefetch-shards", "-1"], "--prefetch-shards must be 0 or more"),
    (["--raw-window", "1"], "--raw-window needs --stream"),
    (["--stream", "--raw-window", "0"], "--raw-window must be a number of GB above 0"),
    (["--stream", "--raw-window", "1", "--prefetch-shards", "0"], "exclude each other"),
])
def test_bad_prefetch_is_one_line_naming_the_option(hub, tmp_path, args, expected):
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--no-smoke", *args])
    assert result.exit_code == 2 and expected in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()
    assert not [r for r in hub.log if r.path.endswith(".safetensors")]  # refused before any shard was read


class RangedPull:
    """What ``pull_by_ranges`` saw: the run's RangeStream, the bytes it had fetched ahead before the first block was
    made, the staging folder's allocated bytes when each block's ranges had arrived, and every GET of the
    repository's safetensors files, in order."""

    def __init__(self, feed, ahead, usage, gets):
        self.feed, self.ahead, self.usage, self.gets = feed, ahead, usage, gets

    def spans(self) -> list:
        """[start, end] (inclusive, as a Range header gives it) of each GET."""
        return [tuple(map(int, r.range.split("=")[1].split("-"))) for r in self.gets]


def pull_by_ranges(hub, monkeypatch, repo: str, out: Path, window: int, args) -> RangedPull:
    """``pull-and-quantize REPO OUT --stream --raw-window`` (``window`` bytes) ``ARGS``, watched. The first block
    waits until the prefetch has stopped (a loopback conversion keeps pace with its fetches, which would otherwise
    never run a window ahead): what was fetched by then is what the window lets the stream hold ahead."""
    import time

    from mtpconvert.hub import ranges

    stage, usage, feeds, ahead, first = out.parent / f".{out.name}.stream", [], [], [], len(hub.log)
    real_init, real_acquire = ranges.RangeStream.__init__, ranges.RangeStream.acquire

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        feeds.append(self)

    def acquire(self, key):
        if not ahead:  # the prefetch has stopped: every request taken has landed, and none came for 0.2 s
            seen = None
            while seen != (self.requests, self.held_bytes) or self.held_bytes != self.fetched_bytes:
                seen = (self.requests, self.held_bytes)
                time.sleep(0.2)
            ahead.append(self.held_bytes)
        real_acquire(self, key)
        usage.append(allocated(stage))

    monkeypatch.setattr(ranges.RangeStream, "__init__", init)
    monkeypatch.setattr(ranges.RangeStream, "acquire", acquire)
    result = runner.invoke(app, ["pull-and-quantize", repo, str(out), "--stream", "--raw-window", repr(window / 1e9),
                                 *args])
    assert result.exit_code == 0, result.output
    assert not stage.exists()
    gets = [r for r in hub.log[first:] if r.method == "GET" and r.path.endswith(".safetensors") and repo in r.path]
    assert gets and all(r.range for r in gets)  # never a whole shard
    (feed,) = feeds
    return RangedPull(feed, ahead[0], usage, gets)


@pytest.mark.parametrize("quantizer", ["mlx", "numpy workers"])
def test_stream_by_byte_ranges_holds_the_window_and_writes_the_same_bytes(hub, tmp_path, monkeypatch, quantizer):
    """--stream --raw-window: no shard is downloaded whole; each block's source bytes arrive just before it is
    made (the fused backbone experts as one gate or up half per expert) and are punched out after it is
    written, so raw data on disk stays near the window while the shards are several times larger. Every
    byte is fetched once, the output bytes are those of a plain pull, and the record gives the command."""
    from mtpconvert.io.header import read_header
    from mtpconvert.provenance import command_args

    repo, src = served_moe(hub, tmp_path, monkeypatch, quantizer, "Qwen/Ranges-", 2)
    shard_bytes = sorted(p.stat().st_size for p in src.glob("*.safetensors"))
    window = shard_bytes[0] // 8
    args = ["--bits", "4", "--group-size", "32", "--no-smoke"]
    out = tmp_path / "streamed"
    run = pull_by_ranges(hub, monkeypatch, repo, out, window, args)
    feed, spans = run.feed, run.spans()
    assert feed.requests == len(spans) - 2 * 2  # the stubs first: length prefix, then header, of each shard
    # every byte the plan reads (all but the vision tower's), in requests that never overlap: each fetched once
    read = sum(t.nbytes for p in src.glob("*.safetensors") for k, t in read_header(p).tensors.items()
               if "visual" not in k)
    assert sum(b - a + 1 for a, b in spans[2 * 2:]) == feed.fetched_bytes == read > shard_bytes[-1]
    # the window binds: fetched ahead at most the window, plus the blocks execution already waits for
    # (a few dozen tensors of at most 64 KiB here); disk follows it, punched ranges included
    stubs = 2 * 8192  # each stub's header, rounded up to filesystem blocks
    usage = run.usage
    assert feed.punched and usage and max(usage) <= feed.peak_bytes + stubs + 8 * 4096, (max(usage), feed.peak_bytes)
    assert window / 2 < run.ahead <= window and feed.peak_bytes < shard_bytes[0] / 3, (run.ahead, feed.peak_bytes)
    record = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["mtpconvert"]
    assert record["stream"] == {"raw_window_gb": window / 1e9}
    assert command_args(record, "x")[-3:] == ["--stream", "--raw-window", repr(window / 1e9)]

    plain = tmp_path / "plain"
    assert runner.invoke(app, ["pull-and-quantize", repo, str(plain), *args]).exit_code == 0
    assert shard_digests(out) == shard_digests(plain)


def test_a_full_disk_while_downloading_is_named_as_such():
    """ENOSPC under a download (huggingface_hub may wrap it) is "disk full", not "could not reach the Hub"."""
    import errno

    from mtpconvert.hub.errors import hub_error

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("download failed") from inner
    except RuntimeError as wrapped:
        for e in (full, wrapped):
            err = hub_error(e, "Qwen/Big", "model-00001-of-00002.safetensors")
            assert "disk full while downloading model-00001-of-00002.safetensors from Qwen/Big" in str(err)
            assert "--raw-window" in err.hint
    assert "could not reach the Hub" in str(hub_error(ConnectionResetError(), "Qwen/Big", "x"))


@pytest.mark.parametrize("fetch", [[], ["--raw-window", "0.001"]], ids=["shards", "ranges"])
def test_stream_failure_names_the_shard_and_leaves_nothing(hub, tmp_path, monkeypatch, fetch):
    """A shard that cannot be fetched mid-conversion (here: gone from the repository after the plan
    was made) fails the run with its name, whether whole or by byte ranges; no OUT, no partial
    folder, no staged shards are left."""
    from mtpconvert.hub import pull as hub_mod

    repo = hub.repos["Qwen/Tiny-MoE"]
    victim = sorted(n for n in repo.files if n.endswith(".safetensors"))[-1]
    real_stubs = hub_mod.fetch_stubs

    def stubs_then_vanish(*a, **kw):
        folder = real_stubs(*a, **kw)
        del repo.files[victim]
        return folder

    monkeypatch.setattr(hub_mod, "fetch_stubs", stubs_then_vanish)
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MoE", str(out), "--stream", "--no-smoke", *fetch])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert victim in result.output
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))) == [".out.lock"]


# ------------------------------------------------------------ --stream --upload-repo (hub/publish.py)

PUBLISH_ARGS = ["--bits", "4", "--group-size", "32", "--max-shard-size", "0.00003"]


def five_shard_moe(hub, tmp_path, repo="Qwen/Five-Pub"):
    from tests.checkpoints import build

    src = reshard(build(tmp_path / "one", moe=True, experts="published35", dtype="bfloat16", seed=3).path,
                  tmp_path / "five", 5)
    hub.add_folder(repo, src)
    return repo


def shards_holding_data(folder: Path) -> int:
    """Model shards in ``folder`` whose bytes are on disk (a header stub holds one block or two). A shard
    gone between listing and looking (the folder renamed to OUT at the end) holds nothing."""
    def allocated(p: Path) -> int:
        try:
            return p.stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    return sum(1 for p in folder.glob("model-*.safetensors") if allocated(p) > 16 * 1024)


class Counts(list):
    stop = None


def watch_output_shards(monkeypatch, partial: Path) -> Counts:
    """Count the shards holding data in the partial folder at every shard handed to the publisher and every
    stub, and every 2 ms in between."""
    import threading

    from mtpconvert.hub import publish

    counts, done = Counts(), threading.Event()

    def poll():
        while not done.is_set():
            if partial.exists():
                counts.append(shards_holding_data(partial))
            done.wait(0.002)

    real_finished, real_stub = publish.ShardPublisher.finished, publish.stub_in_place

    def finished(self, shard, path, fingerprint):
        counts.append(shards_holding_data(partial))
        real_finished(self, shard, path, fingerprint)

    def stub(path):
        counts.append(shards_holding_data(partial))
        real_stub(path)

    monkeypatch.setattr(publish.ShardPublisher, "finished", finished)
    monkeypatch.setattr(publish, "stub_in_place", stub)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    counts.stop = lambda: (done.set(), poller.join())
    return counts


def test_streamed_publish_equals_a_plain_upload_and_keeps_two_output_shards(hub, tmp_path, monkeypatch):
    """--stream --upload-repo --no-smoke: the repo gets the same bytes as convert-then-upload, in one commit;
    each shard is sent once (the MTP head once for its two paths); at most two output shards hold data
    locally at any time; OUT keeps the small files and the head, not the stubs."""
    import hashlib

    repo = five_shard_moe(hub, tmp_path)
    counts = watch_output_shards(monkeypatch, tmp_path / ".streamed.partial")
    result = runner.invoke(app, ["pull-and-quantize", repo, str(tmp_path / "streamed"), "--stream", "--no-smoke",
                                 "--upload-repo", "a/tiny", *PUBLISH_ARGS])
    counts.stop()
    assert result.exit_code == 0, result.output
    streamed = hub.repos["a/tiny"]
    model_shards = [n for n in streamed.files if n.startswith("model-")]
    assert len(model_shards) >= 5, model_shards
    assert len(streamed.commits) == 1
    assert counts and max(counts) <= 2 and max(counts) >= 1, counts  # the watch saw real shards
    sent = hub.lfs_puts
    assert len(sent) == len(set(sent))  # nothing sent twice
    head = hashlib.sha256(streamed.files["mtp.safetensors"]).hexdigest()
    assert sent.count(head) == 1 and streamed.files["mtp/weights.safetensors"] == streamed.files["mtp.safetensors"]
    local = tmp_path / "streamed"
    assert not list(local.glob("model-*.safetensors")) and (local / "mtp.safetensors").is_file()
    assert (local / "config.json").read_bytes() == streamed.files["config.json"]

    plain = tmp_path / "plain"
    assert runner.invoke(app, ["pull-and-quantize", repo, str(plain), "--no-smoke", *PUBLISH_ARGS]).exit_code == 0
    result = runner.invoke(app, ["upload", str(plain), "b/tiny", "--no-smoke"])
    assert result.exit_code == 0, result.output
    uploaded = hub.repos["b/tiny"].files
    assert set(uploaded) == set(streamed.files)
    for name in uploaded:
        if name == "README.md":  # the card names its repo
            assert streamed.files[name].replace(b"a/tiny", b"b/tiny") == uploaded[name]
        else:
            assert streamed.files[name] == uploaded[name], name


def test_streamed_publish_failure_leaves_no_commit_and_a_retry_completes(hub, tmp_path):
    """An upload refused mid-way fails the run with the file's name and no commit; the shards stay with the
    resume command. ``--resume`` rebuilds nothing already delivered and re-sends nothing; a retry from
    scratch (a fresh CI runner) converts again but the Hub answers that it has every shard."""
    repo = five_shard_moe(hub, tmp_path)
    out = tmp_path / "out"
    args = ["pull-and-quantize", repo, str(out), "--stream", "--no-smoke", "--upload-repo", "me/pub", *PUBLISH_ARGS]
    hub.fail_lfs_puts_after = 2
    failed = runner.invoke(app, args)
    assert failed.exit_code == 2, failed.output
    assert "model-00003" in failed.output and "--resume" in failed.output, failed.output
    assert hub.repos["me/pub"].commits == [] and not out.exists()
    first = list(hub.lfs_puts)
    assert len(first) == 2

    hub.fail_lfs_puts_after = None
    retried = runner.invoke(app, [*args, "--resume"])
    assert retried.exit_code == 0, retried.output
    assert not set(hub.lfs_puts[2:]) & set(first)  # delivered shards were neither rebuilt nor sent again
    assert len(hub.repos["me/pub"].commits) == 1
    files = hub.repos["me/pub"].files
    index = json.loads(files["model.safetensors.index.json"])
    assert set(index["weight_map"].values()) <= set(files)

    before = len(hub.lfs_puts)
    fresh = runner.invoke(app, ["pull-and-quantize", repo, str(tmp_path / "fresh"), "--stream", "--no-smoke",
                                "--upload-repo", "me/pub", *PUBLISH_ARGS])
    assert fresh.exit_code == 0, fresh.output
    assert hub.lfs_puts[before:] == []  # the Hub holds every object: nothing re-sent
    assert len(hub.repos["me/pub"].commits) == 2 and hub.repos["me/pub"].files == files


def test_streamed_publish_with_the_full_smoke_keeps_the_shards_until_it_passed(hub, tmp_path):
    """With --smoke-mode full (it loads the whole folder), shards are pre-uploaded as they finish but kept;
    the card carries the measured acceptance. (The default, layerwise, is fed shard by shard and frees
    them: tests/test_streamed_smoke.py.)"""
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--stream", "--upload-repo",
                                 "me/smoked", "--bits", "8", "--group-size", "32", "--max-shard-size", "0.0001",
                                 "--smoke-mode", "full"])
    assert result.exit_code == 0, result.output
    repo = hub.repos["me/smoked"]
    shards = sorted(n for n in repo.files if n.startswith("model-"))
    assert len(shards) >= 2 and len(repo.commits) == 1
    assert all((out / n).read_bytes() == repo.files[n] for n in shards)
    card = repo.files["README.md"].decode()
    assert "| smoke (greedy MTP draft acceptance, depth 1) | not run |" not in card and "%" in card


# ------------------------------------------------------------ shards a pull skips (issue #16)

VISION_SHARD = "model.safetensors-00004-of-00005.safetensors"  # reshard(dense-vlm, 5): model.visual.* only
MTP_SHARD = "model.safetensors-00005-of-00005.safetensors"  # mtp.* only
SKIP_ARGS = ["--bits", "4", "--group-size", "32", "--no-smoke"]


@pytest.fixture()
def five_shard_vlm(hub, tmp_path, raw_checkpoints):
    """The VLM fixture in five shards, as Qwen3.6-27B is published: one holds only the vision tower,
    the last only the MTP head."""
    src = reshard(raw_checkpoints("dense-vlm").path, tmp_path / "five-vlm", 5)
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k.split(".")[1] for k, s in weight_map.items() if s == VISION_SHARD} == {"visual"}
    assert {k.split(".")[0] for k, s in weight_map.items() if s == MTP_SHARD} == {"mtp"}
    hub.add_folder("Qwen/Five-VLM", src)
    return src


def shard_digests(folder: Path) -> dict:
    from tests.checkpoints import tree_digest

    return {n: d for n, d in tree_digest(folder).items() if n.endswith(".safetensors")}


@pytest.mark.parametrize("mtp", ["keep", "drop"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pull_converts_without_the_shards_it_skipped(hub, five_shard_vlm, tmp_path, stream, mtp):
    """A shard holding only dropped tensors (vision; MTP with --mtp drop) is neither fetched nor
    asked for: the output equals converting the full folder, byte for byte."""
    from tests.checkpoints import convert_folder

    skipped = {VISION_SHARD} | ({MTP_SHARD} if mtp == "drop" else set())
    out = tmp_path / "pulled"
    args = ["pull-and-quantize", "Qwen/Five-VLM", str(out), *SKIP_ARGS, "--mtp", mtp] + (["--stream"] if stream else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert not skipped & set(hub.downloaded())
    plan = convert_folder(five_shard_vlm, tmp_path / "local", bits=4, group_size=32, mtp=mtp)
    assert shard_digests(out) == shard_digests(tmp_path / "local")
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "local" / "config.json").read_text())
    assert {r for _, r in plan.dropped} >= {"vision tower (use --keep-vision)"}


def test_plan_lists_the_tensors_of_a_skipped_shard_as_dropped(hub, five_shard_vlm, tmp_path):
    """--dry-run shows the shard under "skip"; the conversion plan of the pulled folder drops its tensors
    with the reason a vision tensor sharing a shard gets, and reads none of them."""
    from mtpconvert.hub import pull
    from mtpconvert.io.checkpoint import open_checkpoint
    from mtpconvert.plan import build_plan

    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Five-VLM", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert VISION_SHARD in {f["name"] for f in json.loads(result.stdout)["skip"]}
    pulled = pull.plan_pull("Qwen/Five-VLM")
    assert pulled.skipped_shards == [VISION_SHARD]
    folder = pull.download(pulled)
    ckpt = open_checkpoint(folder, absent=pulled.skipped_shards)
    assert VISION_SHARD not in ckpt.shards and not any(t.file.name == VISION_SHARD for t in ckpt.tensors.values())
    full = build_plan(open_checkpoint(five_shard_vlm))
    assert sorted(build_plan(ckpt).dropped) == sorted(full.dropped)
    assert {ckpt.absent[k] for k, _ in full.dropped if k in ckpt.absent} == {VISION_SHARD}


def test_keep_vision_fetches_the_vision_shard(hub, five_shard_vlm):
    result = runner.invoke(app, ["pull-and-quantize", "Qwen/Five-VLM", "--keep-vision", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert VISION_SHARD in {f["name"] for f in json.loads(result.stdout)["download"]}


def test_convert_still_refuses_a_folder_missing_a_shard(five_shard_vlm, tmp_path):
    """Only a pull's own choice excuses a shard: one missing from a folder the user gives is an error."""
    src = tmp_path / "broken"
    shutil.copytree(five_shard_vlm, src)
    (src / VISION_SHARD).unlink()
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--bits", "4", "--no-smoke"])
    assert result.exit_code == 2
    assert f"index lists shard '{VISION_SHARD}', which is missing" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_absent_shard_holding_a_kept_tensor_is_refused(five_shard_vlm):
    """open_checkpoint(absent=...) excuses a shard, not the tensors the conversion needs from it."""
    from mtpconvert.errors import LayoutError
    from mtpconvert.io.checkpoint import open_checkpoint
    from mtpconvert.plan import build_plan

    ckpt = open_checkpoint(five_shard_vlm, absent=["model.safetensors-00002-of-00005.safetensors"])
    with pytest.raises(LayoutError, match="was not fetched") as e:
        build_plan(ckpt)
    assert e.value.code == "shard-missing"


def test_published_qwen36_27b_vision_shard_is_skipped():
    """The real case: Qwen3.6-27B puts model.visual.* alone in shard 7 of 15, which a pull skips
    (and the converter then opens the folder without it, as tested above)."""
    from tools import layouts

    from mtpconvert.hub.pull import needed_files

    name = "Qwen3.6-27B"
    weight_map = {key: shard for key, _, _, shard in layouts.rows(name)}
    vision_only = "model-00007-of-00015.safetensors"
    assert {k.split(".")[1] for k, s in weight_map.items() if s == vision_only} == {"visual"}
    index = {"weight_map": weight_map}
    siblings = {s: 1 for s in set(weight_map.values())} | {"config.json": 1, "model.safetensors.index.json": 1}
    needed = needed_files(siblings, index, keep_vision=False, keep_mtp=True)
    assert vision_only not in needed
    assert set(weight_map.values()) - set(needed) == {vision_only}
    assert vision_only in needed_files(siblings, index, keep_vision=True, keep_mtp=True)


# ------------------------------------------------------------ Qwen3.8-27B's layout (issue #27): add-mtp from the Hub

QWEN38_TINY = "Qwen/Qwen3.8-Tiny"


def qwen38_release(src: Path, dst: Path) -> Path:
    """``src`` (a bf16 VLM raw checkpoint) rewritten as Qwen/Qwen3.8-27B publishes itself: every tensor BF16
    (A_log and linear_attn.norm too), shards ``model-0000N-of-00005.safetensors`` with the vision tower and the
    first layer in shard 1, ``embed_tokens`` alone in shard 3, and ``lm_head.weight`` with every ``mtp.*`` in the
    last shard."""
    import mlx.core as mx

    from mtpconvert.io.reader import read_all
    from mtpconvert.io.shard_writer import write_all

    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
    tensors = {}
    for p in sorted(src.glob("*.safetensors")):
        tensors.update({k: v.astype(mx.bfloat16) for k, v in read_all(p).items()})

    def layer(key: str):
        return int(key.split(".layers.")[1].split(".")[0]) if ".language_model.layers." in key else None

    groups = [
        lambda k: k.startswith("model.visual.") or layer(k) == 0,
        lambda k: layer(k) == 1,
        lambda k: k == "model.language_model.embed_tokens.weight",
        lambda k: (layer(k) or 0) >= 2 or k == "model.language_model.norm.weight",
        lambda k: k == "lm_head.weight" or k.startswith("mtp."),
    ]
    weight_map = {}
    for i, member in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        chunk = {k: tensors[k] for k in sorted(tensors) if member(k) and k not in weight_map}
        write_all(dst / name, chunk, {"format": "pt"})
        weight_map.update({k: name for k in chunk})
    assert set(weight_map) == set(tensors)
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def fetched_ranges(hub, repo: str, shard: str) -> list:
    """The merged [start, end) byte ranges of ``shard`` asked for by GET; a GET without a Range is the whole file."""
    size = len(hub.repos[repo].files[shard])
    spans = []
    for r in hub.log:
        if r.method == "GET" and r.path.endswith(f"/{shard}") and "/resolve/" in r.path:
            if not r.range:
                spans.append((0, size))
                continue
            a, b = r.range.removeprefix("bytes=").split("-")
            spans.append((int(a), int(b) + 1 if b else size))
    return merged(spans)


def merged(spans) -> list:
    """[start, end) spans, sorted, with those that touch or overlap joined."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def tensor_bytes(path: Path) -> dict:
    """Each tensor's dtype, shape and stored bytes, by key."""
    from mtpconvert.io.header import read_header

    data = path.read_bytes()
    return {k: (t.dtype, tuple(t.shape), data[t.start:t.end]) for k, t in read_header(path).tensors.items()}


def graft_onto_headless(hub, repo: str, src: Path, base: Path, tmp_path: Path, options) -> dict:
    """add-mtp as users meet it: ``base`` converted with ``options`` and --mtp drop (a folder without a single mtp.*
    tensor, that verifies), then ``add-mtp REPO`` (``src`` served as ``repo``) onto it. Gate that it exits 0 with the
    smoke's greedy output unchanged; the folder verifies with a complete head; the head is the one a direct `convert`
    of ``src`` with the same options writes; the backbone's shards are the bytes they were and the sidecar is the
    only new file; and from the Hub only, by range, each shard's header and its mtp.* tensors. Returns the head."""
    from tests.checkpoints import tree_digest

    from mtpconvert.io.checkpoint import MTP_FILE
    from mtpconvert.io.header import read_header
    from mtpconvert.verify import verify

    hub.add_folder(repo, src)
    folder, direct = tmp_path / "headless-4bit", tmp_path / "direct"
    made = runner.invoke(app, ["convert", str(base), str(folder), *options, "--mtp", "drop"])
    assert made.exit_code == 0, made.output
    before = verify(folder)
    assert before.ok and before.mtp_layers_config == 0 and before.mtp_layers_found == 0
    assert not (folder / MTP_FILE).exists()
    shards_before = {n: d for n, d in tree_digest(folder).items() if n.endswith(".safetensors")}

    result = runner.invoke(app, ["add-mtp", repo, str(folder), "--min-acceptance", "0", "--min-mlp-gain", "-1"])
    assert result.exit_code == 0, result.output
    assert "identical to plain greedy" in result.output
    report = verify(folder)
    assert report.ok and report.mtp_complete and report.mtp_layers_config == report.mtp_layers_found == 1
    made = runner.invoke(app, ["convert", str(src), str(direct), *options])
    assert made.exit_code == 0, made.output
    grafted = tensor_bytes(folder / MTP_FILE)
    assert grafted and grafted == tensor_bytes(direct / MTP_FILE)
    after = tree_digest(folder)
    assert {n: d for n, d in after.items() if n in shards_before} == shards_before
    assert {n for n in after if n.endswith(".safetensors")} == set(shards_before) | {MTP_FILE}
    gets = [r for r in hub.log if r.method == "GET" and r.path.endswith(".safetensors") and repo in r.path]
    assert gets and all(r.range for r in gets)
    for p in sorted(src.glob("*.safetensors")):
        header = read_header(p)
        want = [(0, header.data_start)] + [(t.start, t.end) for k, t in header.tensors.items() if k.startswith("mtp.")]
        assert fetched_ranges(hub, repo, p.name) == merged(want), p.name
    return grafted


def test_add_mtp_grafts_qwen38_27b_head_from_its_last_shard_by_byte_range(hub, tmp_path):
    """Qwen3.8-27B's head, as add-mtp meets it: no mlx-community conversion keeps a single mtp.* tensor
    (their 4bit folder is --bits 4 --keep-vision --mtp drop: tests/test_layouts.py), and the release puts
    lm_head and all 15 mtp.* in its last shard. add-mtp reads each shard's header and the mtp.* ranges only
    (not lm_head beside them, not whole shards), writes the same 15 sidecar tensors a direct conversion writes,
    leaves the backbone's shards as they were, and the folder verifies with a complete head."""
    from tests.checkpoints import build

    from mtpconvert.io.header import read_header

    built = build(tmp_path / "built", dtype="bfloat16", shards=3, shard_style="hf", seed=38)
    src = qwen38_release(built.path, tmp_path / "release")
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    last = "model-00005-of-00005.safetensors"
    mtp_keys = {k for k in weight_map if k.startswith("mtp.")}
    assert len(mtp_keys) == 15 and {k for k, s in weight_map.items() if s == last} == mtp_keys | {"lm_head.weight"}
    assert {t.dtype for s in set(weight_map.values()) for t in read_header(src / s).tensors.values()} == {"BF16"}

    options = ["--bits", "4", "--group-size", "64", "--keep-vision", "--no-smoke"]
    grafted = graft_onto_headless(hub, QWEN38_TINY, src, src, tmp_path, options)
    assert set(grafted) == mtp_keys
    lm_head = read_header(src / last).tensors["lm_head.weight"]  # beside the head in its shard: not read
    assert not any(a < lm_head.end and lm_head.start < b for a, b in fetched_ranges(hub, QWEN38_TINY, last))


# ------------------------------------------------------------ Qwen's block-FP8 releases (issue #27): one file per layer

FP8_MOE = "Qwen/Qwen3.6-Tiny-MoE-FP8"
FP8_ARGS = ["--bits", "4", "--group-size", "32", "--no-smoke"]


def fp8_release(raw_checkpoints, tmp_path, layout: str) -> Path:
    """``layout``'s raw checkpoint in Qwen's FP8 release layout (tests/fp8.py): F8_E4M3 weights, each with its BF16
    weight_scale_inv, experts one by one (the head's too, and the head in FP8 but mtp.fc); layers-{i}.safetensors,
    mtp.safetensors, outside.safetensors and the index."""
    from tests import fp8

    return fp8.fp8_twin(raw_checkpoints(layout), tmp_path / f"{layout}-fp8")


def scale_keys(folder: Path) -> dict:
    """file -> the weight_scale_inv keys it holds."""
    from mtpconvert.io.header import read_header

    return {p.name: {k for k in read_header(p).tensors if k.endswith(".weight_scale_inv")}
            for p in sorted(folder.glob("*.safetensors"))}


def test_stream_of_an_fp8_release_fetches_weights_and_scales_once_within_the_window(hub, tmp_path, monkeypatch,
                                                                                     raw_checkpoints):
    """--stream --raw-window on Qwen's FP8 layout (a MoE: four layers-i files, mtp, outside): no file is downloaded
    whole; each block's F8_E4M3 rows arrive with the scale rows that dequantize them, so the requests are, file by
    file, exactly each header and the bytes the plan reads (every tensor but the vision tower's: weights AND
    scales), none twice; the stream runs at most a window of half a layer's file ahead, and raw data on disk
    follows what it holds, under half what it reads. The output is byte for byte a plain pull's, and so is --stream
    by whole files, which fetches each file once."""
    from mtpconvert.io.header import read_header

    src = fp8_release(raw_checkpoints, tmp_path, "moe-published35")
    hub.add_folder(FP8_MOE, src)
    headers = {p.name: read_header(p) for p in sorted(src.glob("*.safetensors"))}
    layers = [n for n in headers if n.startswith("layers-")]
    assert len(layers) == 4 and set(headers) == {*layers, "mtp.safetensors", "outside.safetensors"}
    scales = scale_keys(src)
    assert all(scales[n] for n in [*layers, "mtp.safetensors"]) and not scales["outside.safetensors"]
    window = min((src / n).stat().st_size for n in layers) // 2  # half a layer's file

    out = tmp_path / "ranged"
    run = pull_by_ranges(hub, monkeypatch, FP8_MOE, out, window, FP8_ARGS)
    names = [r.path.rsplit("/", 1)[-1] for r in run.gets]
    spans = run.spans()
    # the stubs first: each file's length prefix, then its header; then the data, in requests that never overlap
    stubs = 2 * len(headers)
    assert sorted(zip(names[:stubs], spans[:stubs])) == sorted(
        (n, r) for n, h in headers.items() for r in ((0, 7), (8, h.data_start - 1)))
    data: dict = {}
    for name, (a, b) in zip(names[stubs:], spans[stubs:]):
        data.setdefault(name, []).append((a, b + 1))
    assert sum(b - a for spans_ in data.values() for a, b in spans_) == run.feed.fetched_bytes == sum(
        b - a for spans_ in data.values() for a, b in merged(spans_))  # no byte twice
    for name, header in headers.items():
        want = merged([(t.start, t.end) for k, t in header.tensors.items() if not k.startswith("model.visual.")])
        assert merged(data.get(name, [])) == want, name  # weights and scales, nothing else
        for key in scales[name]:  # (said once more for the scales: each inside what was fetched)
            t = header.tensors[key]
            assert any(a <= t.start and t.end <= b for a, b in want), key
    assert run.feed.requests == len(spans) - stubs
    # the window binds: the stream runs at most the window ahead of the conversion, and holds at once (the blocks in
    # flight included: the embedding and lm_head alone are 1.4 layer files here) under half of what it reads, less
    # than the largest file; disk follows what it holds (the stubs' header blocks aside): freed ranges are punched
    read = sum(b - a for spans_ in data.values() for a, b in spans_)
    assert window / 2 < run.ahead <= window and run.feed.peak_bytes < read / 2 < max(
        (src / n).stat().st_size for n in headers), (run.ahead, run.feed.peak_bytes, read)
    stub_blocks = sum(-(-h.data_start // 4096) * 4096 for h in headers.values())
    assert run.feed.punched and max(run.usage) <= run.feed.peak_bytes + stub_blocks + 8 * 4096, max(run.usage)

    whole, plain, first = tmp_path / "whole", tmp_path / "plain", len(hub.log)
    result = runner.invoke(app, ["pull-and-quantize", FP8_MOE, str(whole), "--stream", *FP8_ARGS])
    assert result.exit_code == 0, result.output
    gets = [r for r in hub.log[first:] if r.method == "GET" and r.path.endswith(".safetensors")]
    assert sorted(r.path.rsplit("/", 1)[-1] for r in gets if not r.range) == sorted(headers)  # each file once
    assert len([r for r in gets if r.range]) == stubs  # and only its stub's header by range
    assert runner.invoke(app, ["pull-and-quantize", FP8_MOE, str(plain), *FP8_ARGS]).exit_code == 0
    assert shard_digests(out) == shard_digests(whole) == shard_digests(plain) and shard_digests(plain)


FP8_TINY = "Qwen/Qwen3.6-Tiny-FP8"


@pytest.mark.parametrize("layout, backbone", [("dense-vlm", "bf16"), ("moe-published35", "fp8")],
                         ids=["dense-onto-bf16-conversion", "moe-onto-fp8-conversion"])
def test_add_mtp_grafts_the_head_of_an_fp8_release_from_its_mtp_file(hub, tmp_path, raw_checkpoints, layout,
                                                                     backbone):
    """add-mtp from Qwen's FP8 layout onto a head-less 4-bit folder (converted from the BF16 release, or from the FP8
    one with --mtp drop): the release's root mtp.safetensors is a raw shard of the release, not a converted sidecar.
    From it add-mtp reads by range the head's F8_E4M3 weights, their scales and the BF16 mtp.fc and norms; of every
    other file only the header. The head it writes is the one a direct `convert` of the release writes (the FP8
    weights dequantized with their scales), the backbone's shards are untouched, and the folder verifies."""
    from mtpconvert.io.checkpoint import MTP_FILE
    from mtpconvert.io.header import read_header

    src = fp8_release(raw_checkpoints, tmp_path, layout)
    raw_head = read_header(src / MTP_FILE).tensors
    assert scale_keys(src)[MTP_FILE] and raw_head["mtp.fc.weight"].dtype == "BF16"
    base = src if backbone == "fp8" else raw_checkpoints(layout).path
    options = ["--bits", "4", "--group-size", "64", "--dtype", "bfloat16", "--no-smoke"]
    grafted = graft_onto_headless(hub, FP8_TINY, src, base, tmp_path, options)
    assert not any(k.endswith("_scale_inv") for k in grafted)  # dequantized: no scale reaches the MLX head


def test_a_skipped_fp8_mtp_file_left_in_the_cache_is_not_read(hub, tmp_path, raw_checkpoints):
    """--mtp drop skips an FP8 release's mtp.safetensors, which holds only mtp.*; a copy an earlier pull left in the
    cache snapshot is a raw shard of the release, not a converted sidecar: it is not read (its entries are the
    index's absent ones), as for any skipped shard (docs/hub.md step 4)."""
    from mtpconvert.hub import pull
    from mtpconvert.io.checkpoint import MTP_FILE, open_checkpoint

    hub.add_folder(FP8_MOE, fp8_release(raw_checkpoints, tmp_path, "moe-published35"))
    pull.download(pull.plan_pull(FP8_MOE))  # an earlier pull kept the head
    pulled = pull.plan_pull(FP8_MOE, keep_mtp=False)
    assert pulled.skipped_shards == [MTP_FILE]
    ckpt = open_checkpoint(pull.download(pulled), absent=pulled.skipped_shards)
    assert MTP_FILE not in ckpt.shards and not any(k.startswith("mtp.") for k in ckpt.tensors)
    assert set(ckpt.absent.values()) == {MTP_FILE} and all(k.startswith("mtp.") for k in ckpt.absent)


# ------------------------------------------------------------ Qwen3-Next (issue #29): pull-and-quantize

NEXT_TINY = "Qwen/Qwen3-Next-Tiny"
NEXT_ARGS = ["--bits", "4", "--group-size", "32", "--no-smoke"]


@pytest.fixture()
def next_release(hub, tmp_path):
    """A tiny raw Qwen3-Next in the published layout, served: flat ``model.*`` keys, per-expert experts, a config
    with no MTP count, two ``model-0000N-of-00002`` shards with every ``mtp.*`` alone in the last."""
    from tests.checkpoints import build_next

    src = build_next(tmp_path / "next-raw", shards=2).path
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    head_shard = "model-00002-of-00002.safetensors"
    assert {k for k, s in weight_map.items() if s == head_shard} == {k for k in weight_map if k.startswith("mtp.")}
    hub.add_folder(NEXT_TINY, src)
    return src, head_shard


@pytest.mark.parametrize("fetch", [[], ["--prefetch-shards", "0"], ["--raw-window", "0.0002"]],
                         ids=["shards", "one-shard", "ranges"])
def test_streamed_pull_of_qwen3_next_keeps_the_whole_head(hub, next_release, tmp_path, fetch):
    """--stream on a Qwen3-Next release: the head-only shard is fetched (whole or by ranges), the output verifies
    with its MTP head complete (1 layer, found from the tensors: the config has no count) and every file is a local
    `convert`'s of the same source and options, byte for byte. With --mtp drop the head's shard is not fetched."""
    from tests.checkpoints import convert_folder, tree_digest
    from mtpconvert.verify import verify

    src, head_shard = next_release
    out = tmp_path / "pulled"
    result = runner.invoke(app, ["pull-and-quantize", NEXT_TINY, str(out), "--stream", *fetch, *NEXT_ARGS])
    assert result.exit_code == 0, result.output
    got = [r for r in hub.log if r.method == "GET" and r.path.endswith(head_shard)]
    assert got and (all(r.range for r in got) if "--raw-window" in fetch else any(r.range is None for r in got))
    report = verify(out)
    assert report.ok, [f.message for f in report.findings if f.severity == "error"]
    assert report.model_type == "qwen3_next" and report.mtp_complete
    assert report.mtp_layers_found == report.mtp_layers_config == 1
    convert_folder(src, tmp_path / "local", bits=4, group_size=32)
    assert shard_digests(out) == shard_digests(tmp_path / "local")
    assert (out / "mtp.safetensors").is_file() and "mtp.safetensors" in shard_digests(out)
    assert tree_digest(out / "mtp") == tree_digest(tmp_path / "local" / "mtp")  # the sidecar's weights + manifest
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "local" / "config.json").read_text())

    before = len(hub.log)
    dropped = tmp_path / "dropped"
    result = runner.invoke(app, ["pull-and-quantize", NEXT_TINY, str(dropped), "--stream", *fetch, *NEXT_ARGS,
                                 "--mtp", "drop"])
    assert result.exit_code == 0, result.output
    assert not [r for r in hub.log[before:] if r.method == "GET" and r.path.endswith(head_shard)]
    convert_folder(src, tmp_path / "local-drop", bits=4, group_size=32, mtp="drop")
    assert shard_digests(dropped) == shard_digests(tmp_path / "local-drop")


def test_upload_card_of_a_qwen3_next_folder(hub, next_release, tmp_path):
    """The card of a pulled Qwen3-Next folder, as `upload` sends it: the release as base model, the qwen3_next tag,
    the head as stored (float, 1 layer) and the command that made it; no Qwen3.5 (``language_model.``) names in what
    the card itself states. A folder whose config has no MTP count (as the release publishes it) or a vLLM-lineage
    ``num_nextn_predict_layers`` still gets its head's layer count."""
    from mtpconvert.hub.card import model_card

    out = tmp_path / "next-4bit"
    result = runner.invoke(app, ["pull-and-quantize", NEXT_TINY, str(out), *NEXT_ARGS])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["upload", str(out), "me/next-4bit", "--no-smoke"])
    assert result.exit_code == 0, result.output
    card = hub.repos["me/next-4bit"].files["README.md"].decode()
    assert f"base_model: {NEXT_TINY}" in card and "- qwen3_next" in card and "base_model_relation: quantized" in card
    stated = card.split("## MTP runtimes")[0]  # the runtime table below is mtpconvert.compat's
    assert "| backbone | 4-bit, group 32, affine |" in stated and "| MTP head | float (" in stated
    assert "| MTP layers | 1 |" in stated and "language_model" not in stated and "qwen3_5" not in stated
    assert f"pull-and-quantize {NEXT_TINY} next-4bit --revision {hub.repos[NEXT_TINY].sha} --bits 4" in card
    config = json.loads((out / "config.json").read_text())
    assert config.pop("mtp_num_hidden_layers") == 1
    (out / "config.json").write_text(json.dumps(config))
    assert "| MTP layers | 1 (from its tensors: config.json has no count) |" in model_card(out, "me/next-4bit")
    (out / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    assert "| MTP layers | 1 |" in model_card(out, "me/next-4bit")
