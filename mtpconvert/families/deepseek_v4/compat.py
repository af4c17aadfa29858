"""Every runtime's contract for a deepseek_v4 folder.

* mlx-lm (0.31 and 0.32) has no ``deepseek_v4`` module (0.32 has ``deepseek_v41`` only): ``load`` raises
  ``ValueError: Model type deepseek_v4 not supported``; mtplx, rapid-mlx, vllm-mlx and the PR #990 branch load models
  with mlx-lm, so none of them serves it.
* mlx-vlm 0.7.10 loads the backbone (``models/deepseek_v4``): the files the index names, ``mtp.*`` dropped by its
  sanitize (``language.py:1302-1314``), quantized modules as config.json's ``quantization`` says per module (mxfp4
  experts beside affine ones included).
* mlx-vlm drafts with the head (``speculative/drafters/deepseek_v4_mtp``). ``--draft-model OUT/mtp`` loads the
  drafter folder as written: ``mtp/config.json`` of type ``deepseek_v4_mtp`` restating the head's quantization under
  the drafter's module paths, ``mtp.*`` weights stripped of ``mtp.`` by its sanitize. ``--draft-model OUT`` runs its
  splitter over the root (the files the index names for ``mtp.*`` keys, else every root ``*.safetensors``:
  ``mtp_split.py:176-194``), which finds the sidecar but describes a quantized head by module name, whatever
  config.json says (``split.py:19-37``): experts mxfp4, ``e_proj`` / ``h_proj`` / shared experts / attention
  projections mxfp8, anything else 8-bit affine at group 64. A float head, or one quantized exactly so, loads by
  that route; any other quantized head fails its load there.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ...compat import vlm_only
from ...compat.folder import Folder, _files_str
from ...compat.head import _head
from ...compat.report import RuntimeCompat, Verdict

NO_BACKBONE = Verdict(None, "drafter folder: the head only, no backbone")
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}
SPLITTER_DEFAULT = {"group_size": 64, "bits": 8, "mode": "affine"}


def _backbone(folder: Folder) -> Verdict:
    files = vlm_only.loader_files(folder)
    if not files:
        return Verdict(False, "no safetensors file for mlx-vlm to load")
    return Verdict(True, f"{_files_str(files)} loaded as written (mtp.* dropped by its sanitize, no norm shifted)")


def splitter_spec(module: str) -> dict:
    """The quantization mlx-vlm's deepseek_v4 splitter gives a quantized head module (drafter path), by its name."""
    if "decoder.ffn.switch_mlp." in module and module.endswith("_proj"):
        return MXFP4
    if module in ("e_proj", "h_proj") or "decoder.ffn.shared_experts." in module or "decoder.attn.w" in module:
        return MXFP8
    return SPLITTER_DEFAULT


def _misread(folder: Folder, quantized: List[str]) -> Optional[str]:
    """The first quantized head module the splitter would build with another quantization than config.json's."""
    quant = folder.config.get("quantization") or {}
    default = {k: quant[k] for k in ("group_size", "bits", "mode") if k in quant}
    default.setdefault("mode", "affine")
    for module in quantized:
        stated = quant.get("mtp." + module, default)
        stated = {**{"mode": "affine"}, **stated} if isinstance(stated, dict) else stated
        if stated != splitter_spec(module):
            return module
    return None


def _root_route(folder: Folder) -> Verdict:
    files = vlm_only.splitter_files(folder, ("mtp.",))
    found = _head(folder, files, ("mtp.",))
    if found is None:
        return Verdict(False, f"--draft-model OUT: no mtp.* keys in {_files_str(files) if files else 'its files'}")
    module = _misread(folder, found.quantized)
    if module is not None:
        return Verdict(False, f"--draft-model OUT: mlx-vlm 0.7.10's splitter describes a quantized head by module name "
                              f"and would build mtp.{module} as {splitter_spec(module)['mode']} "
                              f"{splitter_spec(module)['bits']}-bit, not as config.json says (use --draft-model OUT/mtp)")
    return Verdict(True, f"--draft-model OUT: its splitter over {_files_str(found.files)} ({len(found.tensors)} mtp.* "
                         "tensors; embedding and lm_head borrowed from the target)")


def _drafter_route(folder: Folder) -> Verdict:
    drafter = folder.drafter_config
    if drafter is None:
        return Verdict(False, "no mtp/config.json: OUT/mtp is not a drafter folder")
    if drafter.get("model_type") != "deepseek_v4_mtp" or not isinstance(drafter.get("text_config"), dict):
        return Verdict(False, "mtp/config.json must say model_type 'deepseek_v4_mtp' over the model's text_config, not "
                              f"{drafter.get('model_type')!r}")
    files = sorted(f for f in folder.headers if f.startswith("mtp/") and f.count("/") == 1)
    found = _head(folder, files, ("mtp.",))
    if found is None:
        return Verdict(False, f"--draft-model OUT/mtp: no mtp.* keys in {_files_str(files) if files else 'mtp/'}")
    if found.quantized and "quantization" not in drafter:
        return Verdict(False, "the head is quantized but mtp/config.json has no quantization block: the strict load "
                              "refuses its scales")
    return Verdict(True, f"--draft-model OUT/mtp: deepseek_v4_mtp over {_files_str(found.files)} "
                         f"({len(found.tensors)} mtp.* tensors; embedding and lm_head borrowed from the target)")


def rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """runtime -> its row for a deepseek_v4 folder."""
    backbone = NO_BACKBONE if layout == "drafter" else _backbone(folder)
    return vlm_only.rows("deepseek_v4", backbone, _root_route(folder), _drafter_route(folder))
