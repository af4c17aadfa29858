"""Every runtime's contract for a qwen4_exp folder.

* mlx-lm (0.31 and 0.32) has no ``qwen4_exp`` module: ``load`` raises ``ValueError: Model type qwen4_exp not
  supported``; mtplx, rapid-mlx, vllm-mlx and the PR #990 branch load models with mlx-lm, so none of them serves
  it (mtplx's own ``forge`` names it unsupported: MTPLX #508).
* mlx-vlm 0.7.10 loads the backbone (``models/qwen4_exp``): the files the index names, ``mtp.*`` dropped by its
  ``sanitize`` (``qwen4_exp.py:27``), no norm shifted; its strict load needs every module's tensors, the n-gram
  hashing buffers included.
* mlx-vlm drafts with the head (``speculative/drafters/qwen4_exp_mtp``): ``--draft-model OUT/mtp`` reads
  ``mtp/config.json`` (the model's own config, so its ``qwen4_exp`` splitter runs) and the ``mtp.*`` keys of
  ``mtp/*.safetensors``; the splitter selects ``mtp.`` / ``language_model.mtp.`` / ``model.mtp.`` keys
  (``split.py:11-43``), its drafter strips them and takes stacked ``switch_mlp`` experts as written
  (``qwen4_exp_mtp.py:132-157``). ``--draft-model OUT`` runs the same splitter over the root: the files the index
  names for ``mtp.*`` keys, else every root ``*.safetensors`` (``mtp_split.py:176-194``), so it finds the sidecar.
"""

from __future__ import annotations

from typing import Dict, List

from ...compat import vlm_only
from ...compat.folder import Folder, _files_str
from ...compat.head import _head
from ...compat.report import RuntimeCompat, Verdict

NO_BACKBONE = Verdict(None, "drafter folder: the head only, no backbone")
HEAD_KEYS = ("mtp.", "language_model.mtp.", "model.mtp.")  # what its splitter selects (split.py:18-20)


def _backbone(folder: Folder) -> Verdict:
    files = vlm_only.loader_files(folder)
    if not files:
        return Verdict(False, "no safetensors file for mlx-vlm to load")
    return Verdict(True, f"{_files_str(files)} loaded as written (mtp.* dropped by its sanitize, no norm shifted)")


def _head_verdict(folder: Folder, files: List[str], route: str) -> Verdict:
    found = _head(folder, files, HEAD_KEYS)
    if found is None:
        return Verdict(False, f"{route}: no mtp.* keys in {_files_str(files) if files else 'its files'}")
    per_expert = [k for k in found.tensors if ".mlp.experts." in k and k.endswith(".weight")
                  and k.split(".mlp.experts.")[1].split(".")[0].isdigit()]
    if per_expert and not any(k.endswith(".scales") for k in found.tensors):
        return Verdict(False, f"{route}: float experts stored per expert ({per_expert[0]}): the drafter takes them "
                              "stacked (switch_mlp) or fused, and its strict load refuses these")
    if any(k.endswith(".scales") for k in found.tensors) and "quantization" not in folder.config:
        return Verdict(False, f"{route}: the head is quantized but config.json has no quantization block")
    return Verdict(True, f"{route}: qwen4_exp_mtp drafter over {_files_str(found.files)} ({len(found.tensors)} "
                         "tensors; embedding and lm_head borrowed from the target)")


def _drafter_route(folder: Folder) -> Verdict:
    drafter = folder.drafter_config
    if drafter is None:
        return Verdict(False, "no mtp/config.json: OUT/mtp is not a drafter folder")
    if drafter != folder.config:
        return Verdict(False, "mtp/config.json is not the model's own config: mlx-vlm would not run its qwen4_exp "
                              "splitter over mtp/")
    files = sorted(f for f in folder.headers if f.startswith("mtp/") and f.count("/") == 1)
    return _head_verdict(folder, files, "--draft-model OUT/mtp")


def rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """runtime -> its row for a qwen4_exp folder."""
    backbone = NO_BACKBONE if layout == "drafter" else _backbone(folder)
    root = _head_verdict(folder, vlm_only.splitter_files(folder, HEAD_KEYS), "--draft-model OUT")
    return vlm_only.rows("qwen4_exp", backbone, root, _drafter_route(folder))
