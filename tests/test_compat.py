"""mtpconvert.compat: per-runtime compatibility from config + safetensors headers.

Every folder here is written as real (tiny, zero-filled) safetensors files, and most tests
compare two folders that differ in one property only, asserting opposite verdicts -- so a rule
that ignored that property would fail. The rules were checked against the runtimes themselves
(docs/interop.md; interop/notes-mtplx-rapid-vllm.md for mtplx, rapid-mlx and vllm-mlx).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from mtpconvert.compat import (PRECISION, RUNTIMES, Folder, check_folder, compat, precision_warnings, read_folder,
                               read_header, render)

H, HEADS, HEAD_DIM, KV, INTER = 64, 2, 32, 1, 128
E, MOE_INTER, SHARED = 4, 64, 64
BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}

Spec = Tuple[str, tuple]  # (dtype, shape)


# ----------------------------------------------------------------------------- folder builder


def write_st(path: Path, tensors: Dict[str, Spec], fmt: Optional[str] = "mlx") -> None:
    """A valid safetensors file of zeros (header + data)."""
    header, off = {}, 0
    for k, (dt, shape) in sorted(tensors.items()):
        n = BYTES[dt]
        for s in shape:
            n *= s
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    if fmt is not None:
        header["__metadata__"] = {"format": fmt}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(off))


def linear(name: str, out: int, ind: int, bits: Optional[int] = None, group: int = 32) -> Dict[str, Spec]:
    if bits is None:
        return {f"{name}.weight": ("F32", (out, ind))}
    return {f"{name}.weight": ("U32", (out, ind * bits // 32)), f"{name}.scales": ("F16", (out, ind // group)),
            f"{name}.biases": ("F16", (out, ind // group))}


def backbone(raw: bool = False, prefix: str = "language_model.") -> Dict[str, Spec]:
    conv = (192, 1, 4) if raw else (192, 4, 1)
    return {f"{prefix}model.embed_tokens.weight": ("F32", (512, H)),
            f"{prefix}model.norm.weight": ("F32", (H,)),
            f"{prefix}model.layers.0.input_layernorm.weight": ("F32", (H,)),
            f"{prefix}model.layers.0.linear_attn.conv1d.weight": ("F32", conv),
            f"{prefix}lm_head.weight": ("F32", (512, H))}


def head(prefix: str = "mtp.", bits: Optional[int] = None, group: int = 32, moe: Optional[str] = None,
         fc_bits: Optional[int] = None, layers: int = 1, only: Optional[Tuple[str, ...]] = None,
         routers: Tuple[Optional[int], Optional[int]] = (None, None)) -> Dict[str, Spec]:
    """An MTP head under ``prefix``: fc never quantized unless fc_bits; moe: stacked|per-expert|fused.
    ``only``: quantize just the layer modules whose names end so (as where a group size leaves the
    others unquantizable); ``routers``: bits of (mlp.gate, mlp.shared_expert_gate), float when None."""

    def lin(name, out, ind, bits_=bits):
        return linear(name, out, ind, bits_ if only is None or name.endswith(only) else None, group)

    def stk(name, out, ind):
        return {k: (dt, (E,) + shape) for k, (dt, shape) in lin(name, out, ind).items()}

    t: Dict[str, Spec] = {}
    t.update(linear("fc", H, 2 * H, fc_bits, group))
    for n in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        t[f"{n}.weight"] = ("F32", (H,))
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"] = ("F32", (H,))
        t[p + "self_attn.q_norm.weight"] = ("F32", (HEAD_DIM,))
        t[p + "self_attn.k_norm.weight"] = ("F32", (HEAD_DIM,))
        t.update(lin(p + "self_attn.q_proj", 2 * HEADS * HEAD_DIM, H))
        t.update(lin(p + "self_attn.k_proj", KV * HEAD_DIM, H))
        t.update(lin(p + "self_attn.v_proj", KV * HEAD_DIM, H))
        t.update(lin(p + "self_attn.o_proj", H, HEADS * HEAD_DIM))
        if moe is None:
            t.update(lin(p + "mlp.gate_proj", INTER, H))
            t.update(lin(p + "mlp.up_proj", INTER, H))
            t.update(lin(p + "mlp.down_proj", H, INTER))
            continue
        t.update(linear(p + "mlp.gate", E, H, routers[0], group))
        t.update(linear(p + "mlp.shared_expert_gate", 1, H, routers[1], group))
        t.update(lin(p + "mlp.shared_expert.gate_proj", SHARED, H))
        t.update(lin(p + "mlp.shared_expert.up_proj", SHARED, H))
        t.update(lin(p + "mlp.shared_expert.down_proj", H, SHARED))
        if moe == "stacked":
            t.update(stk(p + "mlp.switch_mlp.gate_proj", MOE_INTER, H))
            t.update(stk(p + "mlp.switch_mlp.up_proj", MOE_INTER, H))
            t.update(stk(p + "mlp.switch_mlp.down_proj", H, MOE_INTER))
        elif moe == "per-expert":
            for e in range(E):
                t.update(lin(f"{p}mlp.experts.{e}.gate_proj", MOE_INTER, H))
                t.update(lin(f"{p}mlp.experts.{e}.up_proj", MOE_INTER, H))
                t.update(lin(f"{p}mlp.experts.{e}.down_proj", H, MOE_INTER))
        elif moe == "fused":
            t[p + "mlp.experts.gate_up_proj"] = ("F32", (E, 2 * MOE_INTER, H))
            t[p + "mlp.experts.down_proj"] = ("F32", (E, H, MOE_INTER))
    return {prefix + k: v for k, v in t.items()}


def config(moe: bool = False, mtp_layers: int = 1, quant: Optional[dict] = None, **extra) -> dict:
    tc = dict(model_type="qwen3_5_text", hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
              head_dim=HEAD_DIM, intermediate_size=INTER, mtp_num_hidden_layers=mtp_layers, vocab_size=512)
    if moe:
        tc.update(num_experts=E, moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=SHARED)
    cfg = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": tc}
    if quant is not None:
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    cfg.update(extra)
    return cfg


def make(tmp: Path, name: str, files: Dict[str, Dict[str, Spec]], cfg: dict, index: Optional[Dict] = "auto",
         fmt: Dict[str, Optional[str]] = None, manifest: Optional[dict] = None) -> Path:
    """Write a folder: files {relative name: tensors}; index "auto" = the model*-shards' keys only."""
    d = tmp / name
    d.mkdir(parents=True)
    for rel, tensors in files.items():
        write_st(d / rel, tensors, (fmt or {}).get(rel, "mlx"))
    (d / "config.json").write_text(json.dumps(cfg))
    if index == "auto":
        index = {k: rel for rel, t in files.items() if rel.startswith("model") and "mtp" not in rel for k in t}
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if manifest is not None:
        (d / "mtp").mkdir(exist_ok=True)
        (d / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    return d


SHARD = "model-00001-of-00001.safetensors"


def in_model(tmp, name="in-model", moe=None, bits=None, quant=None, cfg_extra=None, raw=False):
    files = {SHARD: {**backbone(raw), **head("language_model.mtp.", bits=bits, moe=moe)}}
    return check_folder(make(tmp, name, files, config(moe=moe is not None, quant=quant, **(cfg_extra or {}))))


def sidecar(tmp, name="sidecar", side="mtp.safetensors", prefix="mtp.", moe=None, bits=None, fc_bits=None,
            quant=None, fmt="mlx", index="auto", cfg_extra=None, manifest=None, group=32):
    files = {SHARD: backbone(), side: head(prefix, bits=bits, moe=moe, fc_bits=fc_bits, group=group)}
    extra = {"mlx_lm_extra_tensors": {"mtp_file": side}} if side == "mtp.safetensors" else {}
    extra.update(cfg_extra or {})
    if index == "lists-sidecar":
        index = {k: rel for rel, t in files.items() for k in t}
    return check_folder(make(tmp, name, files, config(moe=moe is not None, quant=quant, **extra), index=index,
                             fmt={side: fmt}, manifest=manifest))


def ok(rep, rt):
    r = rep.get(rt)
    return r.backbone_exact.ok, r.head_usable.ok


Q4 = {"bits": 4, "group_size": 32, "mode": "affine"}


def mtp8_entries(prefix: str, moe: bool = False) -> dict:
    mods = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    mods += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return {f"{prefix}layers.0.{m}": {"bits": 8, "group_size": 32, "mode": "affine"} for m in mods}


# ----------------------------------------------------------------------------- stock mlx-lm


def test_in_model_head_double_shifts_only_mlx_lm_before_032(tmp_path):
    inm, side = in_model(tmp_path), sidecar(tmp_path)
    assert ok(inm, "mlx-lm<0.32") == (False, False)
    assert "second time" in inm.get("mlx-lm<0.32").backbone_exact.reason
    assert ok(side, "mlx-lm<0.32") == (True, False)
    assert ok(inm, "mlx-lm>=0.32") == (True, False) and ok(side, "mlx-lm>=0.32") == (True, False)
    assert inm.layout == "in-model" and side.layout == "sidecar"


def test_raw_checkpoint_single_shift_is_the_right_one(tmp_path):
    # the same keys with a [C,1,K] conv1d: a raw HF checkpoint, whose one shift is intended
    assert ok(in_model(tmp_path, "raw", raw=True), "mlx-lm<0.32")[0] is True
    assert ok(in_model(tmp_path, "mlx", raw=False), "mlx-lm<0.32")[0] is False


def test_model_mtp_sidecar_name_is_globbed_by_mlx_lm(tmp_path):
    glob_hit = sidecar(tmp_path, "a", side="model-mtp.safetensors")
    no_hit = sidecar(tmp_path, "b", side="mtp.safetensors")
    assert ok(glob_hit, "mlx-lm<0.32")[0] is False and "model-mtp.safetensors" in glob_hit.get(
        "mlx-lm<0.32").backbone_exact.reason
    assert ok(no_hit, "mlx-lm<0.32")[0] is True


# ----------------------------------------------------------------------------- mlx-vlm


def test_mlx_vlm_finds_only_top_level_mtp_keys(tmp_path):
    assert ok(in_model(tmp_path), "mlx-vlm") == (True, False)
    assert "language_model.mtp" in in_model(tmp_path, "x").get("mlx-vlm").head_usable.reason
    assert ok(sidecar(tmp_path), "mlx-vlm") == (True, True)
    assert ok(sidecar(tmp_path, "lm-prefixed", prefix="language_model.mtp."), "mlx-vlm")[1] is False


def test_mlx_vlm_needs_format_mlx_on_an_mlx_head(tmp_path):
    assert ok(sidecar(tmp_path, "mlx", fmt="mlx"), "mlx-vlm")[1] is True
    no_fmt = sidecar(tmp_path, "pt", fmt=None)
    assert ok(no_fmt, "mlx-vlm")[1] is False and "+1" in no_fmt.get("mlx-vlm").head_usable.reason
    assert ok(sidecar(tmp_path, "pt2", fmt="pt"), "mlx-vlm")[1] is False


def test_mlx_vlm_index_listing_of_the_sidecar_is_harmless(tmp_path):
    unlisted = sidecar(tmp_path, "u")
    listed = sidecar(tmp_path, "l", index="lists-sidecar")
    noindex = sidecar(tmp_path, "n", index=None)
    for rep in (unlisted, listed, noindex):
        assert ok(rep, "mlx-vlm") == (True, True)
    assert "index weight_map" in listed.get("mlx-vlm").head_usable.reason
    assert "scan" in unlisted.get("mlx-vlm").head_usable.reason


def test_mlx_vlm_quantized_head_reads_mtp_prefixed_entries(tmp_path):
    assert ok(sidecar(tmp_path, "q4", bits=4, quant=dict(Q4)), "mlx-vlm")[1] is True
    good = sidecar(tmp_path, "q8-mtp", bits=8, quant={**Q4, **mtp8_entries("mtp.")})
    bad = sidecar(tmp_path, "q8-lm", bits=8, quant={**Q4, **mtp8_entries("language_model.mtp.")})
    assert ok(good, "mlx-vlm")[1] is True
    assert ok(bad, "mlx-vlm")[1] is False and "8-bit" in bad.get("mlx-vlm").head_usable.reason
    # mtplx's own field takes precedence in mlx-vlm
    via_mtplx = sidecar(tmp_path, "q8-mtplx", bits=8, quant=dict(Q4),
                        cfg_extra={"mtplx_mtp_quantization": {"bits": 8, "group_size": 32}})
    assert ok(via_mtplx, "mlx-vlm")[1] is True


def test_mlx_vlm_moe_head_must_be_stacked_when_mlx(tmp_path):
    assert ok(sidecar(tmp_path, "s", moe="stacked"), "mlx-vlm") == (True, True)
    assert ok(sidecar(tmp_path, "p", moe="per-expert"), "mlx-vlm")[1] is False
    assert ok(sidecar(tmp_path, "f", moe="fused"), "mlx-vlm")[1] is False


def test_mlx_vlm_backbone_hf_named_norms_in_mlx_folder_are_shifted(tmp_path):
    files = {SHARD: {**backbone(prefix=""), **head("mtp.")}}  # keys not under language_model.
    rep = check_folder(make(tmp_path, "hf-named", files, config()))
    assert ok(rep, "mlx-vlm")[0] is False
    assert ok(sidecar(tmp_path), "mlx-vlm")[0] is True


# ----------------------------------------------------------------------------- PR #990 branch


def test_pr990_reads_the_head_only_from_model_shards(tmp_path):
    assert ok(in_model(tmp_path), "mlx-lm-pr990") == (True, True)
    side = sidecar(tmp_path)
    assert ok(side, "mlx-lm-pr990") == (False, False)
    assert "refuses to load" in side.get("mlx-lm-pr990").backbone_exact.reason
    # model-mtp.safetensors is globbed: found (unprefixed mtp.* keys are prefixed by its sanitize)
    assert ok(sidecar(tmp_path, "mm", side="model-mtp.safetensors"), "mlx-lm-pr990") == (True, True)


def test_pr990_moe_experts_per_expert_or_fused_not_stacked(tmp_path):
    stacked_ = in_model(tmp_path, "s", moe="stacked")
    assert ok(stacked_, "mlx-lm-pr990") == (False, False)
    assert "KeyError" in stacked_.get("mlx-lm-pr990").head_usable.reason
    assert ok(in_model(tmp_path, "p", moe="per-expert"), "mlx-lm-pr990") == (True, True)
    assert ok(in_model(tmp_path, "f", moe="fused"), "mlx-lm-pr990") == (True, True)
    q = in_model(tmp_path, "pq", moe="per-expert", bits=4, quant=dict(Q4))
    assert ok(q, "mlx-lm-pr990") == (False, False)


def test_pr990_quantized_head_reads_language_model_prefixed_entries(tmp_path):
    good = in_model(tmp_path, "g", bits=8, quant={**Q4, **mtp8_entries("language_model.mtp.")})
    bad = in_model(tmp_path, "b", bits=8, quant={**Q4, **mtp8_entries("mtp.")})
    assert ok(good, "mlx-lm-pr990") == (True, True)
    assert ok(bad, "mlx-lm-pr990") == (False, False)


def test_pr990_without_mtp_layers_drops_the_head(tmp_path):
    rep = in_model(tmp_path, cfg_extra={})
    assert ok(rep, "mlx-lm-pr990") == (True, True)
    files = {SHARD: {**backbone(), **head("language_model.mtp.")}}
    rep0 = check_folder(make(tmp_path, "zero", files, config(mtp_layers=0)))
    assert ok(rep0, "mlx-lm-pr990") == (True, False)


# ----------------------------------------------------------------------------- the converter's layouts

MANIFEST = {"artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma"}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
LAYOUT_DATA = Path(__file__).parent / "data" / "layouts"


def default_layout(tmp: Path, name: str = "default", prefix: str = "mtp.", moe: Optional[str] = None,
                   bits: Optional[int] = None, fc_bits: Optional[int] = None, only=None, routers=(None, None),
                   quant: Optional[dict] = None, entries: Optional[dict] = None, link: Optional[str] = "hard",
                   manifest: Optional[dict] = MANIFEST, cfg_extra: Optional[dict] = None) -> Path:
    """What ``convert`` writes by default: two backbone shards + index with no ``mtp.`` key, root
    mtp.safetensors (``mtp.*`` keys, format mlx), mtp/weights.safetensors linked to it,
    mtp/manifest.json, config ``mlx_lm_extra_tensors`` and per-path ``mtp.X`` quantization entries."""
    bb = backbone()
    keys = sorted(bb)
    files = {SHARDS[0]: {k: bb[k] for k in keys[:2]}, SHARDS[1]: {k: bb[k] for k in keys[2:]},
             "mtp.safetensors": head(prefix, bits=bits, fc_bits=fc_bits, moe=moe, only=only, routers=routers)}
    extra = {"mlx_lm_extra_tensors": {"mtp_file": "mtp.safetensors", "mtp_tensor_count": len(files["mtp.safetensors"])}}
    extra.update(cfg_extra or {})
    extra = {k: v for k, v in extra.items() if v is not None}
    q = None if quant is None else {**quant, **(entries or {})}
    d = make(tmp, name, files, config(moe=moe is not None, quant=q, **extra), manifest=manifest)
    (d / "mtp").mkdir(exist_ok=True)
    if link == "hard":
        os.link(d / "mtp.safetensors", d / "mtp" / "weights.safetensors")
    elif link == "symlink":
        os.symlink("../mtp.safetensors", d / "mtp" / "weights.safetensors")
    return d


def table(rep) -> Dict[str, Tuple[Optional[bool], bool]]:
    """Every row but the drafter route's, which these hand-built folders (no mtp/config.json) never offer: its rules
    are tested on converted folders below."""
    return {r.runtime: (r.backbone_exact.ok, r.head_usable.ok) for r in rep.runtimes if r.runtime != "mlx-vlm-drafter"}


def head_reason(rep, rt: str) -> str:
    return rep.get(rt).head_usable.reason


def entries(prefix: str, modules, bits: int, group: int = 32) -> dict:
    return {f"{prefix}layers.0.{m}": {"bits": bits, "group_size": group, "mode": "affine"} for m in modules}


DEFAULT_GREEN = {"mlx-lm<0.32": (True, False), "mlx-lm>=0.32": (True, False), "mlx-vlm": (True, True),
                 "mtplx": (True, True), "rapid-mlx": (True, True), "vllm-mlx": (True, True),
                 "mlx-lm-pr990": (False, False)}
IN_MODEL = {"mlx-lm<0.32": (False, False), "mlx-lm>=0.32": (True, False), "mlx-vlm": (True, False),
            "mtplx": (False, True), "rapid-mlx": (True, False), "vllm-mlx": (False, False),
            "mlx-lm-pr990": (True, True)}


@pytest.mark.parametrize("moe, quant", [(None, None), (None, Q4), ("stacked", None), ("stacked", Q4)])
def test_default_layout_is_green_everywhere_but_stock_heads_and_pr990(tmp_path, moe, quant):
    rep = check_folder(default_layout(tmp_path, moe=moe, quant=quant))  # float head (--mtp keep)
    assert rep.layout == "sidecar"
    assert table(rep) == DEFAULT_GREEN
    vllm = head_reason(rep, "vllm-mlx")
    assert "head injected" in vllm and "mtp/weights.safetensors" in vllm and "declares mlx_gamma" in vllm
    assert "scheduler.py:827: BatchGenerator lacks _step" in vllm
    assert "mlx_lm_extra_tensors.mtp_file" in head_reason(rep, "mtplx")
    assert "mtp.safetensors" in head_reason(rep, "rapid-mlx")
    assert "refuses to load" in head_reason(rep, "mlx-lm-pr990")
    assert precision_warnings(rep, "--mtp keep") == []


def test_default_layout_link_kinds(tmp_path):
    assert check_folder(default_layout(tmp_path, "sym", link="symlink")).layout == "sidecar"
    assert table(check_folder(default_layout(tmp_path, "sym2", link="symlink"))) == DEFAULT_GREEN
    rootonly = check_folder(default_layout(tmp_path, "rootonly", link=None))
    assert ok(rootonly, "vllm-mlx") == (True, False) and "not root mtp.safetensors" in head_reason(rootonly, "vllm-mlx")
    assert ok(rootonly, "mtplx") == ok(rootonly, "rapid-mlx") == (True, True)
    subonly = sidecar(tmp_path, "subonly", side="mtp/weights.safetensors", manifest=MANIFEST)
    assert subonly.layout == "sidecar:mtp/weights.safetensors"
    assert ok(subonly, "vllm-mlx") == ok(subonly, "mtplx") == (True, True)
    assert ok(subonly, "rapid-mlx") == (True, False) and "no head file" in head_reason(subonly, "rapid-mlx")


def test_mtp_match_rapid_mlx_refuses_a_float_fc(tmp_path):
    rep = check_folder(default_layout(tmp_path, bits=4, quant=Q4))  # --mtp match: layer linears 4-bit, fc float
    t = table(rep)
    assert t["mlx-vlm"] == t["mtplx"] == t["vllm-mlx"] == (True, True)
    assert t["rapid-mlx"] == (True, False)
    assert rep.get("rapid-mlx").head_usable.cause == PRECISION and "float fc" in head_reason(rep, "rapid-mlx")
    assert "kept quantized" in head_reason(rep, "mtplx")
    assert "dequantized with the top-level 4-bit/g32" in head_reason(rep, "vllm-mlx")
    warnings = precision_warnings(rep, "--mtp match")
    assert len(warnings) == 1 and warnings[0].startswith("--mtp match: rapid-mlx") and "float fc" in warnings[0]
    # the same head with fc quantized like the rest (never written by mtpconvert) is what rapid-mlx takes
    fcq = check_folder(default_layout(tmp_path, "fcq", bits=4, fc_bits=4, quant=Q4))
    assert ok(fcq, "rapid-mlx") == (True, True)
    mixed = check_folder(default_layout(tmp_path, "fc4l8", bits=8, fc_bits=4, quant=Q4))
    assert ok(mixed, "rapid-mlx") == (True, False) and "bits taken from fc" in head_reason(mixed, "rapid-mlx")
    partial = check_folder(default_layout(tmp_path, "fc4part", bits=4, fc_bits=4, only=("down_proj",), quant=Q4))
    assert ok(partial, "rapid-mlx") == (True, False) and "float beside a quantized fc" in head_reason(partial,
                                                                                                     "rapid-mlx")


def test_mtp_match_where_only_some_linears_quantize(tmp_path):
    # as the fixture at group 64: only down_proj quantizable -> not a key set mtplx knows; dequantized at top bits
    rep = check_folder(default_layout(tmp_path, bits=4, only=("down_proj",), quant=Q4))
    assert ok(rep, "mtplx") == (True, True) and "dequantized with the top-level 4-bit/g32" in head_reason(rep, "mtplx")
    assert ok(rep, "vllm-mlx") == (True, True) and ok(rep, "rapid-mlx") == (True, False)


def test_mtp_bits_8_over_a_4bit_backbone(tmp_path):
    all7 = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj"]
    rep = check_folder(default_layout(tmp_path, bits=8, quant=Q4, entries=entries("mtp.", all7, 8)))
    t = table(rep)
    assert t["vllm-mlx"] == (False, False)  # dequantizing fails while loading: no server at all
    assert rep.get("vllm-mlx").backbone_exact.reason.startswith("ValueError: [dequantize]")
    assert t["mtplx"] == (True, True) and "kept quantized" in head_reason(rep, "mtplx")
    assert t["mlx-vlm"] == (True, True) and t["rapid-mlx"] == (True, False)
    warned = precision_warnings(rep, "--mtp-bits 8")
    assert sorted(w.split(": ")[1].split()[0] for w in warned) == ["rapid-mlx", "vllm-mlx"]
    # a key set mtplx does not know (only down_proj quantized) is dequantized at the top-level 4 bits
    odd = check_folder(default_layout(tmp_path, "odd", bits=8, only=("down_proj",), quant=Q4,
                                      entries=entries("mtp.", ["mlp.down_proj"], 8)))
    assert ok(odd, "mtplx") == (True, False) and "ValueError: [dequantize]" in head_reason(odd, "mtplx")
    assert ok(odd, "mlx-vlm") == (True, True)
    # a known set without per-module entries is built at the top-level bits
    noent = check_folder(default_layout(tmp_path, "noent", bits=8, quant=Q4))
    assert ok(noent, "mtplx") == (True, False) and "8-bit/g32 but would be read as 4-bit/g32" in head_reason(
        noent, "mtplx")
    # a text_config quantization block is what vllm-mlx reads first
    tc8 = default_layout(tmp_path, "tc8", bits=8, quant=Q4)
    cfg = json.loads((tc8 / "config.json").read_text())
    cfg["text_config"]["quantization"] = {"bits": 8, "group_size": 32}
    (tc8 / "config.json").write_text(json.dumps(cfg))
    assert ok(check_folder(tc8), "vllm-mlx") == (True, True)


def test_moe_mtp_match_routers(tmp_path):
    routers8 = entries("mtp.", ["mlp.gate", "mlp.shared_expert_gate"], 8)
    real = check_folder(default_layout(tmp_path, "real", moe="stacked", bits=4, routers=(8, 8), quant=Q4,
                                       entries=routers8))  # mlx-lm's 8-bit router rule applied to the head
    assert ok(real, "mtplx") == (True, False) and "ValueError: [dequantize]" in head_reason(real, "mtplx")
    assert ok(real, "vllm-mlx") == (False, False) and ok(real, "rapid-mlx") == (True, False)
    assert ok(real, "mlx-vlm") == (True, True)
    fixture = check_folder(default_layout(tmp_path, "fx", moe="stacked", bits=4, quant=Q4))  # routers float: ours
    assert ok(fixture, "mtplx") == (True, True) and "dequantized" in head_reason(fixture, "mtplx")
    assert ok(fixture, "vllm-mlx") == (True, True)
    known = check_folder(default_layout(tmp_path, "known", moe="stacked", bits=4, routers=(None, 4), quant=Q4))
    assert ok(known, "mtplx") == (True, True) and "kept quantized" in head_reason(known, "mtplx")


@pytest.mark.parametrize("moe", [None, "per-expert", "fused"])
def test_in_model_layout(tmp_path, moe):
    rep = in_model(tmp_path, moe=moe)
    assert rep.layout == "in-model"
    assert table(rep) == IN_MODEL
    for rt in ("mtplx", "vllm-mlx"):
        assert "second time" in rep.get(rt).backbone_exact.reason
    assert "embedded" in head_reason(rep, "mtplx")
    assert "undoes" in rep.get("rapid-mlx").backbone_exact.reason
    assert "in-model keys are not read" in head_reason(rep, "rapid-mlx")


def test_in_model_moe_stacked_fails_only_pr990(tmp_path):
    rep = in_model(tmp_path, moe="stacked")
    assert table(rep) == {**IN_MODEL, "mlx-lm-pr990": (False, False)}


def test_in_model_mtp_bits_8_with_language_model_entries(tmp_path):
    all7 = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj"]
    rep = in_model(tmp_path, bits=8, quant={**Q4, **entries("language_model.mtp.", all7, 8)})
    assert ok(rep, "mlx-lm-pr990") == (True, True)
    assert ok(rep, "mtplx") == (False, True)  # mtplx reads language_model.mtp.X entries too; backbone still shifted


def test_bare_head_keys_load_nothing_in_mtplx_and_vllm_mlx(tmp_path):
    rep = check_folder(default_layout(tmp_path, prefix=""))
    assert rep.layout == "sidecar"
    assert ok(rep, "mtplx") == (True, False) and "loads 0 tensors" in head_reason(rep, "mtplx")
    assert ok(rep, "vllm-mlx") == (True, False) and "loads 0 tensors" in head_reason(rep, "vllm-mlx")
    assert ok(rep, "rapid-mlx") == (True, True)
    assert ok(rep, "mlx-vlm") == (True, False)


def test_language_model_prefixed_sidecar(tmp_path):
    rep = check_folder(default_layout(tmp_path, prefix="language_model.mtp."))
    assert ok(rep, "mtplx") == ok(rep, "vllm-mlx") == (True, True)
    assert ok(rep, "rapid-mlx") == (True, False) and "language_model.mtp" in head_reason(rep, "rapid-mlx")


def test_rapid_mlx_takes_the_first_candidate_file_only(tmp_path):
    single = check_folder(make(tmp_path, "single", {"model.safetensors": {**backbone(), **head("language_model.mtp.")}},
                               config()))
    assert ok(single, "rapid-mlx") == (True, False)
    assert "model.safetensors (its first candidate file)" in head_reason(single, "rapid-mlx")
    # a bad mtp.safetensors hides a good mtp/model.safetensors
    files = {SHARD: backbone(), "mtp.safetensors": head("language_model.mtp."), "mtp/model.safetensors": head()}
    hidden = check_folder(make(tmp_path, "hidden", files, config()))
    assert ok(hidden, "rapid-mlx") == (True, False)
    files = {SHARD: backbone(), "mtp/model.safetensors": head()}
    assert ok(check_folder(make(tmp_path, "alone", files, config())), "rapid-mlx") == (True, True)


def test_root_model_mtp_file_is_globbed_by_mlx_lm_031(tmp_path):
    rep = sidecar(tmp_path, side="model-mtp.safetensors")
    assert rep.layout == "sidecar:model-mtp.safetensors"
    assert ok(rep, "mtplx") == (False, True) and ok(rep, "vllm-mlx") == (False, True)
    assert "model-mtp.safetensors" in rep.get("vllm-mlx").backbone_exact.reason
    assert ok(rep, "rapid-mlx") == (True, True) and ok(rep, "mlx-lm<0.32") == (False, False)


@pytest.mark.parametrize("manifest, guarded", [
    (MANIFEST, True), (None, False), ({"rmsnorm_weight_format": "mlx_gamma"}, False),
    ({"artifact_schema_version": 1, "rmsnorm_weight_format": "zero_centered"}, False)])
def test_vllm_mlx_manifest_guards_the_head_norms(tmp_path, manifest, guarded):
    rep = check_folder(default_layout(tmp_path, manifest=manifest))
    # without the guard the head still loads as stored when its norms sit near 1 (measured): usable, unguarded
    assert ok(rep, "vllm-mlx") == (True, True)
    why = head_reason(rep, "vllm-mlx")
    assert ("declares mlx_gamma" in why) is guarded and ("unguarded" in why) is (not guarded)


def test_mtplx_reads_only_the_file_the_config_names(tmp_path):
    missing = check_folder(default_layout(tmp_path, "missing", cfg_extra={
        "mlx_lm_extra_tensors": {"mtp_file": "nope.safetensors"}}))
    assert ok(missing, "mtplx") == (True, False) and "no such file" in head_reason(missing, "mtplx")
    assert ok(missing, "rapid-mlx") == ok(missing, "vllm-mlx") == (True, True)
    unnamed = check_folder(default_layout(tmp_path, "unnamed", cfg_extra={"mlx_lm_extra_tensors": None}))
    assert ok(unnamed, "mtplx") == (True, True) and "(mlx_lm_extra_tensors" not in head_reason(unnamed, "mtplx")
    custom = sidecar(tmp_path, "custom", side="heads/draft.safetensors", cfg_extra={
        "mlx_lm_extra_tensors": {"mtp_file": "heads/draft.safetensors"}})
    assert ok(custom, "mtplx") == (True, True) and "heads/draft.safetensors" in head_reason(custom, "mtplx")
    assert ok(custom, "mlx-vlm")[1] is False  # mlx-vlm does not read that config field


def test_mixed_layouts_are_named(tmp_path):
    files = {SHARD: {**backbone(), **head("language_model.mtp.")}, "mtp.safetensors": head()}
    both = check_folder(make(tmp_path, "both", files, config()))
    assert both.layout == "mixed:in-model+mtp.safetensors"
    assert ok(both, "mtplx") == (False, True) and ok(both, "rapid-mlx") == (True, True)
    files = {SHARD: backbone(), "mtp.safetensors": head(), "mtp/weights.safetensors": head(bits=4)}
    two = check_folder(make(tmp_path, "two", files, config(quant=Q4), manifest=MANIFEST))
    assert two.layout == "mixed:mtp.safetensors+mtp/weights.safetensors"


def drafter(tmp: Path, name: str = "drafter", prefix: str = "", **head_args) -> Path:
    """mlx-vlm's drafter folder (what ``python -m mlx_vlm.split_mtp`` writes)."""
    cfg = {"model_type": "qwen3_5_mtp", "text_config": config()["text_config"]}
    return make(tmp, name, {"model.safetensors": head(prefix, **head_args)}, cfg, index=None)


def test_drafter_folder(tmp_path):
    rep = check_folder(drafter(tmp_path))
    assert rep.layout == "drafter"
    assert all(r.backbone_exact.ok is None for r in rep.runtimes)
    assert ok(rep, "mlx-vlm") == (None, True) and "--draft-model" in head_reason(rep, "mlx-vlm")
    assert ok(rep, "rapid-mlx") == (None, True)
    for rt in ("mlx-lm<0.32", "mlx-lm>=0.32", "mtplx", "vllm-mlx", "mlx-lm-pr990"):
        assert ok(rep, rt) == (None, False), rt
    assert "n/a" in render(rep)
    prefixed = check_folder(drafter(tmp_path, "prefixed", prefix="mtp."))
    assert ok(prefixed, "mlx-vlm") == (None, False) and "+1" in head_reason(prefixed, "mlx-vlm")


def test_mlx_community_folder_without_mtp(tmp_path):
    cfg = json.loads((LAYOUT_DATA / "mlx-community_Qwen3.5-2B-mxfp4" / "config.json").read_text())
    rep = check_folder(make(tmp_path, "mc", {"model.safetensors": backbone()}, cfg))
    assert rep.layout == "none"
    assert ok(rep, "mlx-lm<0.32") == ok(rep, "mlx-lm>=0.32") == (True, False)
    for rt in ("mlx-vlm", "mtplx", "rapid-mlx", "vllm-mlx"):
        assert ok(rep, rt) == (True, False), rt
    for rt in ("mtplx", "rapid-mlx", "vllm-mlx"):
        assert "no MTP tensors" in head_reason(rep, rt), rt
    # its config still declares one MTP layer: the PR #990 branch refuses the folder
    assert ok(rep, "mlx-lm-pr990") == (False, False)


# ----------------------------------------------------------------------------- the table itself


def test_no_head_folder(tmp_path):
    rep = check_folder(make(tmp_path, "none", {SHARD: backbone()}, config(mtp_layers=0)))
    assert rep.layout == "none"
    for rt in ("mlx-vlm", "mtplx", "rapid-mlx", "vllm-mlx"):
        assert ok(rep, rt) == (True, False), rt
    assert ok(rep, "mlx-lm<0.32") == (True, False)


def test_report_covers_every_runtime_and_is_json(tmp_path):
    rep = sidecar(tmp_path)
    assert [r.runtime for r in rep.runtimes] == list(RUNTIMES)
    assert len(RUNTIMES) == 8  # mlx-lm twice, mlx-vlm twice (the model folder, --draft-model OUT/mtp), four more
    back = json.loads(json.dumps(rep.to_json()))
    assert back["layout"] == "sidecar"
    assert all(r["verified"] for r in back["runtimes"])
    assert set(back["runtimes"][0]) >= {"runtime", "versions", "backbone_exact", "head_usable"}
    assert "mlx-vlm" in render(rep)


def test_compat_is_pure_on_a_snapshot(tmp_path):
    folder = read_folder(make(tmp_path, "x", {SHARD: {**backbone(), **head("language_model.mtp.")}}, config()))
    snap = Folder(config=folder.config, headers=folder.headers, index=folder.index)
    assert compat(snap).to_json()["runtimes"] == compat(folder).to_json()["runtimes"]
    # no file is touched: the same snapshot gives the same table after the folder is gone
    for p in sorted((tmp_path / "x").iterdir()):
        p.unlink()
    assert compat(snap).get("mlx-lm<0.32").backbone_exact.ok is False


def test_read_header_rejects_bad_files(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError):
        read_header(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError):
        read_header(tmp_path / "huge.safetensors")
    (tmp_path / "trunc.safetensors").write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(ValueError):
        read_header(tmp_path / "trunc.safetensors")
    write_st(tmp_path / "ok.safetensors", {"a": ("F32", (2, 2))})
    assert read_header(tmp_path / "ok.safetensors")["a"]["shape"] == [2, 2]
