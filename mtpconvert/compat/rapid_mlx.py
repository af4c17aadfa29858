"""rapid-mlx 0.16.10 (``rapid-mlx serve DIR --speculative-config '{"method":"mtp","model":"DIR"}'``),
measured in ``interop/notes-mtplx-rapid-vllm.md``. What it reads:

* backbone: mlx-lm 0.31.3's loader, plus its own patch (``patches/qwen3_5_norm_shift.py``) that
  subtracts the spurious +1 again when the norms already were MLX gains: exact even with ``mtp.``
  keys in the shards;
* head file: the first existing of ``mtp.safetensors``, ``model-mtp.safetensors``,
  ``mtp/model.safetensors``, ``model.safetensors`` in the ``"model"`` folder, whatever it holds;
  ``mtp/weights.safetensors`` and in-model keys are not read;
* head keys: ``mtp.`` is stripped when present, so ``mtp.X`` and bare ``X`` work and
  ``language_model.mtp.X`` does not. Every weight of the canonical MLX head (MoE experts stacked as
  ``switch_mlp``) must be there, or the server refuses to boot;
* no safetensors metadata and no quantization entries: bits/group are inferred from ``fc`` and
  applied to every linear, so a float ``fc`` means a float head. mtpconvert never quantizes ``fc``:
  of its heads, rapid-mlx takes the float ones only.
"""

from __future__ import annotations

from typing import Optional

from .folder import (MODEL_MTP, NO_BACKBONE, SIDECAR, Folder, _glob_model, _is_moe, _keys_with, _mtp_layers, _no_head,
                     _no_mtp_layers, _text)
from .head import Head, _bits, _head, _missing_weights, _quant_mismatches
from .report import PRECISION, RuntimeCompat, Verdict

NAME, VERSION = "rapid-mlx", "0.16.10"
RAPID = (NAME, VERSION)
# The "model" folder of --speculative-config: the first of these that exists is the head file,
# whatever it holds (it does not go on to the next).
RAPID_SIDECARS = (SIDECAR, MODEL_MTP, "mtp/model.safetensors", "model.safetensors")


def _rapid_backbone(folder: Folder) -> Verdict:
    if not _glob_model(folder):
        return Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)")
    return Verdict(True, "rapid-mlx undoes mlx-lm 0.31's spurious +1 on already-MLX norms: exact even with mtp. "
                         "keys in the shards")


def _rapid_precision(head: Head, tc: dict, src: str) -> Optional[Verdict]:
    """rapid-mlx infers bits/group from fc and quantizes every linear alike."""
    if not head.quantized:
        return None
    if "fc" not in head.quantized:
        return Verdict(False, f"{src}: float fc with {len(head.quantized)} quantized modules is refused (rapid-mlx "
                              "infers the head's bits from fc; mtpconvert keeps fc float)", PRECISION)
    fc = _bits(head, "fc", tc)
    floats = [m for m in head.linears if m not in head.quantized]
    if floats:
        return Verdict(False, f"{src}: {floats[0]} is float beside a quantized fc (rapid-mlx quantizes every linear "
                              "like fc)", PRECISION)
    bad = _quant_mismatches(head, tc, lambda m: fc)
    if bad:
        return Verdict(False, f"{src}: {bad[0]} (bits taken from fc)", PRECISION)
    return None


def compat(folder: Folder, layout: str) -> RuntimeCompat:
    bb = NO_BACKBONE if layout == "drafter" else _rapid_backbone(folder)
    # a drafter folder is only the "model" of --speculative-config; the layer count comes from the served model
    stop = _no_head(layout) or (None if layout == "drafter" else _no_mtp_layers(folder))
    if stop:
        return RuntimeCompat(*RAPID, bb, stop)
    src = next((s for s in RAPID_SIDECARS if s in folder.headers), None)
    if src is None:
        return RuntimeCompat(*RAPID, bb, Verdict(False, (
            "no head file: rapid-mlx reads the head only from " + ", ".join(RAPID_SIDECARS)
            + ("; in-model keys are not read" if layout == "in-model" else ""))))
    head = _head(folder, [src], ("mtp.",), bare=True)  # "mtp." stripped when present
    n, moe = max(_mtp_layers(folder.config), 1), _is_moe(folder.config)
    missing = _missing_weights(head, moe, n) if head else ["fc.weight"]
    if missing:
        lm = _keys_with(folder, [src], lambda k: k.startswith("language_model.mtp."))
        why = ("keys are language_model.mtp.*, which it does not strip" if lm
               else f"e.g. {missing[0]}" + (" (MoE experts must be stacked switch_mlp)" if moe else ""))
        return RuntimeCompat(*RAPID, bb, Verdict(False, (
            f"{src} (its first candidate file) lacks {len(missing)} required head tensor(s): {why} -- boot refused")))
    refusal = _rapid_precision(head, _text(folder.config), src)
    if refusal:
        return RuntimeCompat(*RAPID, bb, refusal)
    where = f"{len(head.tensors)} head tensors from {src}"
    if layout == "drafter":
        where += " (as the --speculative-config model folder)"
    return RuntimeCompat(*RAPID, bb, Verdict(True, where + ("; quantized like fc" if head.quantized else "")))
