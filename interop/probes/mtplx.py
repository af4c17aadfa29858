"""Probe: mtplx 2.12.2 (PyPI), through its own Python API.

    <venv>/bin/python -m interop.probes.mtplx --folder DIR --prompts-json FILE --max-tokens N

prints ONE JSON object on stdout (everything else goes to stderr):

    {"runtime": "mtplx", "version", "backbone_tokens": [[ids]...], "backbone_logprobs",
     "head_found": bool, "mtp_tokens": [[ids]...] | null, "proposed": int | null,
     "accepted": int | null, "error": str | null, "detail": {...}}

What it runs: ``mtplx.runtime.load(folder)`` (mlx-lm ``load`` for the backbone, then mtplx's
MTP injection, which looks for ``config.mlx_lm_extra_tensors.mtp_file``, else ``mtp.safetensors``,
``mtp/weights.safetensors``, ``model-mtp.safetensors``, else ``mtp.*`` keys inside the model
shards), then ``mtplx.generation.generate_ar`` (plain greedy) and ``generate_mtpk`` (greedy MTP,
depth 1) on each prompt, with the head's KV cache kept over the prompt and every committed token
(``mtp_cache_policy="persistent"``, ``mtp_history_policy="committed"``: what mtplx's CLI and server
pass, cli.py:1549). ``generate_mtp1`` drafts each token from an empty head cache instead
(generation.py:9814), which a head trained over whole sequences cannot do well: it is reported as
``detail.history_free`` (proposed, accepted). Proposed/accepted are mtplx's own ``drafted_tokens`` /
``accepted_drafts`` counters. When the load with the head fails, the backbone is still loaded
with ``mtp=False`` so ``backbone_tokens`` are reported next to the error.

mtplx's CLI and server need macOS; its Python API runs on Linux except for one import:
``mtplx.route_tape`` opens ``/usr/lib/libSystem.B.dylib`` at import time for a monotonic clock
(``mach_continuous_time``). On other systems this probe answers that one library with a stand-in
built on ``time.monotonic_ns`` (recorded as ``detail.clock_stand_in``); nothing that loads
weights or decodes is replaced.

``detail.tier`` is mtplx's own label for the folder (``verified`` with a valid ``mtplx_runtime.json``,
``family-compatible-unverified`` without one): what ``mtplx inspect-model DIR --json`` reports.
"""

from __future__ import annotations

import logging
import platform
import sys
import traceback
from pathlib import Path

from interop.probes._common import run_probe

RUNTIME = "mtplx"


def _install_clock_stand_in() -> bool:
    """Answer ``ctypes.CDLL('/usr/lib/libSystem.B.dylib')`` off macOS with a monotonic clock."""
    if platform.system() == "Darwin":
        return False
    import ctypes
    import time

    real_cdll = ctypes.CDLL

    class _Fn:
        def __init__(self, fn):
            self.fn, self.restype, self.argtypes = fn, None, None

        def __call__(self, *args):
            return self.fn(*args)

    def _timebase(ref):
        info = ref._obj
        info.numer, info.denom = 1, 1
        return 0

    class _LibSystem:
        mach_timebase_info = _Fn(_timebase)
        mach_continuous_time = _Fn(time.monotonic_ns)
        mach_absolute_time = _Fn(time.monotonic_ns)
        sysctlbyname = _Fn(lambda *a: -1)

    def cdll(name, *args, **kwargs):
        if str(name).endswith("libSystem.B.dylib"):
            return _LibSystem()
        return real_cdll(name, *args, **kwargs)

    ctypes.CDLL = cdll
    return True


class _LogTap(logging.Handler):
    """Keeps mtplx's own log lines (which file the head came from, refusals) for the report."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        try:
            self.lines.append(f"{record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001
            pass


def _norm_mean(module) -> float:
    import mlx.core as mx

    return round(float(module.weight.astype(mx.float32).mean()), 4)


def _head_detail(text_model) -> dict:
    """Which precision each linear of the loaded head ended up in."""
    mtp = getattr(text_model, "mtp", None)
    if mtp is None:
        return {}
    quantized = {}
    for name, mod in mtp.named_modules():
        if hasattr(mod, "bits") and hasattr(mod, "group_size"):
            quantized[name] = f"{mod.bits}b/g{mod.group_size}"
    return {"head_quantized_modules": quantized, "head_fc": type(mtp.fc).__name__,
            "head_pre_fc_norm_hidden_mean": _norm_mean(mtp.pre_fc_norm_hidden)}


def _label(folder: Path, result: dict) -> None:
    """mtplx's own verdict on the folder, as ``mtplx inspect-model DIR --json`` prints it (cli.py:1126:
    ``artifacts.inspect_model(DIR).compatibility``): its tier, and what it made of ``mtplx_runtime.json``;
    ``serve_depth``: the draft depth ``mtplx serve`` would default to (commands/public.py
    ``_model_contract_depth``, which caps its default depth 3 at the contract's ``mtp_depth_max``)."""
    from mtplx.artifacts import inspect_model

    inspection = inspect_model(str(folder))
    c = inspection.compatibility or {}
    result["detail"]["tier"] = c.get("tier")
    result["detail"]["inspect"] = {k: c.get(k) for k in ("arch_id", "can_run", "unverified_model", "mtp_supported",
                                                         "support_level", "recommended_profile",
                                                         "runtime_contract_error", "message")}
    result["detail"]["inspect"]["runtime_contract"] = c.get("runtime_contract") is not None
    try:
        from mtplx.commands.public import _model_contract_depth

        result["detail"]["serve_depth"] = _model_contract_depth(inspection.to_dict(), profile="sustained",
                                                                fallback=3)
    except Exception as e:  # noqa: BLE001 - a private helper: its absence is not the probe's failure
        result["detail"]["serve_depth"] = f"{type(e).__name__}: {e}"[:200]


def body(folder: Path, prompts, max_tokens: int, result: dict, tap: _LogTap) -> None:
    from importlib.metadata import version

    result["version"] = version("mtplx")
    result["detail"]["mlx_lm"] = version("mlx-lm")
    result["detail"]["clock_stand_in"] = _install_clock_stand_in()

    from mtplx.generation import generate_ar, generate_mtp1, generate_mtpk
    from mtplx.runtime import load
    from mtplx.sampling import SamplerConfig

    try:
        _label(folder, result)
    except Exception as e:  # noqa: BLE001 - the label is a side finding: decoding is still probed
        result["detail"]["tier"] = f"inspect-model failed: {type(e).__name__}: {e}"[:300]
    greedy = SamplerConfig(temperature=0.0, top_p=1.0, top_k=0)
    load_error = None
    try:
        rt = load(str(folder))
    except Exception as e:  # noqa: BLE001 - mtplx's refusal is the finding
        traceback.print_exc(file=sys.stderr)
        load_error = f"{type(e).__name__}: {str(e).strip()}"[:600]
        rt = load(str(folder), mtp=False)
    lm = getattr(rt.model, "language_model", rt.model)
    result["detail"]["backbone_final_norm_mean"] = _norm_mean(lm.model.norm)
    fa = next(layer for layer in lm.model.layers if not layer.is_linear)
    result["detail"]["backbone_q_norm_mean"] = _norm_mean(fa.self_attn.q_norm)
    result["head_found"] = bool(rt.mtp_enabled)
    result["detail"].update(_head_detail(lm))

    tokens, lps = [], []
    for p in prompts:
        out = generate_ar(rt, list(p), max_tokens=max_tokens, sampler=greedy, stop_token_ids=set(),
                          first_token_logprobs_top_k=5)
        tokens.append([int(t) for t in out.tokens])
        ftl = out.first_token_logprobs
        lps.append({str(t): round(v, 5) for t, v in ftl.top} if ftl is not None else None)
    result["backbone_tokens"] = tokens
    result["backbone_logprobs"] = lps
    if load_error is not None:
        result["error"] = load_error
        return
    if not rt.mtp_enabled:
        result["error"] = "mtplx loaded the model without an MTP head (mtp_enabled=False)"
        return

    mtp_tokens, proposed, accepted, free = [], 0, 0, [0, 0]
    for p in prompts:
        out = generate_mtpk(rt, list(p), max_tokens=max_tokens, sampler=greedy, stop_token_ids=set(),
                            speculative_depth=1, mtp_cache_policy="persistent", mtp_history_policy="committed")
        mtp_tokens.append([int(t) for t in out.tokens])
        proposed += int(out.stats.drafted_tokens)
        accepted += int(out.stats.accepted_drafts)
        once = generate_mtp1(rt, list(p), max_tokens=max_tokens, sampler=greedy, stop_token_ids=set())
        free[0] += int(once.stats.drafted_tokens)
        free[1] += int(once.stats.accepted_drafts)
    result["mtp_tokens"], result["proposed"], result["accepted"] = mtp_tokens, proposed, accepted
    result["detail"]["history_free"] = {"proposed": free[0], "accepted": free[1]}


def main(argv=None) -> int:
    tap = _LogTap()
    logging.getLogger().addHandler(tap)
    logging.getLogger().setLevel(logging.INFO)

    def keep_log(result: dict) -> None:
        result["detail"]["log"] = [line for line in tap.lines if "MTP" in line or "mtp" in line][:20]

    return run_probe(RUNTIME, lambda folder, prompts, max_tokens, result: body(folder, prompts, max_tokens, result,
                                                                                 tap),
                     argv, error_chars=600, finish=keep_log)


if __name__ == "__main__":
    sys.exit(main())
