"""Every runtime's contract for a glm5_next folder.

* mlx-lm (0.31 and 0.32) has no ``glm5_next`` module (``ValueError: Model type glm5_next not supported``); mtplx,
  rapid-mlx, vllm-mlx and the PR #990 branch load models with mlx-lm, so none of them serves it.
* mlx-vlm 0.7.10 loads the backbone (``models/glm5_next``): the files the index names, its ``sanitize`` dropping
  every layer from ``num_hidden_layers`` on and fusing what the folder stores apart (``language.py:950-1053``), no
  norm shifted.
* mlx-vlm drafts with the head (``speculative/drafters/glm5_next_mtp``) through its splitter, which selects the
  keys under ``{model.language_model., language_model.model., model., }layers.{num_hidden_layers}.``
  (``split.py:29-39``) in the files the index names for them, else in every root ``*.safetensors``
  (``mtp_split.py:176-194``). ``--draft-model OUT`` runs it over the root, where it finds the sidecar
  (``mtp.safetensors``, which the index does not list); ``--draft-model OUT/mtp`` over ``mtp/``, whose config is
  the model's own and whose ``weights.safetensors`` is the same file: one head, both routes. The drafter's strict
  load refuses anything else in the nextn layer (its own ``embed_tokens`` or ``shared_head.head``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ...compat import vlm_only
from ...compat.folder import Folder, _files_str
from ...compat.head import _head
from ...compat.report import RuntimeCompat, Verdict
from . import drafter_module

NO_BACKBONE = Verdict(None, "drafter folder: the head only, no backbone")
OWN_VOCAB = ("embed_tokens.", "shared_head.head.")


def _layer_prefixes(config: dict) -> tuple:
    """The splitter's key prefixes of the nextn layer (``split.py:29-36``); none without a layer count."""
    n = (config.get("text_config") or {}).get("num_hidden_layers") if isinstance(config, dict) else None
    if isinstance(n, bool) or not isinstance(n, int):
        return ()
    return tuple(f"{p}layers.{n}." for p in ("model.language_model.", "language_model.model.", "model.", ""))


def _backbone(folder: Folder) -> Verdict:
    files = vlm_only.loader_files(folder)
    if not files:
        return Verdict(False, "no safetensors file for mlx-vlm to load")
    return Verdict(True, f"{_files_str(files)} loaded as written (its sanitize drops the nextn layer and fuses "
                         "the projections stored apart; no norm shifted)")


def _head_verdict(folder: Folder, config: dict, files: List[str], route: str) -> Verdict:
    prefixes = _layer_prefixes(config)
    found = _head(folder, files, prefixes) if prefixes else None
    if found is None:
        return Verdict(False, f"{route}: no layers.{{num_hidden_layers}}.* keys in "
                              f"{_files_str(files) if files else 'its files'} (No MTP tensors found)")
    extra = sorted(k for k in found.tensors if k.startswith(OWN_VOCAB))
    if extra:
        return Verdict(False, f"{route}: the nextn layer holds {extra[0]}, which mlx-vlm's glm5_next_mtp drafter "
                              "has no parameter for: its strict load refuses it")
    if found.quantized and "quantization" not in config:
        return Verdict(False, f"{route}: the head is quantized but the config has no quantization block")
    unnamed = _unnamed_for_the_drafter(config, found.quantized)
    if unnamed:
        return Verdict(False, f"{route}: the config gives {unnamed} its own quantization only under the folder's "
                              "key, not under the drafter's module path: mlx-vlm would build it at the default bits")
    return Verdict(True, f"{route}: glm5_next_mtp drafter over {_files_str(found.files)} ({len(found.tensors)} "
                         "tensors; embedding and lm_head borrowed from the target)")


def _unnamed_for_the_drafter(config: dict, quantized: List[str]) -> Optional[str]:
    """The first quantized head module whose per-module entry the drafter's loader would not find (it looks one up
    by its own module path only)."""
    block = config.get("quantization") if isinstance(config.get("quantization"), dict) else {}
    n = (config.get("text_config") or {}).get("num_hidden_layers")
    for local in quantized:
        entry = block.get(f"language_model.model.layers.{n}.{local}")
        if entry is not None and block.get(drafter_module(local)) != entry:
            return local
    return None


def _drafter_route(folder: Folder) -> Verdict:
    drafter = folder.drafter_config
    if drafter is None:
        return Verdict(False, "no mtp/config.json: OUT/mtp is not a drafter folder")
    if drafter != folder.config:
        return Verdict(False, "mtp/config.json is not the model's own config: mlx-vlm would not run its glm5_next "
                              "splitter over mtp/")
    return _head_verdict(folder, drafter, vlm_only.splitter_files(folder, _layer_prefixes(drafter), "mtp/"),
                         "--draft-model OUT/mtp")


def _own_drafter(folder: Folder) -> Optional[Verdict]:
    """mlx-vlm's own drafter folder (``mlx_vlm.convert --mtp``: model_type glm5_next_mtp, drafter names)."""
    if folder.config.get("model_type") != "glm5_next_mtp":
        return None
    keys = {k for h in folder.headers.values() for k in h if k != "__metadata__"}
    if not any(k.startswith("mtp_block.") for k in keys):
        return Verdict(False, "a glm5_next_mtp folder without mtp_block.* tensors: not mlx-vlm's drafter layout")
    return Verdict(True, "--draft-model DIR: mlx-vlm's own glm5_next_mtp drafter folder")


def rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """runtime -> its row for a glm5_next folder."""
    own = _own_drafter(folder)
    backbone = NO_BACKBONE if layout == "drafter" or own is not None else _backbone(folder)
    root_files = vlm_only.splitter_files(folder, _layer_prefixes(folder.config))
    root = own or _head_verdict(folder, folder.config, root_files, "--draft-model OUT")
    return vlm_only.rows("glm5_next", backbone, root, own or _drafter_route(folder))
