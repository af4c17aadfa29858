"""The CLI: exit codes, --json, refusal to clobber, nothing half-written."""

import json

from typer.testing import CliRunner

from mtpconvert.cli import app

runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "convert" in result.output and "verify" in result.output


def test_dry_run_json_writes_nothing(raw_checkpoints, tmp_path):
    src = raw_checkpoints("moe-published35").path
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--bits", "4", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["norm_shift"] is True and plan["mtp_layers"] == 1
    assert any(t["name"] == "language_model.mtp.fc.weight" and t["quant"] is None for t in plan["tensors"])
    assert not (tmp_path / "out").exists()


def test_convert_then_verify_json(raw_checkpoints, tmp_path):
    src = raw_checkpoints("dense-vlm").path
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src), str(out), "--bits", "4", "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["format"] == "mlx"
    result = runner.invoke(app, ["verify", str(out), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["ok"] is True
    # existing OUT is refused without --overwrite, and left intact
    before = sorted(p.name for p in out.iterdir())
    result = runner.invoke(app, ["convert", str(src), str(out)])
    assert result.exit_code == 2 and "already exists" in result.output
    assert sorted(p.name for p in out.iterdir()) == before
    result = runner.invoke(app, ["convert", str(src), str(out), "--overwrite"])
    assert result.exit_code == 0


def test_failed_conversion_leaves_nothing(tmp_path):
    from checkpoints import build

    built = build(tmp_path / "nomtp", mtp_layers=0, config_mtp=1, tokenizer=False)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(built.path), str(out)])
    assert result.exit_code == 2
    assert "mtp_num_hidden_layers=1" in result.output and "--mtp drop" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nomtp"]
    result = runner.invoke(app, ["verify", str(built.path), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["findings"][0]["code"] == "mtp-missing"
