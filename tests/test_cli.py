"""The CLI: exit codes, --json, refusal to clobber, nothing half-written."""

import json
import re
import shlex

import pytest
from tests.checkpoints import resume_command
from typer.testing import CliRunner

from mtpconvert.cli import app
from mtpconvert.execute.resume import RESUME_DIR
from mtpconvert.fixture import fixture_path
from mtpconvert.verify import verify

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
    assert any(t["name"] == "mtp.fc.weight" and t["quant"] is None and t["shard"] == "mtp.safetensors"
               for t in plan["tensors"])
    assert not (tmp_path / "out").exists()


def test_convert_then_verify_json(raw_checkpoints, tmp_path):
    src = raw_checkpoints("dense-vlm").path
    out = tmp_path / "out"
    # random weights cannot draft: the smoke test is skipped here (the fixture tests run it)
    result = runner.invoke(app, ["convert", str(src), str(out), "--bits", "4", "--dtype", "float16", "--no-smoke"])
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
    result = runner.invoke(app, ["convert", str(src), str(out), "--overwrite", "--no-smoke"])
    assert result.exit_code == 0


def test_failed_conversion_leaves_nothing(tmp_path):
    from tests.checkpoints import build

    built = build(tmp_path / "nomtp", mtp_layers=0, config_mtp=1, tokenizer=False)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(built.path), str(out)])
    assert result.exit_code == 2
    assert "mtp_num_hidden_layers=1" in result.output and "--mtp drop" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nomtp"]
    result = runner.invoke(app, ["verify", str(built.path), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["findings"][0]["code"] == "mtp-missing"


def test_convert_runs_smoke_and_a_failing_head_keeps_the_shards_for_resume(raw_checkpoints, tmp_path):
    """Random weights draft nothing useful: the smoke check fails before OUT is committed, the
    finished shards stay, and the command the message gives (--resume --no-smoke, same options)
    commits them without rewriting any."""
    src = raw_checkpoints("dense-vlm").path
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src), str(out), "--dtype", "float32", "--smoke-mode", "full"])
    assert result.exit_code == 2 and "MTP smoke test failed (full)" in result.output, result.output
    assert not out.exists() and (tmp_path / ".out.partial" / RESUME_DIR).is_dir()
    args = resume_command(result.output)
    assert args == ["convert", str(src), str(out), "--dtype", "float32", "--resume", "--no-smoke", "--smoke-mode",
                    "full"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "2 reused after checking" in result.output and verify(out).ok  # the model shard and mtp.safetensors
    assert not (tmp_path / ".out.partial").exists() and not (out / RESUME_DIR).exists()


def test_convert_fixture_passes_smoke_then_bench_json(tmp_path):
    from mtpconvert.demo import fixture_prompts
    from mtpconvert.fixture import fixture_path

    out = tmp_path / "fx"
    result = runner.invoke(app, ["convert", str(fixture_path("dense")), str(out), "--bits", "8", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    assert "identical to plain greedy" in result.output
    args = ["bench", str(out), "--max-tokens", "24", "--depth", "1", "--depth", "2", "--json"]
    for p in fixture_prompts(2):
        args += ["-p", p]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {(r["hidden"], r["depth"]): r for r in report["rows"]}
    assert set(rows) == {("post-norm", 1), ("post-norm", 2), ("pre-norm", 1), ("pre-norm", 2)}
    r = rows["post-norm", 2]
    assert r["mtp"]["acceptance"] > 0.8 and len(r["mtp"]["acceptance_by_depth"]) == 2
    assert r["plain"]["decode_tok_per_s"] > 0 and r["speedup"] > 0 and r["costs"]["beta"] > 0
    # plain = mlx-lm's generate_step, our loop only a cross-check; greedy MTP output equals mlx-lm's
    assert report["baseline"] == r["plain"]["decoder"] == "mlx_lm.generate.generate_step"
    assert r["plain_loop"]["decode_tok_per_s"] > 0 and r["speedup_vs_plain_loop"] > 0
    assert r["plain"]["emitted"] == r["mtp"]["emitted"] == 2 * 24 and r["greedy_identical_to_mlx_lm"]
    result = runner.invoke(app, ["bench", str(out), "--depth", "0"])
    assert result.exit_code == 2
    # the table, piped (not a terminal, 80 columns): every cell printed whole, the speedup column included
    table = runner.invoke(app, ["bench", str(out), "--max-tokens", "8", "-p", fixture_prompts(1)[0]],
                          env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    rows = [line for line in table.stdout.splitlines() if line.startswith("│ post") or line.startswith("│ pre")]
    assert len(rows) == 2 and "…" not in table.stdout, table.stdout
    assert all(re.search(r"│ +\d+\.\d\dx │", row) for row in rows), rows


def test_a_table_in_a_terminal_folds_instead_of_cutting_cells():
    import io

    from rich.console import Console
    from rich.table import Table

    from mtpconvert.cli.render import print_whole

    table = Table()
    for i in range(11):
        table.add_column(f"column {i}", justify="right")
    table.add_row(*[f"{i}.98x" for i in range(11)])
    screen = Console(file=io.StringIO(), force_terminal=True, width=70, color_system=None)
    print_whole(table, screen)
    text = screen.file.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 70, text


@pytest.mark.parametrize("args, message", [
    (["--q-mode", "nvfp4"], "--q-mode nvfp4 needs --bits"),
    (["--q-mode", "mxfp8"], "--q-mode mxfp8 needs --bits"),
    (["--keep-vision"], "--keep-vision"),
    (["--max-shard-size", "0"], "--max-shard-size"),
    (["--max-shard-size", "-1"], "--max-shard-size"),
])
def test_options_that_would_do_nothing_are_refused(tmp_path, args, message):
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["convert", str(fixture_path("dense")), str(out), "--no-smoke", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()


def test_json_without_dry_run_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(fixture_path("dense")), str(tmp_path / "o"), "--json"])
    assert result.exit_code == 2 and "--json needs --dry-run" in result.output and not (tmp_path / "o").exists()


def test_smoke_on_a_raw_folder_says_convert_first():
    result = CliRunner().invoke(app, ["smoke", str(fixture_path("dense"))])
    assert result.exit_code == 2 and "raw Hugging Face checkpoint: convert it first" in result.output


def test_smoke_refuses_an_empty_prompt():
    result = CliRunner().invoke(app, ["smoke", str(fixture_path("dense")), "-p", ""])
    assert result.exit_code == 2 and "--prompt must not be empty" in result.output


def test_an_unknown_exception_is_a_bug_report_not_a_hub_error(monkeypatch, tmp_path):
    from mtpconvert import api

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(api, "convert", boom)
    result = CliRunner().invoke(app, ["convert", str(fixture_path("dense")), str(tmp_path / "o")])
    assert result.exit_code == 1 and "internal error: RuntimeError: kaboom" in result.output
    assert "Hub" not in result.output and "Traceback" not in result.output
    monkeypatch.setenv("MTPCONVERT_DEBUG", "1")
    result = CliRunner().invoke(app, ["convert", str(fixture_path("dense")), str(tmp_path / "o")])
    assert "Traceback" in result.output


def test_add_mtp_on_a_stock_mlx_lm_folder_from_a_local_source(tmp_path):
    """The folder add-mtp exists for: made by mlx_lm.convert (no mtpconvert metadata), head from a local raw folder."""
    from mlx_lm import convert as mlx_lm_convert

    from mtpconvert.verify import verify

    folder = tmp_path / "mlx-lm-4bit"
    mlx_lm_convert(str(fixture_path("dense")), mlx_path=str(folder), quantize=True, q_bits=4, q_group_size=32)
    assert not verify(folder).mtp_complete
    result = CliRunner().invoke(app, ["add-mtp", str(fixture_path("dense")), str(folder)])
    assert result.exit_code == 0, result.output
    assert "pass" in result.output and "added" in result.output
    assert verify(folder).ok and verify(folder).mtp_complete


def test_convert_prints_the_runtime_table_and_verify_reports_it(tmp_path):
    from mtpconvert.compat import RUNTIMES

    out = tmp_path / "match"
    result = runner.invoke(app, ["convert", str(fixture_path("dense")), str(out), "--bits", "4", "--group-size", "32",
                                 "--mtp", "match", "--no-smoke"])
    assert result.exit_code == 0, result.output
    assert "MTP runtimes" in result.output
    for rt in RUNTIMES:
        assert rt in result.output, rt
    table = api_runtimes(out)
    for r in table.runtimes:  # one warning per runtime refused because of the head's precision
        assert (f"--mtp match: {r.runtime} cannot use this head" in result.output) is (r.head_usable.cause == "precision"
                                                                                     or r.backbone_exact.cause
                                                                                     == "precision")
    result = runner.invoke(app, ["verify", str(out), "--json"])
    report = json.loads(result.stdout)
    assert [r["runtime"] for r in report["runtimes"]] == list(RUNTIMES)
    assert report["mtp_layout"] == table.layout
    for r in report["runtimes"]:
        assert set(r) >= {"runtime", "versions", "backbone_exact", "head_usable"}
        assert set(r["backbone_exact"]) >= {"ok", "reason"} and set(r["head_usable"]) >= {"ok", "reason"}
    result = runner.invoke(app, ["verify", str(out)])
    assert "MTP runtimes" in result.stdout and "mlx-lm-pr990" in result.stdout and "exact?" in result.stdout


def api_runtimes(path):
    from mtpconvert import api

    return api.runtimes(path)


def test_convert_warns_for_each_runtime_the_mtp_precision_shuts_out(tmp_path, monkeypatch):
    """On the default layout with a --mtp match head (fc float): rapid-mlx refuses, the others take it."""
    from io import StringIO
    from types import SimpleNamespace

    from rich.console import Console
    from tests.test_compat import Q4, default_layout

    from mtpconvert.cli import convert as convert_cli
    from mtpconvert.options import QuantOptions

    def printed(folder, quant):
        buf = StringIO()
        monkeypatch.setattr(convert_cli, "console", Console(file=buf, width=200))
        convert_cli.print_runtimes(SimpleNamespace(out=folder, plan=SimpleNamespace(options=SimpleNamespace(
            quant=quant))))
        return buf.getvalue()

    match = printed(default_layout(tmp_path, "match", bits=4, quant=Q4), QuantOptions(bits=4, mtp="match"))
    warnings = [ln for ln in match.splitlines() if ln.startswith("warning")]
    assert len(warnings) == 1 and "--mtp match: rapid-mlx cannot use this head" in warnings[0]
    assert "float fc" in warnings[0] and "rapid-mlx" in match and "vllm-mlx" in match
    keep = printed(default_layout(tmp_path, "keep"), QuantOptions(bits=4))
    assert "warning" not in keep and "mlx-lm-pr990" in keep
    bits8 = printed(default_layout(tmp_path, "bits8", bits=8, quant=Q4), QuantOptions(bits=4, mtp_bits=8))
    assert "--mtp-bits 8: vllm-mlx cannot use this head: ValueError: [dequantize]" in bits8


def _commands(group, path=()):
    """(argv prefix, click command) for every command under ``group``, groups included."""
    yield list(path), group
    for name, cmd in getattr(group, "commands", {}).items():  # typer's own click: no isinstance(click.Group)
            yield from _commands(cmd, (*path, name))


def _examples(epilog: str):
    return [shlex.split(line, comments=True)[1:] for line in (epilog or "").splitlines()
            if line.strip().startswith("mtpconvert ")]


def test_help_pages_show_no_bool_type_and_every_option_has_one_line_of_help():
    import typer

    for path, cmd in _commands(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, path
        for param in cmd.params:
            if param.param_type_name == "option" or getattr(param, "help", None) is not None:
                help_text = (param.help or "").strip()
                assert help_text and "\n" not in help_text, (path, param.name)


def test_every_command_shows_examples_that_parse():
    """Each command's help ends in examples; each example is accepted by that command's own parser."""
    import typer

    root = typer.main.get_command(app)
    for path, cmd in _commands(root):
        if hasattr(cmd, "commands"):
            continue
        examples = _examples(cmd.epilog)
        assert (cmd.epilog or "").startswith("Examples:") and examples, path
        for argv in examples:
            assert argv[:len(path)] == path, (path, argv)
            with cmd.make_context(" ".join(path), argv[len(path):], resilient_parsing=False) as ctx:
                assert ctx.params is not None


def test_smoke_and_bench_name_a_truncated_shard(tmp_path):
    out = tmp_path / "fx"
    assert runner.invoke(app, ["convert", str(fixture_path("dense")), str(out), "--no-smoke"]).exit_code == 0
    shard = next(out.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4096])  # an interrupted copy
    for command in ("smoke", "bench"):
        result = runner.invoke(app, [command, str(out)], env={"COLUMNS": "300"})
        assert result.exit_code == 2, (command, result.output)
        assert shard.name in result.output and "internal error" not in result.output, result.output


def test_ctrl_c_in_the_demo_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    from mtpconvert import demo

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("mtpconvert.execute.execute", interrupted)  # Ctrl-C while the first conversion runs
    assert demo.run(["--out", str(tmp_path / "demo")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    monkeypatch.setattr(demo.api, "bench", interrupted)  # ... or while it is benched
    assert demo.run(["--out", str(tmp_path / "demo")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["convert", "SRC", "OUT", "--post-checks", "none"], "No such option: --post-checks"),
    (["convert", "SRC", "OUT", "--bits", "five"], "Invalid value for '--bits'"),
])
def test_a_usage_error_is_a_usage_message_not_a_bug_report(args, message):
    """The parser's own errors (typer >= 0.29 raises them from its copy of click) exit 2 with click's message."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mtpconvert", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "internal error" not in r.stderr and "Traceback" not in r.stderr
