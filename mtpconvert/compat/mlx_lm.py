"""Stock mlx-lm, before and from 0.32: the backbone rule (which the runtimes built on mlx-lm 0.31
inherit) and no MTP decoding.

Measured on mlx-lm 0.31.3 and 0.32.2 (``docs/interop.md``). What its loader reads:

* files: ``load_model`` globs ``model*.safetensors``; the index is not read, so a root
  ``model-mtp.safetensors`` is loaded with the shards;
* keys: ``sanitize`` drops every ``mtp.*`` key, so no version drafts with the head;
* norms: 0.30.7-0.31.x adds +1 to every backbone RMSNorm when any loaded key contains ``mtp.``. On a
  raw (PyTorch-layout) checkpoint, conv1d ``[C, 1, K]``, that one shift is the right one; on a folder
  already in MLX form it is a second one, and the model is silently wrong. 0.32 drops the ``mtp.*``
  keys before that decision, which then looks only at conv1d.

mtplx and vllm-mlx load the backbone with mlx-lm 0.31.3: :func:`_mlx_lm_old_backbone` is their rule too
(through :func:`_old_mlx_lm_injector`).
"""

from __future__ import annotations

from typing import Optional, Tuple

from .folder import (NO_BACKBONE, Folder, _conv_raw, _drafter_head, _files_str, _glob_model, _keys_with, _no_head,
                     _no_mtp_layers)
from .report import RuntimeCompat, Verdict

OLD = ("mlx-lm<0.32", "0.30.7-0.31.3")  # (runtime, versions)
NEW = ("mlx-lm>=0.32", "0.32.x")


def _mlx_lm_old_backbone(folder: Folder, who: str = "mlx-lm 0.30.7-0.31.x") -> Verdict:
    files = _glob_model(folder)
    if not files:
        return Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)")
    hits = _keys_with(folder, files, lambda k: "mtp." in k)
    if hits and not _conv_raw(folder, files):
        where = sorted({f for f, _ in hits})
        return Verdict(False, f"{len(hits)} key(s) containing 'mtp.' in {_files_str(where)}: {who} then adds +1 "
                              "to every backbone RMSNorm a second time (silently wrong model)")
    if hits:
        return Verdict(True, "raw checkpoint (conv1d [C,1,K]): the one norm shift it applies is the right one")
    return Verdict(True, f"no 'mtp.' key in {_files_str(files)}: norms loaded as written")


def _old_mlx_lm_injector(folder: Folder, layout: str,
                         runtime: Tuple[str, str]) -> Tuple[Verdict, Optional[RuntimeCompat]]:
    """A runtime that loads the model with mlx-lm 0.31.3 and injects the head into it (mtplx,
    vllm-mlx): its backbone verdict, and its whole row where the head question is settled before any
    head file is looked for (a drafter folder, no MTP tensors, no MTP layers declared)."""
    name = runtime[0]
    if layout == "drafter":
        return NO_BACKBONE, RuntimeCompat(*runtime, NO_BACKBONE, _drafter_head(name))
    bb = _mlx_lm_old_backbone(folder, f"mlx-lm 0.31.3 ({name}'s)")
    stop = _no_head(layout) or _no_mtp_layers(folder)
    return bb, (RuntimeCompat(*runtime, bb, stop) if stop else None)


NO_DECODING = Verdict(False, "stock mlx-lm has no MTP decoding (sanitize drops every mtp.* key)")


def compat_old(folder: Folder, layout: str) -> RuntimeCompat:
    bb = NO_BACKBONE if layout == "drafter" else _mlx_lm_old_backbone(folder)
    return RuntimeCompat(*OLD, bb, NO_DECODING)


def compat_new(folder: Folder, layout: str) -> RuntimeCompat:
    if layout == "drafter":
        bb = NO_BACKBONE
    elif _glob_model(folder):
        bb = Verdict(True, "mtp.* keys are dropped before the norm-shift decision, which looks only at conv1d")
    else:
        bb = Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)")
    return RuntimeCompat(*NEW, bb, NO_DECODING)
