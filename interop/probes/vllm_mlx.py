"""Probe: vllm-mlx 0.6.0 (PyPI), through the engine its ``--continuous-batching`` server runs.

    <venv>/bin/python -m interop.probes.vllm_mlx --folder DIR --prompts-json FILE --max-tokens N

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

A folder with a ``vision_config`` (``--keep-vision``) goes to the engine's MLLM scheduler instead,
for every request: that scheduler takes text prompts (the tokenizer's decoding of the ids, round
trip in ``detail.prompt_roundtrip``) and has its own MTP loop
(``mllm_batch_generator.install_mtp_mllm``), which does not depend on mlx-lm's ``BatchGenerator``.

``--requests --folder DIR [--add-serving-files]``: a text-only and an image chat request against
``vllm-mlx serve DIR --enable-mtp`` with and without ``--continuous-batching`` (see requests_main).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

from interop.probes._common import run_probe

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
    out = out[0] if isinstance(out, tuple) else out
    # a --keep-vision folder is served by mlx-vlm's model, which returns a LanguageModelOutput
    logits = getattr(out, "logits", out)[0, -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits)
    order = mx.argsort(-lp)[:5].tolist()
    vals = lp.tolist()
    return {str(i): round(vals[i], 5) for i in order}


async def _decode(folder: Path, prompts, max_tokens: int, enable_mtp: bool, texts=None):
    from vllm_mlx.engine.batched import BatchedEngine
    from vllm_mlx.scheduler import SchedulerConfig

    engine = BatchedEngine(model_name=str(folder), scheduler_config=SchedulerConfig(enable_mtp=enable_mtp),
                           stream_interval=1, model_path=str(folder))
    await engine.start()
    try:
        tokens, drafts, accepted = [], 0, 0
        for i, p in enumerate(prompts):
            # the MLLM scheduler (a folder with a vision_config) runs its processor over a text prompt:
            # ids come back empty, so it gets the tokenizer's decoding of them (round trip checked)
            prompt = texts[i] if texts is not None else list(p)
            out = await engine.generate(prompt=prompt, max_tokens=max_tokens, temperature=0.0, top_p=1.0)
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

    texts = None
    import json

    if "vision_config" in json.loads((folder / "config.json").read_text()):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))  # never trust_remote_code
        texts = [tok.decode(list(p)) for p in prompts]
        result["detail"]["route"] = "MLLM (vision_config): text prompts through the MLLM scheduler"
        result["detail"]["prompt_roundtrip"] = [tok.encode(t, add_special_tokens=False) == list(p)
                                                for t, p in zip(texts, prompts)]
    bb, _d, _a, model, _s = asyncio.run(_decode(folder, prompts, max_tokens, enable_mtp=False, texts=texts))
    result["backbone_tokens"] = bb
    result["backbone_logprobs"] = [_top5(model, p) for p in prompts]
    lm = getattr(model, "language_model", model)
    result["detail"]["backbone_final_norm_mean"] = round(float(lm.model.norm.weight.astype(mx.float32).mean()), 4)
    del model

    mark = len(tap.lines)
    toks, drafts, accepted, model, stats = asyncio.run(_decode(folder, prompts, max_tokens, enable_mtp=True,
                                                               texts=texts))
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


# ----------------------------------------------------------------------------- --requests mode
# What a user of a --keep-vision folder sees: `vllm-mlx serve DIR --enable-mtp`, once with
# --continuous-batching (BatchedEngine: a folder with a vision_config goes to its MLLM scheduler for
# every request) and once without (SimpleEngine: "per-request routing", text-only -> an mlx-lm
# TextModel built from the VLM's weights, media -> mlx-vlm), one text-only and one image chat
# request each (OpenAI API), with what served it (its log), its MTP counters (/v1/status) and the
# answer. SimpleEngine's text route reports no counters, so that mode is also run in-process with
# the injected head's mtp_forward counted.

REQUEST_TEXT = "zokabe zokabe hazo ruvika noberu vizo sarugi vizo zokabe vimi no gino"  # a fixture prompt
_ROUTE_MARKS = ("Model route", "MLLM", "Text-only request", "routing", "SimpleEngine loaded", "[MTP",
                "MTP inject", "MLLM.chat", "mllm_batch_generator:[sampling]", "Chat completion:", "Error", "error")
# A Qwen-style chat template with image parts (the fixture tokenizer has none).
_CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for c in message.content %}"
    "{%- if c.type == 'image' or c.type == 'image_url' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c.type == 'text' %}{{ c.text }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def serving_copy(folder: Path, out: Path) -> List[str]:
    """Copy ``folder`` to ``out`` (weights hard-linked) and add what a chat + image request needs and
    the bundled fixture lacks, as a Qwen3.5 release ships it: image special tokens (new ids inside the
    embedding table) and the config's ids for them, a chat template with image parts, and a
    Qwen2-VL image processor config sized to the folder's vision_config. Returns what was added."""
    import json
    import shutil

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(folder, out, copy_function=link)
    added = []
    cfg = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    have = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    if "<|image_pad|>" not in have:
        nxt = max(max(tok["model"]["vocab"].values()), max(have.values(), default=0)) + 1
        for name in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"):
            tok["added_tokens"].append({"id": nxt, "content": name, "single_word": False, "lstrip": False,
                                        "rstrip": False, "normalized": False, "special": True})
            have[name] = nxt
            nxt += 1
        if nxt > cfg.get("text_config", cfg)["vocab_size"]:
            raise ValueError("no room for image tokens in the embedding table")
        (out / "tokenizer.json").unlink()
        (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        cfg.update(image_token_id=have["<|image_pad|>"], video_token_id=have["<|video_pad|>"],
                   vision_start_token_id=have["<|vision_start|>"], vision_end_token_id=have["<|vision_end|>"])
        (out / "config.json").unlink()
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        added.append(f"image tokens {have['<|vision_start|>']}-{have['<|video_pad|>']} (tokenizer.json, config.json)")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    if not tc.get("chat_template") and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(_CHAT_TEMPLATE)
        added.append("chat_template.jinja")
    if not (out / "preprocessor_config.json").exists():
        vc = cfg["vision_config"]
        pre = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
               "patch_size": vc["patch_size"], "temporal_patch_size": vc["temporal_patch_size"],
               "merge_size": vc["spatial_merge_size"], "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
               "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}}
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
        vp = {k: v for k, v in pre.items() if k != "image_processor_type"}
        (out / "video_preprocessor_config.json").write_text(
            json.dumps(dict(vp, video_processor_type="Qwen3VLVideoProcessor"), indent=2) + "\n")
        added.append("preprocessor_config.json, video_preprocessor_config.json")
    return added


def _marked(line: str) -> bool:
    return not line.startswith(" ") and any(m in line for m in _ROUTE_MARKS)  # no traceback frames


def _png_b64(path: Optional[Path]) -> str:
    import base64
    import io

    if path is None:
        from PIL import Image, ImageDraw

        im = Image.new("RGB", (64, 64), (255, 255, 255))
        d = ImageDraw.Draw(im)
        d.rectangle([8, 8, 40, 40], fill=(220, 30, 30))
        d.ellipse([30, 30, 60, 60], fill=(30, 60, 220))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()
    return base64.b64encode(path.read_bytes()).decode()


def _http(port: int, path: str, body=None, timeout: float = 300):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode() if body else None,
                                 headers={"content-type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=timeout).read())
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": e.read().decode(errors="replace")[:300]}


def _messages(kind: str, image_b64: str):
    if kind == "text":
        return [{"role": "user", "content": REQUEST_TEXT}]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + image_b64}},
                                         {"type": "text", "text": REQUEST_TEXT}]}]


def _serve(folder: Path, flags: List[str], port: int, max_tokens: int, image_b64: str, log_path: Path) -> dict:
    import subprocess
    import time

    exe = Path(sys.executable).with_name("vllm-mlx")
    cmd = [str(exe), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--offline", *flags]
    out = {"command": "vllm-mlx " + " ".join(cmd[1:]), "requests": {}}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-mlx serve exited with {proc.returncode}")
            try:
                _http(port, "/v1/status", timeout=5)
                break
            except OSError:
                time.sleep(1)
        for kind in ("text", "image"):
            mark = log_path.stat().st_size
            before = (_http(port, "/v1/status").get("mtp") or {})
            r = _http(port, "/v1/chat/completions", {"model": str(folder), "messages": _messages(kind, image_b64),
                                                      "max_tokens": max_tokens, "temperature": 0})
            after = (_http(port, "/v1/status").get("mtp") or {})
            with open(log_path, errors="replace") as f:
                f.seek(mark)
                lines = [ln.rstrip()[:240] for ln in f if _marked(ln)]
            out["requests"][kind] = {
                "output": r["choices"][0]["message"]["content"] if "choices" in r else None,
                "error": None if "choices" in r else r, "usage": r.get("usage"),
                "mtp_status": {k: after.get(k) for k in ("enabled", "implementation")} if after else None,
                "mtp_attempted": (after.get("attempted") or 0) - (before.get("attempted") or 0) if after else None,
                "mtp_accepted": (after.get("accepted") or 0) - (before.get("accepted") or 0) if after else None,
                "log": lines[:12]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            proc.kill()
    with open(log_path, errors="replace") as f:
        out["startup_log"] = [ln.rstrip()[:240] for ln in f if _marked(ln)][:25]
    return out


def _simple_in_process(folder: Path, max_tokens: int, image_b64: str) -> dict:
    """SimpleEngine(force_mllm, mtp=True) as `serve --enable-mtp` builds it, with the injected head's
    mtp_forward counted on both routes."""
    from vllm_mlx.engine.simple import SimpleEngine

    calls = {"n": 0}

    async def run():
        e = SimpleEngine(model_name=str(folder), force_mllm=True, mtp=True)
        await e.start()
        out = {"text_route_model": type(e._text_model).__name__ if e._text_model is not None else None}
        if e._text_model is not None and hasattr(type(e._text_model), "mtp_forward"):
            cls, orig = type(e._text_model), type(e._text_model).mtp_forward

            def counted(self, *a, **k):
                calls["n"] += 1
                return orig(self, *a, **k)

            cls.mtp_forward = counted
        for kind in ("text", "image"):
            n0 = calls["n"]
            r = await e.chat(messages=_messages(kind, image_b64), max_tokens=max_tokens, temperature=0.0)
            out[kind] = {"output": r.text, "prompt_tokens": r.prompt_tokens, "mtp_drafts": r.mtp_drafts,
                         "mtp_accepted": r.mtp_accepted, "head_calls": calls["n"] - n0}
        await e.stop()
        return out

    return asyncio.run(run())


def requests_main(argv) -> int:
    import argparse
    import json
    import tempfile
    from importlib.metadata import version

    ap = argparse.ArgumentParser(description="vllm-mlx: a text and an image chat request on one --keep-vision folder")
    ap.add_argument("--requests", action="store_true")
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--image", type=Path, default=None, help="a PNG (default: a drawn 64x64 one)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=8411)
    ap.add_argument("--add-serving-files", action="store_true",
                    help="serve a copy with image tokens, a chat template and a processor config added (the "
                         "bundled fixture has none of them)")
    a = ap.parse_args(argv)
    res = {"runtime": RUNTIME, "version": version("vllm-mlx"),
           "versions": {d: version(d) for d in ("mlx-lm", "mlx-vlm", "mlx", "transformers", "torch", "torchvision")},
           "folder": str(a.folder)}
    with tempfile.TemporaryDirectory() as tmp, contextlib_redirect():
        folder = a.folder.resolve()
        if a.add_serving_files:
            folder = Path(tmp) / "served"
            res["serving_files_added"] = serving_copy(a.folder.resolve(), folder)
        img = _png_b64(a.image)
        for mode, flags in (("continuous-batching", ["--continuous-batching", "--enable-mtp"]),
                            ("simple", ["--enable-mtp"])):
            try:
                res[mode] = _serve(folder, flags, a.port, a.max_tokens, img, Path(tmp) / f"{mode}.log")
            except Exception as e:  # noqa: BLE001
                res[mode] = {"error": f"{type(e).__name__}: {e}"}
        try:
            res["simple_in_process"] = _simple_in_process(folder, a.max_tokens, img)
        except Exception as e:  # noqa: BLE001
            res["simple_in_process"] = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(res, indent=1) + "\n")
    sys.stdout.flush()
    os._exit(0)


def contextlib_redirect():
    import contextlib

    return contextlib.redirect_stdout(sys.stderr)


def main(argv=None) -> int:
    if "--requests" in (sys.argv[1:] if argv is None else argv):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return requests_main(sys.argv[1:] if argv is None else argv)
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
