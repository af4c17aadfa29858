"""Shared plumbing of the interop probes (stdlib only: each probe runs in its runtime's own venv).

A probe is run as ``<venv>/bin/python -m interop.probes.<runtime> --folder DIR --prompts-json FILE
--max-tokens N`` and prints exactly ONE JSON object on stdout:

    {"runtime", "version", "backbone_tokens": [[ids]...] | null, "head_found": bool,
     "mtp_tokens": [[ids]...] | null, "proposed": int | null, "accepted": int | null,
     "error": str | null}

plus optional "head_norm_mean" {"file": x, "loaded": y} (the MTP head's final norm weight mean as
stored and as the runtime loaded it), optional "backbone_logprobs" (per prompt, the top-5 log-probabilities of the first plain
greedy step as {token id: logprob}; the driver compares them with the baseline's, because on the
tiny fixtures a wrong backbone can still decode the same greedy tokens) and optional "detail" (a
dict of free-form facts). Anything the runtime prints goes to stderr.
Prompts are lists of token ids. Decoding is greedy (temperature 0) everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Callable, List, Optional


def generated_ids(steps, max_tokens: int):
    """The first ``max_tokens`` token ids a ``generate_step``-style iterator yields, and the first step's
    log-probabilities. A step yields one token, or several (an MTP step's accepted run), as an int, a list or
    an array; ``None`` entries are skipped."""
    out, first = [], None
    for i, (tok, logprobs) in enumerate(steps):
        if i == 0:
            first = logprobs
        value = tok.tolist() if hasattr(tok, "tolist") else tok
        out.extend(int(t) for t in (value if isinstance(value, (list, tuple)) else [value]) if t is not None)
        if len(out) >= max_tokens:
            break
    return out[:max_tokens], first


def empty_result(runtime: str) -> dict:
    return {"runtime": runtime, "version": None, "backbone_tokens": None, "backbone_logprobs": None, "head_found": False,
            "mtp_tokens": None, "proposed": None, "accepted": None, "error": None, "detail": {}}


def run_probe(runtime: str, body: Callable[[Path, List[List[int]], int, dict], None], argv=None, *,
              error_chars: int = 500, finish: Optional[Callable[[dict], None]] = None) -> int:
    """Parse the probe arguments, call ``body(folder, prompts, max_tokens, result)`` (which fills
    ``result`` as it goes, so a failure late still reports what worked), print the JSON.
    ``error_chars``: how much of the failure's first line is kept; ``finish(result)`` adds what the
    probe gathered on the side (log lines) just before it is printed."""
    ap = argparse.ArgumentParser(description=f"interop probe: {runtime}")
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--prompts-json", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args(argv)
    result = empty_result(runtime)
    real_stdout = sys.stdout
    try:
        prompts = json.loads(a.prompts_json.read_text())
        if not (isinstance(prompts, list) and all(isinstance(p, list) and p for p in prompts)):
            raise ValueError("prompts json must be a list of non-empty token-id lists")
        with contextlib.redirect_stdout(sys.stderr):
            body(a.folder, prompts, a.max_tokens, result)
    except BaseException as e:  # noqa: BLE001 - a probe reports every failure as data
        if isinstance(e, KeyboardInterrupt):
            raise
        traceback.print_exc(file=sys.stderr)
        msg = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:error_chars]
    if finish is not None:
        finish(result)
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()
    return 0


def top_logprobs(logprobs, k: int = 5) -> dict:
    """The ``k`` largest log-probabilities of one decode step as {token id: logprob}: a fingerprint
    that sees a wrong backbone (e.g. norms shifted twice) even where greedy tokens do not change."""
    import mlx.core as mx

    v = logprobs.reshape(-1).astype(mx.float32)
    v = v - mx.logsumexp(v)  # accept raw logits too
    order = mx.argsort(-v)[:k].tolist()
    vals = v.tolist()
    return {str(i): round(vals[i], 5) for i in order}


def version_of(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return "unknown"


def file_head_norm_mean(folder: Path):
    """Mean of the MTP head's final norm weight as stored in the folder (any root or mtp/
    safetensors file, key ``[language_model.]mtp.norm.weight``), or None. A probe reports it next to
    the value the runtime loaded: a head whose norms were shifted again on load reads ~1 higher
    (on the fixtures a double-shifted head can still draft well, so acceptance does not show it)."""
    import mlx.core as mx

    for f in sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("mtp/*.safetensors")):
        w = mx.load(str(f))
        for k in ("mtp.norm.weight", "language_model.mtp.norm.weight"):
            if k in w:
                return round(float(w[k].astype(mx.float32).mean()), 4)
    return None


def head_tensor_locations(folder: Path) -> dict:
    """Which safetensors file at the folder root holds which kind of ``mtp`` key (headers only)."""
    import struct

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        keys = [k for k in header if k != "__metadata__" and "mtp." in k]
        if keys:
            out[f.name] = {"count": len(keys), "example": sorted(keys)[0],
                           "metadata": header.get("__metadata__")}
    return out
