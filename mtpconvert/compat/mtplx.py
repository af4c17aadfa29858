"""mtplx 2.12.2 on mlx-lm 0.31.3 (``mtplx.runtime.load``), measured in
``interop/notes-mtplx-rapid-vllm.md`` (file/line references into its wheel there). What it reads:

* backbone: mlx-lm 0.31.3's loader, so ``mtp.`` keys in any ``model*.safetensors`` shift the backbone
  norms a second time (:func:`.mlx_lm._mlx_lm_old_backbone`);
* head file: ``config.mlx_lm_extra_tensors.mtp_file`` if set, and then only that path; else the first
  existing of ``mtp.safetensors``, ``mtp/weights.safetensors``, ``model-mtp.safetensors``; else the
  keys embedded in the model shards;
* head keys: ``mtp.X`` or ``language_model.mtp.X``. Bare ``X`` keys load 0 tensors and the head keeps
  its random init, with no error (it loads with ``strict=False``);
* no safetensors metadata; from the config, ``text_config.mtp_num_hidden_layers`` (0: nothing is
  injected) and the quantization blocks below;
* precision: a quantized head whose key set is one mtplx knows (dense: the layer linears, ``fc``
  float or not; MoE: every linear but ``fc`` and the router) stays quantized, bits/group from the
  per-module entries or the top level; any other is dequantized with the top-level bits/group alone
  (affine triplets only), a ``ValueError`` when those are not the head's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .folder import (MODEL_MTP, SIDECAR, SIDECAR_LINK, Folder, _glob_model, _has_bare_head, _is_moe, _mtp_layers,
                     _named_mtp_file, _text)
from .head import (ATTN, DEFAULT_DEQUANT, DENSE_MLP, SHARED, SWITCH, Bits, Head, _fmt_bits, _head,
                   _mlx_head_linears, _mlx_head_norms, _per_layer, _quant_mismatches, _without_biases)
from .mlx_lm import _old_mlx_lm_injector
from .report import PRECISION, RuntimeCompat, Verdict

NAME, VERSION = "mtplx", "2.12.2 (mlx-lm 0.31.3)"
MTPLX = (NAME, VERSION)
MTPLX_PREFIXES = ("mtp.", "language_model.mtp.")
MTPLX_SIDECARS = (SIDECAR, SIDECAR_LINK, MODEL_MTP)
# Where mtplx looks for a per-module quantization entry, in order (top level, then text_config).
MTPLX_QUANT_BLOCKS = ("mtplx_mtp_quantization", "quantization", "quantization_config")
MTPLX_ENTRY_PREFIXES = ("", "mtp.", "model.mtp.", "language_model.mtp.", "language_model.model.mtp.")


def _mtplx_file(folder: Folder) -> Tuple[List[str], str, Optional[str]]:
    """(files, description, error): the one place mtplx reads the head from."""
    named = _named_mtp_file(folder.config)
    if named:
        if named not in folder.headers:
            return [], named, (f"config mlx_lm_extra_tensors.mtp_file = {named!r} but there is no such file "
                               "(mtplx then looks nowhere else)")
        return [named], f"{named} (mlx_lm_extra_tensors.mtp_file)", None
    side = next((s for s in MTPLX_SIDECARS if s in folder.headers), None)
    if side:
        return [side], side, None
    return _glob_model(folder), "the model shards (embedded)", None


def _mtplx_known_sets(moe: bool, n: int) -> List[frozenset]:
    """Quantized-module sets mtplx keeps quantized (its key-set templates, expanded to n layers):
    dense: the layer linears, with or without fc; MoE (stacked): every linear but fc and the router."""
    if not moe:
        layer = frozenset(_per_layer(ATTN + DENSE_MLP, n))
        return [layer, layer | {"fc"}]
    return [frozenset(_per_layer(ATTN + SHARED + SWITCH, n))]


def _mtplx_known_key_set(head: Head, moe: bool, n: int) -> bool:
    """The head's keys are exactly a canonical MLX head with one of the known quantized sets."""
    for qset in _mtplx_known_sets(moe, n):
        want = {m + ".weight" for m in _mlx_head_linears(moe, n) + _mlx_head_norms(n)}
        want |= {m + s for m in qset for s in (".scales", ".biases")}
        if set(head.tensors) == want:
            return True
    return False


def _mtplx_top_bits(config: dict) -> Bits:
    tc = _text(config)
    q = tc.get("quantization") or tc.get("quantization_config") or config.get("quantization") \
        or config.get("quantization_config") or {}
    return (int(q.get("bits", 4)), int(q.get("group_size", 64))) if q else DEFAULT_DEQUANT


def _mtplx_module_bits(config: dict, module: str) -> Optional[Bits]:
    for owner in (config, _text(config)):
        for block in MTPLX_QUANT_BLOCKS:
            q = owner.get(block)
            if not isinstance(q, dict):
                continue
            for prefix in MTPLX_ENTRY_PREFIXES:
                e = q.get(prefix + module)
                if isinstance(e, dict) and e.get("bits") and e.get("group_size"):
                    return int(e["bits"]), int(e["group_size"])
    return None


def _mtplx_precision(folder: Folder, head: Head) -> Tuple[Optional[Verdict], str]:
    """(refusal or None, how the head is used)."""
    tc, n, moe = _text(folder.config), max(_mtp_layers(folder.config), 1), _is_moe(folder.config)
    if not head.quantized:
        return None, "float head"
    top = _mtplx_top_bits(folder.config)
    if _mtplx_known_key_set(head, moe, n):
        bad = _quant_mismatches(head, tc, lambda m: _mtplx_module_bits(folder.config, m) or top)
        if bad:
            return Verdict(False, bad[0] + " (mtplx keeps this key set quantized, bits from per-module entries "
                                           "mtp.<module> or the top level)", PRECISION), ""
        return None, "kept quantized (a key set mtplx knows)"
    nobias = _without_biases(head)
    if nobias:
        return Verdict(False, f"{nobias[0]} has no biases: mtplx dequantizes only affine triplets, so the packed "
                              "weight would be read as a float one", PRECISION), ""
    bad = _quant_mismatches(head, tc, lambda m: top)
    if bad:
        return Verdict(False, bad[0] + ": outside mtplx's known key sets the head is dequantized with the top-level "
                                       "bits/group only -> ValueError: [dequantize] ...", PRECISION), ""
    return None, f"dequantized with the top-level {_fmt_bits(top)}"


def compat(folder: Folder, layout: str) -> RuntimeCompat:
    bb, settled = _old_mlx_lm_injector(folder, layout, MTPLX)
    if settled:
        return settled
    files, src, error = _mtplx_file(folder)
    if error:
        return RuntimeCompat(*MTPLX, bb, Verdict(False, error))
    head = _head(folder, files, MTPLX_PREFIXES)
    if head is None:
        why = (f"{src} holds head keys without an mtp. prefix: mtplx loads 0 tensors and keeps a random head, "
               "silently" if any(_has_bare_head(folder, f) for f in files) else f"no mtp.* keys in {src}")
        return RuntimeCompat(*MTPLX, bb, Verdict(False, why))
    refusal, how = _mtplx_precision(folder, head)
    if refusal:
        return RuntimeCompat(*MTPLX, bb, refusal)
    return RuntimeCompat(*MTPLX, bb, Verdict(True, f"{len(head.tensors)} head tensors from {src}; {how}"))
