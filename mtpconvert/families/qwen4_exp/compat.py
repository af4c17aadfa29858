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

from ...compat import mlx_lm, mlx_vlm, mtplx, pr990, rapid_mlx, vllm_mlx
from ...compat.folder import Folder, _files_str
from ...compat.head import _head
from ...compat.report import RuntimeCompat, Verdict

NO_BACKBONE = Verdict(None, "drafter folder: the head only, no backbone")
NO_MLX_LM = Verdict(False, "mlx-lm has no qwen4_exp module (ValueError: Model type qwen4_exp not supported)")
NOT_SERVED = "loads models with mlx-lm, which has no qwen4_exp module: the folder is refused"


def _index_files(folder: Folder) -> List[str]:
    """The files mlx-vlm loads: the index's, else every root ``*.safetensors``."""
    weight_map = (folder.index or {}).get("weight_map") or {}
    if weight_map:
        return sorted(set(weight_map.values()))
    return sorted(f for f in folder.headers if "/" not in f and not f.endswith("consolidated.safetensors"))


def _splitter_files(folder: Folder) -> List[str]:
    """The files mlx-vlm's splitter reads at the root: those the index names for ``mtp.*`` keys, else every root
    ``*.safetensors``."""
    weight_map = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for k, f in weight_map.items() if k.startswith(("mtp.", "language_model.mtp.", "model.mtp."))})
    return listed or sorted(f for f in folder.headers if "/" not in f)


def _backbone(folder: Folder) -> Verdict:
    files = _index_files(folder)
    if not files:
        return Verdict(False, "no safetensors file for mlx-vlm to load")
    return Verdict(True, f"{_files_str(files)} loaded as written (mtp.* dropped by its sanitize, no norm shifted)")


def _head_verdict(folder: Folder, files: List[str], route: str) -> Verdict:
    found = _head(folder, files, ("mtp.", "language_model.mtp.", "model.mtp."))
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
    drafter = layout == "drafter"
    backbone = NO_BACKBONE if drafter else _backbone(folder)
    root = _head_verdict(folder, _splitter_files(folder), "--draft-model OUT")
    refused = lambda who: Verdict(False, f"{who} {NOT_SERVED}")  # noqa: E731
    return {
        mlx_lm.OLD[0]: RuntimeCompat(*mlx_lm.OLD, NO_MLX_LM, mlx_lm.NO_DECODING),
        mlx_lm.NEW[0]: RuntimeCompat(*mlx_lm.NEW, NO_MLX_LM, mlx_lm.NO_DECODING),
        mlx_vlm.NAME: RuntimeCompat(*mlx_vlm.VLM, backbone, root),
        mlx_vlm.DRAFTER_ROUTE: RuntimeCompat(mlx_vlm.DRAFTER_ROUTE, mlx_vlm.VERSION, backbone,
                                             _drafter_route(folder)),
        mtplx.NAME: RuntimeCompat(*mtplx.MTPLX, refused("mtplx"), refused("mtplx"), verified=False),
        rapid_mlx.NAME: RuntimeCompat(*rapid_mlx.RAPID, refused("rapid-mlx"), refused("rapid-mlx"), verified=False),
        vllm_mlx.NAME: RuntimeCompat(*vllm_mlx.VLLM, refused("vllm-mlx"), refused("vllm-mlx"), verified=False),
        pr990.NAME: RuntimeCompat(*pr990.PR990, refused("the PR #990 branch"), refused("the PR #990 branch"),
                                  verified=False),
    }
