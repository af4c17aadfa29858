#!/usr/bin/env python3
"""Interop harness: convert the bundled fixtures, run every MTP runtime on the result, compare.

    python interop/run.py                      # convert the fixtures (converter's default layout), run all
    python interop/run.py --mtp-layout L       # pass --mtp-layout L to `mtpconvert convert`
    python interop/run.py --repack sidecar     # research: re-package the converted head (interop/repack.py)
    python interop/run.py --folder DIR ...     # run on existing folders, no conversion
    python interop/run.py --setup-only         # create/cache the runtime venvs and stop

Each runtime lives in its own venv under ``${MTPCONVERT_INTEROP_CACHE:-~/.cache/mtpconvert/interop}/venvs``
(created here from PyPI with pinned versions). Each probe (``interop/probes/<runtime>.py``) prints one
JSON object; this driver checks, per folder and runtime:

* backbone exact: plain greedy tokens equal stock mlx-lm 0.32's on every prompt (>= 2), and the
  first step's top-5 log-probabilities agree within ``--logprob-tol`` (on the tiny fixtures a
  double-shifted backbone can still decode the same greedy tokens);
* head found; drafts proposed and accepted / proposed above ``--min-acceptance`` (0.3);
* MTP greedy output equal to the runtime's own plain greedy output;

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

# name -> how to install and run it. "compat" names the runtime in mtpconvert.compat.RUNTIMES.
# "mtp": the runtime decodes with the MTP head (False: backbone checks only).
# Probes are named after the runtime with "-" -> "_"; a runtime whose probe file is missing is
# reported as "no probe". mtplx / rapid-mlx / vllm-mlx probes come from the other interop helper.
RUNTIMES: Dict[str, dict] = {
    "mlx-lm-0.32": dict(venv="mlx-lm-0.32.2", pip=["mlx-lm==0.32.2", MLX], dist="mlx-lm", version="0.32.2",
                        probe="mlx_lm.py", mtp=False, compat="mlx-lm>=0.32", baseline=True),
    "mlx-lm-0.31": dict(venv="mlx-lm-0.31.3", pip=["mlx-lm==0.31.3", MLX], dist="mlx-lm", version="0.31.3",
                        probe="mlx_lm.py", mtp=False, compat="mlx-lm<0.32"),
    "mlx-vlm": dict(venv="mlx-vlm-0.7.10", pip=["mlx-vlm==0.7.10", MLX], dist="mlx-vlm", version="0.7.10",
                    probe="mlx_vlm.py", mtp=True, compat="mlx-vlm"),
    "mtplx": dict(venv="mtplx", pip=["mtplx==2.12.2"] + ([MLX] if LINUX else []), dist="mtplx",
                  version="2.12.2", probe="mtplx.py", mtp=True, compat="mtplx"),
    "rapid-mlx": dict(venv="rapid-mlx", pip=["rapid-mlx==0.16.10"] + ([MLX] if LINUX else []), dist="rapid-mlx",
                      version="0.16.10", probe="rapid_mlx.py", mtp=True, compat="rapid-mlx"),
    "vllm-mlx": dict(venv="vllm-mlx", pip=["vllm-mlx==0.6.0"] + ([MLX] if LINUX else []), dist="vllm-mlx",
                     version="0.6.0", probe="vllm_mlx.py", mtp=True, compat="vllm-mlx"),
    # not on PyPI: optional (--with-pr990, or MTPCONVERT_PR990_SRC = a local checkout or pip URL)
    "mlx-lm-pr990": dict(venv="mlx-lm-pr990", pip=None, dist="mlx-lm", version=None, probe="mlx_lm_pr990.py",
                         mtp=True, compat="mlx-lm-pr990", optional=True),
}
BASELINE = "mlx-lm-0.32"

# (name, fixture, convert options). Hidden size 96: group 32 lets every weight be quantized.
# bf16 MoE cannot run on mlx's CPU backend (gather_mm is float32-only), so MoE stays float32.
VARIANTS = [
    ("dense-f32", "tiny-qwen35-mtp", ["--dtype", "float32"]),
    ("dense-4bit", "tiny-qwen35-mtp", ["--bits", "4", "--group-size", "32"]),
    ("dense-4bit-mtp8", "tiny-qwen35-mtp", ["--bits", "4", "--group-size", "32", "--mtp-bits", "8"]),
    ("moe-f32", "tiny-qwen35-moe-mtp", ["--dtype", "float32"]),
    ("moe-4bit", "tiny-qwen35-moe-mtp", ["--bits", "4", "--group-size", "32", "--dtype", "float32"]),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- venvs


def venv_python(rt: dict) -> Path:
    return CACHE / "venvs" / rt["venv"] / "bin" / "python"


def pip_spec(name: str, rt: dict, with_pr990: bool) -> Optional[List[str]]:
    if name == "mlx-lm-pr990":
        src = os.environ.get("MTPCONVERT_PR990_SRC")
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


def ensure_venv(name: str, rt: dict, with_pr990: bool, reinstall: bool = False) -> dict:
    """Create (or reuse) the runtime's venv. Returns {"ready": bool, "why": str}."""
    py = venv_python(rt)
    marker = py.parent.parent / ".mtpconvert-interop.json"
    spec = pip_spec(name, rt, with_pr990)
    if py.exists() and not reinstall:
        if marker.exists() and (spec is None or json.loads(marker.read_text()).get("pip") == spec):
            return {"ready": True, "why": "cached"}
        have = installed_version(py, rt["dist"])
        if have and (rt["version"] is None or have == rt["version"]):
            return {"ready": True, "why": f"existing venv ({rt['dist']} {have})"}
    if spec is None:
        return {"ready": False, "why": "optional, not installed: the PR #990 branch is not on PyPI; set "
                                       "MTPCONVERT_PR990_SRC (checkout path or pip URL) or pass --with-pr990"}
    venv_dir = py.parent.parent
    log(f"[setup] {name}: creating {venv_dir} with {' '.join(spec)}")
    if reinstall and venv_dir.exists():
        shutil.rmtree(venv_dir)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        if rt.get("pre"):  # e.g. a CPU torch before a runtime that pulls torch
            subprocess.run([str(py), "-m", "pip", "install", "-q", *rt["pre"]], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *spec], check=True)
    except subprocess.CalledProcessError as e:
        return {"ready": False, "why": f"install failed: {e}"}
    marker.write_text(json.dumps({"pip": spec, "installed": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return {"ready": True, "why": "installed"}


# ----------------------------------------------------------------------------- folders


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


def build_folders(a, work: Path) -> List[dict]:
    py = project_python(a.python)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    folders = []
    wanted = set(a.variants.split(",")) if a.variants else None
    for name, fixture, opts in VARIANTS:
        if wanted and name not in wanted:
            continue
        out = work / name
        if out.exists():
            shutil.rmtree(out)
        cmd = [py, "-m", "mtpconvert", "convert", str(FIXTURES / fixture), str(out), *opts, "--no-smoke"]
        if a.mtp_layout:
            cmd += ["--mtp-layout", a.mtp_layout]
        log(f"[convert] {name}: {' '.join(cmd[1:])}")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
        if r.returncode != 0:
            folders.append({"name": name, "path": str(out), "error": "convert failed: " + _last_line(r.stderr)})
            continue
        if a.repack:
            dst = work / f"{name}.{a.repack}"
            cmd = [py, str(HERE / "repack.py"), str(out), str(dst), "--layout", a.repack]
            if a.index_lists_sidecar:
                cmd.append("--index-lists-sidecar")
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
            if r.returncode != 0:
                folders.append({"name": name, "path": str(dst), "error": "repack failed: " + _last_line(r.stderr)})
                continue
            out, name = dst, dst.name
        folders.append({"name": name, "path": str(out), "error": None})
    return folders


def predict(py: str, folder: str) -> Optional[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([py, "-m", "mtpconvert.compat", folder, "--json"], capture_output=True, text=True, env=env,
                       cwd=str(ROOT))
    if r.returncode != 0:
        log(f"[compat] {folder}: {r.stderr.strip()[-300:]}")
        return None
    rep = json.loads(r.stdout)
    return {x["runtime"]: x for x in rep["runtimes"]} | {"__layout__": rep["layout"]}


# ----------------------------------------------------------------------------- probes and checks


def run_probe(rt: dict, folder: str, prompts: Path, max_tokens: int, timeout: int) -> dict:
    cmd = [str(venv_python(rt)), str(PROBES / rt["probe"]), "--folder", folder, "--prompts-json", str(prompts),
           "--max-tokens", str(max_tokens)]
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


def lp_diff(a: Optional[list], b: Optional[list]) -> Optional[float]:
    """Largest |difference| between two runs' first-step top-5 log-probabilities (inf when the
    top-5 token sets differ); None when either run has none."""
    if not a or not b or len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            return None
        if set(x) != set(y):
            return float("inf")
        worst = max(worst, max(abs(x[k] - y[k]) for k in x))
    return worst


def check(name: str, rt: dict, res: dict, base: Optional[dict], a) -> dict:
    """The checks of one (folder, runtime) result. Values: True / False / None (not applicable)."""
    c: Dict[str, Optional[bool]] = {"backbone_exact": None, "head_found": None, "head_norms_as_written": None,
                                    "acceptance": None, "mtp_equals_plain": None}
    bt = res.get("backbone_tokens")
    if bt is not None and base and base.get("backbone_tokens") is not None:
        same = len(bt) >= 2 and bt == base["backbone_tokens"]
        d = lp_diff(res.get("backbone_logprobs"), base.get("backbone_logprobs"))
        c["backbone_exact"] = bool(same and (d is None or d <= a.logprob_tol))
    elif bt is None:
        c["backbone_exact"] = False
    if rt["mtp"]:
        c["head_found"] = bool(res.get("head_found"))
        hn = res.get("head_norm_mean") or {}
        if hn.get("file") is not None and hn.get("loaded") is not None:
            c["head_norms_as_written"] = abs(hn["file"] - hn["loaded"]) < 0.5
        p, acc = res.get("proposed"), res.get("accepted")
        c["acceptance"] = bool(p and acc is not None and acc / p > a.min_acceptance)
        mt = res.get("mtp_tokens")
        c["mtp_equals_plain"] = bool(mt is not None and bt is not None and mt == bt)
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
        head_ok = bool(c["head_found"] and c["acceptance"] and c["mtp_equals_plain"]
                       and c["head_norms_as_written"] is not False)
        if head_ok != p["head_usable"]["ok"]:
            return False
    return True


# ----------------------------------------------------------------------------- report


def _mark(v: Optional[bool]) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def markdown(rows: List[dict], meta: dict) -> str:
    out = [f"# Interop results ({meta['when']})", "",
           f"Prompts: {meta['prompts']} x {meta['max_tokens']} tokens, greedy. Baseline: {BASELINE}. "
           f"Layout option: {meta['layout']}.", "",
           "| folder | runtime | version | backbone exact (max logprob diff) | head found | head norms as written | "
           "accepted/proposed | MTP == plain | status | compat predicts (backbone / head) | agrees | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, res = r["checks"], r["result"]
        acc = (f"{res['accepted']}/{res['proposed']}" if res.get("proposed") else "-") if r["mtp"] else "-"
        pred = r.get("predicted")
        ptxt = (("exact" if pred["backbone_exact"]["ok"] else "WRONG") + " / "
                + ("yes" if pred["head_usable"]["ok"] else "no")) if pred else "-"
        d = r.get("lp_diff")
        bbtxt = _mark(c["backbone_exact"]) + ("" if d is None else f" ({d:.3g})")
        err = " ".join((res.get("error") or "").replace("|", "/").split())[:160]
        out.append(f"| {r['folder']} | {r['runtime']} | {res.get('version') or '-'} | {bbtxt} | "
                   f"{_mark(c['head_found'])} | {_mark(c['head_norms_as_written'])} | {acc} | {_mark(c['mtp_equals_plain'])} | {r['status']} | {ptxt} | "
                   f"{_mark(r['agrees'])} | {err} |")
    skipped = meta.get("skipped") or {}
    if skipped:
        out += ["", "Not run:", ""] + [f"- {k}: {v}" for k, v in skipped.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", action="append", default=[], help="run on this converted folder (repeatable)")
    ap.add_argument("--mtp-layout", default=None, help="passed to `mtpconvert convert --mtp-layout`")
    ap.add_argument("--repack", default=None, help="research: re-package each converted folder with "
                                                   "interop/repack.py --layout LAYOUT (sidecar, model-mtp, ...)")
    ap.add_argument("--index-lists-sidecar", action="store_true", help="with --repack sidecar")
    ap.add_argument("--variants", default=None, help="comma-separated subset of: " + ",".join(v[0] for v in VARIANTS))
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

    names = [n for n in (a.runtimes.split(",") if a.runtimes else RUNTIMES)]
    for n in names:
        if n not in RUNTIMES:
            ap.error(f"unknown runtime {n!r}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    skipped, ready = {}, []
    for n in names:
        rt = RUNTIMES[n]
        if not (PROBES / rt["probe"]).is_file():
            skipped[n] = f"no probe yet (interop/probes/{rt['probe']})"
            continue
        st = ensure_venv(n, rt, a.with_pr990, a.reinstall)
        if st["ready"]:
            ready.append(n)
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
        folders = [{"name": Path(f).name, "path": str(Path(f).resolve()), "error": None} for f in a.folder]
    else:
        folders = build_folders(a, a.out / "folders")
    prompts = json.loads(a.prompts_json.read_text())
    rows, bad_agreement, failed = [], 0, 0
    for f in folders:
        if f["error"]:
            rows.append({"folder": f["name"], "runtime": "-", "mtp": False, "result": {"error": f["error"]},
                         "checks": {k: None for k in ("backbone_exact", "head_found", "acceptance",
                                                      "mtp_equals_plain", "head_norms_as_written")},
                         "status": "ERROR", "predicted": None,
                         "agrees": None})
            failed += 1
            continue
        pred = predict(py, f["path"])
        base = run_probe(RUNTIMES[BASELINE], f["path"], a.prompts_json, a.max_tokens, a.timeout)
        for n in ready:
            rt = RUNTIMES[n]
            t0 = time.time()
            res = base if n == BASELINE else run_probe(rt, f["path"], a.prompts_json, a.max_tokens, a.timeout)
            c = check(n, rt, res, base, a)
            status = verdict(rt, c)
            agrees = agreement(rt, c, pred)
            log(f"[{f['name']}] {n}: {status} {json.dumps(c)} agrees={agrees} ({time.time() - t0:.1f}s)"
                + (f" error={res.get('error')}" if res.get("error") else ""))
            rows.append({"folder": f["name"], "path": f["path"], "runtime": n, "mtp": rt["mtp"], "result": res,
                         "checks": c, "status": status, "agrees": agrees,
                         "lp_diff": lp_diff(res.get("backbone_logprobs"), base.get("backbone_logprobs")),
                         "predicted": (pred or {}).get(rt["compat"]), "layout": (pred or {}).get("__layout__")})
            bad_agreement += agrees is False
            failed += status != "PASS"
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": len(prompts), "max_tokens": a.max_tokens,
            "layout": a.mtp_layout or (f"repack {a.repack}" if a.repack else "converter default"),
            "skipped": skipped, "baseline": BASELINE}
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
