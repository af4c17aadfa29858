"""Every runtime's contract for a Nemotron-H folder with its MTP head (``nemotron_h``), measured on tiny converted
folders (stock mlx-lm 0.31.3 / 0.32.2, mlx-vlm 0.7.10; ``docs/interop.md``, "Nemotron-H").

* backbone: mlx-lm's ``nemotron_h`` sanitize (``models/nemotron_h.py:560-577`` in 0.32.2, and 0.31.3's) drops every
  ``mtp.*`` key, moves a raw conv1d and stacks per-expert experts; it never shifts a norm. mlx-vlm's copy
  (``models/nemotron_h/language.py:518-542``) does the same over the index's files (else every root
  ``*.safetensors``). A head in the shards or beside them is harmless to both.
* head: only mlx-vlm drafts with it, through its ``nemotron_h`` splitter (``speculative/drafters/mtp_split.py``,
  ``nemotron_h_mtp/split.py``): ``--draft-model OUT`` takes the ``mtp.*`` keys of the index's files (else of every
  root ``*.safetensors``: the sidecar), ``--draft-model OUT/mtp`` those of ``mtp/*.safetensors`` when
  ``mtp/config.json`` is the model's own config (a config of its drafter type ``nemotron_h_mtp`` would load the
  ``mtp.``-prefixed keys as they are and refuse them). Its drafter (``nemotron_h_mtp/config.py``) needs
  ``num_nextn_predict_layers`` 1 and a head pattern of attention and MoE blocks only; its quantization is the
  config's top-level block for every module with ``.scales`` (per-module entries are looked up under the drafter's
  own paths, ``layers.{j}...``, which the model's config never names).
  mtplx, rapid-mlx, vllm-mlx and the PR #990 branch serve Qwen MTP heads only: not run here.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ...compat import mlx_lm, mlx_vlm, mtplx, pr990, rapid_mlx, vllm_mlx
from ...compat.folder import NO_BACKBONE, Folder, _files_str, _glob_model, _root
from ...compat.head import Head, _head, _quant, _top
from ...compat.report import PRECISION, RuntimeCompat, Verdict
from ...errors import ConvertError


def _backbone(files: List[str], who: str) -> Verdict:
    if not files:
        return Verdict(False, f"no weight file that {who} loads")
    return Verdict(True, f"{_files_str(files)} loaded as written (its nemotron_h sanitize drops mtp.*, shifts nothing)")


def _float_tag(config: dict) -> Optional[str]:
    """The first config key holding transformers 5's tag of a non-finite float (``{"__float__": "Infinity"}``)."""
    for key, value in config.items():
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, dict) and "__float__" in v for v in items):
            return key
    return None


def _old_backbone(folder: Folder, files: List[str], who: str) -> Verdict:
    """mlx-lm 0.31.3 does not decode transformers' float tags (0.32 does, ``mlx_lm/utils.py:330-365``): its
    Mamba2 mixer passes the dict to ``mx.clip`` and the first forward fails."""
    tagged = _float_tag(folder.config)
    if tagged:
        return Verdict(False, f"config.json's {tagged} holds transformers' {{\"__float__\": ...}} tag, which {who} "
                              "takes as it is: the Mamba2 forward fails (ValueError: Invalid type dict)")
    return _backbone(files, who)


def _vlm_files(folder: Folder) -> List[str]:
    weight_map = (folder.index or {}).get("weight_map") or {}
    return sorted(set(weight_map.values())) if weight_map else sorted(_root(folder))


def _drafter_problem(folder: Folder, head: Head) -> Optional[Verdict]:
    """What keeps mlx-vlm's nemotron_h_mtp drafter from using a head it found: its config checks, the blocks the
    pattern asks for, and quantized modules it would build at the top-level bits instead of theirs."""
    from . import SWITCH_OF, head_slots, model_spec

    try:
        spec = model_spec(folder.config)
    except ConvertError as e:
        return Verdict(False, f"config.json: {e.detail}")
    if spec.mtp_layers != 1:
        return Verdict(False, f"num_nextn_predict_layers is {spec.mtp_layers}: its drafter requires 1")
    if set(spec.mtp_pattern) - set("*E"):
        return Verdict(False, f"head pattern {spec.mtp_pattern!r}: its drafter builds attention and MoE blocks only")
    slots = {k[len("mtp."):]: s for k, s in head_slots(spec).items()}
    per_expert = {k: k.replace(f".switch_mlp.{fc}.", f".experts.0.{proj}.") for k in slots
                  for proj, fc in SWITCH_OF.items() if f".switch_mlp.{fc}." in k}
    missing = [k for k in slots if k not in head.tensors and per_expert.get(k) not in head.tensors]
    if missing:
        return Verdict(False, f"mtp.{missing[0]} is missing ({len(missing)} head tensors in all): its strict load "
                              "refuses the drafter")
    top = _top(_quant(folder.config))
    if head.quantized and top is None:
        return Verdict(False, "the head is quantized but config.json has no quantization block", PRECISION)
    for module in head.quantized:
        slot = slots.get(module + ".weight")
        w, s = head.tensors[module + ".weight"].get("shape") or [0], head.tensors[module + ".scales"].get("shape")
        if slot is None or not s:
            continue
        have = (w[-1] * 32 // slot.shape[-1], slot.shape[-1] // s[-1])
        if have != top:
            return Verdict(False, f"mtp.{module} is {have[0]}-bit/g{have[1]} but its drafter builds every quantized "
                                  f"module at the top-level {top[0]}-bit/g{top[1]}", PRECISION)
    return None


def _root_route(folder: Folder) -> Verdict:
    """``--draft-model OUT``: the splitter over the model folder."""
    weight_map = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for k, f in weight_map.items() if k.startswith("mtp.") and f in folder.headers})
    head = _head(folder, listed or sorted(_root(folder)), ("mtp.",))
    if head is None:
        return Verdict(False, "no mtp.* key in the index's files or any root *.safetensors")
    problem = _drafter_problem(folder, head)
    return problem or Verdict(True, f"--draft-model OUT: nemotron_h_mtp drafter from {len(head.tensors)} mtp.* "
                                    f"tensors in {_files_str(head.files)}; embeddings and lm_head bound from the "
                                    "target; drafts from the post-norm hidden state")


def _drafter_route(folder: Folder) -> Verdict:
    """``--draft-model OUT/mtp``: the splitter over the drafter folder."""
    drafter = folder.drafter_config
    if drafter is None:
        return Verdict(False, "no mtp/config.json: OUT/mtp is not a drafter folder (--draft-model OUT works)")
    if drafter != folder.config:
        return Verdict(False, "mtp/config.json is not the model's config.json: mlx-vlm picks its splitter from it "
                              "(a nemotron_h_mtp config would take the mtp.-prefixed keys as they are)")
    files = sorted(f for f in folder.headers if f.startswith("mtp/") and f.count("/") == 1)
    head = _head(folder, files, ("mtp.",))
    if head is None:
        return Verdict(False, f"no mtp.* keys in {_files_str(files) if files else 'mtp/*.safetensors'}")
    problem = _drafter_problem(folder, head)
    return problem or Verdict(True, f"--draft-model OUT/mtp: the model's config beside {_files_str(head.files)} "
                                    f"({len(head.tensors)} mtp.* tensors), split in memory into its nemotron_h_mtp "
                                    "drafter")


def _split_drafter(folder: Folder) -> Verdict:
    """mlx-vlm's own split folder (``mlx_vlm.convert --mtp``): unprefixed ``layers.{j}...`` keys."""
    files = sorted(_root(folder))
    head = _head(folder, files, ("mtp.",), bare=True)
    if head is None:
        return Verdict(False, "drafter folder without head tensors")
    text = folder.config.get("text_config") if isinstance(folder.config.get("text_config"), dict) else {}
    problem = _drafter_problem(dataclasses.replace(folder, config=dict(text, quantization=folder.config.get(
        "quantization"))), head)
    return problem or Verdict(True, f"drafter folder: {len(head.tensors)} head tensors in {_files_str(head.files)}; "
                                    "use it as --draft-model DIR --draft-kind mtp next to its target")


def rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """runtime -> its row for a Nemotron-H folder."""
    drafter = layout == "drafter"
    shards = _glob_model(folder)

    def bb(files, who):
        return NO_BACKBONE if drafter else _backbone(files, who)

    def old(files, who):
        return NO_BACKBONE if drafter else _old_backbone(folder, files, who)

    none = Verdict(False, "the folder has no MTP tensors") if layout == "none" else None
    vlm_head = _split_drafter(folder) if drafter else (none or _root_route(folder))
    route = vlm_head if drafter else (none or _drafter_route(folder))
    not_run = Verdict(False, "serves Qwen MTP heads only; not run on nemotron_h")
    return {
        mlx_lm.OLD[0]: RuntimeCompat(*mlx_lm.OLD, old(shards, "mlx-lm 0.31"), mlx_lm.NO_DECODING),
        mlx_lm.NEW[0]: RuntimeCompat(*mlx_lm.NEW, bb(shards, "mlx-lm 0.32"), mlx_lm.NO_DECODING),
        mlx_vlm.NAME: RuntimeCompat(*mlx_vlm.VLM, bb(_vlm_files(folder), "mlx-vlm"), vlm_head),
        mlx_vlm.DRAFTER_ROUTE: RuntimeCompat(mlx_vlm.DRAFTER_ROUTE, mlx_vlm.VERSION, bb(_vlm_files(folder), "mlx-vlm"),
                                             route),
        mtplx.NAME: dataclasses.replace(mtplx.compat(folder, layout), backbone_exact=old(shards, "mlx-lm 0.31.3"),
                                        head_usable=not_run, verified=False),
        rapid_mlx.NAME: RuntimeCompat(*rapid_mlx.RAPID, old(shards, "mlx-lm 0.31.3"), not_run, verified=False),
        vllm_mlx.NAME: RuntimeCompat(*vllm_mlx.VLLM, old(shards, "mlx-lm 0.31.3"), not_run, verified=False),
        pr990.NAME: RuntimeCompat(*pr990.PR990, old(shards, "mlx-lm 0.31.3"),
                                  Verdict(False, "the PR #990 branch decodes MTP for qwen3_5 only"), verified=False),
    }
