"""An optimized BLAS under MLX (``mtpconvert.blas``) and the smoke's work fitted to the backend.

The re-exec is tested in real child processes: a script named ``mtpconvert`` (what ``is_cli_process``
recognises, as it does the installed command) calls ``blas.startup()`` and reports what it then has mapped
(``/proc/self/maps``) and which environment it runs under. The preloaded library is a copy of a plain
system library renamed ``libopenblas-*.so.0``, so the mechanics are tested on any Linux machine; the real
OpenBLAS, and the real command line, where they are installed."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpconvert import blas

REPO = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/maps"),
                           reason="LD_PRELOAD and /proc/self/maps are Linux's")

CHILD = """
import json, os, sys
print("start", os.getpid(), flush=True)
from mtpconvert import blas
blas.startup()
print(json.dumps({"pid": os.getpid(), "mapped": blas.mapped_blas(), "preload": os.environ.get("LD_PRELOAD", ""),
                  "state": os.environ.get(blas.STATE_ENV)}), flush=True)
"""


def plain_library() -> str:
    """A shared library with no BLAS in it and nothing to load but libc (zlib is everywhere Python is)."""
    for pattern in ("/lib/*-linux-gnu/libz.so.1", "/usr/lib/*-linux-gnu/libz.so.1", "/usr/lib64/libz.so.1",
                    "/lib64/libz.so.1", "/usr/lib/libz.so.1", "/lib/libz.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return os.path.realpath(found[0])
    pytest.skip("no libz.so.1 to stand in for a BLAS")


@pytest.fixture
def fake_blas(tmp_path) -> str:
    path = tmp_path / "libopenblas-standin.so.0"
    shutil.copy(plain_library(), path)
    return str(path)


def run_child(tmp_path: Path, env_extra: dict, drop=("LD_PRELOAD",)):
    script = tmp_path / "cli" / "mtpconvert"
    script.parent.mkdir(exist_ok=True)
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in drop and k not in (blas.ENV, blas.STATE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # this mtpconvert
    env.update(env_extra)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    starts = [ln for ln in lines if ln.startswith("start ")]
    return starts, json.loads(lines[-1]), p.stderr


# ---------------------------------------------------------------- the decision


def test_decide_preloads_an_optimized_blas_only_over_the_reference_one():
    ref = "/x/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
    fast = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    d = blas.decide({}, ref, fast)
    assert (d.state, d.library, d.preload) == (blas.PRELOADED, fast, fast)
    assert blas.decide({}, ref, None).state == blas.REFERENCE
    assert blas.decide({}, "/usr/lib/libopenblas.so.0", fast).state == blas.OPTIMIZED_LINKED
    assert blas.decide({}, None, fast).state == blas.UNKNOWN  # no mlx (or not the CPU wheel): nothing to do
    assert blas.decide({blas.ENV: "off"}, ref, fast).state == blas.OFF
    assert blas.decide({blas.ENV: "auto"}, ref, fast).state == blas.PRELOADED


def test_decide_respects_the_users_ld_preload():
    ref, fast = "/x/libblas-1.so.3", "/usr/lib/libopenblas.so.0"
    d = blas.decide({"LD_PRELOAD": "/opt/libjemalloc.so.2"}, ref, fast)
    assert d.state == blas.PRELOADED and d.preload == f"/opt/libjemalloc.so.2:{fast}"  # theirs first, kept
    for theirs in ("/opt/mkl/libmkl_rt.so.2", "/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3"):
        d = blas.decide({"LD_PRELOAD": f"/opt/libjemalloc.so.2 {theirs}"}, ref, fast)
        assert d.state == blas.USER and d.library == theirs and d.preload is None


def test_decide_with_a_named_library(tmp_path):
    lib = tmp_path / "libmyblas.so"
    lib.write_bytes(b"")
    # a named library is preloaded whatever MLX links
    assert blas.decide({blas.ENV: str(lib)}, "/usr/lib/libopenblas.so.0", None).preload == str(lib)
    missing = blas.decide({blas.ENV: str(tmp_path / "none.so")}, "/x/libblas-1.so.3", None)
    assert missing.state == blas.REFERENCE and missing.preload is None


def test_numpys_prefixed_openblas_is_not_taken_for_one():
    assert not blas.is_optimized("/v/numpy.libs/libscipy_openblas64_-32a4b2a6.so")  # scipy_cblas_sgemm64_ only
    assert blas.is_optimized("/usr/lib64/libopenblasp.so.0") and not blas.is_optimized("/x/libblas-bd8a282c.so.3")


def test_find_optimized_takes_the_first_installed(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "libopenblas.so.0").write_bytes(b"")
    patterns = [str(tmp_path / "a" / "libopenblas.so.0"), str(tmp_path / "b" / "libopenblas.so.0")]
    assert blas.find_optimized(patterns) == patterns[1]
    assert blas.find_optimized(patterns[:1]) is None


# ---------------------------------------------------------------- what MLX links


def test_elf_dynamic_reads_needed_and_runpath(tmp_path):
    needed = blas.elf_dynamic(plain_library())["needed"]
    assert any(n.startswith("libc.so") for n in needed)
    (tmp_path / "x.so").write_bytes(b"not an ELF file at all" * 4)
    with pytest.raises(ValueError):
        blas.elf_dynamic(str(tmp_path / "x.so"))


def test_the_mlx_cpu_wheel_links_the_reference_blas():
    lib = blas.mlx_library()
    if lib is None or not glob.glob(os.path.join(os.path.dirname(lib), "..", "..", "mlx_cpu.libs")):
        pytest.skip("not the mlx[cpu] wheel")
    linked = blas.linked_blas(lib)
    assert linked is not None and os.path.basename(linked).startswith("libblas-") and os.path.isfile(linked)
    assert not blas.is_optimized(linked)


# ---------------------------------------------------------------- the re-exec, in real processes


@linux
def test_reexec_preloads_the_library_once(tmp_path, fake_blas):
    starts, child, _ = run_child(tmp_path, {blas.ENV: fake_blas})
    assert len(starts) == 2  # the command, then itself once more under LD_PRELOAD: no loop
    assert starts[0].split()[1] == starts[1].split()[1] == str(child["pid"])  # exec: the same process
    assert fake_blas in child["mapped"] and child["preload"] == fake_blas and child["state"] == blas.PRELOADED


@linux
def test_reexec_keeps_the_users_preload_first(tmp_path, fake_blas):
    theirs = str(tmp_path / "libtheirs.so.1")
    shutil.copy(plain_library(), theirs)
    starts, child, _ = run_child(tmp_path, {blas.ENV: fake_blas, "LD_PRELOAD": theirs})
    assert len(starts) == 2 and child["preload"] == f"{theirs}:{fake_blas}" and fake_blas in child["mapped"]


@linux
def test_opt_out_and_loop_guard(tmp_path, fake_blas):
    starts, child, _ = run_child(tmp_path, {blas.ENV: "off"})
    assert len(starts) == 1 and child["state"] == blas.OFF and not any("standin" in p for p in child["mapped"])
    # decided already (the re-executed command, or a worker process it started): nothing happens again
    starts, child, _ = run_child(tmp_path, {blas.ENV: fake_blas, blas.STATE_ENV: blas.REFERENCE})
    assert len(starts) == 1 and fake_blas not in child["mapped"] and child["preload"] == ""
    # a BLAS the user preloads: left alone
    starts, child, _ = run_child(tmp_path, {blas.ENV: fake_blas, "LD_PRELOAD": fake_blas})
    assert len(starts) == 1 and child["state"] == blas.USER and child["preload"] == fake_blas


def test_startup_does_nothing_outside_the_command_line():
    before = os.environ.get(blas.STATE_ENV)
    blas.startup()  # this is pytest: an exec here would end the test run
    assert os.environ.get(blas.STATE_ENV) == before and not blas.is_cli_process()


@linux
def test_the_installed_openblas_is_preloaded_under_mlx(tmp_path):
    found, linked = blas.find_optimized(), blas.linked_blas()
    if found is None or linked is None or blas.is_optimized(linked):
        pytest.skip("needs mlx[cpu] on the reference BLAS and an installed OpenBLAS "
                    "(apt-get install libopenblas0-pthread)")
    starts, child, _ = run_child(tmp_path, {})
    assert len(starts) == 2 and child["state"] == blas.PRELOADED and child["preload"] == found
    assert any(blas.is_optimized(p) and "scipy_openblas" not in p for p in child["mapped"])


@linux
def test_the_command_line_reexecs_before_mlx_loads(tmp_path, fake_blas):
    """``python -m mtpconvert``: the loader's own log (LD_DEBUG=files) names the library the re-executed
    command preloads; with the opt-out it loads no such file."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ENV, blas.STATE_ENV)}
    for choice, loaded in ((fake_blas, True), ("off", False)):
        p = subprocess.run([sys.executable, "-m", "mtpconvert", "--version"], cwd=REPO, capture_output=True,
                           text=True, timeout=120, env=dict(env, **{blas.ENV: choice, "LD_DEBUG": "files"}))
        assert p.returncode == 0 and "0.1.0" in p.stdout, p.stderr[-2000:]
        assert (f"file={fake_blas}" in p.stderr) == loaded


@linux
def test_the_command_says_once_when_mlx_stays_on_the_reference_blas(tmp_path):
    linked = blas.linked_blas()
    if linked is None or blas.is_optimized(linked):
        pytest.skip("MLX does not link the reference BLAS here")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.STATE_ENV)}
    p = subprocess.run([sys.executable, "-m", "mtpconvert", "smoke", str(tmp_path / "none")], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=dict(env, **{blas.ENV: "off"}))
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note: MLX computes on the reference BLAS")]
    assert len(notes) == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.returncode != 0  # the folder does not exist: the command's own error, after the note
    p = subprocess.run([sys.executable, "-m", "mtpconvert", "smoke", str(tmp_path / "none"), "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=dict(env, **{blas.ENV: "off"}))
    assert "reference BLAS" not in p.stderr


# ---------------------------------------------------------------- the smoke's work against the backend


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.checkpoints import convert_folder
    from mtpconvert.fixture import fixture_path

    out = tmp_path_factory.mktemp("blas") / "q4"
    convert_folder(fixture_path("dense"), out, dtype="bfloat16", bits=4, group_size=32)
    return out


def test_layerwise_tokens_fit_the_measured_gemm_rate(converted, monkeypatch):
    from mtpconvert.runtime.smoke import compute

    units = compute.active_params(converted)
    assert set(units) >= {"lm_head", "mtp", "layer 0"} and all(v > 0 for v in units.values())
    assert compute.layerwise_flops(units, [96] * 3) == 2 * compute.layerwise_flops(units, [48] * 3)
    monkeypatch.setattr(compute, "gemm_gflops", lambda dtype, size=384: 1e6)
    assert compute.fitted_prompt_tokens(converted, 96) == (96, None)  # fast: the whole check
    seconds_at_96 = compute.layerwise_flops(units, [96] * 3) / 1e9  # at 1 GFLOP/s
    monkeypatch.setattr(compute, "gemm_gflops", lambda dtype, size=384: 1.0)
    tokens, why = compute.fitted_prompt_tokens(converted, 96, budget_s=seconds_at_96 / 2)
    assert tokens == 48 and "48 tokens of each prompt, not 96" in why
    tokens, why = compute.fitted_prompt_tokens(converted, 96, budget_s=seconds_at_96 / 100)
    assert tokens == compute.MIN_PROMPT_TOKENS  # never below the floor


def test_decoding_misfit(converted, tmp_path, monkeypatch):
    from mtpconvert.runtime.smoke import decode as smoke

    assert smoke.decoding_misfit(converted) is None  # the fixture decodes in seconds
    monkeypatch.setattr(smoke, "row_gflops", lambda folder, size=1024: 1e-6)
    assert "decoding would take" in smoke.decoding_misfit(converted)
    cut = tmp_path / "two-layers"
    cut.mkdir()
    (cut / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "num_hidden_layers": 2, "full_attention_interval": 4}}))
    assert "needs a full-attention layer" in smoke.decoding_misfit(cut)


def test_a_cut_layerwise_smoke_still_fails_a_broken_head(tmp_path, monkeypatch):
    from tests.checkpoints import convert_folder, without_shift
    from mtpconvert.gate import GateFailed, GateRecord, Gate, run_gate
    from mtpconvert.demo import fixture_prompts
    from mtpconvert.fixture import fixture_path
    from mtpconvert.runtime.smoke import compute

    out = tmp_path / "noshift"
    convert_folder(fixture_path("dense"), out, edit=without_shift(), dtype="bfloat16", bits=4, group_size=32)
    monkeypatch.setattr(compute, "gemm_gflops", lambda dtype, size=384: 1e-9)
    stages = []
    with pytest.raises(GateFailed, match="MTP smoke test failed"):
        run_gate(out, Gate(verify=False, smoke_mode="layerwise", prompts=tuple(fixture_prompts(3))),
                   GateRecord(), has_mtp=True, on_stage=stages.append)
    assert any(f"{compute.MIN_PROMPT_TOKENS} tokens of each prompt, not 96" in s for s in stages)
