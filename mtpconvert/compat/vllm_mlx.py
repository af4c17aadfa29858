"""vllm-mlx 0.6.0 on mlx-lm 0.31.3 (``vllm-mlx serve DIR --continuous-batching --enable-mtp``),
measured in ``interop/notes-mtplx-rapid-vllm.md``. What it reads:

* backbone: mlx-lm 0.31.3's loader (:func:`.mlx_lm._mlx_lm_old_backbone`: ``mtp.`` keys in any
  ``model*.safetensors``, a root ``model-mtp.safetensors`` included, shift its norms a second time).
  The head is injected *while loading* whenever the config declares MTP layers, with or without
  ``--enable-mtp``, so a head that fails to dequantize stops the whole server;
* head file: ``mtp/weights.safetensors``, else root ``model-mtp.safetensors``; not root
  ``mtp.safetensors``, not the model shards;
* head keys: ``mtp.`` and ``language_model.mtp.`` stripped, other keys dropped (bare ``X``: 0 tensors
  loaded, a random head, no error);
* manifest: the one next to the head file (``mtp/manifest.json``; root ``manifest.json`` for
  ``model-mtp.safetensors``). Only ``artifact_schema_version`` 1 together with
  ``rmsnorm_weight_format`` ``mlx_gamma`` keeps the head norms as stored; otherwise every head norm
  whose mean is < 0.5 gets +1;
* precision: every weight/scales/biases triplet is dequantized with ``quantization.bits/group_size``
  (text_config first, then the top level; per-module entries ignored) and the head runs in float.

Its text scheduler's MTP loop never runs with the mlx-lm it pins (:data:`VLLM_LOOP_BUG`); a folder with a
``vision_config`` is served by its MLLM scheduler, whose own MTP loop drafts (``--continuous-batching
--enable-mtp``, measured on a ``--keep-vision`` folder, text and image requests alike: docs/interop.md).
"head usable" means the head is found and injected.
"""

from __future__ import annotations

from typing import Optional

from .folder import MODEL_MTP, SIDECAR, SIDECAR_LINK, Folder, _has_bare_head, _text
from .head import DEFAULT_DEQUANT, Bits, Head, _fmt_bits, _head, _quant_mismatches, _without_biases
from .mlx_lm import _old_mlx_lm_injector
from .report import PRECISION, RuntimeCompat, Verdict

NAME, VERSION = "vllm-mlx", "0.6.0 (mlx-lm 0.31.3)"
VLLM = (NAME, VERSION)
VLLM_FILES = ((SIDECAR_LINK, "mtp/manifest.json"), (MODEL_MTP, "manifest.json"))  # (head file, its manifest)
VLLM_PREFIXES = ("mtp.", "language_model.mtp.")
VLLM_LOOP_BUG = ("vllm-mlx 0.6.0's MTP loop never runs with the mlx-lm it pins (scheduler.py:827: "
                 "BatchGenerator lacks _step → '[MTP] disabled')")
VLLM_MLLM_LOOP = ("a vision_config routes every request, text or image, to vllm-mlx's MLLM scheduler, whose MTP loop "
                  "drafts with --continuous-batching --enable-mtp")


def _vllm_top_bits(config: dict) -> Bits:
    q = _text(config).get("quantization", config.get("quantization", {}))
    return (int(q.get("bits", 4)), int(q.get("group_size", 64))) if q else DEFAULT_DEQUANT


def _vllm_manifest_guards(manifest: Optional[dict]) -> bool:
    """Only this pair keeps vllm-mlx from adding +1 to head norms whose mean is < 0.5."""
    m = manifest or {}
    return m.get("artifact_schema_version") == 1 and m.get("rmsnorm_weight_format") == "mlx_gamma"


def _vllm_load_failure(folder: Folder, head: Head) -> Optional[Verdict]:
    """Dequantizing the head happens while the model loads: a failure stops the whole server."""
    top = _vllm_top_bits(folder.config)
    bad = _quant_mismatches(head, _text(folder.config), lambda m: top)
    if not bad:
        return None
    return Verdict(False, f"ValueError: [dequantize] Shape of scales and biases does not match ... while loading "
                          f"the model (server exits, even without --enable-mtp): {bad[0]}; vllm-mlx dequantizes "
                          "with the top-level bits/group only", PRECISION)


def compat(folder: Folder, layout: str) -> RuntimeCompat:
    bb, settled = _old_mlx_lm_injector(folder, layout, VLLM)
    if settled:
        return settled
    found = next(((f, m) for f, m in VLLM_FILES if f in folder.headers), None)
    if found is None:
        return RuntimeCompat(*VLLM, bb, Verdict(False, (
            f"no {SIDECAR_LINK} or root {MODEL_MTP}: vllm-mlx reads the head only there (not root {SIDECAR}, "
            "not the model shards)")))
    src, manifest = found
    head = _head(folder, [src], VLLM_PREFIXES)
    if head is None:
        why = ("head keys without an mtp. prefix: vllm-mlx loads 0 tensors and keeps a random head, silently"
               if _has_bare_head(folder, src) else "no mtp.* keys")
        return RuntimeCompat(*VLLM, bb, Verdict(False, f"{src}: {why}"))
    nobias = _without_biases(head)
    if nobias:
        return RuntimeCompat(*VLLM, bb, Verdict(False, (
            f"{nobias[0]} has no biases: vllm-mlx dequantizes only affine triplets, so the packed weight would be "
            "read as a float one"), PRECISION))
    failure = _vllm_load_failure(folder, head)
    if failure:
        return RuntimeCompat(*VLLM, failure, failure)
    norms = (f"{manifest} declares mlx_gamma: norms kept as stored" if _vllm_manifest_guards(
        folder.manifests.get(manifest)) else
        f"unguarded: no {manifest} with artifact_schema_version 1 and rmsnorm_weight_format mlx_gamma, so any "
        "head norm with mean < 0.5 gets +1 (MLX norms sit near 1: not triggered unless a trained gamma is small)")
    quant = f"; dequantized with the top-level {_fmt_bits(_vllm_top_bits(folder.config))}" if head.quantized else ""
    return RuntimeCompat(*VLLM, bb, Verdict(True, (
        f"head injected ({len(head.tensors)} tensors from {src}{quant}; {norms}); "
        + (VLLM_MLLM_LOOP if "vision_config" in folder.config else VLLM_LOOP_BUG))))
