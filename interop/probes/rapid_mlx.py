"""Probe: rapid-mlx 0.16.10 (PyPI), through its server, as a user runs it.

    <venv>/bin/python -m interop.probes.rapid_mlx --folder DIR --prompts-json FILE --max-tokens N

prints ONE JSON object on stdout (everything else goes to stderr):

    {"runtime": "rapid-mlx", "version", "backbone_tokens": [[ids]...], "backbone_logprobs",
     "head_found": bool, "mtp_tokens": [[ids]...] | null, "proposed": int | null,
     "accepted": int | null, "error": str | null, "detail": {...}}

rapid-mlx's MTP path is its OpenAI server (the in-process engine needs the CLI's configuration
plumbing), so the probe starts it twice on 127.0.0.1 with a free port and stops it itself:

1. ``rapid-mlx serve DIR`` (no speculative decoding): plain greedy = ``backbone_tokens``;
2. ``rapid-mlx serve DIR --speculative-config '{"method":"mtp","model":"DIR"}'``: greedy MTP =
   ``mtp_tokens``; proposed / accepted are the sums of the server's own per-request
   ``metrics.speculative_decoding.drafted_by_depth`` / ``accepted_by_depth``. When the server
   refuses to boot, ``error`` carries its refusal and the injector's warning from its log.

Requests go to ``/v1/completions`` (temperature 0, ``logprobs: 5``). That endpoint takes text, so
each token-id prompt is sent as the folder tokenizer's decoding of it (``detail.prompt_roundtrip``
says whether re-encoding gives the same ids back), and the generated tokens are read back from the
per-token pieces of ``logprobs.tokens`` through the tokenizer's one-token decodings (pieces that
decode ambiguously are counted in ``detail.ambiguous_pieces``).

Privacy and isolation: telemetry off (``--no-telemetry``, ``RAPID_MLX_TELEMETRY=0``,
``DO_NOT_TRACK=1``), no version check (``RAPID_MLX_DISABLE_VERSION_CHECK=1``), no downloads
(``--disable-model-downloads``, ``HF_HUB_OFFLINE=1``), no disk caches, no prefix cache, and a
throw-away ``HOME`` for its state files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from interop.probes._common import run_probe

RUNTIME = "rapid-mlx"
BOOT_TIMEOUT_S = float(os.environ.get("MTPCONVERT_PROBE_BOOT_TIMEOUT", "600"))
REQUEST_TIMEOUT_S = float(os.environ.get("MTPCONVERT_PROBE_REQUEST_TIMEOUT", "600"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``rapid-mlx serve`` process on 127.0.0.1, started and stopped by this probe."""

    def __init__(self, folder: Path, spec: bool, workdir: Path, extra: dict = None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / (("serve-mtp" + "".join(f"-{k}" for k in extra or {}) if spec else "serve-plain")
                                   + ".log")
        exe = Path(sys.executable).with_name("rapid-mlx")
        cmd = [str(exe), "--no-telemetry", "serve", str(folder), "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "probe", "--disable-model-downloads", "--disable-disk-caches",
               "--disable-prefix-cache", "--no-preflight"]
        if spec:
            # extra keys go inside the config: rapid-mlx refuses its legacy flags beside --speculative-config
            cmd += ["--speculative-config", json.dumps({"method": "mtp", "model": str(folder), **(extra or {})})]
        home = workdir / "home"
        home.mkdir(exist_ok=True)
        env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), RAPID_MLX_TELEMETRY="0",
                   DO_NOT_TRACK="1", RAPID_MLX_DISABLE_VERSION_CHECK="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
        env.pop("CI", None)  # CI changes rapid-mlx's defaults; telemetry is off by the switches above
        self.cmd = cmd
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        return False

    def complete(self, prompt: str, max_tokens: int) -> dict:
        body = json.dumps({"model": "probe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "top_p": 1.0, "logprobs": 5, "stream": False}).encode()
        req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def status(self) -> dict:
        try:
            with urllib.request.urlopen(self.base + "/v1/status", timeout=30) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # only the server process this probe started
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def _log_lines(text: str, needles) -> list:
    return [ln.strip() for ln in text.splitlines() if any(n in ln for n in needles) and 'File "' not in ln][:12]


def _refusal(text: str) -> str:
    """The server's own words for a refused boot: the injector's warning, then the fatal error."""
    lines = text.splitlines()
    inject = [ln.strip() for ln in lines if "[mtp.inject]" in ln and ("WARNING" in ln or "ERROR" in ln)]
    fatal = [ln.strip() for ln in lines if ln.startswith(("RuntimeError", "ValueError", "error:", "ERROR:"))]
    parts = inject[-1:] + fatal[-2:]
    if not parts:
        parts = [ln.strip() for ln in lines[-3:]]
    return " | ".join(parts)[:1500]


def _pieces_to_ids(pieces, piece_ids: dict, ambiguous: set, hits: set):
    out = []
    for piece in pieces:
        if piece not in piece_ids:
            raise ValueError(f"generated piece {piece!r} is no single-token decoding of this tokenizer")
        if piece in ambiguous:
            hits.add(piece)
        out.append(piece_ids[piece])
    return out


def _run(server: Server, texts, max_tokens: int, piece_ids: dict, ambiguous: set, hits: set):
    tokens, first_lps, drafted, accepted, metrics = [], [], 0, 0, []
    for text in texts:
        resp = server.complete(text, max_tokens)
        choice = resp["choices"][0]
        lp = choice.get("logprobs") or {}
        tokens.append(_pieces_to_ids(lp.get("tokens") or [], piece_ids, ambiguous, hits))
        top = (lp.get("top_logprobs") or [None])[0] or {}
        first_lps.append({str(piece_ids[k]): round(v, 5) for k, v in top.items() if k in piece_ids})
        sd = (resp.get("metrics") or {}).get("speculative_decoding")
        metrics.append(sd)
        if sd:
            drafted += int(sum(sd.get("drafted_by_depth") or []))
            accepted += int(sum(sd.get("accepted_by_depth") or []))
    return tokens, first_lps, drafted, accepted, metrics


def _run_spec(folder, workdir, texts, max_tokens, piece_ids, ambiguous, hits, result, extra) -> bool:
    """One MTP server run; True when it should be run again with a fixed draft depth: the head was
    injected and the MTP loop ran, but rapid-mlx's EV depth controller (a port of Ollama's
    speculate_depth) parked the drafter (K=0: drafting did not pay in its timing on this host), so
    no draft was verified. ``disable_auto_k`` (its A/B benching switch) fixes the depth at
    ``mtp_max_k``; the default run's status is kept in ``detail.auto_k``."""
    spec = Server(folder, spec=True, workdir=workdir, extra=extra)
    try:
        ready = spec.wait_ready()
        log = spec.log_text()
        result["detail"]["mtp_log"] = _log_lines(log, ("[mtp.inject]", "MTP-vendored", "norm_shift", "spec decode"))
        if extra:
            result["detail"]["speculative_config_extra"] = dict(extra)
        if not ready:
            result["error"] = "MTP server refused to boot: " + _refusal(log)
            return False
        result["head_found"] = "dispatch_mtp_inject succeeded" in log
        mt, _lps, drafted, accepted, metrics = _run(spec, texts, max_tokens, piece_ids, ambiguous, hits)
        result["mtp_tokens"], result["proposed"], result["accepted"] = mt, drafted, accepted
        result["detail"]["speculative_decoding"] = metrics
        status = spec.status().get("mtp_prompt_lookup")
        result["detail"]["mtp_status"] = status
        result["detail"]["mtp_log"] = _log_lines(spec.log_text(),
                                                 ("[mtp.inject]", "MTP-vendored", "norm_shift", "spec decode"))
        result["error"] = None
        if all(m is None for m in metrics):
            result["error"] = ("rapid-mlx answered every request without its MTP loop (no per-request "
                               "speculative_decoding metrics); /v1/status mtp_prompt_lookup: "
                               + json.dumps(status))[:1500]
            parked = (isinstance(status, dict) and status.get("vendored_steps") and not status.get("verify_calls")
                      and not status.get("fallthrough_steps"))
            if parked and not extra:
                result["detail"]["auto_k"] = {"parked": True, "mtp_status": status}
                return True
        return False
    finally:
        spec.stop()


def body(folder: Path, prompts, max_tokens: int, result: dict) -> None:
    from importlib.metadata import version

    result["version"] = version("rapid-mlx")
    result["detail"]["mlx_lm"] = version("mlx-lm")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))  # never trust_remote_code
    texts = [tok.decode(p) for p in prompts]
    result["detail"]["prompt_roundtrip"] = [tok.encode(t) == list(p) for t, p in zip(texts, prompts)]
    piece_ids, ambiguous, hits = {}, set(), set()
    for i in range(len(tok)):
        piece = tok.decode([i])
        if piece in piece_ids:
            ambiguous.add(piece)
        else:
            piece_ids[piece] = i

    workdir = Path(tempfile.mkdtemp(prefix="rapid-mlx-probe-"))
    try:
        plain = Server(folder, spec=False, workdir=workdir)
        try:
            if not plain.wait_ready():
                raise RuntimeError("plain server did not come up: " + _refusal(plain.log_text()))
            bb, lps, _d, _a, _m = _run(plain, texts, max_tokens, piece_ids, ambiguous, hits)
            result["backbone_tokens"], result["backbone_logprobs"] = bb, lps
            result["detail"]["plain_log"] = _log_lines(plain.log_text(), ("norm_shift", "Loading", "Model profile"))
        finally:
            plain.stop()

        for extra in ({}, {"disable_auto_k": True}):
            if not _run_spec(folder, workdir, texts, max_tokens, piece_ids, ambiguous, hits, result, extra):
                break
    finally:
        result["detail"]["ambiguous_pieces"] = len(hits)
        if os.environ.get("MTPCONVERT_PROBE_KEEP_LOGS"):
            result["detail"]["server_logs"] = str(workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
    return run_probe(RUNTIME, lambda folder, prompts, max_tokens, result: body(folder.resolve(), prompts, max_tokens,
                                                                                 result),
                     argv, error_chars=1500)


if __name__ == "__main__":
    sys.exit(main())
