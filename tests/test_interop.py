"""Interop in CI (issue #15, the part that fits the budget): the converter's default layout, run in
the real runtimes, through the same probes and checks as ``make interop`` (``interop/run.py``).

* stock **mlx-lm 0.31.3** (pinned by mtplx, rapid-mlx and vllm-mlx): its ``qwen3_5`` sanitize adds
  +1 to every backbone norm a second time when any loaded key contains ``mtp.``. The sidecar
  folders (dense, MoE) must decode exactly like the project's own mlx-lm 0.32 (5 prompts, greedy
  tokens and first-step top-5 logprobs); the in-model folder must NOT (the hazard is real and this
  check sees it, so the test can fail);
* **mlx-vlm 0.7.10**: finds the head in ``mtp.safetensors``, drafts with acceptance above the smoke
  floor, its MTP greedy output equals its plain greedy output, backbone exact, head norms as written;
* ``mtpconvert.compat`` predicts every one of those observations.

The two runtimes are installed once, outside the repo, in
``${MTPCONVERT_INTEROP_CACHE:-~/.cache/mtpconvert/interop}/venvs/ci/``: a venv whose own
site-packages hold just the pinned packages (``pip install --no-deps``) in front of the project
venv's site-packages (a ``.pth``), so nothing large is downloaded (~10 s the first time). A file
lock keeps parallel runs from building the same venv. Without network access to the package index
the test is skipped, saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from interop import run
from mtpconvert.compat import check_folder
from tests.checkpoints import convert_folder

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "mtpconvert" / "fixture" / "data"
CACHE = Path(os.environ.get("MTPCONVERT_INTEROP_CACHE") or Path.home() / ".cache" / "mtpconvert" / "interop")
MAX_TOKENS = 24

# what each probe imports beyond the project venv (mlx-vlm's own requirements are much wider: audio,
# opencv, datasets, ...; its generate / drafter path needs only these)
OVERLAYS = {
    "mlx-lm-0.31.3": ["mlx-lm==0.31.3"],
    "mlx-vlm-0.7.10": ["mlx-vlm==0.7.10", "requests==2.34.2", "urllib3==2.8.0", "certifi==2026.10.18",
                       "pillow==13.0.0"],
}
_OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Could not fetch URL",
            "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
            "ConnectTimeout", "ReadTimeout", "ProxyError", "No route to host", "Max retries exceeded")


def _index_reachable() -> str:
    """'' when PyPI answers, else why not."""
    try:
        urllib.request.urlopen("https://pypi.org/simple/mlx-lm/", timeout=10).close()
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _overlay(name: str, pins) -> Path:
    """The venv's python: pins in its own site-packages, the project venv's after them."""
    from filelock import FileLock

    tag = hashlib.sha256(f"{sys.prefix}|{pins}".encode()).hexdigest()[:10]
    venv = CACHE / "venvs" / "ci" / f"{name}-{tag}"
    py = venv / "bin" / "python"
    marker = venv / ".mtpconvert-interop.json"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv) + ".lock", timeout=900):
        if marker.is_file() and py.exists():
            return py
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                            "--retries", "1", "--timeout", "20", "--target", site, *pins],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            why = _index_reachable()
            offline = [ln.strip() for ln in r.stderr.splitlines() if any(s in ln for s in _OFFLINE)]
            if why or offline:
                pytest.skip(f"interop: PyPI unreachable, cannot install {' '.join(pins)} "
                            f"({why or offline[0][:300]})")
            pytest.fail(f"pip install {' '.join(pins)} failed:\n{r.stderr[-2000:]}")
        parent = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        (Path(site) / "_mtpconvert_project.pth").write_text(
            "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in sorted(parent)) + "\n")
        marker.write_text(json.dumps({"pip": pins, "project": sys.prefix}) + "\n")
    return py


@pytest.fixture(scope="module")
def venvs():
    return {name: _overlay(name, pins) for name, pins in OVERLAYS.items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    out = {}
    for name, fixture, layout in (("dense", "tiny-qwen35-mtp", "sidecar"), ("moe", "tiny-qwen35-moe-mtp", "sidecar"),
                                  ("dense-in-model", "tiny-qwen35-mtp", "in-model"),
                                  ("next", "text-qwen3next-mtp", "sidecar")):
        # float32: exact across mlx-lm versions (bf16 kernels differ), and MoE must be float32 on CPU
        convert_folder(FIXTURES / fixture, root / name, dtype="float32", mtp_layout=layout)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def observed(venvs, folders):
    """{(folder, runtime): probe JSON} for every pair the test asserts on, two probes at a time."""
    prompts = run.HERE / "prompts.json"
    py = {"mlx-lm-0.32": sys.executable, "mlx-lm-0.31": venvs["mlx-lm-0.31.3"], "mlx-vlm": venvs["mlx-vlm-0.7.10"]}
    jobs = [(f, r) for f in folders for r in ("mlx-lm-0.32", "mlx-lm-0.31")]
    jobs += [(f, "mlx-vlm") for f in ("dense", "moe", "next")]

    def probe(job):
        f, r = job
        return job, run.run_probe(run.RUNTIMES[r], str(folders[f]), prompts, MAX_TOKENS, 600, python=py[r])

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(probe, jobs))


class _Args:
    min_acceptance = 0.3
    logprob_tol = 0.25


def _checks(observed, folder, runtime):
    res, base = observed[(folder, runtime)], observed[(folder, "mlx-lm-0.32")]
    assert base.get("error") is None and base["version"].startswith("0.32."), base
    assert res.get("error") is None, res
    return run.check(runtime, run.RUNTIMES[runtime], res, base, _Args)


def _agrees(folder: Path, runtime: str, checks: dict) -> None:
    rep = check_folder(folder).to_json()
    pred = {x["runtime"]: x for x in rep["runtimes"]}
    assert run.agreement(run.RUNTIMES[runtime], checks, pred), (runtime, checks, pred[run.RUNTIMES[runtime]["compat"]])


@pytest.mark.parametrize("folder", ["dense", "moe", "next"])
def test_mlx_lm_031_backbone_exact_with_default_layout(observed, folders, folder):
    res = observed[(folder, "mlx-lm-0.31")]
    assert res["version"] == "0.31.3"
    c = _checks(observed, folder, "mlx-lm-0.31")
    assert c["backbone_exact"], (res["backbone_tokens"], observed[(folder, "mlx-lm-0.32")]["backbone_tokens"])
    _agrees(folders[folder], "mlx-lm-0.31", c)


def test_mlx_lm_031_double_shifts_the_in_model_layout(observed, folders):
    """The check above can fail: the same fixture with the head inside the shards is a wrong model."""
    c = _checks(observed, "dense-in-model", "mlx-lm-0.31")
    assert c["backbone_exact"] is False
    shifted = observed[("dense-in-model", "mlx-lm-0.31")]["detail"]["final_norm_mean"]
    right = observed[("dense-in-model", "mlx-lm-0.32")]["detail"]["final_norm_mean"]
    assert abs(shifted - right - 1.0) < 0.01, (shifted, right)
    _agrees(folders["dense-in-model"], "mlx-lm-0.31", c)


@pytest.mark.parametrize("folder", ["dense", "moe"])
def test_mlx_vlm_drafts_with_the_head(observed, folders, folder):
    res = observed[(folder, "mlx-vlm")]
    assert res["version"] == "0.7.10"
    c = _checks(observed, folder, "mlx-vlm")
    assert c == {"backbone_exact": True, "head_found": True, "head_norms_as_written": True, "acceptance": True,
                 "mtp_equals_plain": True, "loads_as_vlm": None}, (c, res["accepted"], res["proposed"])
    _agrees(folders[folder], "mlx-vlm", c)


def test_mlx_vlm_runs_the_qwen3_next_backbone_and_cannot_draft_as_predicted(observed, folders):
    """mlx-vlm 0.7.10 loads a qwen3_next folder itself (backbone exact) and builds the drafter from mtp.safetensors,
    but its qwen3_next model returns no hidden states, so MTP decoding fails: the table says so (head: no)."""
    res, base = observed[("next", "mlx-vlm")], observed[("next", "mlx-lm-0.32")]
    assert res["version"] == "0.7.10" and res["head_found"] and "NoneType" in (res.get("error") or ""), res
    c = run.check("mlx-vlm", run.RUNTIMES["mlx-vlm"], res, base, _Args)
    assert c["backbone_exact"] and c["head_found"], c
    assert check_folder(folders["next"]).get("mlx-vlm").head_usable.ok is False
    _agrees(folders["next"], "mlx-vlm", c)


@pytest.fixture(scope="module")
def glm(venvs, tmp_path_factory):
    """{(model type, folder): the mlx-vlm GLM probe's JSON}: GLM-5 (float32 and a 4-bit head) and GLM-4.7-Flash."""
    from tests.checkpoints import build_glm

    root = tmp_path_factory.mktemp("glm")
    out = {}
    for model_type, name, quant in (("glm_moe_dsa", "f32", {}), ("glm_moe_dsa", "q4-match", dict(bits=4, group_size=32,
                                    mtp="match")), ("glm4_moe_lite", "f32", {})):
        raw = root / model_type
        if not raw.exists():
            build_glm(raw, model_type, **({"index_topk": 64} if model_type == "glm_moe_dsa" else {}))
        folder = root / f"{model_type}-{name}"
        convert_folder(raw, folder, dtype="float32", **quant)  # float32: the CPU's gather_mm
        r = subprocess.run([str(venvs["mlx-vlm-0.7.10"]), "-m", "interop.probes.mlx_vlm_glm", str(folder),
                            str(raw), json.dumps([[5, 17, 99, 3, 250, 41, 7, 8], [9, 10, 11, 12, 300]]), "16"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        out[(model_type, name)] = (folder, json.loads(r.stdout.strip().splitlines()[-1]))
    # the trained GLM-5 fixture on held-out stdlib prompts: mlx-vlm's drafter accepts a realistic share
    from mtpconvert.fixture.text import heldout_prompts, text_fixture_path

    src = text_fixture_path("glm5")
    folder = root / "glm5-fixture"
    convert_folder(src, folder, dtype="float32")
    ids = heldout_prompts(src, per_file=1, prompt_tokens=48, files=4)[1]
    r = subprocess.run([str(venvs["mlx-vlm-0.7.10"]), "-m", "interop.probes.mlx_vlm_glm", str(folder),
                        str(src), json.dumps(ids), "32"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out[("glm_moe_dsa", "fixture")] = (folder, json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def test_mlx_vlm_drafts_the_trained_glm5_fixture_at_a_realistic_acceptance(glm):
    folder, res = glm[("glm_moe_dsa", "fixture")]
    assert res["error"] is None and res["mtp_tokens"] == res["backbone_tokens"], res
    assert 0.5 <= res["accepted"] / res["proposed"] <= 0.95, (res["accepted"], res["proposed"])
    assert res["splitter"]["differ"] == res["splitter"]["only_ours"] == res["splitter"]["only_split"] == []


@pytest.mark.parametrize("name", ["f32", "q4-match"])
def test_mlx_vlm_drafts_glm5_from_the_drafter_folder_with_plain_greedys_output(glm, name):
    """``--draft-model OUT/mtp``: mlx-vlm's glm_moe_dsa_mtp drafter loads our head (strictly; 4-bit with its
    quantization block) and its MTP greedy output equals its plain greedy output; the table predicted it."""
    folder, res = glm[("glm_moe_dsa", name)]
    assert res["error"] is None and res["version"] == "0.7.10", res
    assert res["head_found"] and res["drafter_class"] == "GlmMoeDsaMTPDraftModel"
    assert res["proposed"] > 0 and res["mtp_tokens"] == res["backbone_tokens"]
    assert check_folder(folder).get("mlx-vlm-drafter").head_usable.ok


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "glm4_moe_lite"])
def test_mlx_vlms_splitter_reads_the_same_head_from_the_raw_source(glm, model_type):
    """mlx-vlm's own splitter over the raw release (``mlx_vlm convert --mtp``) gives exactly our head's tensors
    (GLM-4.7-Flash's splitter names them model.* / model.mtp_block.* / lm_head: the same values)."""
    folder, res = glm[(model_type, "f32")]
    split = res["splitter"]
    assert split["model_type"] == model_type + "_mtp" and split["keys"] > 20
    assert split["only_split"] == split["only_ours"] == split["differ"] == [], split


def test_mlx_vlm_cannot_draft_glm4_7_flash_as_predicted(glm):
    folder, res = glm[("glm4_moe_lite", "f32")]
    assert res["head_found"] is False and "has no attribute 'Model'" in res["error"], res
    assert res["backbone_tokens"] and check_folder(folder).get("mlx-vlm-drafter").head_usable.ok is False
