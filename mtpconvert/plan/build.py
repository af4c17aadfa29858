"""The conversion plan: every output tensor and the rule that makes it.

Built from headers alone (config.json + safetensors headers). It is what
``--dry-run`` prints, what the tests assert on, and what execution streams: the
executor does nothing the plan does not name.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from ..errors import LayoutError, OptionsError
from ..families import family_for
from ..families.base import (BUFFER, FLOAT32_KINDS, KV_B_PARTS, CONV, kv_b_fits, MLX, MTP, NORM, QUANT_AUX, RAW_VLM, SWITCH,
                             VISION, Family, Gather, Mapped, Slot, text_config)
from ..io.checkpoint import INDEX_NAME, MTP_FILE, Checkpoint
from ..io.header import mlx_dtype_name
from ..options import FLOAT_DTYPES, MTP_LAYOUTS, ConvertOptions
from . import fp8
from .head import place_head, sidecar_slot
from .items import Plan, PlanItem, SourceRef
from .output import order_and_shard, output_config
from .quant import QuantSpec, decide, quantization_block
from .steps import Cast, CarryMX, ConvAxis, DequantFP8, DequantMXFP4, Quantize, ShiftNorm, Step, gather_step


FLOAT_SOURCE_DTYPES = ("F32", "F16", "BF16", "F64")
BUFFER_DTYPES = ("I64", "I32")


def default_dtype(ckpt: Checkpoint) -> str:
    tc = text_config(ckpt.config)
    for cfg in (tc, ckpt.config):
        for k in ("dtype", "torch_dtype"):
            if cfg.get(k) in FLOAT_DTYPES:
                return cfg[k]
    return "bfloat16"


def _ref(ckpt: Checkpoint, key: str) -> SourceRef:
    """A source tensor; a quantized one (F8_E4M3, MXFP4) with its scale (``fp8.scale_key``, checked by
    ``fp8.check_scales``)."""
    t = ckpt.tensors[key]
    scale = fp8.scale_key(key, ckpt.tensors) if fp8.may_be_quantized(key, t) else None
    return SourceRef(key, t.file.name, t.shape, t.dtype, _ref(ckpt, scale) if scale else None)


def _stored(ckpt: Checkpoint, key: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return fp8.stored_shape(key, ckpt.tensors, shape)


def _shape_error(ckpt: Checkpoint, key: str, expected, got) -> LayoutError:
    return LayoutError(
        f"shape {list(got)} does not match the config (expected {list(expected)})",
        file=ckpt.tensors[key].file,
        key=key,
    )


def _source_files(ckpt: Checkpoint) -> Dict[str, Path]:
    """Every source key, with the file it is in: read ones, then the index's entries for absent shards."""
    files = {key: info.file for key, info in ckpt.tensors.items()}
    files.update((key, ckpt.root / shard) for key, shard in ckpt.absent.items())
    return files


def _map_all(ckpt: Checkpoint, family: Family) -> List[Mapped]:
    """Every source key's contributions (a fused gate_up gives two), absent ones included: they are
    mapped like any other, so a vision or MTP tensor in a shard the pull skipped is dropped with the
    same reason as one that shares a shard with kept tensors."""
    mapped = []
    scales = fp8.scale_keys(ckpt.tensors, ckpt.absent)
    for key, file in _source_files(ckpt).items():
        if key in scales or fp8.ignored(key):
            continue  # read with its weight, or dropped (build_plan)
        if QUANT_AUX.search(key):
            raise LayoutError(
                "checkpoint is already quantized; convert needs unquantized weights",
                file=file,
                key=key,
                hint="convert the original BF16 release instead",
            )
        try:
            mapped.extend(family.contributions(key))
        except LayoutError as e:
            raise LayoutError(e.detail, file=file, key=key) from None
    return mapped


def _refuse_absent(ckpt: Checkpoint, kept: List[Mapped]) -> None:
    """A tensor the conversion keeps cannot come from a shard that was not fetched. The pull skips only
    shards whose every tensor is dropped under the same options, so this is a caller's mistake."""
    for c in kept:
        if c.source in ckpt.absent:
            raise LayoutError(
                f"the conversion needs this tensor but its shard {ckpt.absent[c.source]} was not fetched",
                file=ckpt.root / INDEX_NAME,
                key=c.source,
                code="shard-missing",
            )


def _gather_switch(ckpt, slot: Slot, contribs: List[Mapped], spec):
    """Sources for one stacked-expert slot: per-expert, fused, or an MLX stack."""
    E = spec.num_experts
    per_expert = [c for c in contribs if c.part is Gather.STACK]
    fused = [c for c in contribs if c.part is not Gather.STACK]
    if per_expert and fused:
        raise LayoutError(
            "experts are given both per expert and fused", file=ckpt.tensors[fused[0].source].file,
            key=fused[0].source,
        )
    if fused:
        (c,) = fused
        shape = ckpt.tensors[c.source].shape
        if c.part is Gather.LOAD:
            if shape != _stored(ckpt, c.source, slot.shape):
                raise _shape_error(ckpt, c.source, _stored(ckpt, c.source, slot.shape), shape)
            return (_ref(ckpt, c.source),), Gather.LOAD
        want = _stored(ckpt, c.source, (slot.shape[0], 2 * slot.shape[1], slot.shape[2]))
        if shape != want:
            raise _shape_error(ckpt, c.source, want, shape)
        ref = _ref(ckpt, c.source)
        if fp8.block_of(ref) and slot.shape[1] % fp8.BLOCK:
            raise LayoutError(f"fused FP8 gate_up_proj whose halves ({slot.shape[1]} rows) do not fall on the "
                              f"{fp8.BLOCK}-row scale grid", file=ckpt.tensors[c.source].file, key=c.source)
        return (ref,), c.part
    by_index: Dict[int, Mapped] = {}
    for c in per_expert:
        by_index[c.index] = c
        shape = ckpt.tensors[c.source].shape
        if shape != _stored(ckpt, c.source, slot.shape[1:]):
            raise _shape_error(ckpt, c.source, _stored(ckpt, c.source, slot.shape[1:]), shape)
        if c.index >= E:
            raise LayoutError(
                f"expert index {c.index} but config has num_experts={E}",
                file=ckpt.tensors[c.source].file, key=c.source,
            )
    missing = [e for e in range(E) if e not in by_index]
    if missing:
        sample = per_expert[0].source
        first = re.sub(r"\.experts\.\d+\.", f".experts.{missing[0]}.", sample)
        raise LayoutError(
            f"missing expert {missing[0]} ({len(missing)} of {E} experts missing for {slot.name})",
            key=first,
        )
    return tuple(_ref(ckpt, by_index[e].source) for e in range(E)), Gather.STACK


def build_plan(ckpt: Checkpoint, opts: ConvertOptions = ConvertOptions()) -> Plan:
    family = family_for(ckpt.config)
    spec = family.spec(ckpt.config)
    quant = opts.quant.validated()
    dtype = opts.dtype or default_dtype(ckpt)
    if dtype not in FLOAT_DTYPES:
        raise OptionsError(f"--dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")

    if opts.mtp_layout not in MTP_LAYOUTS:
        raise OptionsError(f"--mtp-layout must be one of {MTP_LAYOUTS}, got {opts.mtp_layout!r}")
    if opts.mtp_layout not in family.mtp_layouts and quant.mtp != "drop":
        raise OptionsError(f"--mtp-layout {opts.mtp_layout}: {family.title} writes its head only as "
                           f"{' or '.join(family.mtp_layouts)} (docs/transforms.md says why)")
    if opts.max_shard_bytes <= 0:
        raise OptionsError(f"--max-shard-size must be > 0 GB, got {opts.max_shard_bytes / (1 << 30):g}")
    files = _source_files(ckpt)
    fp8.refuse(files)
    fp8.check_scales(ckpt.tensors, files)
    style = family.style_of(files)
    raw = family.norms_zero_centred(ckpt.tensors)
    raw_conv = family.conv_layout_raw(ckpt.tensors)

    contribs: Dict[str, List[Mapped]] = defaultdict(list)
    vision: List[Mapped] = []
    for m in _map_all(ckpt, family):
        if m.target is None:
            vision.append(m)
        else:
            contribs[m.target].append(m)

    dropped: List[Tuple[str, str]] = [(key, fp8.ignored(key)) for key in files if fp8.ignored(key)]
    notes: List[str] = []
    n_mtp = _head_layers(ckpt, family, spec, contribs, dropped, notes, quant.mtp == "drop")
    slots = family.expected_slots(spec, n_mtp)
    if spec.tie_word_embeddings and family.lm_head in contribs:
        dropped += [(c.source, "tie_word_embeddings: lm_head shares embed_tokens") for c in contribs.pop(family.lm_head)]

    _refuse_absent(ckpt, [c for cs in contribs.values() for c in cs] + (vision if opts.keep_vision else []))
    _match_slots(ckpt, family, spec, style, slots, contribs)
    items = [_item(ckpt, slot, contribs[name], spec, (raw, raw_conv), dtype, quant) for name, slot in slots.items()]
    items += _vision_items(ckpt, vision, opts.keep_vision, raw, dtype, dropped)

    # quantization entries name modules as the loader builds them: the sidecar head's as mtp.X,
    # an in-model head's by its stacked switch_mlp module, whatever form its experts are stored in
    sidecar = n_mtp and opts.mtp_layout == "sidecar"
    decisions = {(sidecar_slot(it.slot, family) if sidecar and it.slot.group == MTP else it.slot): it.quant
                 for it in items if it.slot.group != VISION}
    if n_mtp:
        items = place_head(items, opts.mtp_layout, family, spec.num_experts)
    order_and_shard(ckpt, items, opts.max_shard_bytes)
    plan = Plan(
        source=ckpt.root,
        family=family,
        spec=spec,
        style=style,
        raw=raw,
        dtype=dtype,
        options=dataclasses.replace(opts, dtype=dtype, quant=quant),
        items=items,
        dropped=dropped,
        mtp_layers=n_mtp,
        config={},
        shards=sorted({it.shard for it in items}),
        notes=notes,
    )
    plan.config = family.loadable_config(
        output_config(ckpt.config, spec, n_mtp, quantization_block(decisions, quant), opts.keep_vision,
                      family.mtp_count_key))
    if sidecar:
        tc = plan.config.get("text_config", plan.config)
        # read by mtplx (mtp_file) and vllm-mlx (hidden state mode); the head drafts from the
        # hidden state it was trained on
        plan.config["mlx_lm_extra_tensors"] = {"mtp_file": MTP_FILE,
                                               "mtp_tensor_count": sum(len(it.outputs()) for it in plan.head_items)}
        tc["mtp_hidden_state_mode"] = family.head.hidden_state
    return plan


def _head_layers(ckpt: Checkpoint, family: Family, spec, contribs: Dict[str, List[Mapped]],
                 dropped: List[Tuple[str, str]], notes: List[str], drop: bool) -> int:
    """The number of head layers the output keeps; under ``--mtp drop`` the head's sources move to
    ``dropped``. A config without the count takes it from the tensors (said in ``notes``); a head
    that disagrees with the config's count is refused, naming both counts."""
    n_mtp, any_mtp = family.head_layers(contribs)
    if drop:
        for t in [t for t in contribs if family.is_head(t)]:
            dropped += [(c.source, "--mtp drop") for c in contribs.pop(t)]
        return 0
    key = family.mtp_count_key
    if spec.mtp_layers is None and not (any_mtp and n_mtp == 0):
        if n_mtp:
            notes.append(f"config.json has no {key}: {n_mtp} MTP layer(s) found in the tensors, "
                         "written into the output config")
        return n_mtp
    if n_mtp == spec.mtp_layers and not (any_mtp and n_mtp == 0):
        return n_mtp
    if n_mtp == 0 and spec.mtp_layers:
        raise LayoutError(
            f"config.json promises {key}={spec.mtp_layers} but the checkpoint "
            "has no MTP layers" + (" (only partial mtp.* tensors)" if any_mtp else " (no mtp.* tensors)"),
            file=ckpt.root / "config.json",
            hint=f"pass --mtp drop to write {key}: 0, or graft the head with "
            "`mtpconvert add-mtp` from the original release",
        )
    raise LayoutError(
        f"checkpoint has {n_mtp} MTP layer(s) but config.json says "
        f"{key}={spec.mtp_layers}",
        file=ckpt.root / "config.json",
        hint=f"pass --mtp drop to discard the MTP tensors, or fix {key}",
    )


def _match_slots(ckpt: Checkpoint, family: Family, spec, style: str, slots: Dict[str, Slot],
                 contribs: Dict[str, List[Mapped]]) -> None:
    """Every source maps to a slot and every slot has a source; the first of each kind is named."""
    unexpected = [c for t, cs in contribs.items() if t not in slots for c in cs]
    if unexpected:
        c = unexpected[0]
        raise LayoutError(
            f"unexpected tensor: no {spec.model_type} slot for it under this config "
            f"({len(unexpected)} unexpected in total)",
            file=ckpt.tensors[c.source].file,
            key=c.source,
        )
    missing = [s for s in slots if s not in contribs]
    if missing:
        first = slots[missing[0]]
        src = family.source_name(first.name, style)
        if first.kind == SWITCH and style != MLX:
            src = src.replace(".switch_mlp.", ".experts.0.")
        raise LayoutError(
            f"missing tensor for {first.name} ({len(missing)} missing in total)",
            key=src,
            file=ckpt.root,
        )


def _gather_kv_b(ckpt: Checkpoint, slot: Slot, c: Mapped):
    """An MLA kv_b_proj [heads*(nope+v), kv_lora] as the source of embed_q [heads, kv_lora, nope] or
    unembed_out [heads, v, kv_lora]: the other part's width is whatever rows per head remain."""
    shape = ckpt.tensors[c.source].shape
    if not kv_b_fits(shape, slot.shape, c.part):
        raise LayoutError(f"kv_b_proj shape {list(shape)} does not split into {slot.name} {list(slot.shape)}",
                          file=ckpt.tensors[c.source].file, key=c.source)
    return (_ref(ckpt, c.source),), c.part


def _item(ckpt: Checkpoint, slot: Slot, cs: List[Mapped], spec, raw: Tuple[bool, bool], dtype: str,
          quant) -> PlanItem:
    """One slot's item: its sources (shapes checked against the config), steps and quantization; ``raw``: (norms
    zero-centred, conv1d weights raw)."""
    if slot.kind == SWITCH:
        sources, gather = _gather_switch(ckpt, slot, cs, spec)
    elif len(cs) == 1 and cs[0].part in KV_B_PARTS:
        sources, gather = _gather_kv_b(ckpt, slot, cs[0])
    elif len(cs) == 1 and cs[0].part is Gather.GROUPS:
        sources, gather = _gather_groups(ckpt, slot, cs[0])
    else:
        if len(cs) != 1 or cs[0].part is not Gather.LOAD:
            raise LayoutError(f"{len(cs)} source tensors map to {slot.name}", key=cs[0].source)
        key = cs[0].source
        shape = ckpt.tensors[key].shape
        want = _stored(ckpt, key, slot.shape)
        if slot.kind == CONV and raw[1]:
            want = (slot.shape[0], 1, slot.shape[1])
        if shape != want:
            raise _shape_error(ckpt, key, want, shape)
        sources, gather = (_ref(ckpt, key),), Gather.LOAD
    forms = {(fp8.form_of(s), s.scale.dtype if s.scale else None) for s in sources}
    if len(forms) > 1:
        raise LayoutError(f"the sources of {slot.name} mix quantized forms (FP8 block or per tensor, MXFP4, their "
                          "scale dtypes, none): each must be read the same way", file=ckpt.tensors[sources[0].key].file,
                          key=sources[0].key)
    kinds = BUFFER_DTYPES if slot.kind == BUFFER else FLOAT_SOURCE_DTYPES
    for s in sources:
        if s.dtype not in kinds and s.scale is None:
            raise LayoutError(f"expected {'an integer' if slot.kind == BUFFER else 'a floating-point'} tensor, "
                              f"found {s.dtype}", file=ckpt.tensors[s.key].file, key=s.key)
    if slot.kind == BUFFER:  # carried as stored: the model computes it from its config, no cast
        dtype = mlx_dtype_name(sources[0].dtype)
    q = decide(slot, quant)
    carry = fp8.carried(sources[0], q)
    steps = (_carry_steps(gather, carry) if carry is not None
             else _steps(slot, sources, gather, raw[0], dtype, q, raw[1]))
    return PlanItem(slot, sources, gather, steps, _out_dtype(slot, dtype), carry or q)


def _carry_steps(gather: Gather, carry: QuantSpec) -> Tuple[Step, ...]:
    """The steps of a source carried into MLX's format as it is stored (``fp8.carried``): its gather, the view."""
    recorded = gather_step(gather)
    return ((recorded,) if recorded is not None else ()) + (CarryMX(carry.mode),)


def _gather_groups(ckpt: Checkpoint, slot: Slot, c: Mapped):
    """A grouped projection stored as one [G * R, C] matrix, the source of the [G, R, C] slot."""
    shape = ckpt.tensors[c.source].shape
    form = (slot.shape[0] * slot.shape[1], slot.shape[2]) if len(slot.shape) == 3 else None
    want = _stored(ckpt, c.source, form) if form else None
    if shape != want:
        raise _shape_error(ckpt, c.source, want, shape)
    return (_ref(ckpt, c.source),), Gather.GROUPS


def _vision_items(ckpt: Checkpoint, vision: List[Mapped], keep: bool, raw: bool, dtype: str,
                  dropped: List[Tuple[str, str]]) -> List[PlanItem]:
    """The vision tower under mlx-vlm's names with ``--keep-vision``; otherwise its sources are dropped."""
    if keep and not vision:
        raise OptionsError("--keep-vision: the source has no vision tower (no model.visual.* tensors)",
                           file=ckpt.root)
    items = []
    for m in vision:
        if not keep:
            dropped.append((m.source, "vision tower (use --keep-vision)"))
            continue
        t = ckpt.tensors[m.source]
        patch = m.vision.endswith("patch_embed.proj.weight") and len(t.shape) == 5
        gather = Gather.VISION_PATCH if patch else Gather.LOAD
        shape = (t.shape[0], *t.shape[2:], t.shape[1]) if patch else t.shape
        slot = Slot(m.vision, tuple(shape), "vision", VISION)
        sources = (_ref(ckpt, m.source),)
        items.append(PlanItem(slot, sources, gather, _steps(slot, sources, gather, raw, dtype, None), dtype, None))
    return items


def _out_dtype(slot: Slot, dtype: str) -> str:
    return "float32" if slot.kind in FLOAT32_KINDS else dtype


def _steps(slot: Slot, sources: Tuple[SourceRef, ...], gather: Gather, raw: bool, dtype: str,
           q: Optional[QuantSpec], raw_conv: Optional[bool] = None) -> Tuple[Step, ...]:
    steps: List[Step] = []
    if fp8.form_of(sources[0]) == fp8.MXFP4:
        steps.append(DequantMXFP4())
    elif sources[0].scale is not None:
        steps.append(DequantFP8(fp8.block_of(sources[0])))
    if (recorded := gather_step(gather)) is not None:
        steps.append(recorded)
    if slot.kind == CONV and (raw if raw_conv is None else raw_conv):
        steps.append(ConvAxis())
    if slot.kind == NORM and raw:
        steps.append(ShiftNorm())
    steps.append(Cast(_out_dtype(slot, dtype)))
    if q is not None:
        steps.append(Quantize(q))
    return tuple(steps)
