"""The conversion plan: every output tensor and the rule that makes it.

Built from headers alone (config.json + safetensors headers). It is what
``--dry-run`` prints, what the tests assert on, and what execution streams: the
executor does nothing the plan does not name.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import LayoutError, OptionsError
from ..io.checkpoint import INDEX_NAME, MTP_FILE, Checkpoint
from ..io.header import dtype_itemsize
from ..io.shard_writer import TensorSpec
from ..model.keys import MLX, QUANT_AUX, RAW_VLM, Gather, Mapped, contributions, key_style, source_name
from ..model.slots import A_LOG, CONV, LINEAR, LM, MTP, NORM, SWITCH, VISION, Slot, expected_slots
from ..model.spec import ModelSpec, model_spec, text_config
from ..options import FLOAT_DTYPES, MTP_LAYOUTS, ConvertOptions
from .quant import QuantSpec, decide, quantization_block
from .steps import Cast, ConvAxis, Quantize, ShiftNorm, Step, gather_step

MTP_LAYER = re.compile(r"^language_model\.mtp\.layers\.(\d+)\.")

# The sidecar layout (options.MTP_LAYOUTS): the head in its own root file under mtp.* names,
# the same bytes linked where vllm-mlx looks, and the manifest vllm-mlx reads to take the
# norms as stored. Never named model*.safetensors: mlx-lm 0.30.7-0.31.x loads that glob and
# shifts every backbone norm again when any of its keys contains "mtp.".
MTP_LINK = "mtp/weights.safetensors"
MTP_MANIFEST = "mtp/manifest.json"
MTP_MANIFEST_BODY = {"artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma"}
SIDECAR_PREFIX = "mtp."


@dataclass(frozen=True)
class SourceRef:
    key: str
    file: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors dtype (BF16, F32, ...)


@dataclass
class PlanItem:
    """One output tensor (and its .scales/.biases when quantized)."""

    slot: Slot
    sources: Tuple[SourceRef, ...]
    gather: Gather
    steps: Tuple[Step, ...]  # the transform chain, in order
    dtype: str
    quant: Optional[QuantSpec]
    shard: str = ""

    @property
    def name(self) -> str:
        return self.slot.name

    def outputs(self) -> List[TensorSpec]:
        shape = self.slot.shape
        if self.quant is None:
            return [TensorSpec(self.name, self.dtype, shape)]
        q = self.quant
        scale_dtype = self.dtype if q.mode == "affine" else "uint8"
        module = self.slot.module
        out = [
            TensorSpec(module + ".weight", "uint32", q.packed_shape(shape)),
            TensorSpec(module + ".scales", scale_dtype, q.scales_shape(shape)),
        ]
        if q.has_biases:
            out.append(TensorSpec(module + ".biases", scale_dtype, q.scales_shape(shape)))
        return out

    @property
    def out_bytes(self) -> int:
        return sum(s.nbytes for s in self.outputs())

    @property
    def in_bytes(self) -> int:
        return sum(math.prod(s.shape) * dtype_itemsize(s.dtype) for s in self.sources)


@dataclass
class Plan:
    source: Path
    spec: ModelSpec
    style: str  # raw-vlm / raw-text / mlx
    raw: bool  # norms zero-centred in the source (decided once, from conv1d shapes)
    dtype: str
    options: ConvertOptions
    items: List[PlanItem]
    dropped: List[Tuple[str, str]]  # (source key, reason)
    mtp_layers: int  # kept in the output
    config: dict  # config.json to write
    shards: List[str] = field(default_factory=list)

    def by_group(self) -> Dict[str, List[PlanItem]]:
        out: Dict[str, List[PlanItem]] = defaultdict(list)
        for item in self.items:
            out[item.slot.group].append(item)
        return dict(out)

    @property
    def head_items(self) -> List[PlanItem]:
        return [it for it in self.items if it.slot.group == MTP]

    @property
    def model_shards(self) -> List[str]:
        """The shards the index lists (everything but the MTP sidecar)."""
        return [s for s in self.shards if s != MTP_FILE]

    def source_files(self) -> List[str]:
        return sorted({s.file for it in self.items for s in it.sources})

    def to_json(self) -> dict:
        return {
            "source": str(self.source),
            "model_type": self.spec.model_type,
            "layout": self.style,
            "norm_shift": self.raw,
            "dtype": self.dtype,
            "mtp_layers": self.mtp_layers,
            "mtp_policy": self.options.quant.mtp,
            "mtp_layout": self.options.mtp_layout if self.mtp_layers else None,
            "quantization": self.config.get("quantization"),
            "shards": self.shards,
            "dropped": [{"key": k, "reason": r} for k, r in self.dropped],
            "tensors": [
                {
                    "name": it.name,
                    "group": it.slot.group,
                    "kind": it.slot.kind,
                    "sources": [s.key for s in it.sources],
                    "source_files": sorted({s.file for s in it.sources}),
                    "steps": [s.label for s in it.steps],
                    "shape": list(it.slot.shape),
                    "dtype": it.dtype,
                    "quant": it.quant.as_config() if it.quant else None,
                    "shard": it.shard,
                    "outputs": [{"key": o.key, "dtype": o.dtype, "shape": list(o.shape)} for o in it.outputs()],
                }
                for it in self.items
            ],
        }


def detect_style(keys) -> str:
    styles = {key_style(k) for k in keys} - {""}
    if len(styles) > 1:
        raise LayoutError(
            f"checkpoint mixes key namespaces ({', '.join(sorted(styles))}); "
            "expected either raw Hugging Face or MLX names"
        )
    return styles.pop() if styles else RAW_VLM


def detect_raw(ckpt: Checkpoint) -> bool:
    """True when norms are zero-centred: the raw conv1d layout [C, 1, K] says so.

    Decided once for the whole checkpoint, from every conv1d tensor, exactly like
    mlx-lm's sanitize, so no shard is shifted differently from another.
    """
    convs = {k: t.shape for k, t in ckpt.tensors.items() if k.endswith("linear_attn.conv1d.weight")}
    flags = {k: len(s) == 3 and s[-1] != 1 for k, s in convs.items()}
    if flags and len(set(flags.values())) > 1:
        raw_one = next(k for k, v in flags.items() if v)
        mlx_one = next(k for k, v in flags.items() if not v)
        raise LayoutError(
            f"conv1d weights disagree on layout: {raw_one} is raw [C,1,K] but {mlx_one} is "
            "MLX [C,K,1]; the checkpoint was partly converted",
            file=ckpt.tensors[raw_one].file,
            key=raw_one,
        )
    return any(flags.values())


def default_dtype(ckpt: Checkpoint) -> str:
    tc = text_config(ckpt.config)
    for cfg in (tc, ckpt.config):
        for k in ("dtype", "torch_dtype"):
            if cfg.get(k) in FLOAT_DTYPES:
                return cfg[k]
    return "bfloat16"


def count_mtp_layers(targets) -> Tuple[int, bool]:
    """(number of MTP decoder layers, whether any mtp.* tensor exists)."""
    idx = {int(m.group(1)) for t in targets if (m := MTP_LAYER.match(t))}
    any_mtp = any(t.startswith(LM + "mtp.") for t in targets)
    return (max(idx) + 1 if idx else 0), any_mtp


def _ref(ckpt: Checkpoint, key: str) -> SourceRef:
    t = ckpt.tensors[key]
    return SourceRef(key, t.file.name, t.shape, t.dtype)


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


def _map_all(ckpt: Checkpoint) -> List[Mapped]:
    """Every source key's contributions (a fused gate_up gives two), absent ones included: they are
    mapped like any other, so a vision or MTP tensor in a shard the pull skipped is dropped with the
    same reason as one that shares a shard with kept tensors."""
    mapped = []
    for key, file in _source_files(ckpt).items():
        if QUANT_AUX.search(key):
            raise LayoutError(
                "checkpoint is already quantized; convert needs unquantized weights",
                file=file,
                key=key,
                hint="convert the original BF16 release instead",
            )
        try:
            mapped.extend(contributions(key))
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


def _gather_switch(ckpt, slot: Slot, contribs: List[Mapped], spec: ModelSpec):
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
            if shape != slot.shape:
                raise _shape_error(ckpt, c.source, slot.shape, shape)
            return (_ref(ckpt, c.source),), Gather.LOAD
        want = (slot.shape[0], 2 * slot.shape[1], slot.shape[2])
        if shape != want:
            raise _shape_error(ckpt, c.source, want, shape)
        return (_ref(ckpt, c.source),), c.part
    by_index: Dict[int, Mapped] = {}
    for c in per_expert:
        by_index[c.index] = c
        shape = ckpt.tensors[c.source].shape
        if shape != slot.shape[1:]:
            raise _shape_error(ckpt, c.source, slot.shape[1:], shape)
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
    spec = model_spec(ckpt.config)
    quant = opts.quant.validated()
    dtype = opts.dtype or default_dtype(ckpt)
    if dtype not in FLOAT_DTYPES:
        raise OptionsError(f"--dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")

    if opts.mtp_layout not in MTP_LAYOUTS:
        raise OptionsError(f"--mtp-layout must be one of {MTP_LAYOUTS}, got {opts.mtp_layout!r}")
    if opts.max_shard_bytes <= 0:
        raise OptionsError(f"--max-shard-size must be > 0 GB, got {opts.max_shard_bytes / (1 << 30):g}")
    style = detect_style(_source_files(ckpt))
    raw = detect_raw(ckpt)
    mapped = _map_all(ckpt)

    contribs: Dict[str, List[Mapped]] = defaultdict(list)
    vision: List[Mapped] = []
    for m in mapped:
        if m.target is None:
            vision.append(m)
        else:
            contribs[m.target].append(m)

    n_mtp, any_mtp = count_mtp_layers(contribs)
    dropped: List[Tuple[str, str]] = []
    if quant.mtp == "drop":
        for t in [t for t in contribs if t.startswith(LM + "mtp.")]:
            dropped += [(c.source, "--mtp drop") for c in contribs.pop(t)]
        n_mtp = 0
    elif n_mtp != spec.mtp_layers or (any_mtp and n_mtp == 0):
        if n_mtp == 0 and spec.mtp_layers > 0:
            raise LayoutError(
                f"config.json promises mtp_num_hidden_layers={spec.mtp_layers} but the checkpoint "
                "has no MTP layers" + (" (only partial mtp.* tensors)" if any_mtp else " (no mtp.* tensors)"),
                file=ckpt.root / "config.json",
                hint="pass --mtp drop to write mtp_num_hidden_layers: 0, or graft the head with "
                "`mtpconvert add-mtp` from the original release",
            )
        raise LayoutError(
            f"checkpoint has {n_mtp} MTP layer(s) but config.json says "
            f"mtp_num_hidden_layers={spec.mtp_layers}",
            file=ckpt.root / "config.json",
            hint="pass --mtp drop to discard the MTP tensors, or fix mtp_num_hidden_layers",
        )

    slots = expected_slots(spec, n_mtp)
    if spec.tie_word_embeddings and (LM + "lm_head.weight") in contribs:
        dropped += [(c.source, "tie_word_embeddings: lm_head shares embed_tokens") for c in contribs.pop(LM + "lm_head.weight")]

    _refuse_absent(ckpt, [c for cs in contribs.values() for c in cs] + (vision if opts.keep_vision else []))
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
        src = source_name(first.name, style)
        if first.kind == SWITCH and style != MLX:
            src = src.replace(".switch_mlp.", ".experts.0.")
        raise LayoutError(
            f"missing tensor for {first.name} ({len(missing)} missing in total)",
            key=src,
            file=ckpt.root,
        )

    items: List[PlanItem] = []
    for name, slot in slots.items():
        cs = contribs[name]
        if slot.kind == SWITCH:
            sources, gather = _gather_switch(ckpt, slot, cs, spec)
        else:
            if len(cs) != 1 or cs[0].part is not Gather.LOAD:
                raise LayoutError(f"{len(cs)} source tensors map to {name}", key=cs[0].source)
            key = cs[0].source
            shape = ckpt.tensors[key].shape
            want = slot.shape
            if slot.kind == CONV and raw:
                want = (slot.shape[0], 1, slot.shape[1])
            if shape != want:
                raise _shape_error(ckpt, key, want, shape)
            sources, gather = (_ref(ckpt, key),), Gather.LOAD
        for s in sources:
            if s.dtype not in ("F32", "F16", "BF16", "F64"):
                raise LayoutError(f"expected a floating-point tensor, found {s.dtype}",
                                  file=ckpt.tensors[s.key].file, key=s.key)
        q = decide(slot, quant)
        items.append(PlanItem(slot, sources, gather, _steps(slot, gather, raw, dtype, q), _out_dtype(slot, dtype), q))

    if opts.keep_vision and not vision:
        raise OptionsError("--keep-vision: the source has no vision tower (no model.visual.* tensors)",
                           file=ckpt.root)
    for m in vision:
        if not opts.keep_vision:
            dropped.append((m.source, "vision tower (use --keep-vision)"))
            continue
        t = ckpt.tensors[m.source]
        patch = m.vision.endswith("patch_embed.proj.weight") and len(t.shape) == 5
        gather = Gather.VISION_PATCH if patch else Gather.LOAD
        shape = (t.shape[0], *t.shape[2:], t.shape[1]) if patch else t.shape
        slot = Slot(m.vision, tuple(shape), "vision", VISION)
        items.append(PlanItem(slot, (_ref(ckpt, m.source),), gather, _steps(slot, gather, raw, dtype, None), dtype, None))

    # quantization entries name modules as the loader builds them: the sidecar head's as mtp.X,
    # an in-model head's by its stacked switch_mlp module, whatever form its experts are stored in
    sidecar = n_mtp and opts.mtp_layout == "sidecar"
    decisions = {(_sidecar_slot(it.slot) if sidecar and it.slot.group == MTP else it.slot): it.quant
                 for it in items if it.slot.group != VISION}
    if n_mtp:
        items = place_head(items, opts.mtp_layout, spec.num_experts)
    _order_and_shard(ckpt, items, opts.max_shard_bytes)
    plan = Plan(
        source=ckpt.root,
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
    )
    plan.config = output_config(ckpt.config, spec, n_mtp, quantization_block(decisions, quant), opts.keep_vision)
    if sidecar:
        tc = plan.config.get("text_config", plan.config)
        # read by mtplx (mtp_file) and vllm-mlx (hidden state mode); the head drafts from the
        # post-final-norm hidden state, as it was trained
        plan.config["mlx_lm_extra_tensors"] = {"mtp_file": MTP_FILE,
                                               "mtp_tensor_count": sum(len(it.outputs()) for it in plan.head_items)}
        tc["mtp_hidden_state_mode"] = "post_norm"
    return plan


def place_head(items: List[PlanItem], layout: str, num_experts: int) -> List[PlanItem]:
    """Name the head's items for ``layout``.

    sidecar: ``language_model.mtp.X`` -> ``mtp.X`` in ``mtp.safetensors`` (what mlx-vlm, mtplx,
    rapid-mlx and vllm-mlx read). in-model: the names stay; a float MoE head is written in the
    raw per-expert form (one ``experts.{e}.{proj}.weight`` per expert), the only expert form the
    mlx-lm PR #990 branch stacks itself -- it raises on a stacked ``switch_mlp`` head.
    """
    out: List[PlanItem] = []
    for it in items:
        if it.slot.group != MTP:
            out.append(it)
        elif layout == "sidecar":
            out.append(dataclasses.replace(it, slot=_sidecar_slot(it.slot), shard=MTP_FILE))
        elif it.slot.kind == SWITCH and it.quant is None:
            out.extend(_raw_experts(it, num_experts))
        else:
            out.append(it)
    return out


def _sidecar_slot(slot: Slot) -> Slot:
    return dataclasses.replace(slot, name=SIDECAR_PREFIX + slot.name[len(LM + "mtp."):])


def _raw_experts(item: PlanItem, num_experts: int) -> List[PlanItem]:
    """A float expert stack of the head in the source's raw form: per expert when the source is
    per expert, the fused ``experts.gate_up_proj`` / ``experts.down_proj`` when it is fused (the
    up half is dropped: the gate half's item writes the whole fused tensor). An MLX stack stays."""
    mlp = item.slot.name.rsplit(".switch_mlp.", 1)[0]
    (src, *_) = item.sources
    if item.gather is Gather.STACK:
        return _per_expert(item, num_experts)
    if item.gather is Gather.UP_HALF:
        return []
    if item.gather is Gather.GATE_HALF or ".experts.down_proj" in src.key:
        name = f"{mlp}.experts.{'gate_up_proj' if item.gather is Gather.GATE_HALF else 'down_proj'}"
        steps = tuple(s for s in item.steps if s != gather_step(item.gather))
        return [PlanItem(Slot(name, src.shape, LINEAR, MTP), (src,), Gather.LOAD, steps, item.dtype, None)]
    return [item]


def _per_expert(item: PlanItem, num_experts: int) -> List[PlanItem]:
    """A float stacked-expert item whose sources are per expert -> one item per expert."""
    mlp, proj = item.slot.name.rsplit(".switch_mlp.", 1)
    steps = tuple(s for s in item.steps if gather_step(Gather.STACK) != s)
    return [PlanItem(Slot(f"{mlp}.experts.{e}.{proj}", item.slot.shape[1:], LINEAR, MTP),
                     (item.sources[e],), Gather.LOAD, steps, item.dtype, None)
            for e in range(num_experts)]


def _out_dtype(slot: Slot, dtype: str) -> str:
    return "float32" if slot.kind == A_LOG else dtype


def _steps(slot: Slot, gather: Gather, raw: bool, dtype: str, q: Optional[QuantSpec]) -> Tuple[Step, ...]:
    steps: List[Step] = []
    if (recorded := gather_step(gather)) is not None:
        steps.append(recorded)
    if slot.kind == CONV and raw:
        steps.append(ConvAxis())
    if slot.kind == NORM and raw:
        steps.append(ShiftNorm())
    steps.append(Cast(_out_dtype(slot, dtype)))
    if q is not None:
        steps.append(Quantize(q))
    return tuple(steps)


def natural_key(name: str) -> Tuple:
    """``name`` with its digit runs as numbers: ``layers.2`` sorts before ``layers.10``."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name)))


def _order_and_shard(ckpt: Checkpoint, items: List[PlanItem], max_bytes: int) -> None:
    """Order work by source shard (so each raw shard is finished early) and assign output shards."""
    shard_index = {name: i for i, name in enumerate(ckpt.shards)}

    def key(item: PlanItem):
        # within a source shard, by name with numbers compared as numbers (layers 2 before 10): the
        # output shards then hold layers in order, so the streamed smoke (runtime.streamed) can run
        # each layer as its shard is finished instead of holding shards for a layer to come
        return (max(shard_index[s.file] for s in item.sources), natural_key(item.name))

    items.sort(key=key)
    groups: List[List[PlanItem]] = [[]]
    size = 0
    for item in items:
        if item.shard == MTP_FILE:
            continue
        b = item.out_bytes
        if groups[-1] and size + b > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += b
    n = len(groups)
    for i, group in enumerate(groups):
        for item in group:
            item.shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def output_config(config: dict, spec: ModelSpec, mtp_layers: int, quantization, keep_vision: bool) -> dict:
    """config.json for the output: loadable by stock mlx-lm, honest about MTP and quantization."""
    out = copy.deepcopy(config)
    # a converted source's head placement is re-decided by this conversion's layout
    for k in ("quantization", "quantization_config", "mlx_lm_extra_tensors"):
        out.pop(k, None)
    tc = out["text_config"] if "text_config" in out else out
    tc.pop("quantization_config", None)
    tc.pop("mtp_hidden_state_mode", None)
    tc["mtp_num_hidden_layers"] = mtp_layers
    tc["tie_word_embeddings"] = spec.tie_word_embeddings
    if "text_config" in out:
        out["tie_word_embeddings"] = spec.tie_word_embeddings
        if not keep_vision:
            out.pop("vision_config", None)
    out["model_type"] = spec.model_type
    if quantization is not None:
        out["quantization"] = quantization
        out["quantization_config"] = copy.deepcopy(quantization)
    return out
