"""Every runtime's contract for a Qwen3-Next (``qwen3_next``) folder, measured on a qwen3_next-shaped
trained folder (stock mlx-lm 0.31.3 / 0.32.2, mlx-vlm 0.7.10, mtplx 2.12.2, rapid-mlx 0.16.10,
vllm-mlx 0.6.0; ``docs/interop.md``, file/line references in ``interop/notes-qwen3-next.md``).

* backbone: mlx-lm's ``qwen3_next`` sanitize (and mlx-vlm's copy of it) runs only on a raw folder
  (per-expert backbone experts): then it stacks experts, shifts the norms once and drops ``mtp.*``.
  On a converted folder it changes nothing, so no version shifts twice; but an ``mtp.`` key in a
  loaded shard then reaches the strict load, which refuses the whole model.
* head: only mtplx drafts with it (its head-file and precision rules are Qwen3.5's, the count at
  the config's top level). mtplx builds the head from qwen3_5's ``TextModelArgs``, whose default
  ``rope_parameters`` sets the RoPE base to 100000: the config's ``rope_parameters`` must carry the
  model's ``rope_theta`` for the head to attend as trained.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

from ...compat import mlx_lm, mlx_vlm, mtplx, pr990, rapid_mlx, vllm_mlx
from ...compat.folder import MODEL_MTP, NO_BACKBONE, Folder, _conv_raw, _files_str, _glob_model, _keys_with
from ...compat.report import RuntimeCompat, Verdict

ROPE_KEYS = ("type", "rope_theta", "partial_rotary_factor", "mrope_section")  # what mlx-vlm's drafter config requires


def _backbone(folder: Folder, files: List[str], who: str) -> Verdict:
    if not files:
        return Verdict(False, f"no weight file that {who} loads (model*.safetensors)")
    hits = _keys_with(folder, files, lambda k: "mtp." in k)
    if hits and _conv_raw(folder, files):
        return Verdict(True, "raw checkpoint: its qwen3_next sanitize stacks the experts, shifts the norms once "
                             "and drops mtp.*")
    if hits:
        where = sorted({f for f, _ in hits})
        return Verdict(False, f"{len(hits)} mtp.* key(s) in {_files_str(where)}: {who}'s qwen3_next sanitize keeps "
                              "them in a converted folder and the strict load refuses the model (ValueError: "
                              "parameters not in model)")
    return Verdict(True, f"no mtp.* key in {_files_str(files)}: loaded as written (qwen3_next's sanitize never "
                         "shifts a converted folder)")


def _vlm_files(folder: Folder) -> List[str]:
    """mlx-vlm loads the index's files when there is an index, else every root *.safetensors."""
    weight_map = (folder.index or {}).get("weight_map") or {}
    if weight_map:
        return sorted(set(weight_map.values()))
    return sorted(f for f in folder.headers if "/" not in f)


def _rope_note(config: dict) -> str:
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and all(k in rope for k in ROPE_KEYS) and rope["rope_theta"] == config.get(
            "rope_theta", rope["rope_theta"]):
        return ""
    return ("; config has no complete rope_parameters, so mtplx's head uses RoPE base 100000 instead of rope_theta "
            "(drafts degrade at long context)")


def _mtplx(folder: Folder, layout: str) -> RuntimeCompat:
    row = mtplx.compat(folder, layout)
    bb = NO_BACKBONE if layout == "drafter" else _backbone(folder, _glob_model(folder), "mlx-lm 0.31.3 (mtplx's)")
    head = row.head_usable
    if head.ok:
        head = dataclasses.replace(head, reason=head.reason + _rope_note(folder.config))
    return dataclasses.replace(row, backbone_exact=bb, head_usable=head)


def _no_head(reason: str) -> Callable[[Folder, str, tuple, List[str], str], RuntimeCompat]:
    def row(folder: Folder, layout: str, runtime: tuple, files: List[str], who: str) -> RuntimeCompat:
        bb = NO_BACKBONE if layout == "drafter" else _backbone(folder, files, who)
        return RuntimeCompat(*runtime, bb, Verdict(False, reason))
    return row


_MLX_VLM_HEAD = ("mlx-vlm 0.7.10 builds its qwen3_5_mtp drafter from mtp.safetensors, but its qwen3_next model "
                 "returns no hidden states (models/qwen3_next/language.py:402), so MTP decoding raises TypeError "
                 "(speculative/utils.py:308); plain decoding is exact")
_RAPID_HEAD = ("qwen3_next is not on rapid-mlx 0.16.10's MTP allowlist (spec_decode/mtp/detect.py:72): it serves the "
               "backbone and exits 2 when MTP is asked for")
_VLLM_HEAD = ("vllm-mlx 0.6.0 injects a Qwen3-Next head only from a root model-mtp.safetensors with a top-level "
              "num_nextn_predict_layers (patches/qwen3_next_mtp.py:47), a file mlx-lm's model*.safetensors glob also "
              "loads, and its mtp_forward concatenates [hidden, embed], the reverse of the trained order; its MTP "
              "loop is off with every mlx-lm it accepts (scheduler.py:827)")
_PR990_HEAD = "the PR #990 branch adds MTP decoding to mlx-lm's qwen3_5 models only; its qwen3_next is stock 0.31.3"


def rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """runtime -> its row for a Qwen3-Next folder."""
    shards = _glob_model(folder)
    vllm_files = shards  # a root model-mtp.safetensors matches the glob too
    out = {
        mlx_lm.OLD[0]: _no_head(mlx_lm.NO_DECODING.reason)(folder, layout, mlx_lm.OLD, shards, "mlx-lm 0.31"),
        mlx_lm.NEW[0]: _no_head(mlx_lm.NO_DECODING.reason)(folder, layout, mlx_lm.NEW, shards, "mlx-lm 0.32"),
        mlx_vlm.NAME: _no_head(_MLX_VLM_HEAD)(folder, layout, mlx_vlm.VLM, _vlm_files(folder), "mlx-vlm"),
        mlx_vlm.DRAFTER_ROUTE: _no_head(_MLX_VLM_HEAD + " (through --draft-model OUT/mtp as well)")(
            folder, layout, (mlx_vlm.DRAFTER_ROUTE, mlx_vlm.VERSION), _vlm_files(folder), "mlx-vlm"),
        mtplx.NAME: _mtplx(folder, layout),
        rapid_mlx.NAME: _no_head(_RAPID_HEAD)(folder, layout, rapid_mlx.RAPID, shards, "mlx-lm 0.31.3 (rapid-mlx's)"),
        vllm_mlx.NAME: _no_head(_VLLM_HEAD)(folder, layout, vllm_mlx.VLLM, vllm_files, "mlx-lm 0.31.3 (vllm-mlx's)"),
        pr990.NAME: dataclasses.replace(
            _no_head(_PR990_HEAD)(folder, layout, pr990.PR990, shards, "the PR #990 branch"), verified=False),
    }
    if MODEL_MTP in folder.headers:
        out[vllm_mlx.NAME].head_usable.reason += f" ({MODEL_MTP} is here: see the backbone column)"
    return out
