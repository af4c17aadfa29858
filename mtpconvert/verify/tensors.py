"""verify: the tensors against their family's slots (shapes, experts, quantization), the norms' centre
against the layout, and the config's own consistency."""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from ..errors import LayoutError
from ..families import family_for
from ..families.base import (CONV, FC, KV_B_PARTS, MLX, MTP, QUANT_AUX, QUANTIZABLE, SWITCH, Family, Gather, Slot,
                             kv_b_fits, text_config)
from ..io.checkpoint import INDEX_NAME, MTP_FILE, Checkpoint
from ..io.header import mlx_dtype_name
from ..io.reader import TensorReader
from ..plan import fp8
from .foreign import missing_head_message
from .report import ERROR, INFO, WARNING, Report

# Classification of a norm vector by its mean: raw zero-centred weights sit near 0,
# MLX weights near 1; a second +1 lands near 2.
CENTRED_MAX, SHIFTED_MAX = 0.5, 1.5


def check_sources(ckpt: Checkpoint, report: Report) -> None:
    """Quantized source formats: every block-FP8 weight with a well-formed scale; FP4 formats named."""
    for name, key in fp8.refused_formats(ckpt.tensors):
        report.add("format-unsupported", ERROR, f"{name} checkpoint: mtpconvert does not convert its quantized "
                   "weights (convert the BF16 or block-FP8 release)", key, ckpt.tensors[key].file)
    for problem in fp8.scale_problems(ckpt.tensors, {k: info.file for k, info in ckpt.tensors.items()}):
        report.add("fp8-scale", ERROR, problem.detail, problem.key, problem.file)


def canonical_module(module: str, family: Family) -> str:
    """A stored module path under its canonical MLX name: the sidecar's ``mtp.X`` (``Family.sidecar_prefix``) is
    the family's head prefix + ``X`` (``language_model.mtp.X``)."""
    prefix = family.sidecar_prefix
    return family.head_prefix + module[len(prefix):] if module.startswith(prefix) else module


def sidecar_module(module: str, family: Family) -> str:
    """A canonical head module under its sidecar name (``mtp.X``, ``Family.sidecar_prefix``)."""
    return family.sidecar_prefix + module[len(family.head_prefix):]


def _config_file(ckpt: Checkpoint) -> Path:
    return ckpt.root / "config.json"


def _mtp_count_key(ckpt: Checkpoint) -> str:
    return (("text_config." if isinstance(ckpt.config.get("text_config"), dict) else "")
            + family_for(ckpt.config).mtp_count_key)


def _file_of(ckpt: Checkpoint, key: Optional[str]):
    """The file holding ``key`` (None when the folder has no such tensor)."""
    info = ckpt.tensors.get(key) if key else None
    return info.file if info is not None else None


def _stored_weight(ckpt: Checkpoint, module: str, family: Family) -> Optional[str]:
    """The key holding a canonical module's weight, in the shards or in the MTP sidecar."""
    for key in (module + ".weight", sidecar_module(module, family) + ".weight" if family.is_head(module) else None):
        if key and key in ckpt.tensors:
            return key
    return None


def check_tensors(ckpt: Checkpoint, family: Family, spec, raw_conv: bool, report: Report) -> None:
    """Every tensor against the family's slots; ``raw_conv``: conv1d weights are in the raw [C,1,K] layout."""
    aux: Dict[str, Dict[str, str]] = defaultdict(dict)  # canonical module -> {scales|biases: key}
    targets: Dict[str, List] = defaultdict(list)
    expert_styles = Counter()
    scales = fp8.scale_keys(ckpt.tensors)
    for key in ckpt.tensors:
        if m := QUANT_AUX.search(key):
            aux[canonical_module(key[: m.start()], family)][m.group(1)] = key
            continue
        if key in scales or fp8.refused_format(key) or fp8.ignored(key):
            continue  # checked with their weights (_check_sources); activation / KV-cache scales are not converted
        try:
            mapped = family.contributions(key)
        except LayoutError as e:
            report.add("tensor-unexpected", ERROR, e.detail, key, ckpt.tensors[key].file)
            continue
        for m in mapped:
            if m.target is not None:
                targets[m.target].append(m)
        if (style := mapped[0].expert_layout) is not None:
            group = MTP if family.is_head(mapped[0].target) else "backbone"
            expert_styles[(group, style)] += 1
    if expert_styles:
        styles = sorted({s for _, s in expert_styles})
        report.experts = styles[0] if len(styles) == 1 else "mixed"

    n_mtp, any_mtp = family.head_layers(targets)
    report.mtp_layers_found = n_mtp
    claimed = n_mtp if spec.mtp_layers is None else spec.mtp_layers
    if spec.mtp_layers is None and any_mtp:
        report.add("mtp-count-missing", WARNING,
                   f"config.json has no {family.mtp_count_key} but the folder has {n_mtp} MTP layer(s); runtimes "
                   "read the count from the config (mtpconvert convert writes it)", _mtp_count_key(ckpt), _config_file(ckpt))
    if spec.mtp_layers and not any_mtp:
        report.add("mtp-missing", ERROR, missing_head_message(ckpt.root, family.mtp_count_key, spec.mtp_layers),
                   _mtp_count_key(ckpt), _config_file(ckpt))
    elif n_mtp != claimed and any_mtp:
        report.add("mtp-count", ERROR,
                   f"folder has {n_mtp} MTP layer(s), config.json says {spec.mtp_layers}", _mtp_count_key(ckpt),
                   _config_file(ckpt))

    slots = family.expected_slots(spec, max(n_mtp, claimed if any_mtp else 0))
    style = report.layout
    missing = []
    for name, slot in slots.items():
        contribs = targets.get(name, [])
        if not contribs:
            missing.append(slot)
            continue
        if slot.kind == SWITCH:
            _check_experts(ckpt, family, slot, contribs, spec, report)
            continue
        if contribs[0].part in KV_B_PARTS:
            check_kv_b(ckpt, slot, contribs[0], report)
            continue
        if contribs[0].part is Gather.GROUPS:  # a grouped projection's [G * R, C] source
            slot = dataclasses.replace(slot, shape=(slot.shape[0] * slot.shape[1], *slot.shape[2:]))
        check_shape(ckpt, slot, contribs[0].source, raw_conv, aux.get(slot.module), report)
    head_only = any_mtp and all(family.is_head(t) for t in targets)
    if head_only:
        report.layout = "head-only"
        report.add("head-only", INFO, "the MTP head alone, no backbone: a drafter folder, used next to its model "
                   "(mlx-vlm: --model OUT --draft-model OUT/mtp); `mtpconvert verify OUT` checks it with its model "
                   "and gives the runtime table", file=ckpt.root)
    for slot in missing:
        code = "mtp-incomplete" if slot.group == MTP and any_mtp else "tensor-missing"
        if slot.group == MTP and not any_mtp:
            continue  # reported once as mtp-missing
        if head_only and slot.group != MTP:
            continue  # a drafter folder has no backbone to miss
        report.add(code, ERROR, f"missing {slot.name}", family.source_name(slot.name, style),
                   _missing_file(ckpt, slot.group == MTP))
    report.mtp_complete = any_mtp and not any(s.group == MTP for s in missing) and n_mtp == claimed

    tie = spec.tie_word_embeddings
    for name, contribs in targets.items():
        if name in slots:
            continue
        if tie and name == family.lm_head:
            continue
        for c in contribs:
            report.add("tensor-unexpected", ERROR, "tensor has no slot in this model under its config",
                       c.source, ckpt.tensors[c.source].file)
    _check_quantization(ckpt, family, slots, aux, report)

    dtypes: Dict[str, Counter] = defaultdict(Counter)
    for key, info in ckpt.tensors.items():
        if QUANT_AUX.search(key) or key in scales:
            continue
        group = "vision" if "visual" in key or key.startswith("vision_tower") else (
            MTP if key.startswith((family.sidecar_prefix, family.head_prefix)) else "backbone")
        dtypes[group][mlx_dtype_name(info.dtype)] += 1
    report.dtypes = {g: dict(c) for g, c in dtypes.items()}


def _missing_file(ckpt: Checkpoint, head: bool) -> Path:
    """Where a missing tensor was looked for: the head's sidecar, else the index, else the folder."""
    if head and MTP_FILE in ckpt.headers:
        return ckpt.root / MTP_FILE
    return ckpt.root / INDEX_NAME if ckpt.index_map is not None else ckpt.root


def _check_experts(ckpt, family: Family, slot: Slot, contribs, spec, report: Report) -> None:
    per_expert = [c for c in contribs if c.part is Gather.STACK]
    if per_expert:
        if report.layout == MLX and slot.group == MTP:
            # --mtp-layout in-model writes a float head so: the mlx-lm PR #990 branch stacks them
            # itself; which runtimes take it is the compatibility table's business
            report.add("mtp-moe-per-expert", INFO,
                       f"experts of {slot.module} are stored per expert (the mlx-lm PR #990 form)",
                       per_expert[0].source, _file_of(ckpt, per_expert[0].source))
        elif family.key_style(contribs[0].source) == MLX:
            report.add("moe-unstacked", ERROR,
                       f"experts of {slot.module} are stored per expert; MLX runtimes need stacked "
                       "switch_mlp weights", per_expert[0].source, _file_of(ckpt, per_expert[0].source))
        have = {c.index for c in per_expert}
        for e in range(spec.num_experts):
            if e not in have:
                key = re.sub(r"\.experts\.\d+\.", f".experts.{e}.", per_expert[0].source)
                report.add("expert-missing", ERROR,
                           f"expert {e} of {spec.num_experts} is missing for {slot.module}", key,
                           _file_of(ckpt, per_expert[0].source))
                break
        return
    c = contribs[0]
    info = ckpt.tensors[c.source]
    fused = c.part in (Gather.GATE_HALF, Gather.UP_HALF)
    want = (slot.shape[0], 2 * slot.shape[1], slot.shape[2]) if fused else slot.shape
    got = info.shape
    if info.dtype == "U32":  # quantized stack: compare all but the packed axis
        if got[:-1] != want[:-1]:
            report.add("shape-mismatch", ERROR, f"shape {list(got)} does not match {list(want)} (packed)", c.source,
                       info.file)
        return
    if got != want:
        report.add("shape-mismatch", ERROR, f"shape {list(got)} does not match the config {list(want)}", c.source,
                   info.file)


def infer_quant(ckpt, family: Family, slot: Slot, aux: Dict[str, str]) -> Optional[dict]:
    """(bits, group_size, mode) recovered from packed shapes, like mlx-lm's loader."""
    weight_key = _stored_weight(ckpt, slot.module, family)
    if weight_key is None or "scales" not in aux:
        return None
    in_dim = slot.shape[-1]
    scales = ckpt.tensors[aux["scales"]]
    packed = ckpt.tensors[weight_key].shape[-1]
    if scales.shape[-1] == 0 or in_dim % scales.shape[-1]:
        return {"group_size": -1, "bits": -1, "mode": "invalid"}
    group, bits = in_dim // scales.shape[-1], packed * 32 // in_dim
    if scales.dtype != "U8":
        return {"group_size": group, "bits": bits, "mode": "affine"}
    mode = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}.get((bits, group), "invalid")
    return {"group_size": group, "bits": bits, "mode": mode}


def _check_quantization(ckpt: Checkpoint, family: Family, slots: Dict[str, Slot], aux, report: Report) -> None:
    block = ckpt.config.get("quantization")
    if block is None:
        block = text_config(ckpt.config).get("quantization")
    config_file = _config_file(ckpt)
    if block is not None and not isinstance(block, dict):
        report.add("quant-config-invalid", ERROR, f"the quantization block must be a JSON object, not {block!r}",
                   "quantization", config_file)
        return
    summary: Dict[str, Counter] = defaultdict(Counter)
    by_module = {s.module: s for s in slots.values()}
    for module, parts in aux.items():
        if module not in by_module:
            report.add("tensor-unexpected", ERROR, "quantization scales for an unknown module", parts.get("scales"),
                       _file_of(ckpt, parts.get("scales")))
    for slot in slots.values():
        if slot.kind not in QUANTIZABLE:
            continue
        have = infer_quant(ckpt, family, slot, aux.get(slot.module, {}))
        stored = _stored_weight(ckpt, slot.module, family) or slot.module + ".weight"
        summary[slot.group]["unquantized" if have is None else f"{have['bits']}b/g{have['group_size']}/{have['mode']}"] += 1
        if slot.kind == FC and have is not None:
            report.add("mtp-fc-quantized", ERROR,
                       f"mtp.fc is quantized ({have['bits']} bits); it mixes embedding and hidden state and "
                       "must stay unquantized", stored, _file_of(ckpt, stored))
        if have is not None and have["mode"] == "invalid":
            report.add("quant-invalid", ERROR, "scales/weight shapes match no quantization mode", stored,
                       _file_of(ckpt, stored))
            continue
        if block is None:
            if have is not None:
                report.add("quant-config-mismatch", ERROR,
                           "weights are quantized but config.json has no quantization block", stored, config_file)
            continue
        declared = block.get(slot.module, block.get(sidecar_module(slot.module, family)) if slot.group == MTP else None)
        if declared is None:
            if have is None:
                continue  # unlisted and unquantized: mlx-lm's loader also infers this from the missing scales
            declared = {k: block.get(k) for k in ("group_size", "bits", "mode")}
            declared["mode"] = declared.get("mode") or "affine"
        if declared is False:
            if have is not None:
                report.add("quant-config-mismatch", ERROR, "config says unquantized but the weights carry scales",
                           stored, config_file)
            continue
        if have is None:
            report.add("quant-config-mismatch", ERROR,
                       f"config says {declared.get('bits')}-bit but the weight has no scales", stored, config_file)
            continue
        want = (declared.get("bits"), declared.get("group_size"), declared.get("mode") or "affine")
        if want != (have["bits"], have["group_size"], have["mode"]):
            report.add("quant-config-mismatch", ERROR,
                       f"config says {want[0]}b/g{want[1]}/{want[2]} but the weights are "
                       f"{have['bits']}b/g{have['group_size']}/{have['mode']}", stored, config_file)
    report.quantization = {g: dict(c) for g, c in summary.items()}


def _norm_keys(ckpt: Checkpoint, family: Family) -> Dict[str, List[str]]:
    groups: Dict[str, List[str]] = defaultdict(list)
    for key in ckpt.tensors:
        if QUANT_AUX.search(key):
            continue
        try:
            (mapped, *_) = family.contributions(key)
        except LayoutError:
            continue
        if mapped.target and family.is_zero_centred_norm(mapped.target):
            groups[MTP if family.is_head(mapped.target) else "backbone"].append(key)
    return groups


def classify_norm(mean: float) -> str:
    if abs(mean) < CENTRED_MAX:
        return "zero-centred"
    if mean < SHIFTED_MAX:
        return "shifted"
    return "double-shifted"


def check_norms(ckpt: Checkpoint, family: Family, raw: bool, report: Report) -> None:
    """Read the norm vectors (a few KB each) and compare their centre with the layout."""
    with TensorReader() as reader:
        for group, keys in _norm_keys(ckpt, family).items():
            means = [float(mx.mean(reader.read(ckpt.tensors[k]).astype(mx.float32))) for k in keys]
            centre = statistics.median(means)
            state = classify_norm(centre)
            report.norms[group] = state
            report.norm_means[group] = round(centre, 4)
            where = (keys[0], ckpt.tensors[keys[0]].file)
            if raw and state != "zero-centred":
                report.add("norm-double-shift", ERROR,
                           f"{group} norms are raw layout but centred near {centre:.2f}: they were already "
                           "shifted, and converting would add 1 a second time", *where)
            elif not raw and state == "zero-centred":
                report.add("norm-unshifted", ERROR,
                           f"{group} norms are MLX layout but centred near {centre:.2f}: the +1 shift is missing",
                           *where)
            elif not raw and state == "double-shifted":
                report.add("norm-double-shift", ERROR,
                           f"{group} norms are centred near {centre:.2f}: +1 was applied twice", *where)


def check_config(ckpt: Checkpoint, spec, report: Report) -> None:
    tc = text_config(ckpt.config)
    if "tie_word_embeddings" not in tc and ckpt.config.get("tie_word_embeddings"):
        report.add("tie-top-level", WARNING,
                   "tie_word_embeddings=true only at the top level; mlx-lm reads text_config and would expect "
                   "an lm_head (mtpconvert writes it into text_config)", "tie_word_embeddings", _config_file(ckpt))
    if report.layout == MLX and ckpt.index_map is not None:
        fmt = ckpt.index_metadata.get("format")
        if fmt not in (None, "mlx"):
            report.add("index-format", WARNING, f"index metadata format is {fmt!r}, expected 'mlx'", "metadata.format",
                       ckpt.root / INDEX_NAME)


def check_kv_b(ckpt, slot, contrib, report) -> None:
    """A raw MLA kv_b_proj, checked against the per-head matrix it is split into (``families.base.kv_b_fits``)."""
    info = ckpt.tensors[contrib.source]
    if not kv_b_fits(info.shape, slot.shape, contrib.part):
        report.add("shape-mismatch", ERROR, f"kv_b_proj shape {list(info.shape)} does not split into {slot.name} "
                   f"{list(slot.shape)}", contrib.source, info.file)


def check_shape(ckpt, slot, key: str, raw_conv: bool, aux, report) -> None:
    """A tensor against its slot's shape (a raw conv1d [C,1,K]; a quantized one by all but its packed axis)."""
    info = ckpt.tensors[key]
    want = fp8.stored_shape(key, ckpt.tensors, slot.shape)  # MXFP4: two codes a byte
    if slot.kind == CONV and raw_conv:
        want = (slot.shape[0], 1, slot.shape[1])
    if aux and "scales" in aux:
        if info.shape[:-1] != want[:-1]:
            report.add("shape-mismatch", ERROR, f"packed shape {list(info.shape)} does not match {list(want)}", key,
                       info.file)
        return
    if info.shape != want:
        report.add("shape-mismatch", ERROR, f"shape {list(info.shape)} does not match the config {list(want)}",
                   key, info.file)
