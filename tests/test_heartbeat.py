"""tools.heartbeat: `make demo`'s quiet install steps get a stage line and heartbeat lines on stderr."""

import io
import subprocess
import sys

import pytest

from tools import heartbeat


def test_a_log_gets_the_stage_and_a_line_per_beat_and_the_commands_status():
    out = io.StringIO()
    # the command sleeps 10x the beat, so the first wait times out: at least one beat line, whatever the load
    code = heartbeat.run("installing", [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"],
                         every=0.05, out=out)
    lines = out.getvalue().splitlines()
    assert code == 3
    assert lines[0] == "[make] installing..."
    assert len(lines) >= 2 and all(line.startswith("[make] installing: ") and line.endswith(" s") for line in lines[1:])


def test_a_quick_command_gets_the_stage_line_only_and_its_output_passes_through():
    done = subprocess.run([sys.executable, "-m", "tools.heartbeat", "saying hi", "--every", "60", "--",
                           sys.executable, "-c", "print('hi')"], capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout == "hi\n" and done.stderr == "[make] saying hi...\n"


@pytest.mark.parametrize("argv, message", [
    (["label"], "no command given"),
    (["label", "--"], "no command given"),
    (["label", "--every", "0", "--", "true"], "--every must be a positive number of seconds, got 0.0"),
])
def test_bad_arguments_say_what_is_wrong(argv, message):
    done = subprocess.run([sys.executable, "-m", "tools.heartbeat", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_command_that_cannot_start_is_named():
    out = io.StringIO()
    assert heartbeat.run("running", ["/nonexistent/tool"], out=out) == 127
    assert "cannot run '/nonexistent/tool'" in out.getvalue()
