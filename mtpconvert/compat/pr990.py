"""The mlx-lm PR #990 branch (AirRunner/mlx-lm ``feat/mtp-native`` @ f840f6c, on mlx-lm 0.31.3),
measured in ``docs/interop.md``: the runtime ``--mtp-layout in-model`` is for. What it reads:

* files: glob ``model*.safetensors``, like stock mlx-lm, but its norm shift is decided by conv1d
  only, so ``mtp.`` keys in the shards leave the backbone exact;
* head: from the model shards only, keys ``language_model.mtp.X`` or ``mtp.X``. The head is part of
  the model: with ``mtp_num_hidden_layers`` > 0 and no head in the shards the model refuses to load
  (``ValueError``; ``KeyError`` for MoE, whose expert stacking runs first), and whatever stops the
  head from loading stops the whole model. With ``mtp_num_hidden_layers`` 0 no head is built;
* MoE experts: its ``sanitize`` stacks ``experts.{e}.{proj}.weight`` itself, so the head's experts
  come per expert or fused; stacked ``switch_mlp`` ones raise ``KeyError``, and quantized per-expert
  ones leave their scales/biases over;
* quantization: per-path entries ``language_model.mtp.<module>``, else the top-level bits/group.
  It drafts from the pre-norm hidden state.
"""

from __future__ import annotations

from typing import List, Optional

from .folder import (NO_BACKBONE, Folder, _drafter_head, _files_str, _glob_model, _is_moe, _keys_with, _mtp_layers,
                     _text)
from .head import _EXPERT_RE, _entry_bits, _head, _moe_expert_layout, _quant, _quant_mismatches
from .report import PRECISION, RuntimeCompat, Verdict

NAME, VERSION = "mlx-lm-pr990", "AirRunner/mlx-lm feat/mtp-native (0.31.3 base)"
PR990 = (NAME, VERSION)


def _pr990_head_problem(folder: Folder, files: List[str], tc: dict) -> Optional[Verdict]:
    head = _head(folder, files, ("language_model.mtp.", "mtp."))
    if head is None:
        hits = _keys_with(folder, files, lambda k: "mtp." in k)
        return Verdict(False, f"mtp keys under a prefix the branch does not map (e.g. {hits[0][1]})")
    if _is_moe(folder.config):
        layout = _moe_expert_layout(head)
        if layout == "stacked":
            return Verdict(False, "stacked switch_mlp MTP experts: the branch's sanitize stacks "
                                  "experts.{e}.{proj}.weight itself and raises KeyError on a stacked head")
        if layout == "per-expert" and any(_EXPERT_RE.match(k) and not k.endswith(".weight") for k in head.tensors):
            return Verdict(False, "quantized per-expert MTP experts: the branch stacks only .weight (scales/biases "
                                  "are left over)", PRECISION)
    q = _quant(folder.config)
    if head.quantized:
        bad = _quant_mismatches(head, tc, lambda m: _entry_bits(q.get("language_model.mtp." + m), q))
        if bad:
            return Verdict(False, bad[0] + " (the branch reads per-path entries named language_model.mtp.<module>)",
                           PRECISION)
    return None


def compat(folder: Folder, layout: str) -> RuntimeCompat:
    tc = _text(folder.config)
    if layout == "drafter":
        return RuntimeCompat(*PR990, NO_BACKBONE, _drafter_head("the branch"))
    files = _glob_model(folder)
    n = _mtp_layers(folder.config)
    hits = _keys_with(folder, files, lambda k: "mtp." in k)
    if not files:
        v = Verdict(False, "no model*.safetensors file")
        return RuntimeCompat(*PR990, v, v)
    if n > 0 and not hits:
        v = Verdict(False, "refuses to load: mtp_num_hidden_layers > 0 but no mtp key in model*.safetensors "
                           "(ValueError; KeyError for MoE, whose expert stacking runs first) -- the branch reads "
                           "the head only from the model shards")
        return RuntimeCompat(*PR990, v, v)
    bb = Verdict(True, "norm shift decided by conv1d only; the head is loaded with the model")
    if n == 0:
        return RuntimeCompat(*PR990, bb, Verdict(False, "mtp_num_hidden_layers is 0: no head is built "
                                                        "(mtp.* keys dropped)"))
    # The head is part of the model: whatever stops it from loading stops the whole model.
    problem = _pr990_head_problem(folder, files, tc)
    if problem:
        v = Verdict(False, "the model does not load: " + problem.reason, problem.cause)
        return RuntimeCompat(*PR990, v, v)
    head = _head(folder, files, ("language_model.mtp.", "mtp."))
    return RuntimeCompat(*PR990, bb, Verdict(True, (
        f"{len(head.tensors)} head tensors in {_files_str(head.files)} (in-model)"
        + (f"; {len(head.quantized)} quantized modules" if head.quantized else "")
        + "; drafts from the pre-norm hidden state")))
