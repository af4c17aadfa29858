"""mlx-vlm 0.7.10 (``mlx_vlm.generate --model DIR --draft-model DIR --draft-kind mtp``), measured in
``docs/interop.md``. What its loader reads:

* backbone files: those the index's ``weight_map`` names, else every root ``*.safetensors`` but
  ``consolidated.safetensors``. It drops ``mtp.*`` keys, then shifts a norm +1 when the checkpoint is
  raw (conv1d ``[C, 1, K]``) or when the norm's key does not start with ``language_model.`` (HF
  naming), so an MLX folder must keep its text weights under ``language_model.``;
* head: keys starting with ``mtp.``, from the files the index's ``weight_map`` names for them, else
  from any root ``*.safetensors``; in-model ``language_model.mtp.*`` keys are not selected;
* head metadata: ``format: mlx`` -> the head is used as written (its MoE layer then wants the experts
  stacked as ``switch_mlp``); without it the head is taken for a raw HF one and its norms get +1;
* config: depth from ``text_config.mtp_num_hidden_layers``; quantization from
  ``mtplx_mtp_quantization``, else ``quantization``: per-module entries ``mtp.<module>`` (then
  ``<module>``), else the top-level bits/group. It drafts from the post-norm hidden state.

A drafter folder (its ``model_type`` mlx-vlm's own drafter type: ``Family.drafter_folder_type``) is the head
alone, passed as ``--draft-model`` next to its target: its keys are unprefixed (``mtp.`` ones are taken for raw HF keys) and its
quantization entries are named ``<module>``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from .folder import (DRAFTER_CONFIG, NO_BACKBONE, Folder, _conv_raw, _files_str, _keys_with, _mtp_layers, _no_head,
                     _root, _text)
from .head import Head, _entry_bits, _head, _moe_expert_layout, _quant, _quant_mismatches, _top
from .report import PRECISION, RuntimeCompat, Verdict

NAME, VERSION = "mlx-vlm", "0.7.10"
VLM = (NAME, VERSION)
# RMSNorm keys mlx-vlm shifts +1 when they are not under language_model. (HF naming)
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


def _mlx_vlm_files(folder: Folder) -> Tuple[List[str], bool]:
    wm = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for f in wm.values() if f in folder.headers})
    if listed:
        return listed, True
    return sorted(n for n in _root(folder) if not n.endswith("consolidated.safetensors")), False


def _mlx_vlm_backbone(folder: Folder) -> Verdict:
    # mtp.* keys are dropped first; then a norm is shifted when the checkpoint is raw
    # (conv1d [C,1,K]) or when its key does not start with "language_model." (HF naming).
    files, from_index = _mlx_vlm_files(folder)
    if not files:
        return Verdict(False, "no safetensors file to load")
    raw = _conv_raw(folder, files)
    hf_named = [k for f, k in _keys_with(folder, files, lambda k: "mtp." not in k and k.endswith(NORM_SUFFIXES)
                                         and not k.startswith("language_model."))]
    if not raw and hf_named:
        return Verdict(False, f"norm {hf_named[0]} is not under language_model.: mlx-vlm shifts it +1 although "
                              "the folder is already MLX (conv1d [C,K,1])")
    return Verdict(True, "reads " + ("the index's files" if from_index else "every root *.safetensors")
                   + "; drops mtp.* keys before its norm-shift decision")


def _mlx_vlm_head_problem(folder: Folder, head: Head, entry: Callable[[str, dict], object],
                          names: str) -> Optional[Verdict]:
    """What stops mlx-vlm from using a head it found; ``entry(module, q)`` = its per-path entry,
    ``names`` says how those entries are named."""
    n = _mtp_layers(folder.config) or 1
    if head.layers() and head.layers() != set(range(n)):
        return Verdict(False, f"head has layers {sorted(head.layers())}, config mtp_num_hidden_layers={n}")
    q = folder.config.get("mtplx_mtp_quantization") or _quant(folder.config)
    if head.quantized:
        if not _top(q):
            return Verdict(False, "quantized head but no quantization block in config.json", PRECISION)
        bad = _quant_mismatches(head, _text(folder.config), lambda m: _entry_bits(entry(m, q), q))
        if bad:
            return Verdict(False, f"{bad[0]} (mlx-vlm reads per-path entries named {names})", PRECISION)
    return None


def _mlx_vlm_drafter(folder: Folder) -> RuntimeCompat:
    files, _ = _mlx_vlm_files(folder)
    head = _head(folder, files, ("mtp.",), bare=True)
    if head is None:
        return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(False, "drafter folder without head tensors"))
    if _keys_with(folder, files, lambda k: k.startswith("mtp.")):
        return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(False, (
            "drafter keys keep the mtp. prefix: mlx-vlm's drafter takes them for raw HF keys and adds +1 to the "
            "(already shifted) norms")))
    if _moe_expert_layout(head) == "per-expert":
        return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(False, "per-expert MTP experts: the drafter wants stacked "
                                                               "switch_mlp (or fused experts)"))
    problem = _mlx_vlm_head_problem(folder, head, lambda m, q: q.get(m), "<module>, unprefixed")
    if problem:
        return RuntimeCompat(*VLM, NO_BACKBONE, problem)
    return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(True, (
        f"drafter folder: {len(head.tensors)} unprefixed head tensors in {_files_str(head.files)}; use it as "
        "--draft-model DIR --draft-kind mtp next to its target")))


def compat(folder: Folder, layout: str) -> RuntimeCompat:
    if layout == "drafter":
        return _mlx_vlm_drafter(folder)
    bb = _mlx_vlm_backbone(folder)
    nh = _no_head(layout)
    if nh:
        return RuntimeCompat(*VLM, bb, nh)
    # head: keys starting with "mtp." -- the index's weight_map first, else every root file
    wm = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for k, f in wm.items() if k.startswith("mtp.") and f in folder.headers})
    head = _head(folder, listed, ("mtp.",)) if listed else None
    if head is None:
        head = _head(folder, sorted(n for n in _root(folder) if not n.endswith("consolidated.safetensors")),
                     ("mtp.",))
    if head is None:
        inm = _keys_with(folder, _root(folder), lambda k: k.startswith("language_model.mtp."))
        why = ("in-model language_model.mtp.* keys are not found: mlx-vlm selects only keys that start with 'mtp.'"
               if inm else "no key starting with 'mtp.' in the index or any root *.safetensors")
        return RuntimeCompat(*VLM, bb, Verdict(False, why))
    where = _files_str(head.files)
    raw_folder = _conv_raw(folder, _root(folder))
    if not head.mlx_format and not raw_folder:
        return RuntimeCompat(*VLM, bb, Verdict(False, (
            f"{where} has no safetensors metadata format=mlx: mlx-vlm takes the head for a raw HF one and adds +1 "
            "to its (already shifted) norms")))
    if head.mlx_format and _moe_expert_layout(head) in ("per-expert", "fused"):
        return RuntimeCompat(*VLM, bb, Verdict(False, (
            f"{_moe_expert_layout(head)} MTP experts in an MLX-format head: mlx-vlm loads MLX heads as-is, and its "
            "MoE layer wants stacked switch_mlp")))
    problem = _mlx_vlm_head_problem(folder, head, lambda m, q: q.get("mtp." + m, q.get(m)),
                                    "mtp.<module>; language_model.mtp.* ones are not seen")
    if problem:
        return RuntimeCompat(*VLM, bb, problem)
    how = "index weight_map" if listed else "root *.safetensors scan"
    return RuntimeCompat(*VLM, bb, Verdict(True, (
        f"{len(head.tensors)} mtp.* tensors in {where} (via {how}); "
        + ("format=mlx: used as written" if head.mlx_format else "raw HF head: norms +1 once")
        + (f"; {len(head.quantized)} quantized modules" if head.quantized else "")
        + "; drafts from the post-norm hidden state")))


DRAFTER_ROUTE = "mlx-vlm-drafter"  # the same mlx-vlm, the head given as --draft-model OUT/mtp


def compat_drafter_route(folder: Folder, layout: str) -> RuntimeCompat:
    """``--model OUT --draft-model OUT/mtp``: mlx-vlm reads ``mtp/config.json`` and, when that is the model's own
    config, its splitter takes the ``mtp.*`` keys of every ``*.safetensors`` in ``mtp/`` (``weights.safetensors``)
    as mlx-vlm takes them from the model folder. A config of mlx-vlm's own drafter type there would run that
    drafter's sanitize, which shifts every ``mtp.*`` norm again."""
    row = compat(folder, layout)
    if layout == "drafter":
        return RuntimeCompat(DRAFTER_ROUTE, VERSION, row.backbone_exact, row.head_usable)
    name = DRAFTER_CONFIG
    drafter = folder.drafter_config
    if drafter is None:
        head = Verdict(False, f"no {name}: OUT/mtp is not a drafter folder (the whole folder works as --draft-model OUT)")
    elif drafter.get("model_type") == folder.config.get("model_type") and drafter != folder.config:
        head = Verdict(False, f"{name} differs from config.json: the drafter would be built from another config")
    elif drafter.get("model_type") != folder.config.get("model_type"):
        head = Verdict(False, f"{name} says model_type {drafter.get('model_type')!r}, not the model's "
                              f"{folder.config.get('model_type')!r}: a config of mlx-vlm's own drafter type shifts the "
                              "head's norms a second time")
    else:
        files = sorted(f for f in folder.headers if f.startswith("mtp/") and f.count("/") == 1)
        found = _head(folder, files, ("mtp.",))
        if found is None:
            head = Verdict(False, f"no mtp.* keys in {_files_str(files) if files else 'mtp/*.safetensors'}")
        elif not found.mlx_format:
            head = Verdict(False, f"{_files_str(found.files)} has no metadata format=mlx: the splitter adds +1 to "
                                  "its (already shifted) norms")
        elif not row.head_usable.ok:
            head = row.head_usable
        else:
            head = Verdict(True, f"--draft-model OUT/mtp: the model's config beside {_files_str(found.files)} "
                                 f"({len(found.tensors)} mtp.* tensors, format=mlx: used as written)")
    return RuntimeCompat(DRAFTER_ROUTE, VERSION, row.backbone_exact, head)
