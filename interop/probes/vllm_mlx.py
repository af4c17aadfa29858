"""Probe: vllm-mlx 0.6.0 (PyPI), through the engine its ``--continuous-batching`` server runs.

    <venv>/bin/python interop/probes/vllm_mlx.py --folder DIR --prompts-json FILE --max-tokens N

prints ONE JSON object on stdout (everything else goes to stderr):

    {"runtime": "vllm-mlx", "version", "backbone_tokens": [[ids]...], "backbone_logprobs",
     "head_found": bool, "mtp_tokens": [[ids]...] | null, "proposed": int | null,
     "accepted": int | null, "error": str | null, "detail": {...}}

``vllm-mlx serve DIR --continuous-batching [--enable-mtp]`` builds a
``vllm_mlx.engine.batched.BatchedEngine(model_name=DIR, scheduler_config=SchedulerConfig(
enable_mtp=...))`` and answers requests with ``BatchedEngine.generate``; this probe builds the same
object in-process (no server, no port) and passes the prompts as token ids, which that API takes:

1. ``enable_mtp=False``: plain greedy = ``backbone_tokens`` (``backbone_logprobs``: top-5 of the
   first step from the loaded model's own forward);
2. ``enable_mtp=True``: ``head_found`` = the Qwen3.5 injector attached a head that vllm-mlx's
   own ``patches.qwen3_5_mtp.validate_mtp_support`` accepts; proposed / accepted are the engine's
   per-request ``mtp_drafts`` / ``mtp_accepted`` counters.

vllm-mlx 0.6.0 pins mlx-lm >=0.31.3,<0.32, whose ``BatchGenerator`` has no ``_step`` method, and its
MTP loop (``scheduler._install_mtp``) returns before installing itself when that method is absent.
When no draft was proposed, ``mtp_tokens`` is null and ``error`` quotes vllm-mlx's own log lines
(the tokens the MTP-enabled engine produced are kept in ``detail.enable_mtp_tokens``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

# The probe file is named like the runtime's package and Python puts the probe's folder first on
# sys.path, where this file would shadow ``vllm_mlx``: drop that folder before importing anything.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_probe  # noqa: E402  (and _common drops this folder from sys.path)

RUNTIME = "vllm-mlx"


class _LogTap(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        try:
            self.lines.append((record.levelname, record.name, record.getMessage()))
        except Exception:  # noqa: BLE001
            pass

    def mtp(self):
        return [f"{lvl}:{name}: {msg}" for lvl, name, msg in self.lines if "MTP" in msg]


def _top5(model, prompt) -> dict:
    import mlx.core as mx

    out = model(mx.array([list(prompt)], dtype=mx.uint32))
    logits = (out[0] if isinstance(out, tuple) else out)[0, -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits)
    order = mx.argsort(-lp)[:5].tolist()
    vals = lp.tolist()
    return {str(i): round(vals[i], 5) for i in order}


async def _decode(folder: Path, prompts, max_tokens: int, enable_mtp: bool):
    from vllm_mlx.engine.batched import BatchedEngine
    from vllm_mlx.scheduler import SchedulerConfig

    engine = BatchedEngine(model_name=str(folder), scheduler_config=SchedulerConfig(enable_mtp=enable_mtp),
                           stream_interval=1, model_path=str(folder))
    await engine.start()
    try:
        tokens, drafts, accepted = [], 0, 0
        for p in prompts:
            out = await engine.generate(prompt=list(p), max_tokens=max_tokens, temperature=0.0, top_p=1.0)
            tokens.append([int(t) for t in out.tokens])
            drafts += int(out.mtp_drafts or 0)
            accepted += int(out.mtp_accepted or 0)
        model = engine._model  # what the engine decodes with (after vllm-mlx's MTP injection)
        stats = engine.get_stats()
        return tokens, drafts, accepted, model, stats
    finally:
        await engine.stop()


def body(folder: Path, prompts, max_tokens: int, result: dict, tap: _LogTap) -> None:
    from importlib.metadata import version

    result["version"] = version("vllm-mlx")
    result["detail"]["mlx_lm"] = version("mlx-lm")
    import mlx.core as mx

    bb, _d, _a, model, _s = asyncio.run(_decode(folder, prompts, max_tokens, enable_mtp=False))
    result["backbone_tokens"] = bb
    result["backbone_logprobs"] = [_top5(model, p) for p in prompts]
    lm = getattr(model, "language_model", model)
    result["detail"]["backbone_final_norm_mean"] = round(float(lm.model.norm.weight.astype(mx.float32).mean()), 4)
    del model

    mark = len(tap.lines)
    toks, drafts, accepted, model, stats = asyncio.run(_decode(folder, prompts, max_tokens, enable_mtp=True))
    from vllm_mlx.patches.qwen3_5_mtp import validate_mtp_support

    result["head_found"] = bool(validate_mtp_support(model))
    lm = getattr(model, "language_model", model)
    head = getattr(lm, "mtp", None)
    if head is not None:
        result["detail"]["head_pre_fc_norm_hidden_mean"] = round(
            float(head.pre_fc_norm_hidden.weight.astype(mx.float32).mean()), 4)
        result["detail"]["head_fc"] = type(head.fc).__name__
    result["detail"]["mtp_status"] = stats.get("mtp") if isinstance(stats, dict) else None
    result["detail"]["enable_mtp_tokens"] = toks
    lines = [f"{lvl}:{name}: {msg}" for lvl, name, msg in tap.lines[mark:] if "MTP" in msg]
    result["detail"]["mtp_log"] = lines[:20]
    result["proposed"], result["accepted"] = drafts, accepted
    if drafts > 0:
        result["mtp_tokens"] = toks
        return
    why = [msg for lvl, _n, msg in tap.lines[mark:] if lvl in ("WARNING", "ERROR") and "MTP" in msg]
    result["error"] = ("no MTP draft was proposed: " + " | ".join(dict.fromkeys(why)))[:1500] if why else \
        "no MTP draft was proposed (vllm-mlx logged no reason)"


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    tap = _LogTap()
    logging.getLogger().addHandler(tap)
    logging.getLogger().setLevel(logging.INFO)

    def logged_body(folder: Path, prompts, max_tokens: int, result: dict) -> None:
        try:
            body(folder.resolve(), prompts, max_tokens, result, tap)
        except Exception:
            result["detail"].setdefault("mtp_log", tap.mtp()[:20])  # what vllm-mlx said before it failed
            raise

    run_probe(RUNTIME, logged_body, argv, error_chars=1500)
    sys.stderr.flush()
    # After a failed load, vllm-mlx's engine thread is left behind and the interpreter's exit aborts
    # ("terminate called without an active exception"): the answer is out, leave without teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
