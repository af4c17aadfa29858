"""Interruptions in every mode: SIGTERM to the whole process group while npquant's worker
processes run, Ctrl-C while --stream downloads, and the output lock (filelock)."""

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from tests.checkpoints import resume_command

from mtpconvert.execute.resume import RESUME_DIR

# Runs in every process of a child, its npquant workers too (they are spawned: nothing patched
# in the parent reaches them): each quantization task takes a while, so a signal finds the
# workers busy and the parent waiting on them. The pool runs even for a tiny checkpoint.
SLOW_WORKERS = """
import os, time
if os.environ.get("MTPCONVERT_TEST_SLOW_TASK"):
    from mtpconvert.execute import npquant, pipeline
    pipeline.NUMPY_MIN_BYTES = 0
    real = npquant.quantize_file_rows_into
    def slow_task(*args):
        time.sleep(float(os.environ["MTPCONVERT_TEST_SLOW_TASK"]))
        return real(*args)
    npquant.quantize_file_rows_into = slow_task
"""


def default_sigint() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A runner started as a background job (``make test &``)
    starts with SIGINT ignored, which its children inherit; the test is about our handler, not the runner's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def slow_pool_env(tmp_path, seconds: float) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WORKERS)
    env = dict(os.environ, MTPCONVERT_TEST_SLOW_TASK=str(seconds), COLUMNS="250")  # rich: no wrapped lines
    env["PYTHONPATH"] = os.pathsep.join([str(site), *sys.path])
    return env


def wait_for(condition, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the child ended first: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def group_members(pgid: int) -> list:
    """Pids of the process group ``pgid`` (the child's session: it was started as its leader)."""
    out = subprocess.run(["ps", "-o", "pid=", "-s", str(pgid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def pool_workers(pgid: int) -> list:
    """The spawned worker processes of the session (not its resource tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "-s", str(pgid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


PROGRESS_LINE = re.compile(r"\[ *\d+\.\ds\] ")


def error_lines(stderr: str) -> list:
    """What the run printed after its plan summary (which ends with the 'layout ...' lines), its progress log
    ('[   6.9s] converting: ...': stderr is not a terminal) left out."""
    lines = [line for line in stderr.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    after = max((i for i, line in enumerate(lines) if line.startswith("layout ")), default=-1) + 1
    return lines[after:]


@contextmanager
def group_killed_on_exit(proc):
    """Whatever the test does with ``proc``, no process of its group outlives the block."""
    try:
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def stop_and_wait(proc, stop, timeout: float):
    """Call ``stop()`` (deliver the signal), wait for ``proc`` to exit: (its stderr, seconds it took)."""
    stop()
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return err, time.monotonic() - t0


def signal_group(pgid: int, sig: int) -> None:
    os.killpg(pgid, sig)


def signal_workers_first(pgid: int, sig: int) -> None:
    """As a supervisor that walks the process tree: the workers, then the parent a moment later."""
    for pid in group_members(pgid):
        if pid != pgid:
            os.kill(pid, sig)
    time.sleep(0.3)
    os.kill(pgid, sig)


def start_slow_pool_conversion(raw_checkpoints, tmp_path):
    """A 4-bit conversion into many small shards, its npquant workers slowed down, in its own
    process group: (argv, OUT, the process, the folder its resume records appear in)."""
    src = raw_checkpoints("dense-sharded-tied").path
    out = tmp_path / "out"
    args = ["convert", str(src), str(out), "--bits", "4", "--group-size", "32", "--max-shard-size", "0.00004",
            "--no-smoke"]
    proc = subprocess.Popen([sys.executable, "-m", "mtpconvert", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=slow_pool_env(tmp_path, 0.3), preexec_fn=default_sigint)
    return args, out, proc, tmp_path / ".out.partial" / RESUME_DIR


@pytest.mark.parametrize("deliver", [signal_group, signal_workers_first], ids=["group", "workers-first"])
def test_sigterm_while_the_worker_pool_runs(raw_checkpoints, tmp_path, deliver):
    """As a CI runner cancels a job: SIGTERM to every process, the npquant workers included.
    The run stops as on Ctrl-C: exit 130, one line naming the kept shards and the resume command,
    no BrokenProcessPool, no traceback, no process left; the resume command finishes the job."""
    args, out, proc, records = start_slow_pool_conversion(raw_checkpoints, tmp_path)
    with group_killed_on_exit(proc):
        wait_for(lambda: records.is_dir() and any(records.glob("*.json")), 60, proc)
        assert len(group_members(proc.pid)) >= 3  # the parent and its worker processes
        err, stopped_s = stop_and_wait(proc, lambda: deliver(proc.pid, signal.SIGTERM), 30)
    assert proc.returncode in (130, 143), err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interrupted: nothing was written to"), err
    assert "Traceback" not in err and "BrokenProcessPool" not in err
    assert stopped_s < 10
    wait_for(lambda: group_gone(proc.pid), 10)
    assert not out.exists() and any(records.glob("*.json"))
    resume = resume_command(lines[0])
    assert resume == [*args[:3], "--bits", "4", "--group-size", "32", "--max-shard-size", "4e-05",
                      "--resume", "--no-smoke"]

    from mtpconvert.cli import run

    assert run(resume) == 0
    assert out.is_dir() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("fetch", [[], ["--raw-window", "1"]], ids=["shards", "ranges"])
def test_ctrl_c_under_stream_stops_within_seconds(raw_checkpoints, tmp_path, fetch):
    """Ctrl-C while --stream downloads a shard, or byte ranges of it (served slowly: a shard would take
    ~30 s) ends the run at once instead of waiting for the download: exit 130, nothing at OUT, the
    staging folder gone."""
    from tests.hubserver import FakeHub

    with FakeHub() as hub:
        hub.add_folder("Qwen/Tiny-MoE", raw_checkpoints("moe-fused").path)
        shard_bytes = max(len(b) for n, b in hub.repos["Qwen/Tiny-MoE"].files.items() if n.endswith(".safetensors"))
        hub.bytes_per_s = shard_bytes / 30
        hub.throttle_ranges = bool(fetch)
        shards = sum(1 for n in hub.repos["Qwen/Tiny-MoE"].files if n.endswith(".safetensors"))
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_DISABLE_TELEMETRY="1",
                   COLUMNS="250")
        env.pop("HF_TOKEN", None)
        out = tmp_path / "out"
        proc = subprocess.Popen([sys.executable, "-m", "mtpconvert", "pull-and-quantize", "Qwen/Tiny-MoE", str(out),
                                 "--stream", "--no-smoke", *fetch], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env, preexec_fn=default_sigint)
        with group_killed_on_exit(proc):
            gets = lambda: [r for r in hub.log if r.method == "GET" and r.path.endswith(".safetensors")]  # noqa: E731
            if fetch:  # past the stubs' two header requests per shard: tensor data
                wait_for(lambda: len([r for r in gets() if r.range]) > 2 * shards, 60, proc)
            else:
                wait_for(lambda: any(r.range is None for r in gets()), 60, proc)
            time.sleep(0.5)  # well inside the download
            err, stopped_s = stop_and_wait(proc, lambda: os.killpg(proc.pid, signal.SIGINT), 60)
    assert proc.returncode == 130, err
    assert stopped_s < 5, stopped_s
    assert "Traceback" not in err and error_lines(err)[-1].startswith("interrupted"), err
    assert not out.exists() and not (tmp_path / ".out.stream").exists() and not (tmp_path / ".out.partial").exists()


def test_a_worker_killed_outright_is_named_and_the_shards_kept(raw_checkpoints, tmp_path):
    """SIGKILL (the kernel's OOM killer) on a worker: not a BrokenProcessPool bug report but a
    one-line error naming it, exit 2, the finished shards kept with the resume command."""
    args, out, proc, records = start_slow_pool_conversion(raw_checkpoints, tmp_path)
    with group_killed_on_exit(proc):
        wait_for(lambda: records.is_dir() and any(records.glob("*.json")), 60, proc)
        workers = pool_workers(proc.pid)
        assert len(workers) >= 2
        err, _ = stop_and_wait(proc, lambda: [os.kill(pid, signal.SIGKILL) for pid in workers], 30)
    assert proc.returncode == 2, err
    lines = error_lines(err)
    assert lines[0].startswith("error: a quantization worker process died") and "Traceback" not in err, err
    assert any("resume with: mtpconvert convert" in line for line in lines) and any(records.glob("*.json"))


@pytest.mark.parametrize("kind", ["shards", "ranges"])
def test_an_abandoned_download_logs_nothing_after_the_run(tmp_path, kind):
    """Ctrl-C abandons the downloads in flight; huggingface_hub's retry loop in their threads then
    logs the closed connection ("Retrying in 1s") after the run's last line. The library's own handler
    prints nothing an abandoned thread logs; what the main thread logs still shows."""
    import io
    import threading

    from mtpconvert.hub.ranges import RangeStream
    from mtpconvert.hub.stream import ShardStream
    from huggingface_hub.utils import logging as hub_logging

    http_log = hub_logging.get_logger("huggingface_hub.utils._http")
    in_request, abandoned = threading.Event(), threading.Event()

    def request(*_):
        in_request.set()
        abandoned.wait(10)
        http_log.warning("'[Errno 9] Bad file descriptor' thrown while requesting GET shard")
        raise OSError(9, "Bad file descriptor")

    handler = hub_logging.get_logger().handlers[0]  # the StreamHandler huggingface_hub installs
    printed = io.StringIO()
    before = handler.setStream(printed)
    try:
        if kind == "shards":
            stub = tmp_path / "model-00001-of-00001.safetensors"
            stub.write_bytes(b"")
            feed = ShardStream([stub], request)
            threading.Thread(target=lambda: pytest.raises(OSError, feed.ensure, stub), daemon=True).start()
        else:
            stub = tmp_path / "model.safetensors"
            stub.write_bytes(bytes(64))
            feed = RangeStream(request, window=64)
            feed.expect([("block", [(str(stub), 8, 64)])])
        assert in_request.wait(10)
        feed.abandon()
        abandoned.set()
        for t in feed._threads:
            t.join(10)
        http_log.warning("main thread: still printed")
    finally:
        handler.setStream(before)
    assert printed.getvalue() == "main thread: still printed\n"
