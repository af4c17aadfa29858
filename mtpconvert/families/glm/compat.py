"""Every runtime's contract for a GLM nextn folder (``glm4_moe_lite``, ``glm_moe_dsa``, ``glm4_moe``), measured
on tiny folders of each (stock mlx-lm 0.31.3 / 0.32.2, mlx-vlm 0.7.10; ``docs/interop.md``, file/line references
in ``interop/notes-glm-mlx-lm.md`` and ``interop/notes-glm-mlx-vlm.md``).

* backbone: mlx-lm's sanitize (and mlx-vlm's copy of it) drops every layer from ``num_hidden_layers`` on
  (``glm4_moe``: the keys starting with that layer) and never shifts a norm; an ``mtp.`` key in a loaded
  shard reaches the strict load, which refuses the model.
* head: mlx-vlm drafts only ``glm_moe_dsa``, from a drafter folder (``--draft-model OUT/mtp``) whose
  config is ``glm_moe_dsa_mtp`` over the whole text config and whose ``mtp.*`` weights are exactly its
  module's (no embedding or lm_head: it borrows the target's). Its ``glm4_moe_lite_mtp`` drafter has no
  model class in 0.7.10 and its ``glm4_moe_lite`` target returns no hidden states; ``glm4_moe`` has no MTP
  route. The Qwen-only runtimes (mtplx, rapid-mlx, vllm-mlx, the PR #990 branch) were not run on GLM.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from ...compat import mlx_lm, mlx_vlm, mtplx, pr990, rapid_mlx, vllm_mlx
from ...compat.folder import Folder, _files_str, _glob_model, _keys_with
from ...compat.head import _head
from ...compat.report import RuntimeCompat, Verdict

NO_BACKBONE = Verdict(None, "drafter folder: the head only, no backbone")
OWN_VOCAB = ("embed_tokens.weight", "shared_head.head.weight")


def _backbone(folder: Folder, files: List[str], who: str) -> Verdict:
    if not files:
        return Verdict(False, f"no weight file that {who} loads")
    hits = _keys_with(folder, files, lambda k: k.startswith("mtp."))
    if hits:
        return Verdict(False, f"{len(hits)} mtp.* key(s) in {_files_str(sorted({f for f, _ in hits}))}: {who}'s strict "
                              "load refuses the model (its sanitize drops only model.layers.{num_hidden_layers}+)")
    return Verdict(True, f"{_files_str(files)} loaded as written (sanitize drops the nextn layer, shifts nothing)")


def _vlm_files(folder: Folder) -> List[str]:
    weight_map = (folder.index or {}).get("weight_map") or {}
    return sorted(set(weight_map.values())) if weight_map else sorted(f for f in folder.headers if "/" not in f)


def _drafter_head(folder: Folder, model_type: str) -> Verdict:
    """``--draft-model OUT/mtp`` in mlx-vlm 0.7.10."""
    if model_type != "glm_moe_dsa":
        why = ("its glm4_moe_lite_mtp drafter has no model class (AttributeError) and its glm4_moe_lite target "
               "returns no hidden states" if model_type == "glm4_moe_lite" else "it has no glm4_moe drafter")
        return Verdict(False, f"mlx-vlm 0.7.10 cannot draft {model_type}: {why}")
    drafter = folder.drafter_config
    want = f"{model_type}_mtp"
    if drafter is None:
        return Verdict(False, "no mtp/config.json: OUT/mtp is not a drafter folder")
    if drafter.get("model_type") != want or not isinstance(drafter.get("text_config"), dict):
        return Verdict(False, f"mtp/config.json must say model_type {want!r} over the model's text_config, not "
                              f"{drafter.get('model_type')!r}")
    files = sorted(f for f in folder.headers if f.startswith("mtp/") and f.count("/") == 1)
    found = _head(folder, files, ("mtp.",))
    if found is None:
        return Verdict(False, f"no mtp.* keys in {_files_str(files) if files else 'mtp/*.safetensors'}")
    extra = [k for k in OWN_VOCAB if k in found.tensors]
    if extra:
        return Verdict(False, f"mtp.{extra[0]} is not a parameter of the drafter (it borrows the target's): "
                              "its strict load refuses the folder")
    quantized = any(k.endswith(".scales") for k in found.tensors)
    if quantized and "quantization" not in drafter:
        return Verdict(False, "the head is quantized but mtp/config.json has no quantization block: the strict "
                              "load refuses its scales")
    return Verdict(True, f"--draft-model OUT/mtp: {want} over {_files_str(found.files)} ({len(found.tensors)} "
                         "mtp.* tensors; embedding and lm_head borrowed from the target)")


def rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """runtime -> its row for a GLM nextn folder."""
    model_type = folder.config.get("model_type", "")
    drafter = layout == "drafter"
    shards = _glob_model(folder)

    def bb(files, who):
        return NO_BACKBONE if drafter else _backbone(folder, files, who)

    root = Verdict(False, "--draft-model OUT runs mlx-vlm's splitter over the root, which looks for "
                          "model.layers.{num_hidden_layers}.*; this folder keeps the head in mtp/ (use --draft-model "
                          "OUT/mtp)")
    not_run = Verdict(False, f"serves Qwen MTP heads only; not run on {model_type}")
    out = {
        mlx_lm.OLD[0]: RuntimeCompat(*mlx_lm.OLD, bb(shards, "mlx-lm 0.31"), mlx_lm.NO_DECODING),
        mlx_lm.NEW[0]: RuntimeCompat(*mlx_lm.NEW, bb(shards, "mlx-lm 0.32"), mlx_lm.NO_DECODING),
        mlx_vlm.NAME: RuntimeCompat(*mlx_vlm.VLM, bb(_vlm_files(folder), "mlx-vlm"), root),
        mlx_vlm.DRAFTER_ROUTE: RuntimeCompat(mlx_vlm.DRAFTER_ROUTE, mlx_vlm.VERSION, bb(_vlm_files(folder), "mlx-vlm"),
                                             _drafter_head(folder, model_type)),
        mtplx.NAME: dataclasses.replace(mtplx.compat(folder, layout), backbone_exact=bb(shards, "mlx-lm 0.31.3"),
                                        head_usable=not_run, verified=False),
        rapid_mlx.NAME: RuntimeCompat(*rapid_mlx.RAPID, bb(shards, "mlx-lm 0.31.3"), not_run, verified=False),
        vllm_mlx.NAME: RuntimeCompat(*vllm_mlx.VLLM, bb(shards, "mlx-lm 0.31.3"), not_run, verified=False),
        pr990.NAME: RuntimeCompat(*pr990.PR990, bb(shards, "mlx-lm 0.31.3"),
                                  Verdict(False, "the PR #990 branch decodes MTP for qwen3_5 only"), verified=False),
    }
    return out
