"""Progress: long stages report Steps; the CLI draws them on stderr (bars on a terminal, lines in a log),
stdout keeps the results (clean JSON under --json); the demo runs one conversion and says what next."""

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mtpconvert.cli import app
from mtpconvert.cli.progress import Bars, Lines, view_for
from mtpconvert.demo import fixture_prompts
from mtpconvert.fixture import fixture_path
from mtpconvert.progress import Step

runner = CliRunner()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("progress") / "fx"
    result = runner.invoke(app, ["convert", str(fixture_path("dense")), str(out), "--no-smoke"])
    assert result.exit_code == 0, result.output
    return out


def prompt_args(n: int = 2):
    return [arg for p in fixture_prompts(n) for arg in ("-p", p)]


@pytest.mark.parametrize("command, stage", [
    (["smoke", "--max-tokens", "6", *prompt_args()], "smoke: 0/36 tokens (prompt 1/2: plain greedy)"),
    (["bench", "--max-tokens", "6", "--mtp-hidden", "post-norm", *prompt_args()],
     "bench: 0/72 tokens (warm-up, prompt 1/2)"),
    (["bench", "--max-tokens", "4", "--concurrency", "1,2", *prompt_args()], "bench: 0/14 runs (depth 1, 1 stream: "),
    (["verify", "--deep"], "verify --deep: 0/"),
])
def test_progress_goes_to_stderr_and_json_stays_clean(converted, command, stage):
    name, *options = command
    result = runner.invoke(app, [name, str(converted), *options, "--json"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # nothing else on stdout
    lines = result.stderr.splitlines()
    assert any(stage in line for line in lines), result.stderr
    assert all(line.startswith("[") for line in lines if "tokens" in line or "tensors" in line or "runs" in line)


def test_a_piped_table_keeps_stdout_for_the_result(converted):
    result = runner.invoke(app, ["smoke", str(converted), "--max-tokens", "6", *prompt_args(1)])
    assert result.exit_code == 0, result.output
    assert "MTP draft acceptance" in result.stdout and "tokens (prompt" not in result.stdout
    assert "smoke: 0/18 tokens (prompt 1/1: plain greedy)" in result.stderr


def test_a_log_gets_a_line_per_stage_and_one_every_heartbeat():
    now = [0.0]
    out = io.StringIO()
    log = Lines(Console(file=out, width=200), interval=5.0, clock=lambda: now[0])
    log.stage("MTP smoke test")
    for t, done in ((0.1, 0), (2.0, 40), (4.9, 80), (5.2, 90), (9.0, 120), (10.3, 150)):
        now[0] = t
        log.step(Step("smoke", done, 432, "tokens", f"prompt {done // 144 + 1}/3"))
    now[0] = 11.0
    log.stage("bench")
    log.step(Step("bench", 0, None, "runs"))
    assert out.getvalue().splitlines() == [
        "[   0.0s] MTP smoke test...",
        "[   0.1s] smoke: 0/432 tokens (prompt 1/3)",  # a stage's first count
        "[   5.2s] smoke: 90/432 tokens (prompt 1/3)",  # then one at most every 5 s
        "[  10.3s] smoke: 150/432 tokens (prompt 2/3)",
        "[  11.0s] bench...",
        "[  11.0s] bench: 0 runs",
    ]


def test_a_log_gets_a_line_for_a_stage_that_counts_nothing_for_a_heartbeat():
    now = [0.0]
    out = io.StringIO()
    log = Lines(Console(file=out, width=200), interval=5.0, clock=lambda: now[0])
    log.beat()  # before any stage: nothing to say
    now[0] = 1.0
    log.stage("MTP smoke test: choosing full or layerwise")
    for t in (4.9, 6.0, 9.0, 11.2, 12.0):
        now[0] = t
        log.beat()
    log.step(Step("smoke", 0, 432, "tokens"))
    now[0] = 16.0
    log.beat()  # a count 3.9 s ago: not yet
    assert out.getvalue().splitlines() == [
        "[   1.0s] MTP smoke test: choosing full or layerwise...",
        "[   6.0s] MTP smoke test: choosing full or layerwise: running for 5 s",
        "[  11.2s] MTP smoke test: choosing full or layerwise: running for 10 s",
        "[  12.0s] smoke: 0/432 tokens",
    ]


def test_bars_only_where_both_streams_are_terminals(monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert isinstance(view_for(terminal), Bars)
    assert isinstance(view_for(terminal, quiet=True), Lines)  # --json
    assert isinstance(view_for(Console(file=io.StringIO())), Lines)  # stderr to a file
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert isinstance(view_for(terminal), Lines)  # stdout to a file or a pipe


def test_bars_pulse_until_a_stage_counts_and_restart_a_stage_that_runs_again():
    bars = Bars(Console(file=io.StringIO(), force_terminal=True))
    bars.stage("MTP smoke test: choosing full or layerwise for this model and backend")
    assert [(t.description, t.total) for t in bars.bar.tasks] == [("MTP smoke test", None)]
    bars.step(Step("smoke", 300, 432, "tokens"))
    first = bars.tasks["smoke"]
    assert [(t.description, t.completed) for t in bars.bar.tasks] == [("smoke", 300)]
    bars.step(Step("smoke", 0, 432, "tokens"))  # the next conversion's smoke
    assert bars.tasks["smoke"] != first and [t.completed for t in bars.bar.tasks] == [0]


def test_layerwise_messages_count_layers():
    from mtpconvert.gate import layer_steps

    steps, stages = [], []
    report = layer_steps(steps.append, stages.append)
    for msg in ("embedding rows", "layer 1/4", "layer 2/4", "layer 4/4", "MTP head", "lm_head rows 0-1024 of 2048"):
        report(msg)
    assert [(s.done, s.total) for s in steps] == [(0, None), (0, 4), (1, 4), (3, 4), (4, 4), (4, 4)]
    assert steps[-1].detail == "lm_head rows 0-1024 of 2048" and not stages
    report = layer_steps(None, stages.append)  # no progress callback: the stage lines of before
    report("layer 1/4")
    report("lm_head rows 0-1024 of 2048")
    assert stages == ["layerwise smoke: layer 1/4"]


def test_the_demo_runs_one_conversion_and_says_what_next(tmp_path, capsys):
    from mtpconvert import demo

    assert [c[0] for c in demo.chosen(every=True)] == [c[0] for c in demo.CONVERSIONS]
    assert [c[0] for c in demo.chosen(name="q4-mtp-8bit")] == ["q4-mtp-8bit"]
    assert demo.main(["--out", str(tmp_path / "demo"), "--fixture", "markov", "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    folder = demo.default_conversion()
    assert (tmp_path / "demo" / folder / "mtp.safetensors").is_file()
    label = dict((f, label) for f, label, _ in demo.CONVERSIONS)[folder]
    assert any(line.startswith(f"│ {label}") and "pass" in line for line in out.splitlines()), out
    assert "4 synthetic-language prompts x 8 tokens" in out
    assert f"verify {tmp_path / 'demo' / folder}" in out and "DEMO_ARGS=--all" in out
    for stage in ("converting: ", "smoke: 0/", "bench: 0/"):
        assert stage in err, err
