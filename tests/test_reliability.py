"""Bad inputs and faults: a clear error naming file/key, non-zero exit, nothing at OUT, source untouched."""

import errno
import json
import os
import shutil
import struct
import subprocess
import sys

import mlx.core as mx
import pytest
from tests.checkpoints import tree_digest
from typer.testing import CliRunner

from mtpconvert.execute import pipeline as execute_mod  # noqa: F401
from mtpconvert.execute.resume import RESUME_DIR
from mtpconvert.cli import app
from mtpconvert.errors import ConvertError, OutputError
from mtpconvert.execute import execute
from mtpconvert.options import ConvertOptions, ExecuteOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.verify import verify

runner = CliRunner()


def lock_is_free(path) -> bool:
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True


def copy_of(raw_checkpoints, tmp_path, name="dense-sharded-tied"):
    dst = tmp_path / "src"
    shutil.copytree(raw_checkpoints(name).path, dst)
    return dst


def small_shards_plan(src):
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32), max_shard_bytes=40_000))
    assert len({it.shard for it in plan.items}) >= 3
    return ckpt, plan


# ---------------------------------------------------------------- interruption and --resume


def test_interrupt_leaves_nothing_at_out_and_resume_reuses_checked_shards(raw_checkpoints, tmp_path):
    src = copy_of(raw_checkpoints, tmp_path)
    before = tree_digest(src)
    ckpt, plan = small_shards_plan(src)
    fresh = tmp_path / "fresh"
    execute(plan, ckpt, fresh)

    out = tmp_path / "out"
    stop_at = len(plan.items) * 2 // 3

    def interrupt(item, i):
        if i == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(plan, ckpt, out, progress=interrupt)
    assert not out.exists()
    partial = tmp_path / ".out.partial"
    assert partial.exists() and lock_is_free(tmp_path / ".out.lock")
    done = sorted(p.name for p in (partial / RESUME_DIR).iterdir())
    assert done, "some shards finished before the interruption"

    # a finished shard that was damaged afterwards is detected by its hash and rewritten
    victim = partial / done[0].removesuffix(".json")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))

    result = execute(plan, ckpt, out, ExecuteOptions(resume=True))
    assert result.shards_reused == len(done) - 1
    assert tree_digest(out) == tree_digest(fresh)  # byte-identical to an uninterrupted run
    assert not (out / RESUME_DIR).exists() and not partial.exists()
    assert tree_digest(src) == before


def test_resume_ignores_shards_from_a_different_plan(raw_checkpoints, tmp_path):
    src = copy_of(raw_checkpoints, tmp_path)
    ckpt, plan = small_shards_plan(src)
    out = tmp_path / "out"

    def interrupt(item, i):
        if i == len(plan.items) - 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(plan, ckpt, out, progress=interrupt)
    other = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=8, group_size=32), max_shard_bytes=40_000))
    result = execute(other, ckpt, out, ExecuteOptions(resume=True))
    assert result.shards_reused == 0 and verify(out).ok


def test_run_without_resume_starts_clean(raw_checkpoints, tmp_path):
    src = copy_of(raw_checkpoints, tmp_path)
    ckpt, plan = small_shards_plan(src)
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    (partial / "junk.safetensors").write_bytes(b"junk")
    result = execute(plan, ckpt, tmp_path / "out")
    assert result.shards_reused == 0 and not (tmp_path / "out" / "junk.safetensors").exists()


def test_sigterm_on_a_real_process_leaves_nothing_at_out(raw_checkpoints, tmp_path):
    src = raw_checkpoints("dense-vlm").path
    out = tmp_path / "out"
    # a child that converts, but pauses inside the first shard so the signal lands mid-write
    code = f"""
import sys, time
from mtpconvert.execute import pipeline as ex
def slowed(real):
    def slow(*a, **k):
        print("writing", flush=True); time.sleep(0.2); return real(*a, **k)
    return slow
ex.produce_block = slowed(ex.produce_block)  # blocks MLX gathers from the mapping
ex.apply_steps = slowed(ex.apply_steps)  # blocks the reader threads read in place
from mtpconvert.cli import run
sys.exit(run(["convert", {str(src)!r}, {str(out)!r}, "--no-smoke"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and not out.exists() and lock_is_free(tmp_path / ".out.lock")


# ---------------------------------------------------------------- disk full, locks


def test_disk_full_gives_clear_error_and_removes_temp(raw_checkpoints, tmp_path, monkeypatch):
    src = copy_of(raw_checkpoints, tmp_path)
    before = tree_digest(src)
    from mtpconvert.io import shard_writer

    real_write, calls = shard_writer.StreamingShardWriter.write, []

    def full(self, key, arr, row=0, **kw):
        calls.append(key)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, key, arr, row, **kw)

    monkeypatch.setattr(shard_writer.StreamingShardWriter, "write", full)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src), str(out), "--no-smoke"])
    assert result.exit_code != 0 and "disk full" in result.output
    # no OUT, no partial (no shard was finished); the lock file stays, free (io/output_folder.py says why)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "src"] and lock_is_free(tmp_path / ".out.lock")
    assert tree_digest(src) == before


HOLD_LOCK = """
import sys, time
from pathlib import Path
from mtpconvert.io.output_folder import OutputFolder
from mtpconvert.errors import OutputError
out, go = Path(sys.argv[1]), Path(sys.argv[2])
print("ready", flush=True)
while not go.exists():  # every contender starts at once
    time.sleep(0.005)
try:
    folder = OutputFolder(out, resume=True).__enter__()
except OutputError as e:
    print("refused", e.detail, flush=True)
    sys.exit(0)
print("holding", flush=True)
time.sleep(float(sys.argv[3]))
"""


def test_second_run_on_the_same_out_is_refused(raw_checkpoints, tmp_path):
    src = raw_checkpoints("dense-vlm").path
    out = tmp_path / "out"
    go = tmp_path / "go"
    go.touch()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out), str(go), "60"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert [holder.stdout.readline().strip() for _ in range(2)] == ["ready", "holding"]
        result = runner.invoke(app, ["convert", str(src), str(out), "--no-smoke"])
        assert result.exit_code == 2 and "another mtpconvert process is writing this output" in result.output
        assert not out.exists()
    finally:
        holder.kill()  # killed outright: the kernel drops its lock, nothing stale is left to take over
        holder.wait()
    result = runner.invoke(app, ["convert", str(src), str(out), "--no-smoke"])
    assert result.exit_code == 0, result.output


def test_racing_runs_over_a_stale_lock_file_one_wins(tmp_path):
    """A lock file left by a killed run (here: the PID file of an older version) is no lock; runs
    that start at the same moment get it one at a time, never two at once."""
    out, go = tmp_path / "out", tmp_path / "go"
    (tmp_path / ".out.lock").write_text("999999999")
    contenders = [subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out), str(go), "3"], stdout=subprocess.PIPE,
                                   text=True) for _ in range(12)]
    assert all(c.stdout.readline().strip() == "ready" for c in contenders)
    go.touch()
    said = [c.communicate(timeout=60)[0].strip() for c in contenders]
    assert sorted(s.split()[0] for s in said) == ["holding"] + ["refused"] * 11, said


# ---------------------------------------------------------------- hostile or inconsistent inputs


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "link.safetensors"])
def test_index_names_leaving_the_folder_are_refused(raw_checkpoints, tmp_path, name):
    src = copy_of(raw_checkpoints, tmp_path, "dense-vlm")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(src / "model.safetensors", outside)
    weight_map = {k: name for k in open_checkpoint(src).tensors}
    if name == "link.safetensors":
        os.symlink(outside, src / name)
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--no-smoke"])
    assert result.exit_code != 0 and repr(name) in result.output
    assert "index.json" in result.output and not (tmp_path / "out").exists()


def _edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _text(cfg):
    return cfg.get("text_config", cfg)


CONFIG_CASES = {
    "missing": (lambda f: (f / "config.json").unlink(), "config.json not found"),
    "not-json": (lambda f: (f / "config.json").write_text("{nope"), "not valid JSON"),
    "unknown-type": (lambda f: _edit_config(f, lambda c: c.update(model_type="llama")), "llama"),
    "hidden-size": (lambda f: _edit_config(f, lambda c: _text(c).update(hidden_size=_text(c)["hidden_size"] * 2)),
                    "shape"),
    "mtp-claims-two": (lambda f: _edit_config(f, lambda c: _text(c).update(mtp_num_hidden_layers=2)),
                       "mtp_num_hidden_layers"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(raw_checkpoints, tmp_path, case):
    src = copy_of(raw_checkpoints, tmp_path, "dense-vlm")
    mutate, expected = CONFIG_CASES[case]
    mutate(src)
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--no-smoke"])
    output = result.output.replace("\n", "")  # rich wraps long paths
    assert result.exit_code != 0 and expected in output, output
    assert "config.json" in output or "model.safetensors" in output
    assert not (tmp_path / "out").exists()


def test_moe_expert_count_disagreeing_with_weights(raw_checkpoints, tmp_path):
    src = copy_of(raw_checkpoints, tmp_path, "moe-per-expert")
    _edit_config(src, lambda c: _text(c).update(num_experts=_text(c)["num_experts"] + 1))
    with pytest.raises(ConvertError, match="does not match the config") as e:
        build_plan(open_checkpoint(src), ConvertOptions())
    assert e.value.key.endswith("mlp.gate.weight") and e.value.file.endswith("model.safetensors")


def test_pickle_weights_are_never_opened(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    # a pickle that would run code if loaded
    (tmp_path / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    result = runner.invoke(app, ["convert", str(tmp_path), str(tmp_path / "out"), "--no-smoke"])
    assert result.exit_code != 0 and "never loaded" in result.output
    assert not (tmp_path / "pwned").exists()


def test_no_remote_code_anywhere():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hits = []
    for base, _, files in os.walk(os.path.join(root, "mtpconvert")):
        for f in files:
            if f.endswith(".py") and "trust_remote_code=True" in open(os.path.join(base, f)).read():
                hits.append(f)
    assert not hits


# ---------------------------------------------------------------- verify --deep


def test_verify_deep_names_non_finite_tensors(raw_checkpoints, tmp_path):
    src = raw_checkpoints("dense-vlm").path
    out = tmp_path / "out"
    execute(build_plan(open_checkpoint(src), ConvertOptions()), open_checkpoint(src), out)
    shard = out / "mtp.safetensors"
    weights = mx.load(str(shard))
    key = "mtp.fc.weight"
    w = weights[key]
    weights[key] = mx.where(mx.arange(w.size).reshape(w.shape) == 3, mx.array(float("nan"), w.dtype), w)
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    assert verify(out).ok  # headers alone cannot see it
    result = runner.invoke(app, ["verify", str(out), "--deep", "--json"])
    assert result.exit_code == 1
    findings = json.loads(result.stdout)["findings"]
    assert [(f["code"], f["key"]) for f in findings if f["severity"] == "error"] == [("non-finite", key)]
    assert "1 NaN" in findings[0]["message"]
    text = runner.invoke(app, ["verify", str(out), "--deep"], env={"COLUMNS": "300"})
    assert text.exit_code == 1 and f"[{key}]" in text.output, text.output  # not eaten as rich markup


# ---------------------------------------------------------------- secrets


def test_token_never_appears_in_outputs(tmp_path, monkeypatch):
    from mtpconvert.fixture import fixture_path

    secret = "hf_SECRETmarker0123456789abcdef"
    monkeypatch.setenv("HF_TOKEN", secret)
    out = tmp_path / "out"
    logs = []
    for args in (["convert", str(fixture_path("dense")), str(out), "--bits", "8", "--group-size", "32"],
                 ["verify", str(out), "--json"], ["smoke", str(out), "--max-tokens", "8", "--json"],
                 ["convert", str(tmp_path / "missing"), str(tmp_path / "o2")]):
        result = runner.invoke(app, args)
        logs.append(result.output)
    assert all(secret not in log for log in logs)
    for p in out.rglob("*"):
        if p.is_file():
            assert secret.encode() not in p.read_bytes(), p.name


def test_output_error_is_a_convert_error():
    assert issubclass(OutputError, ConvertError)


def test_header_reader_refuses_huge_lengths_without_allocating(tmp_path):
    from mtpconvert.errors import SafetensorsError
    from mtpconvert.io.header import read_header

    f = tmp_path / "huge.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(SafetensorsError, match="exceeds"):
        read_header(f)


def _two_shards(raw_checkpoints, tmp_path):
    src = copy_of(raw_checkpoints, tmp_path, "moe-fused")  # two shards + index
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src, index


def test_duplicate_key_across_shards(raw_checkpoints, tmp_path):
    src, index = _two_shards(raw_checkpoints, tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    a, b = (mx.load(str(src / s)) for s in shards)
    key = next(iter(a))
    b[key] = a[key]
    mx.save_safetensors(str(src / shards[1]), b)
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--no-smoke"])
    output = result.output.replace("\n", "")
    assert result.exit_code != 0 and key in output and "two shards" in output, output
    assert not (tmp_path / "out").exists()


def test_shard_with_keys_the_index_does_not_list(raw_checkpoints, tmp_path):
    src, index = _two_shards(raw_checkpoints, tmp_path)
    victim = next(iter(index["weight_map"]))
    del index["weight_map"][victim]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--no-smoke"])
    output = result.output.replace("\n", "")
    assert result.exit_code != 0 and victim in output and "index" in output, output
    assert not (tmp_path / "out").exists()


def test_two_runs_give_byte_identical_output(raw_checkpoints, tmp_path):
    src = raw_checkpoints("moe-published35").path
    outs = []
    for name in ("a", "b"):
        ckpt = open_checkpoint(src)
        execute(build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32))), ckpt, tmp_path / name)
        outs.append(tree_digest(tmp_path / name))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("special, command, expected", [
    ("mtp.safetensors", "smoke", "is a FIFO"),
    ("mtp.safetensors", "verify", "is a FIFO"),
    ("mtp/weights.safetensors", "verify", "is a FIFO"),
])
def test_a_fifo_in_place_of_a_head_file_is_named_not_waited_on(tmp_path, special, command, expected):
    """A FIFO where a head file belongs is named, not opened (open() would wait for a writer forever)."""
    from mtpconvert.fixture import DENSE

    out = tmp_path / "out"
    assert subprocess.run([sys.executable, "-m", "mtpconvert", "convert", str(DENSE), str(out), "--no-smoke"],
                          capture_output=True).returncode == 0
    (out / special).unlink()
    os.mkfifo(out / special)
    proc = subprocess.run([sys.executable, "-m", "mtpconvert", command, str(out)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="400"))
    assert proc.returncode != 0 and expected in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert str(out / special) in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the head files of a converted folder agree


@pytest.fixture(scope="module")
def converted_dense(tmp_path_factory):
    from mtpconvert.fixture import DENSE

    out = tmp_path_factory.mktemp("conv") / "out"
    result = runner.invoke(app, ["convert", str(DENSE), str(out), "--no-smoke"])
    assert result.exit_code == 0, result.output
    return out


def converted_copy(converted_dense, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted_dense, out)
    (out / "mtp" / "weights.safetensors").unlink()
    os.link(out / "mtp.safetensors", out / "mtp" / "weights.safetensors")  # as convert writes it
    return out


def cli(*args):
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    return result.exit_code, result.output


def zeroed(blob: bytes, key: str) -> bytes:
    """A safetensors file with the bytes of one tensor zeroed: still valid, a different head."""
    n = struct.unpack("<Q", blob[:8])[0]
    a, b = json.loads(blob[8: 8 + n])[key]["data_offsets"]
    return blob[: 8 + n + a] + bytes(b - a) + blob[8 + n + b:]


def test_verify_refuses_a_head_link_with_other_bytes(converted_dense, tmp_path):
    """vllm-mlx reads mtp/weights.safetensors, the others mtp.safetensors: other bytes there used to pass
    verify (exit 0, "head injected")."""
    out = converted_copy(converted_dense, tmp_path)
    link = out / "mtp" / "weights.safetensors"
    link.unlink()
    link.write_bytes(zeroed((out / "mtp.safetensors").read_bytes(), "mtp.fc.weight"))
    code, output = cli("verify", out)
    assert code == 1 and "mtp-link" in output and str(link) in output and "[mtp.fc.weight]" in output, output
    code, output = cli("smoke", out)
    assert code != 0 and str(link) in output, output
    link.unlink()
    shutil.copy(out / "mtp.safetensors", link)  # an exact copy is as good as a link
    assert cli("verify", out)[0] == 0


def test_verify_names_a_head_link_to_a_non_safetensors_file(converted_dense, tmp_path):
    """Used to exit 0 with the whole runtime table silently gone."""
    out = converted_copy(converted_dense, tmp_path)
    link = out / "mtp" / "weights.safetensors"
    link.unlink()
    link.symlink_to("../tokenizer.json")
    code, output = cli("verify", out)
    assert code == 1 and str(link) in output and "FAILED" in output, output
    report = verify(out)
    assert {f.code for f in report.findings if f.severity == "error"} == {"mtp-link"}
    assert [f.file for f in report.findings] == [str(link)]


def test_verify_refuses_a_head_in_the_sidecar_and_the_shards(converted_dense, tmp_path):
    """Used to say "MTP-consistent" with only a mixed: layout label."""
    out = converted_copy(converted_dense, tmp_path)
    shard = out / "model-00001-of-00001.safetensors"
    weights = mx.load(str(shard))
    head = mx.load(str(out / "mtp.safetensors"))
    weights.update({"language_model." + k: v for k, v in head.items()})
    shard.unlink()
    mx.save_safetensors(str(shard), weights, {"format": "mlx"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({"language_model." + k: shard.name for k in head})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    code, output = cli("verify", out)
    assert code == 1 and "mtp-two-places" in output and str(out / "mtp.safetensors") in output, output
    assert "language_model.mtp." in output  # the key, in the shards
    for command in (["smoke", out], ["convert", out, tmp_path / "again", "--no-smoke"]):
        code, output = cli(*command)
        assert code != 0 and "two places" in output, output


def test_verify_refuses_a_manifest_that_lies_about_the_norms(converted_dense, tmp_path):
    out = converted_copy(converted_dense, tmp_path)
    manifest = out / "mtp" / "manifest.json"
    manifest.write_text(json.dumps({"artifact_schema_version": 1, "rmsnorm_weight_format": "hf_zero_centered"}))
    code, output = cli("verify", out)
    assert code == 1 and "manifest-norms" in output and str(manifest) in output, output
    assert "rmsnorm_weight_format" in output
    manifest.write_text("{not json")
    code, output = cli("verify", out)
    assert code == 1 and "manifest-invalid" in output and str(manifest) in output, output


def _header_length(blob: bytes, n: int) -> bytes:
    return struct.pack("<Q", n) + blob[8:]


@pytest.mark.parametrize("damage", ["truncated", "absurd", "not-json"])
def test_a_broken_sidecar_is_named_in_the_normal_output(converted_dense, tmp_path, damage):
    """verify's normal (not --json) output used to give the key or nothing, not the file."""
    out = converted_copy(converted_dense, tmp_path)
    sidecar = out / "mtp.safetensors"
    blob = sidecar.read_bytes()
    sidecar.unlink()
    sidecar.write_bytes({"truncated": blob[:100], "absurd": _header_length(blob, 2**62),
                         "not-json": blob[:8] + b"\xff" + blob[9:]}[damage])
    for command in ("verify", "smoke"):
        code, output = cli(command, out)
        assert code != 0 and f"(file {sidecar}" in output, output


def test_smoke_and_bench_refuse_a_sidecar_linking_out_of_the_folder(converted_dense, tmp_path):
    """smoke used to follow the link: a header length read from a token file, or another model's head passing."""
    out = converted_copy(converted_dense, tmp_path)
    elsewhere = tmp_path / "other-head.safetensors"
    shutil.copy(out / "mtp.safetensors", elsewhere)  # a valid head, just not this folder's
    (out / "mtp.safetensors").unlink()
    (out / "mtp.safetensors").symlink_to(elsewhere)
    for command in (["smoke", out], ["bench", out, "--max-tokens", "1"], ["verify", out],
                    ["convert", out, tmp_path / "again", "--no-smoke"]):
        code, output = cli(*command)
        assert code != 0 and "resolves outside" in output and str(out / "mtp.safetensors") in output, output
    assert not (tmp_path / "again").exists()


def test_smoke_reads_the_head_config_names(converted_dense, tmp_path, monkeypatch):
    """smoke used to look for mtp.safetensors only, whatever config's mlx_lm_extra_tensors.mtp_file said."""
    import mtpconvert.runtime.smoke.decode as smoke_mod

    monkeypatch.setattr(smoke_mod, "teacher_forced_mlp_gain", lambda *a, **k: None)  # the head's quality: test_smoke
    out = converted_copy(converted_dense, tmp_path)
    (out / "mtp.safetensors").rename(out / "draft.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["mlx_lm_extra_tensors"]["mtp_file"] = "draft.safetensors"
    (out / "config.json").write_text(json.dumps(config))
    smoke = ["smoke", out, "--max-tokens", "2", "-p", "a", "--min-acceptance", "0"]
    assert cli("verify", out)[0] == 0
    code, output = cli(*smoke)
    assert code == 0, output
    (out / "draft.safetensors").unlink()
    code, output = cli(*smoke)
    assert code != 0 and "mlx_lm_extra_tensors.mtp_file" in output and "config.json" in output, output


def test_config_head_fields_must_be_true_of_the_file(converted_dense, tmp_path):
    out = converted_copy(converted_dense, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["mlx_lm_extra_tensors"]["mtp_tensor_count"] += 1
    (out / "config.json").write_text(json.dumps(config))
    for command in (["verify", out], ["smoke", out], ["convert", out, tmp_path / "again", "--no-smoke"]):
        code, output = cli(*command)
        assert code != 0 and "mlx_lm_extra_tensors.mtp_tensor_count" in output and "config.json" in output, output


def test_add_mtp_and_upload_never_take_a_file_from_outside_the_folder(tmp_path):
    """add-mtp hard-linked every file of the folder into the new one, links to outside included; upload
    sent them to the Hub."""
    from mtpconvert.fixture import DENSE
    from mtpconvert.hub.upload import folder_operations

    out = tmp_path / "nohead"
    assert cli("convert", DENSE, out, "--no-smoke", "--mtp", "drop")[0] == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the hub")
    (out / "notes.txt").symlink_to(secret)
    with pytest.raises(ConvertError, match="resolves outside"):
        folder_operations(out, None)
    before = sorted(p.name for p in out.iterdir())
    code, output = cli("add-mtp", DENSE, out, "--no-smoke")
    assert code != 0 and "resolves outside" in output and str(out / "notes.txt") in output, output
    assert sorted(p.name for p in out.iterdir()) == before


def test_convert_refuses_a_fifo_in_place_of_a_tokenizer_file(tmp_path):
    """The files copied beside the weights go through the folder rule too: a FIFO is named, never opened (it would
    block) nor skipped (the output would silently lack its tokenizer)."""
    from mtpconvert.fixture import fixture_path

    src = tmp_path / "src"
    shutil.copytree(fixture_path("dense"), src)
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--no-smoke"])
    assert result.exit_code != 0 and "tokenizer.json" in result.output and "FIFO" in result.output, result.output
    assert not (tmp_path / "out").exists()
