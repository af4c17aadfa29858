"""The checks after the shards are written: which smoke runs (full or layerwise) and what it gates,
and that a failure there, or anywhere once a shard is finished, loses nothing finished."""

import errno

import pytest
from typer.testing import CliRunner

from tests.checkpoints import convert_folder, resume_command, without_shift
from mtpconvert import api
from mtpconvert.gate import GateFailed, GateRecord, Gate, choose_smoke, run_gate
from mtpconvert.cli import app
from mtpconvert.demo import fixture_prompts
from mtpconvert.execute.resume import RESUME_DIR
from mtpconvert.fixture import fixture_path
from mtpconvert.options import ConvertOptions, QuantOptions
from mtpconvert.verify import verify

runner = CliRunner()
GIB = 1 << 30
FIXTURE_Q4 = ConvertOptions(dtype="bfloat16", quant=QuantOptions(bits=4, group_size=32))


def fixture_checks(mode: str, verify: bool = True) -> Gate:
    return Gate(verify=verify, smoke_mode=mode, prompts=tuple(fixture_prompts(3)))


def memory_available(monkeypatch, n: int) -> None:
    from mtpconvert.runtime.smoke import sizing

    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: n)


# ---------------------------------------------------------------- full or layerwise


def test_choose_smoke_from_weight_bytes_against_available_memory(tmp_path, monkeypatch):
    out = tmp_path / "o"
    convert_folder(fixture_path("dense"), out, dtype="bfloat16")
    memory_available(monkeypatch, 16 * GIB)
    assert choose_smoke(out).mode == "full" and "fits in 16.0 GiB available" in choose_smoke(out).reason
    memory_available(monkeypatch, GIB)  # the weights plus 25% plus 1 GiB do not fit
    assert choose_smoke(out).mode == "layerwise" and "does not fit in 1.0 GiB" in choose_smoke(out).reason
    assert choose_smoke(out, "full").mode == "full"  # asked for: no measuring
    memory_available(monkeypatch, None)
    assert choose_smoke(out).mode == "layerwise"
    with pytest.raises(Exception, match="smoke mode"):
        Gate(smoke_mode="half")


@pytest.mark.parametrize("available, mode", [(64 * GIB, "full"), (GIB, "layerwise")])
def test_convert_runs_the_smoke_that_fits_and_says_which(tmp_path, monkeypatch, available, mode):
    memory_available(monkeypatch, available)
    result = api.convert(fixture_path("dense"), tmp_path / "o", FIXTURE_Q4, checks=fixture_checks("auto"))
    record = result.checks
    assert record.smoke_mode == mode and record.smoke_reason.startswith("the model (")
    assert record.smoke.acceptance >= 0.8 and record.smoke.ok  # 97-100% on the fixture, both ways
    assert (record.smoke.to_json().get("check") == "layerwise-teacher-forced") == (mode == "layerwise")


@pytest.mark.parametrize("mode", ["full", "layerwise"])
def test_both_smokes_collapse_on_a_broken_head(tmp_path, mode):
    out = tmp_path / "noshift"
    convert_folder(fixture_path("dense"), out, edit=without_shift(), dtype="bfloat16", bits=4, group_size=32)
    record = GateRecord()
    with pytest.raises(GateFailed, match=f"MTP smoke test failed \\({mode}"):
        run_gate(out, fixture_checks(mode, verify=False), record, has_mtp=True)  # verify sees it first
    assert record.failed == "smoke" and record.smoke_mode == mode


def test_cli_says_which_smoke_ran(tmp_path, monkeypatch):
    memory_available(monkeypatch, 64 * GIB)
    out = tmp_path / "fx"
    result = runner.invoke(app, ["convert", str(fixture_path("dense")), str(out), "--bits", "8", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    assert "smoke: full (the model (" in result.output and "fits in 64.0 GiB available)" in result.output


# ---------------------------------------------------------------- token identity is a diagnostic


def test_greedy_divergence_is_reported_with_its_margin_not_failed(tmp_path, monkeypatch):
    """A near-tie can part the k+1-token verify pass from the 1-token step (GPU kernels): the
    smoke reports where and by what margin, and still passes on acceptance."""
    import mlx.core as mx

    from mtpconvert.runtime.smoke import decode as smoke_mod
    from mtpconvert.runtime.decoding.load import load

    out = tmp_path / "o"
    convert_folder(fixture_path("dense"), out, dtype="bfloat16")
    real = smoke_mod.mtp_generate

    def parts_at_token_5(m, ids, n, **kw):  # as a near-tie would: one token differs, the rest follows it
        tokens, stats = real(m, ids, n, **kw)
        return tokens[:5] + [(tokens[5] + 1) % 512] + tokens[6:], stats

    monkeypatch.setattr(smoke_mod, "mtp_generate", parts_at_token_5)
    prompts = fixture_prompts(2)
    result = smoke_mod.smoke(out, prompts, max_tokens=12)
    assert result.ok and not result.identical and result.acceptance >= 0.8
    assert [(d.prompt, d.position) for d in result.divergences] == [(0, 5), (1, 5)]
    m = load(out)
    ids = smoke_mod.encode_prompts(out, prompts)[0]
    plain, _ = smoke_mod.plain_generate(m, ids, 12)
    logits = sorted(m.model(mx.array([ids + plain[:5]]))[0, -1].astype(mx.float32).tolist())
    assert result.divergences[0].margin == pytest.approx(logits[-1] - logits[-2], abs=1e-4)
    assert result.divergences[0].plain_token == plain[5]
    assert result.to_json()["divergences"][0]["top2_margin"] is not None

    from rich.console import Console

    from mtpconvert.cli.inspect import print_smoke

    console = Console(record=True, width=300)
    print_smoke(result, console)
    text = console.export_text()
    assert "differs from plain greedy at prompt 0 token 5" in text and "top-2 logit margin" in text and "pass" in text


# ---------------------------------------------------------------- nothing finished is lost


def test_verify_failure_keeps_the_shards_and_names_the_resume_command(raw_checkpoints, tmp_path, monkeypatch):
    from mtpconvert import gate

    def failing(folder, **kw):
        raise GateFailed("output failed verification: index-mismatch: made up for the test", file=folder)

    monkeypatch.setattr(gate, "verify_folder", failing)
    src, out = raw_checkpoints("dense-vlm").path, tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src), str(out), "--bits", "8", "--group-size", "32"])
    assert result.exit_code == 2 and "failed verification" in result.output
    assert resume_command(result.output) == ["convert", str(src), str(out), "--bits", "8", "--group-size", "32",
                                          "--resume"]
    assert not out.exists() and any((tmp_path / ".out.partial" / RESUME_DIR).glob("*.json"))


@pytest.mark.parametrize("error, message, code, advice", [
    (MemoryError(), "out of memory", 2, ["--resume", "--smoke-mode", "layerwise"]),  # the full smoke did not fit
    (RuntimeError("boom"), "internal error: RuntimeError: boom", 1, ["--resume", "--no-smoke", "--smoke-mode", "full"]),
    (KeyboardInterrupt(), "interrupted: nothing was written to", 130, ["--resume", "--smoke-mode", "full"]),
])
def test_an_exception_in_the_smoke_keeps_the_shards(raw_checkpoints, tmp_path, monkeypatch, error, message, code,
                                                    advice):
    from mtpconvert import gate

    def raising(*a, **kw):
        raise error

    monkeypatch.setattr(gate, "smoke_full", raising)
    src, out = raw_checkpoints("dense-vlm").path, tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src), str(out), "--smoke-mode", "full"])
    assert result.exit_code == code and message in result.output, result.output
    assert sorted(resume_command(result.output)) == sorted(["convert", str(src), str(out), *advice])
    assert not out.exists() and any((tmp_path / ".out.partial" / RESUME_DIR).glob("*.json"))
    monkeypatch.undo()
    result = runner.invoke(app, resume_command(result.output) + ["--no-smoke"] * ("--no-smoke" not in advice))
    assert result.exit_code == 0 and "reused after checking" in result.output, result.output
    assert verify(out).ok


def test_disk_full_after_some_shards_keeps_them(raw_checkpoints, tmp_path, monkeypatch):
    """Disk full in a later shard: the finished ones stay (in the first shard: nothing stays,
    tests/test_reliability.py)."""
    from mtpconvert.io import shard_writer

    real_close, closed = shard_writer.StreamingShardWriter.close, []

    def full_on_third(self):
        closed.append(self)
        if len(closed) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_close(self)

    monkeypatch.setattr(shard_writer.StreamingShardWriter, "close", full_on_third)
    src, out = raw_checkpoints("dense-sharded-tied").path, tmp_path / "out"
    args = ["convert", str(src), str(out), "--max-shard-size", "0.00004", "--no-smoke"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "disk full" in result.output
    assert resume_command(result.output) == [*args[:3], "--max-shard-size", "4e-05", "--resume", "--no-smoke"]
    assert len(list((tmp_path / ".out.partial" / RESUME_DIR).glob("*.json"))) == 2


def test_input_error_before_any_shard_removes_the_partial(raw_checkpoints, tmp_path, monkeypatch):
    from mtpconvert.errors import SafetensorsError
    from mtpconvert.io import reader

    def truncated(self, info):
        raise SafetensorsError("file is shorter than its header says", file=info.file)

    monkeypatch.setattr(reader.TensorReader, "ensure", truncated)
    src, out = raw_checkpoints("dense-vlm").path, tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src), str(out), "--no-smoke"])
    assert result.exit_code == 2 and "shorter than its header" in result.output, result.output
    assert "resume" not in result.output
    assert not (tmp_path / ".out.partial").exists() and not out.exists()
