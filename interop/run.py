#!/usr/bin/env python3
"""Interop harness: convert the bundled fixtures, run every MTP runtime on the result, compare.

    python -m interop.run                       # both layouts: sidecar (default) and in-model, every runtime
    python -m interop.run --mtp-layout sidecar  # only the converter's default layout
    python -m interop.run --folder DIR ...      # run on existing folders, no conversion
    python -m interop.run --setup-only          # create/cache the runtime venvs and stop

Each runtime lives in its own venv under ``${MTPCONVERT_INTEROP_CACHE:-~/.cache/mtpconvert/interop}/venvs``
(created here from PyPI with pinned versions). Each probe (``interop/probes/<runtime>.py``) prints one
JSON object; this driver checks, per folder and runtime:

* backbone exact: plain greedy tokens equal stock mlx-lm 0.32's on every prompt (5 prompts), and the
  first step's top-5 log-probabilities agree within ``--logprob-tol`` (on the tiny fixtures a
  double-shifted backbone can still decode the same greedy tokens on some prompts);
* head found; drafts proposed and accepted / proposed above ``--min-acceptance`` (0.3);
* MTP greedy output equal to the runtime's own plain greedy output;
* (``--keep-vision`` variant, mlx-vlm) the folder loads as a VLM (vision tower present);

and sets each result next to the prediction of ``mtpconvert.compat`` for that folder. Writes
``results.md`` and ``results.json`` to ``--out``; exits non-zero when an observation contradicts the
prediction (or with ``--strict`` when any applicable check fails).

Stdlib only: the conversion and the compat prediction run in the project's Python (``--python``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "interop"
PROBES = HERE / "probes"
FIXTURES = ROOT / "mtpconvert" / "fixture" / "data"
CACHE = Path(os.environ.get("MTPCONVERT_INTEROP_CACHE") or Path.home() / ".cache" / "mtpconvert" / "interop")
LINUX = platform.system() == "Linux"
MLX = "mlx[cpu]==0.32.4" if LINUX else "mlx==0.32.4"

PR990_COMMIT = "f840f6cff725773b29272112bedab6980e7a3c5e"  # AirRunner/mlx-lm feat/mtp-native
PR990_DEFAULT_SRC = f"git+https://github.com/AirRunner/mlx-lm@{PR990_COMMIT}"
PR990_LOCAL = CACHE / "src" / "mlx-lm-pr990"  # a checkout of that commit, used when present

# rapid-mlx and vllm-mlx require torchvision: unconstrained, pip picks torchvision 0.29.2 and a CUDA
# torch 2.15 (~4 GB of nvidia-* wheels). Pin torch 2.13.0 / torchvision 0.28.0 (which requires
# exactly torch 2.13.0) and, on Linux, take both from PyTorch's CPU index first
# (MTPCONVERT_TORCH_INDEX overrides it; empty = pip's configured indexes).
# torch and torchvision must be builds of one index: PyPI's Linux torchvision is a CUDA build whose
# operators do not register next to a CPU torch (`operator torchvision::nms does not exist`).
# Where the CPU index cannot be reached (or MTPCONVERT_TORCH_INDEX is empty), the fallback is PyPI's
# pair, both CUDA builds (torch pulls ~3 GB of nvidia-* wheels; they run on CPU). `===` pins the
# exact version string, so a local `2.13.0+cpu` wheel (pip --find-links, a wheel cache) is never
# taken in place of PyPI's torch next to PyPI's torchvision.
TORCH_PINS = ["torch==2.13.0", "torchvision==0.28.0"]
TORCH_PINS_PYPI = ["torch===2.13.0", "torchvision==0.28.0"]
TORCH_INDEX = os.environ.get("MTPCONVERT_TORCH_INDEX", "https://download.pytorch.org/whl/cpu" if LINUX else "")
# mtplx declares mlx, mlx-lm and transformers for darwin/arm64 only: on Linux `pip install mtplx`
# gives a venv without mlx-lm, so they are named explicitly (its own pins).
MTPLX_LINUX = ["mlx[cpu]==0.32.2", "mlx-lm>=0.31,<0.32", "transformers>=5.10,<5.17,!=5.13.0"]

# name -> how to install and run it. "probe": the module in interop/probes that runs in its venv.
# "compat" names the runtime in mtpconvert.compat.RUNTIMES.
# "mtp": the runtime decodes with the MTP head (False: backbone checks only). "drafts": False when
# the runtime injects the head but its MTP loop cannot run (vllm-mlx 0.6.0, upstream bug): then the
# checks are backbone exact + head found, and the probe's `error` carries the runtime's own log text.
# "torch": pre-install a matching torch + torchvision pair (see TORCH_PINS, install_torch).
RUNTIMES: Dict[str, dict] = {
    "mlx-lm-0.32": dict(venv="mlx-lm-0.32.2", pip=["mlx-lm==0.32.2", MLX], dist="mlx-lm", version="0.32.2",
                        probe="mlx_lm", mtp=False, compat="mlx-lm>=0.32", baseline=True),
    "mlx-lm-0.31": dict(venv="mlx-lm-0.31.3", pip=["mlx-lm==0.31.3", MLX], dist="mlx-lm", version="0.31.3",
                        probe="mlx_lm", mtp=False, compat="mlx-lm<0.32"),
    "mlx-vlm": dict(venv="mlx-vlm-0.7.10", pip=["mlx-vlm==0.7.10", MLX], dist="mlx-vlm", version="0.7.10",
                    probe="mlx_vlm", mtp=True, compat="mlx-vlm"),
    # the same venv, the head taken as a separate drafter: --draft-model OUT/mtp
    "mlx-vlm-drafter": dict(venv="mlx-vlm-0.7.10", pip=["mlx-vlm==0.7.10", MLX], dist="mlx-vlm", version="0.7.10",
                            probe="mlx_vlm", probe_args=["--drafter", "{folder}/mtp"], mtp=True,
                            compat="mlx-vlm-drafter"),
    "mtplx": dict(venv="mtplx", pip=(MTPLX_LINUX if LINUX else []) + ["mtplx==2.12.2"], dist="mtplx",
                  version="2.12.2", probe="mtplx", mtp=True, compat="mtplx"),
    "rapid-mlx": dict(venv="rapid-mlx", pip=["rapid-mlx==0.16.10", MLX], dist="rapid-mlx", version="0.16.10",
                      probe="rapid_mlx", mtp=True, compat="rapid-mlx", torch=True),
    "vllm-mlx": dict(venv="vllm-mlx", pip=["vllm-mlx==0.6.0", MLX], dist="vllm-mlx", version="0.6.0",
                     probe="vllm_mlx", mtp=True, drafts=False, compat="vllm-mlx", torch=True),
    # not on PyPI: optional (--with-pr990, MTPCONVERT_PR990_SRC = a checkout or pip URL, or a checkout
    # at PR990_LOCAL)
    "mlx-lm-pr990": dict(venv="mlx-lm-pr990", pip=None, dist="mlx-lm", version=None, probe="mlx_lm_pr990",
                         mtp=True, compat="mlx-lm-pr990", optional=True),
}
BASELINE = "mlx-lm-0.32"
# the upstream vllm-mlx 0.6.0 bug that keeps its MTP loop from running with every mlx-lm it accepts
VLLM_LOOP_BUG = ("vllm_mlx/scheduler.py:827 (_install_mtp): mlx-lm 0.31's BatchGenerator has no _step, so the "
                 "MTP monkey-patch returns before installing itself")

FIX_DENSE, FIX_MOE = "tiny-qwen35-mtp", "tiny-qwen35-moe-mtp"
FIX_NEXT = "text-qwen3next-mtp"  # Qwen3-Next, trained on text: probed on its own held-out prompts (TEXT_FIXTURES)
TEXT_FIXTURES = (FIX_NEXT,)
VISION_SRC = "vision"  # the dense fixture + a random vision tower, built by interop/vision_fixture.py
G32 = ["--bits", "4", "--group-size", "32"]  # hidden 96: group 32 quantizes every head linear, as on a real model
F32 = ["--dtype", "float32"]  # bf16 MoE cannot run on mlx's CPU backend (gather_mm is float32-only)
# layout -> [(name, source, convert options)]
VARIANTS: Dict[str, List[tuple]] = {
    "sidecar": [
        ("dense-bf16", FIX_DENSE, []),
        ("dense-f32", FIX_DENSE, F32),
        ("dense-4bit", FIX_DENSE, G32),                                # head kept float (--mtp keep)
        ("dense-4bit-match", FIX_DENSE, G32 + ["--mtp", "match"]),
        ("dense-4bit-mtp8", FIX_DENSE, G32 + ["--mtp-bits", "8"]),
        ("dense-vision", VISION_SRC, F32 + ["--keep-vision"]),
        ("moe-f32", FIX_MOE, F32),
        ("moe-4bit", FIX_MOE, G32 + F32),
        ("moe-4bit-match", FIX_MOE, G32 + F32 + ["--mtp", "match"]),
        ("moe-4bit-mtp8", FIX_MOE, G32 + F32 + ["--mtp-bits", "8"]),
        ("next-f32", FIX_NEXT, F32),
        ("next-4bit", FIX_NEXT, G32 + F32),
        ("next-4bit-match", FIX_NEXT, G32 + F32 + ["--mtp", "match"]),
    ],
    "in-model": [  # for the mlx-lm PR #990 branch: float head (MoE head experts per expert)
        ("dense-f32", FIX_DENSE, F32),
        ("dense-4bit", FIX_DENSE, G32),
        ("moe-f32", FIX_MOE, F32),
        ("moe-4bit", FIX_MOE, G32 + F32),
    ],
}
LAYOUTS = tuple(VARIANTS)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- venvs


def venv_python(rt: dict) -> Path:
    return CACHE / "venvs" / rt["venv"] / "bin" / "python"


def pip_spec(name: str, rt: dict, with_pr990: bool) -> Optional[List[str]]:
    if name == "mlx-lm-pr990":
        src = os.environ.get("MTPCONVERT_PR990_SRC")
        if not src and (PR990_LOCAL / "mlx_lm").is_dir():
            src = str(PR990_LOCAL)
        if not src and not with_pr990:
            return None
        return [src or PR990_DEFAULT_SRC, MLX]
    return rt["pip"]


def installed_version(py: Path, dist: str) -> Optional[str]:
    try:
        out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def install_torch(py: Path) -> List[str]:
    """Install a torch + torchvision pair built from one index into the venv of ``py``: PyTorch's CPU
    index (TORCH_INDEX) when set and reachable, else PyPI's pair (TORCH_PINS_PYPI). Returns the pins
    installed (for the constraints file); raises CalledProcessError when neither installs."""
    pip = [str(py), "-m", "pip", "install", "-q"]
    if TORCH_INDEX:
        why = _unreachable(TORCH_INDEX)
        if not why:
            try:
                # pip's configured --find-links / --extra-index-url still count beside --index-url: the
                # pair is checked, not assumed
                subprocess.run(pip + TORCH_PINS + ["--index-url", TORCH_INDEX], check=True)
                why = torch_health(py)
                if not why:
                    return TORCH_PINS
            except subprocess.CalledProcessError as e:
                why = str(e)
        log(f"[setup] torch: no matching pair from {TORCH_INDEX} ({why}); falling back to PyPI's pair "
            f"{' '.join(TORCH_PINS_PYPI)} (CUDA builds, ~3 GB of nvidia-* wheels, run on CPU)")
    subprocess.run(pip + TORCH_PINS_PYPI, check=True)
    return TORCH_PINS_PYPI


def _unreachable(url: str) -> Optional[str]:
    """None when ``url`` answers an HTTP request within 15 s, else why not (spares pip's retries)."""
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD"), timeout=15)
        return None
    except Exception as e:  # noqa: BLE001  (DNS, proxy, TLS, HTTP errors: all mean "not this index")
        return f"{type(e).__name__}: {e}"[:200]


def ensure_venv(name: str, rt: dict, with_pr990: bool, reinstall: bool = False) -> dict:
    """Create (or reuse) the runtime's venv. Returns {"ready": bool, "why": str}. A reused venv of a
    "torch" runtime whose torchvision does not run with its torch (a CPU torch next to PyPI's CUDA
    torchvision) gets a matching pair installed over it (install_torch)."""
    py = venv_python(rt)
    marker = py.parent.parent / ".mtpconvert-interop.json"
    spec = pip_spec(name, rt, with_pr990)
    if py.exists() and not reinstall:
        why = None
        if marker.exists() and (spec is None or json.loads(marker.read_text()).get("pip") == spec):
            why = "cached"
        else:
            have = installed_version(py, rt["dist"])
            if have and (rt["version"] is None or have == rt["version"]):
                why = f"existing venv ({rt['dist']} {have})"
        if why and rt.get("torch") and torch_health(py):
            log(f"[setup] {name}: its torchvision does not run with its torch ({torch_health(py)}); "
                "installing a matching pair")
            try:
                pins = install_torch(py)
            except subprocess.CalledProcessError as e:
                return {"ready": True, "why": f"{why}; matching torch pair not installed: {e}"}
            why += f"; torch pair reinstalled ({' '.join(pins)})"
        if why:
            return {"ready": True, "why": why}
    if spec is None:
        return {"ready": False, "why": "optional, not installed: the PR #990 branch is not on PyPI; set "
                                       "MTPCONVERT_PR990_SRC (checkout path or pip URL) or pass --with-pr990"}
    venv_dir = py.parent.parent
    log(f"[setup] {name}: creating {venv_dir} with {' '.join(spec)}")
    if reinstall and venv_dir.exists():
        shutil.rmtree(venv_dir)
    pip = [str(py), "-m", "pip", "install", "-q"]
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
        subprocess.run(pip + ["--upgrade", "pip"], check=True)
        if rt.get("torch"):
            # the torch pair first, so that the runtime's own requirements are already met by it
            pins = install_torch(py)
            constraints = venv_dir / "constraints.txt"
            constraints.write_text("\n".join(pins) + "\n")
            subprocess.run(pip + ["-c", str(constraints)] + spec, check=True)
        else:
            subprocess.run(pip + spec, check=True)
    except subprocess.CalledProcessError as e:
        return {"ready": False, "why": f"install failed: {e}"}
    marker.write_text(json.dumps({"pip": spec, "installed": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return {"ready": True, "why": "installed"}


# ----------------------------------------------------------------------------- folders


def torch_health(py: Path) -> Optional[str]:
    """None when the venv's torchvision runs with its torch, else why not. A torchvision wheel built for
    CUDA next to a CPU torch (PyPI's torchvision beside a `+cpu` torch) fails at its first operator,
    and with it transformers' AutoProcessor: the runtimes' multimodal (VLM) route cannot load,
    text-only folders are not affected."""
    r = subprocess.run([str(py), "-c", "import torch, torchvision; "
                        "torchvision.ops.nms(torch.zeros(1, 4), torch.ones(1), 0.5)"], capture_output=True, text=True)
    return None if r.returncode == 0 else _last_line(r.stderr)


def project_python(arg: Optional[str]) -> str:
    if arg:
        return arg
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"


def preflight(py: str) -> Optional[str]:
    """None when the project's Python can convert (imports mlx and mtpconvert), else why not."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([py, "-c", "import mlx.core, mtpconvert.compat"], capture_output=True, text=True, env=env)
    if r.returncode == 0:
        return None
    return (f"the project's Python ({py}) cannot import mlx / mtpconvert ({_last_line(r.stderr)}): "
            "run `make install` or pass --python")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def source_folder(py: str, source: str, work: Path) -> Path:
    """The raw checkpoint of a variant: a bundled fixture, or (``vision``) the dense fixture with a
    random vision tower added (the fixtures have none), built once into ``work``."""
    if source != VISION_SRC:
        return FIXTURES / source
    out = work / "src-dense-vision"
    if not (out / "config.json").is_file():
        log(f"[build] {out}: the dense fixture + a random vision tower (interop/vision_fixture.py)")
        r = subprocess.run([py, "-m", "interop.vision_fixture", str(out)], capture_output=True, text=True,
                           env=_env(), cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError("vision_fixture.py failed: " + _last_line(r.stderr))
    return out


def convert(py: str, src: Path, out: Path, opts: List[str], layout: str) -> Optional[str]:
    """``mtpconvert convert SRC OUT OPTS --mtp-layout LAYOUT --smoke-mode full``; None, or why it failed. The
    decoding smoke runs as a user's convert runs it, so the folder carries the mtplx_runtime.json it earns."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [py, "-m", "mtpconvert", "convert", str(src), str(out), *opts, "--mtp-layout", layout, "--smoke-mode", "full"]
    log(f"[convert] {out.name}: {' '.join(cmd[1:])}")
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(ROOT))
    return None if r.returncode == 0 else "convert failed: " + _last_line(r.stderr or r.stdout)


def text_prompts(py: str, source: str, work: Path) -> Path:
    """Token ids of held-out prompts for a text fixture (its own tokenizer; the shared prompts.json is the
    Markov fixtures' vocabulary), written once into ``work``."""
    out = work / f"prompts-{source}.json"
    if not out.is_file():
        code = ("import json, sys; from pathlib import Path; from mtpconvert.fixture.text import heldout_prompts; "
                "print(json.dumps(heldout_prompts(Path(sys.argv[1]), per_file=1, prompt_tokens=24, files=5)[1]))")
        r = subprocess.run([py, "-c", code, str(FIXTURES / source)], capture_output=True, text=True, env=_env(),
                           cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError("held-out prompts failed: " + _last_line(r.stderr))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(r.stdout)
    return out


def build_folders(a, work: Path) -> List[dict]:
    py = project_python(a.python)
    folders = []
    wanted = set(a.variants.split(",")) if a.variants else None
    for layout in a.mtp_layout.split(","):
        for name, source, opts in VARIANTS[layout]:
            if wanted and name not in wanted and f"{layout}/{name}" not in wanted:
                continue
            out = work / layout / name
            label = f"{layout}/{name}"
            prompts = None
            try:
                err = convert(py, source_folder(py, source, work), out, opts, layout)
                prompts = text_prompts(py, source, work) if source in TEXT_FIXTURES else None
            except RuntimeError as e:
                err = str(e)
            folders.append({"name": label, "layout": layout, "variant": name, "path": str(out), "error": err,
                            "options": " ".join(opts) or "(defaults: bf16)", "vision": "--keep-vision" in opts,
                            "prompts": prompts})
    return folders


def predict(py: str, folder: str) -> Optional[dict]:
    r = subprocess.run([py, "-m", "mtpconvert.compat", folder, "--json"], capture_output=True, text=True, env=_env(),
                       cwd=str(ROOT))
    if r.returncode != 0:
        log(f"[compat] {folder}: {r.stderr.strip()[-300:]}")
        return None
    rep = json.loads(r.stdout)
    return {x["runtime"]: x for x in rep["runtimes"]} | {"__layout__": rep["layout"]}


# ----------------------------------------------------------------------------- probes and checks


def run_probe(rt: dict, folder: str, prompts: Path, max_tokens: int, timeout: int, python=None) -> dict:
    """The probe's JSON: ``python -m interop.probes.<probe>`` with the runtime venv's Python, from the root."""
    cmd = [str(python or venv_python(rt)), "-m", f"interop.probes.{rt['probe']}", "--folder", folder,
           "--prompts-json", str(prompts), "--max-tokens", str(max_tokens)]
    cmd += [arg.format(folder=folder) for arg in rt.get("probe_args", [])]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"probe timed out after {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("{")]
    if not lines:
        return {"error": f"probe printed no JSON (exit {r.returncode}): {r.stderr.strip()[-300:]}"}
    try:
        return json.loads(lines[-1])
    except ValueError as e:
        return {"error": f"probe JSON unreadable: {e}"}


def lp_diff(a: Optional[list], b: Optional[list], tol: float = 0.25) -> Optional[float]:
    """Largest |difference| between two runs' first-step top-5 log-probabilities; None when either run
    has none. A token in one top-5 but not in the other counts only if it is a tie at the edge (within
    ``tol`` of the other's 5th value: bf16 logits tie often on the tiny fixtures); otherwise inf."""
    if not a or not b or len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if not x or not y:  # a run that reported no top-5 at this step
            return None
        for p, q in ((x, y), (y, x)):
            for k in set(p) - set(q):
                if p[k] > min(q.values()) + tol:
                    return float("inf")
        common = set(x) & set(y)
        if not common:
            return float("inf")
        worst = max(worst, max(abs(x[k] - y[k]) for k in common))
    return worst


def check(name: str, rt: dict, res: dict, base: Optional[dict], a, vision: bool = False) -> dict:
    """The checks of one (folder, runtime) result. Values: True / False / None (not applicable)."""
    min_acc = getattr(a, "min_acceptance", 0.3)
    tol = getattr(a, "logprob_tol", 0.25)
    c: Dict[str, Optional[bool]] = {"backbone_exact": None, "head_found": None, "head_norms_as_written": None,
                                    "acceptance": None, "mtp_equals_plain": None, "loads_as_vlm": None}
    bt = res.get("backbone_tokens")
    if bt is not None and base and base.get("backbone_tokens") is not None:
        same = len(bt) >= 2 and bt == base["backbone_tokens"]
        d = lp_diff(res.get("backbone_logprobs"), base.get("backbone_logprobs"))
        c["backbone_exact"] = bool(same and (d is None or d <= tol))
    elif bt is None:
        c["backbone_exact"] = False
    if rt["mtp"]:
        c["head_found"] = bool(res.get("head_found"))
        hn = res.get("head_norm_mean") or {}
        if hn.get("file") is not None and hn.get("loaded") is not None:
            c["head_norms_as_written"] = abs(hn["file"] - hn["loaded"]) < 0.5
        if rt.get("drafts", True):
            p, acc = res.get("proposed"), res.get("accepted")
            c["acceptance"] = bool(p and acc is not None and acc / p > min_acc)
            mt = res.get("mtp_tokens")
            c["mtp_equals_plain"] = bool(mt is not None and bt is not None and mt == bt)
    if vision and "vision_tower" in (res.get("detail") or {}):
        c["loads_as_vlm"] = bool(res["detail"]["vision_tower"])
    return c


def verdict(rt: dict, c: dict) -> str:
    vals = [v for v in c.values() if v is not None]
    return "PASS" if vals and all(vals) else "FAIL"


def agreement(rt: dict, c: dict, pred: Optional[dict]) -> Optional[bool]:
    """Does the observation match mtpconvert.compat's prediction for this runtime?"""
    if not pred or rt["compat"] not in pred:
        return None
    p = pred[rt["compat"]]
    bb_ok = p["backbone_exact"]["ok"]
    if c["backbone_exact"] is not None and c["backbone_exact"] != bb_ok:
        return False
    if rt["mtp"]:
        if rt.get("drafts", True):
            head_ok = bool(c["head_found"] and c["acceptance"] and c["mtp_equals_plain"]
                           and c["head_norms_as_written"] is not False)
        else:  # compat's "head usable" = the head is found and injected (its loop is upstream's)
            head_ok = bool(c["head_found"])
        if head_ok != p["head_usable"]["ok"]:
            return False
    return True


# ----------------------------------------------------------------------------- report


def _mark(v: Optional[bool]) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def _short(err: Optional[str], n: int = 110) -> str:
    return " ".join((err or "").replace("|", "/").split())[:n]


def cell(r: dict) -> str:
    """One runtime's result on one folder, for the summary matrix."""
    c, res = r["checks"], r["result"]
    if r["runtime"] == BASELINE:
        return "baseline" if res.get("backbone_tokens") is not None else "**fails**: " + _short(res.get("error"))
    if r["status"] == "ENV":
        return "not testable here (torchvision/torch mismatch): " + _short(res.get("error"))
    if res.get("backbone_tokens") is None:
        return "**fails**: " + _short(res.get("error"))
    parts = ["exact" if c["backbone_exact"] else "**WRONG**"]
    if r["mtp"]:
        if not c["head_found"]:
            parts.append("**no head**" + (": " + _short(res.get("error")) if res.get("error") else ""))
        elif c["acceptance"] is None:  # drafts not applicable (vllm-mlx): head injected
            parts.append("head injected, 0 drafts (upstream loop bug)" if not res.get("proposed") else
                         f"head injected, {res['accepted']}/{res['proposed']}")
        else:
            acc = f"{res['accepted']}/{res['proposed']}" if res.get("proposed") else "0 drafts"
            parts.append(acc + (" =plain" if c["mtp_equals_plain"] else " **≠plain**"))
            if c["head_norms_as_written"] is False:
                parts.append("**head norms shifted**")
            if res.get("error") and not c["acceptance"]:
                parts.append(_short(res.get("error")))
    if c.get("loads_as_vlm") is not None:
        parts.append("VLM" if c["loads_as_vlm"] else "**not a VLM**")
    if r["agrees"] is False:
        parts.append("**≠compat**")
    return ", ".join(parts)


def markdown(rows: List[dict], meta: dict) -> str:
    out = [f"# Interop results ({meta['when']})", "",
           f"Prompts: {meta['prompts']} x {meta['max_tokens']} tokens, greedy. Baseline: {BASELINE} "
           f"(plain greedy of the same folder). Layouts: {meta['layout']}. Host: {meta['host']}.", "",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    runtimes = [n for n in RUNTIMES if any(r["runtime"] == n for r in rows)]
    folders = list(dict.fromkeys(r["folder"] for r in rows))
    by = {(r["folder"], r["runtime"]): r for r in rows}
    out += ["## Summary", "", "| folder | options | " + " | ".join(runtimes) + " |",
            "|---|---|" + "---|" * len(runtimes)]
    for f in folders:
        first = next(r for r in rows if r["folder"] == f)
        if first["runtime"] == "-":
            out.append(f"| {f} | | **{_short(first['result']['error'], 200)}** |" + " |" * (len(runtimes) - 1))
            continue
        out.append(f"| {f} | `{first.get('options', '')}` | "
                   + " | ".join(cell(by[(f, n)]) if (f, n) in by else "-" for n in runtimes) + " |")
    out += ["", "## Every check", "",
            "| folder | runtime | version | backbone exact (max logprob diff) | head found | head norms as written | "
            "accepted/proposed | MTP == plain | VLM | status | compat predicts (backbone / head) | agrees | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, res = r["checks"], r["result"]
        acc = (f"{res['accepted']}/{res['proposed']}" if res.get("proposed") else "-") if r["mtp"] else "-"
        pred = r.get("predicted")
        ptxt = (("exact" if pred["backbone_exact"]["ok"] else "WRONG") + " / "
                + ("yes" if pred["head_usable"]["ok"] else "no")) if pred else "-"
        d = r.get("lp_diff")
        bbtxt = _mark(c["backbone_exact"]) + ("" if d is None else f" ({d:.3g})")
        out.append(f"| {r['folder']} | {r['runtime']} | {res.get('version') or '-'} | {bbtxt} | "
                   f"{_mark(c['head_found'])} | {_mark(c['head_norms_as_written'])} | {acc} | "
                   f"{_mark(c['mtp_equals_plain'])} | {_mark(c.get('loads_as_vlm'))} | {r['status']} | {ptxt} | "
                   f"{_mark(r['agrees'])} | {_short(res.get('error'), 300)} |")
    dis = [r for r in rows if r["agrees"] is False]
    if dis:
        out += ["", "## Observation contradicts mtpconvert.compat", ""]
        for r in dis:
            p = r["predicted"]
            out.append(f"- {r['folder']} / {r['runtime']}: observed {json.dumps(r['checks'])}; compat: backbone "
                       f"{p['backbone_exact']} head {p['head_usable']}; error: {_short(r['result'].get('error'), 300)}")
    if any(r["runtime"] == "vllm-mlx" for r in rows):
        out += ["", f"vllm-mlx: pass = head injected + backbone exact; on a text folder its MTP loop does not run "
                f"({VLLM_LOOP_BUG}); a vision_config folder drafts through its MLLM scheduler."]
    if meta.get("environment"):
        out += ["", "Environment (status ENV):", ""] + [f"- {k}: {v}" for k, v in meta["environment"].items()]
    skipped = meta.get("skipped") or {}
    if skipped:
        out += ["", "Not run:", ""] + [f"- {k}: {v}" for k, v in skipped.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", action="append", default=[], help="run on this converted folder (repeatable)")
    ap.add_argument("--mtp-layout", default=",".join(LAYOUTS),
                    help="comma-separated layouts to convert with (`mtpconvert convert --mtp-layout`); default: all")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset (NAME or LAYOUT/NAME) of: "
                         + ", ".join(f"{l}/{v[0]}" for l in LAYOUTS for v in VARIANTS[l]))
    ap.add_argument("--runtimes", default=None, help="comma-separated subset of: " + ",".join(RUNTIMES))
    ap.add_argument("--with-pr990", action="store_true", help=f"install the PR #990 branch from {PR990_DEFAULT_SRC}")
    ap.add_argument("--prompts-json", type=Path, default=HERE / "prompts.json")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--min-acceptance", type=float, default=0.3)
    ap.add_argument("--logprob-tol", type=float, default=0.25,
                    help="max |difference| of the first step's top-5 logprobs vs the baseline (bf16 kernels of "
                         "mlx-lm 0.31 vs 0.32 differ by up to ~0.2 on the fixture; a double norm shift moves them "
                         "by 1-3)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per probe run")
    ap.add_argument("--out", type=Path, default=CACHE / "results")
    ap.add_argument("--python", default=None, help="the project's Python (default: .venv/bin/python, else this one)")
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--reinstall", action="store_true")
    ap.add_argument("--strict", action="store_true", help="exit non-zero on any failed check")
    a = ap.parse_args(argv)
    for lay in a.mtp_layout.split(","):
        if lay not in VARIANTS:
            ap.error(f"unknown layout {lay!r} (one of {', '.join(LAYOUTS)})")

    names = [n for n in (a.runtimes.split(",") if a.runtimes else RUNTIMES)]
    for n in names:
        if n not in RUNTIMES:
            ap.error(f"unknown runtime {n!r}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    skipped, ready, env_notes = {}, [], {}
    for n in names:
        rt = RUNTIMES[n]
        if not (PROBES / f"{rt['probe']}.py").is_file():
            skipped[n] = f"no probe (interop/probes/{rt['probe']}.py)"
            continue
        st = ensure_venv(n, rt, a.with_pr990, a.reinstall)
        if st["ready"]:
            ready.append(n)
            if rt.get("torch"):
                bad = torch_health(venv_python(rt))
                if bad:
                    env_notes[n] = (f"its torchvision does not run with its torch ({bad}): the multimodal route "
                                    "(--keep-vision folders) cannot load here; install torch and torchvision from one index "
                                    "(python -m interop.run --setup-only --runtimes " + n + " does) to test it")
        else:
            skipped[n] = st["why"]
        log(f"[setup] {n}: {st['why']}")
    if a.setup_only:
        return 0 if BASELINE in ready else 1
    if BASELINE not in ready:
        log(f"the baseline {BASELINE} is not available: {skipped.get(BASELINE)}")
        return 2

    py = project_python(a.python)
    why = preflight(py)
    if why:
        log(why)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    if a.folder:
        folders = [{"name": Path(f).name, "path": str(Path(f).resolve()), "error": None, "options": "",
                    "vision": False} for f in a.folder]
    else:
        folders = build_folders(a, a.out / "folders")
    prompts = json.loads(a.prompts_json.read_text())
    rows, bad_agreement, failed = [], 0, 0
    versions = {}
    for f in folders:
        if f["error"]:
            rows.append({"folder": f["name"], "runtime": "-", "mtp": False, "result": {"error": f["error"]},
                         "checks": {k: None for k in ("backbone_exact", "head_found", "acceptance",
                                                      "mtp_equals_plain", "head_norms_as_written")},
                         "status": "ERROR", "predicted": None, "agrees": None})
            failed += 1
            continue
        pred = predict(py, f["path"])
        prompts_json = f.get("prompts") or a.prompts_json
        base = run_probe(RUNTIMES[BASELINE], f["path"], prompts_json, a.max_tokens, a.timeout)
        for n in ready:
            rt = RUNTIMES[n]
            t0 = time.time()
            res = base if n == BASELINE else run_probe(rt, f["path"], prompts_json, a.max_tokens, a.timeout)
            if res.get("version"):
                versions[n] = res["version"] + (f" (mlx-lm {res['detail']['mlx_lm']})"
                                                if (res.get("detail") or {}).get("mlx_lm") else "")
            c = check(n, rt, res, base, a, vision=f.get("vision", False))
            status = verdict(rt, c)
            agrees = agreement(rt, c, pred)
            if f.get("vision") and n in env_notes and status != "PASS":
                status, agrees = "ENV", None  # this machine's torchvision, not the folder (see env_notes)
                res.setdefault("detail", {})["environment"] = env_notes[n]
            log(f"[{f['name']}] {n}: {status} {json.dumps(c)} agrees={agrees} ({time.time() - t0:.1f}s)"
                + (f" error={res.get('error')}" if res.get("error") else ""))
            rows.append({"folder": f["name"], "path": f["path"], "options": f.get("options", ""), "runtime": n,
                         "mtp": rt["mtp"], "result": res, "checks": c, "status": status, "agrees": agrees,
                         "lp_diff": lp_diff(res.get("backbone_logprobs"), base.get("backbone_logprobs")),
                         "predicted": (pred or {}).get(rt["compat"]), "layout": (pred or {}).get("__layout__")})
            bad_agreement += agrees is False
            failed += status != "PASS"
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": len(prompts), "max_tokens": a.max_tokens,
            "layout": "existing folders" if a.folder else a.mtp_layout, "skipped": skipped, "environment": env_notes, "baseline": BASELINE,
            "versions": versions, "host": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"}
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = markdown(rows, meta)
    (a.out / "results.md").write_text(md)
    print(md)
    log(f"wrote {a.out / 'results.md'} and results.json; {failed} failed check row(s), "
        f"{bad_agreement} disagreement(s) with mtpconvert.compat")
    if bad_agreement:
        return 1
    return 1 if (a.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
