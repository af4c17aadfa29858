"""mtpconvert.compat: per-runtime compatibility from config + safetensors headers.

Every folder here is written as real (tiny, zero-filled) safetensors files, and most tests
compare two folders that differ in one property only, asserting opposite verdicts -- so a rule
that ignored that property would fail. The rules for stock mlx-lm, mlx-vlm and the PR #990
branch were checked against the runtimes themselves by ``interop/run.py``
(see docs/interop.md).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from mtpconvert.compat import RUNTIMES, Folder, check_folder, compat, read_folder, read_header, render

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


def stacked(name: str, out: int, ind: int, bits: Optional[int] = None, group: int = 32) -> Dict[str, Spec]:
    return {k: (dt, (E,) + shape) for k, (dt, shape) in linear(name, out, ind, bits, group).items()}


def backbone(raw: bool = False, prefix: str = "language_model.") -> Dict[str, Spec]:
    conv = (192, 1, 4) if raw else (192, 4, 1)
    return {f"{prefix}model.embed_tokens.weight": ("F32", (512, H)),
            f"{prefix}model.norm.weight": ("F32", (H,)),
            f"{prefix}model.layers.0.input_layernorm.weight": ("F32", (H,)),
            f"{prefix}model.layers.0.linear_attn.conv1d.weight": ("F32", conv),
            f"{prefix}lm_head.weight": ("F32", (512, H))}


def head(prefix: str = "mtp.", bits: Optional[int] = None, group: int = 32, moe: Optional[str] = None,
         fc_bits: Optional[int] = None, layers: int = 1) -> Dict[str, Spec]:
    """An MTP head under ``prefix``: fc never quantized unless fc_bits; moe: stacked|per-expert|fused."""
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
        t.update(linear(p + "self_attn.q_proj", 2 * HEADS * HEAD_DIM, H, bits, group))
        t.update(linear(p + "self_attn.k_proj", KV * HEAD_DIM, H, bits, group))
        t.update(linear(p + "self_attn.v_proj", KV * HEAD_DIM, H, bits, group))
        t.update(linear(p + "self_attn.o_proj", H, HEADS * HEAD_DIM, bits, group))
        if moe is None:
            t.update(linear(p + "mlp.gate_proj", INTER, H, bits, group))
            t.update(linear(p + "mlp.up_proj", INTER, H, bits, group))
            t.update(linear(p + "mlp.down_proj", H, INTER, bits, group))
            continue
        t[p + "mlp.gate.weight"] = ("F32", (E, H))
        t[p + "mlp.shared_expert_gate.weight"] = ("F32", (1, H))
        t.update(linear(p + "mlp.shared_expert.gate_proj", SHARED, H, bits, group))
        t.update(linear(p + "mlp.shared_expert.up_proj", SHARED, H, bits, group))
        t.update(linear(p + "mlp.shared_expert.down_proj", H, SHARED, bits, group))
        if moe == "stacked":
            t.update(stacked(p + "mlp.switch_mlp.gate_proj", MOE_INTER, H, bits, group))
            t.update(stacked(p + "mlp.switch_mlp.up_proj", MOE_INTER, H, bits, group))
            t.update(stacked(p + "mlp.switch_mlp.down_proj", H, MOE_INTER, bits, group))
        elif moe == "per-expert":
            for e in range(E):
                t.update(linear(f"{p}mlp.experts.{e}.gate_proj", MOE_INTER, H, bits, group))
                t.update(linear(f"{p}mlp.experts.{e}.up_proj", MOE_INTER, H, bits, group))
                t.update(linear(f"{p}mlp.experts.{e}.down_proj", H, MOE_INTER, bits, group))
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
    assert inm.layout == "in-model" and side.layout == "sidecar:mtp.safetensors"


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


# ----------------------------------------------------------------------------- contract rules (unverified block)


def test_mtplx_sidecar_discovery(tmp_path):
    assert ok(sidecar(tmp_path, "a"), "mtplx") == (True, True)  # mlx_lm_extra_tensors.mtp_file
    custom = sidecar(tmp_path, "b", side="heads/draft.safetensors", cfg_extra={
        "mlx_lm_extra_tensors": {"mtp_file": "heads/draft.safetensors"}})
    assert ok(custom, "mtplx") == (True, True)  # any file the config names
    assert "heads/draft.safetensors" in custom.get("mtplx").head_usable.reason
    assert ok(custom, "mlx-vlm")[1] is False  # mlx-vlm does not read that config field
    missing = sidecar(tmp_path, "c", cfg_extra={"mlx_lm_extra_tensors": {"mtp_file": "nope.safetensors"}})
    assert ok(missing, "mtplx")[1] is False and "no such file" in missing.get("mtplx").head_usable.reason
    assert ok(sidecar(tmp_path, "d", side="mtp/weights.safetensors"), "mtplx") == (True, True)
    inm = in_model(tmp_path, "e")
    assert ok(inm, "mtplx") == (False, True)  # found in-model, but its mlx-lm 0.31 shifts the backbone twice


def test_mtplx_quantized_head_only_for_known_modules(tmp_path):
    assert ok(sidecar(tmp_path, "a", bits=4, quant=dict(Q4)), "mtplx")[1] is True
    assert ok(sidecar(tmp_path, "b", bits=4, fc_bits=4, quant=dict(Q4)), "mtplx")[1] is False  # fc quantized


def test_rapid_mlx_sidecar_only_and_bits_from_fc(tmp_path):
    assert ok(in_model(tmp_path), "rapid-mlx")[1] is False
    assert ok(sidecar(tmp_path, "f"), "rapid-mlx") == (True, True)
    assert ok(sidecar(tmp_path, "bare", prefix=""), "rapid-mlx")[1] is True  # keys X
    assert ok(sidecar(tmp_path, "lm", prefix="language_model.mtp."), "rapid-mlx")[1] is False
    float_fc = sidecar(tmp_path, "q", bits=4, quant=dict(Q4))
    assert ok(float_fc, "rapid-mlx")[1] is False and "float fc" in float_fc.get("rapid-mlx").head_usable.reason
    assert ok(sidecar(tmp_path, "qfc", bits=4, fc_bits=4, quant=dict(Q4)), "rapid-mlx")[1] is True
    assert ok(sidecar(tmp_path, "qmix", bits=8, fc_bits=4, quant=dict(Q4)), "rapid-mlx")[1] is False
    assert ok(sidecar(tmp_path, "mtpdir", side="mtp/model.safetensors"), "rapid-mlx")[1] is True


def test_vllm_mlx_manifest_and_top_level_bits(tmp_path):
    good = {"rmsnorm_weight_format": "mlx_gamma"}
    assert ok(sidecar(tmp_path, "a"), "vllm-mlx")[1] is False  # root mtp.safetensors is not read
    assert ok(sidecar(tmp_path, "b", side="mtp/weights.safetensors", manifest=good), "vllm-mlx") == (True, True)
    assert ok(sidecar(tmp_path, "c", side="mtp/weights.safetensors"), "vllm-mlx")[1] is False
    assert ok(sidecar(tmp_path, "d", side="mtp/weights.safetensors",
                      manifest={"rmsnorm_weight_format": "zero_centered"}), "vllm-mlx")[1] is False
    mm = sidecar(tmp_path, "e", side="model-mtp.safetensors")
    assert ok(mm, "vllm-mlx") == (False, True)  # found, but mlx-lm 0.31's glob double-shifts the backbone
    same_bits = sidecar(tmp_path, "f", side="mtp/weights.safetensors", manifest=good, bits=4, quant=dict(Q4))
    other_bits = sidecar(tmp_path, "g", side="mtp/weights.safetensors", manifest=good, bits=8,
                         quant={**Q4, **mtp8_entries("mtp.")})
    assert ok(same_bits, "vllm-mlx")[1] is True
    assert ok(other_bits, "vllm-mlx")[1] is False and "top-level" in other_bits.get("vllm-mlx").head_usable.reason


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
    assert len(RUNTIMES) == 7
    back = json.loads(json.dumps(rep.to_json()))
    assert back["layout"] == "sidecar:mtp.safetensors"
    assert {r["runtime"]: r["verified"] for r in back["runtimes"]}["mlx-vlm"] is True
    assert {r["runtime"]: r["verified"] for r in back["runtimes"]}["rapid-mlx"] is False
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
