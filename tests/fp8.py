"""Block-FP8 twins of the test checkpoints, an independent dequantization reference, and transformers' FP8 loader.

Qwen's official FP8 releases (Qwen3.6-27B-FP8, Qwen3.6-35B-A3B-FP8, Qwen3.8-27B-FP8; see
``/work/shared/layouts/*-FP8/README.md``) store each quantized Linear as ``X.weight`` F8_E4M3 plus
``X.weight_scale_inv`` (BF16) of shape ``[ceil(out/128), ceil(in/128)]``, and the scale MULTIPLIES:
``W[i, j] = e4m3(W_q[i, j]) * s[i // 128, j // 128]``. The files are ``layers-{i}.safetensors`` (one per decoder
layer), ``mtp.safetensors`` and ``outside.safetensors`` with a ``model.safetensors.index.json``.

Nothing here imports the converter's FP8 code: ``e4m3_decode`` is bit arithmetic and ``dequantize`` is the
reference a conversion's output is compared against.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from tests import checkpoints

BLOCK = 128
E4M3_MAX = 448.0
SCALE = "weight_scale_inv"
FP8_FILES_META = {"format": "pt"}  # layers-*/mtp carry it in the release; outside.safetensors has no metadata

# --- e4m3 -------------------------------------------------------------------------------------------------------


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes (uint8) -> float32, by bit arithmetic: 1 sign, 4 exponent (bias 7), 3 mantissa bits.

    No infinities; 0x7f/0xff are NaN; exponent 0 is subnormal (m/8 * 2^-6).
    """
    c = np.asarray(codes, dtype=np.uint8).astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = (c & 0x7).astype(np.float64)
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e.astype(np.float64) - 7.0))
    out = sign * mag
    out = np.where((c & 0x7F) == 0x7F, np.nan, out)
    return out.astype(np.float32)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> float8_e4m3fn codes (uint8), round to nearest even, saturating at +-448 (NaN stays NaN).

    torch's cast rounds to nearest even but turns out-of-range values into NaN, hence the clip first.
    """
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    t = torch.where(torch.isnan(t), t, t.clamp(-E4M3_MAX, E4M3_MAX))
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().copy()


# --- block quantization -----------------------------------------------------------------------------------------


def grid(shape: Tuple[int, int], block: int = BLOCK) -> Tuple[int, int]:
    """The scale grid of an [out, in] weight: [ceil(out/block), ceil(in/block)]."""
    return (math.ceil(shape[0] / block), math.ceil(shape[1] / block))


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of ``x`` rounded (nearest even) to ``dtype`` ('bfloat16', 'float16', 'float32')."""
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    return t.to(getattr(torch, dtype)).float().numpy()


def block_quantize(w: np.ndarray, block: int = BLOCK, *, scale_dtype: str = "float32") -> Tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (codes uint8 [out, in], scale float32 [ceil(out/block), ceil(in/block)]).

    Per block (partial at the edges) scale = amax / 448 (amax 0 -> 1), rounded to ``scale_dtype`` FIRST (as it will
    be stored), then codes = e4m3(w / stored scale) (saturating, should the rounding have moved the scale down).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"block_quantize wants a 2-D weight, got {w.shape}")
    rows, cols = w.shape
    gr, gc = grid(w.shape, block)
    scale = np.ones((gr, gc), dtype=np.float32)
    for bi in range(gr):
        for bj in range(gc):
            amax = float(np.abs(w[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block]).max(initial=0.0))
            scale[bi, bj] = amax / E4M3_MAX if amax > 0 else 1.0
    scale = round_to(scale, scale_dtype)
    scale[scale == 0] = 1.0  # an amax so small its scale underflows the storage dtype
    full = expand_scale(scale, (rows, cols), block)
    return e4m3_encode(w / full), scale


def expand_scale(scale: np.ndarray, shape: Tuple[int, int], block: int = BLOCK) -> np.ndarray:
    """The [out, in] field of a block scale grid: ``s[i // block, j // block]``."""
    return np.repeat(np.repeat(np.asarray(scale, np.float32), block, 0), block, 1)[: shape[0], : shape[1]]


def dequantize(codes: np.ndarray, scale: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """The independent reference: ``W[i, j] = e4m3_decode(codes)[i, j] * scale[i // block, j // block]`` (float32)."""
    codes = np.asarray(codes)
    scale = np.asarray(scale, dtype=np.float32)
    if codes.ndim != 2 or scale.shape != grid(codes.shape, block):
        raise ValueError(f"scale {scale.shape} does not fit weight {codes.shape} (want {grid(codes.shape, block)})")
    return e4m3_decode(codes) * expand_scale(scale, codes.shape, block)


# --- which tensors a Qwen FP8 release quantizes -----------------------------------------------------------------

_LAYER = re.compile(r"^(?:model\.language_model|model)\.layers\.(\d+)\.")
_DECODER = r"^(?:model\.language_model\.layers|model\.layers|mtp\.layers)\.\d+\."
FP8_LINEAR = re.compile(
    _DECODER + r"(?:"
    r"linear_attn\.(?:in_proj_qkv|in_proj_z|out_proj)"
    r"|self_attn\.(?:q_proj|k_proj|v_proj|o_proj)"
    r"|mlp\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_expert\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)"
    r")\.weight$"
)
_FUSED = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def is_fp8_linear(key: str, *, head_fp8: bool = True) -> bool:
    """Whether a Qwen FP8 release stores ``key`` (a per-expert raw key) as F8_E4M3 with a block scale."""
    if key.startswith("mtp.") and not head_fp8:
        return False
    return FP8_LINEAR.match(key) is not None


def shard_of(key: str) -> str:
    """The release's file for ``key``: layers-{i}, mtp or outside."""
    m = _LAYER.match(key)
    if m:
        return f"layers-{int(m[1])}.safetensors"
    if key.startswith("mtp."):
        return "mtp.safetensors"
    return "outside.safetensors"


def split_fused_experts(raw: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] -> per-expert keys (the FP8 layout)."""
    out: Dict[str, np.ndarray] = {}
    for k, v in raw.items():
        m = _FUSED.match(k)
        if m is None:
            out[k] = v
        elif m["proj"] == "down_proj":
            for e in range(v.shape[0]):
                out[f"{m['mlp']}.experts.{e}.down_proj.weight"] = v[e]
        else:
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{m['mlp']}.experts.{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{m['mlp']}.experts.{e}.up_proj.weight"] = v[e, inter:]
    return out


def _module_of(key: str) -> str:
    """The module a parameter belongs to (``.weight``/``.bias`` dropped; ``A_log``/``dt_bias`` kept, as Qwen lists them)."""
    for suffix in (".weight", ".bias"):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


# --- reading / writing safetensors with any dtype -----------------------------------------------------------------


def _read_torch(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _index(folder: Path) -> Dict[str, str]:
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        return json.loads(idx.read_text())["weight_map"]
    return {k: f.name for f in sorted(folder.glob("*.safetensors")) for k in _read_torch(f)}


def read_source(folder: Path) -> Dict[str, np.ndarray]:
    """Every tensor of a (non-FP8) raw checkpoint as float32 numpy."""
    out: Dict[str, np.ndarray] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in _read_torch(f).items()})
    return out


def _write_index(folder: Path, weight_map: Dict[str, str]) -> None:
    total = 0
    for name in sorted(set(weight_map.values())):
        total += sum(t.numel() * t.element_size() for t in _read_torch(folder / name).values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save(folder: Path, name: str, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    meta = None if name == "outside.safetensors" else dict(FP8_FILES_META)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(folder / name), metadata=meta)


# --- the twin -----------------------------------------------------------------------------------------------------


def quantization_config(modules_to_not_convert: List[str], shape: str = "fmt") -> dict:
    """The two ``quantization_config`` shapes found in FP8 releases."""
    if shape == "fmt":  # Qwen's official releases
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "modules_to_not_convert": modules_to_not_convert, "weight_block_size": [BLOCK, BLOCK]}
    if shape == "per_tensor":
        return {"activation_scheme": "dynamic", "act_per_tensor": False, "quant_method": "fp8",
                "modules_to_not_convert": modules_to_not_convert, "weight_block_size": [BLOCK, BLOCK],
                "weight_per_tensor": False}
    raise ValueError(f"config_shape must be 'fmt' or 'per_tensor', got {shape!r}")


def fp8_twin(
    built_or_folder: Union["checkpoints.Built", Path, str],
    out: Path,
    *,
    head_fp8: bool = True,
    scale_dtype: str = "bfloat16",
    config_shape: str = "fmt",
    a_log_f32: bool = False,
    record: Optional[Dict[str, np.ndarray]] = None,
) -> Path:
    """Write the block-FP8 twin of a raw checkpoint to ``out`` in Qwen's FP8 release layout; return ``out``.

    - FP8 (F8_E4M3 + ``weight_scale_inv`` in ``scale_dtype``): GDN in_proj_qkv/in_proj_z/out_proj, attention q/k/v/o,
      MLP and shared-expert gate/up/down, every routed expert, and the same in ``mtp.layers.*`` unless ``head_fp8``
      is False (then every ``mtp.*`` tensor stays BF16: the "BF16 head" variant).
    - Experts per expert everywhere (fused source experts are split, the head's too).
    - Everything else BF16, except ``A_log`` in F32 when ``a_log_f32``.
    - ``record``, when given, receives ``{weight key: float32}`` for every FP8 weight: exactly
      ``dequantize(codes, scale as stored)``.
    """
    src = Path(getattr(built_or_folder, "path", built_or_folder))
    out = Path(out)
    if scale_dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"scale_dtype: {scale_dtype!r}")
    raw = split_fused_experts(read_source(src))
    out.mkdir(parents=True, exist_ok=True)

    files: Dict[str, Dict[str, torch.Tensor]] = {}
    not_converted: List[str] = []
    for key in sorted(raw):
        w = raw[key]
        bucket = files.setdefault(shard_of(key), {})
        if is_fp8_linear(key, head_fp8=head_fp8):
            codes, scale = block_quantize(w, scale_dtype=scale_dtype)
            bucket[key] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            bucket[key[: -len("weight")] + SCALE] = torch.from_numpy(scale).to(getattr(torch, scale_dtype))
            if record is not None:
                record[key] = dequantize(codes, scale)
            continue
        dt = torch.float32 if (a_log_f32 and key.endswith("A_log")) else torch.bfloat16
        bucket[key] = torch.from_numpy(np.ascontiguousarray(w)).to(dt)
        mod = _module_of(key)
        if mod not in not_converted:
            not_converted.append(mod)

    weight_map: Dict[str, str] = {}
    for name, tensors in files.items():
        _save(out, name, tensors)
        weight_map.update({k: name for k in tensors})
    _write_index(out, weight_map)

    config = json.loads((src / "config.json").read_text())
    for c in (config, config.get("text_config", {})):
        for k in ("dtype", "torch_dtype"):
            if k in c:
                c[k] = "bfloat16"
    config["quantization_config"] = quantization_config(not_converted, config_shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(src, out)
    return out


def _copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, generation config and the other files beside the weights (not config, index or weights)."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)


def twin_tensors(folder: Path) -> Dict[str, torch.Tensor]:
    """Every stored tensor of a twin, as stored (F8 weights as ``torch.float8_e4m3fn``)."""
    out: Dict[str, torch.Tensor] = {}
    for name in sorted(set(_index(Path(folder)).values())):
        out.update(_read_torch(Path(folder) / name))
    return out


def _decoded(stored: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Stored tensors with the scales consumed: each FP8 weight becomes ``dequantize(codes, scale as stored)``
    (float32), every other tensor stays as stored."""
    out: Dict[str, torch.Tensor] = {}
    for k, t in stored.items():
        if k.endswith("." + SCALE):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = stored[k[: -len("weight")] + SCALE].float().numpy()
            t = torch.from_numpy(dequantize(t.view(torch.uint8).numpy(), s))
        out[k] = t
    return out


def twin_weights(folder: Path) -> Dict[str, np.ndarray]:
    """What a twin means, by weight key, in float32: FP8 weights dequantized with the scale AS STORED, the rest
    widened. Scale tensors are consumed, not listed. This is the reference a conversion must reproduce."""
    return {k: t.float().numpy() for k, t in _decoded(twin_tensors(folder)).items()}


def dequantized_twin(twin: Path, out: Path) -> Path:
    """The plain raw folder a twin stands for, written to ``out``; return ``out``.

    Same files and keys as the twin minus the scales; every FP8 weight is ``dequantize(codes, scale as stored)``
    stored as F32, every other tensor exactly as the twin stores it. The index lists the same files, and
    config.json is the twin's without ``quantization_config`` (top level and ``text_config``). Converting it and
    the twin with the same options must give the same bytes: the converter's FP8 reading is checked against this
    module's own decoding, never against itself.
    """
    twin, out = Path(twin), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    wm = _index(twin)
    weight_map: Dict[str, str] = {}
    for name in sorted(set(wm.values())):
        tensors = _decoded(_read_torch(twin / name))
        _save(out, name, tensors)
        weight_map.update({k: name for k in tensors})
    _write_index(out, weight_map)
    config = json.loads((twin / "config.json").read_text())
    for c in (config, config.get("text_config", {})):
        c.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(twin, out)
    return out


# --- damaging a twin in place (bad-input tests) -------------------------------------------------------------------


def fp8_keys(folder: Path) -> List[str]:
    """The FP8 weight keys of a twin (those with a scale), sorted."""
    wm = _index(Path(folder))
    return sorted(k[: -len(SCALE)] + "weight" for k in wm if k.endswith("." + SCALE))


def _edit_file(folder: Path, key: str, fn: Callable[[Dict[str, torch.Tensor]], None]) -> str:
    """Rewrite the file that holds ``key`` after ``fn(tensors)`` edits its dict; refresh the index."""
    folder = Path(folder)
    wm = _index(folder)
    name = wm[key]
    tensors = _read_torch(folder / name)
    fn(tensors)
    _save(folder, name, tensors)
    wm = {k: v for k, v in wm.items() if v != name}
    wm.update({k: name for k in tensors})
    _write_index(folder, wm)
    return name


def _scale_key(folder: Path, weight: Optional[str]) -> Tuple[str, str]:
    weight = weight or fp8_keys(folder)[0]
    return weight, weight[: -len("weight")] + SCALE


def remove_scale(folder: Path, weight: Optional[str] = None) -> str:
    """Delete ``weight``'s scale (default: the first FP8 weight) from its file and the index; return the weight key."""
    weight, sk = _scale_key(folder, weight)
    _edit_file(folder, sk, lambda t: t.pop(sk))
    return weight


def reshape_scale(folder: Path, weight: Optional[str] = None, shape: Optional[Tuple[int, ...]] = None) -> str:
    """Give ``weight``'s scale a wrong shape (default: one extra row and column); return the weight key."""
    weight, sk = _scale_key(folder, weight)

    def fn(t):
        s = t[sk]
        new = tuple(shape) if shape is not None else (s.shape[0] + 1, s.shape[1] + 1)
        t[sk] = torch.ones(new, dtype=s.dtype)

    _edit_file(folder, sk, fn)
    return weight


def retype_scale(folder: Path, weight: Optional[str] = None, dtype: torch.dtype = torch.int32) -> str:
    """Store ``weight``'s scale in a wrong dtype (default I32, values 1); return the weight key."""
    weight, sk = _scale_key(folder, weight)

    def fn(t):
        t[sk] = torch.ones(t[sk].shape, dtype=dtype)

    _edit_file(folder, sk, fn)
    return weight


def poison_scale(folder: Path, weight: Optional[str] = None, value: float = float("inf")) -> str:
    """Put one non-finite value (inf or nan) in ``weight``'s scale; return the weight key."""
    weight, sk = _scale_key(folder, weight)

    def fn(t):
        s = t[sk].clone()
        s.view(-1)[0] = value
        t[sk] = s

    _edit_file(folder, sk, fn)
    return weight


def map_scales(folder: Path, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every scale ``s`` of a twin by ``fn(s)`` (same dtype), e.g. all ones or doubled."""
    folder = Path(folder)
    wm = _index(folder)
    for name in sorted({v for k, v in wm.items() if k.endswith("." + SCALE)}):
        tensors = _read_torch(folder / name)
        for k in tensors:
            if k.endswith("." + SCALE):
                tensors[k] = fn(tensors[k]).to(tensors[k].dtype)
        _save(folder, name, tensors)
    _write_index(folder, wm)


# --- 128-aligned checkpoints (what transformers' FP8 loader dequantizes correctly) --------------------------------

ALIGNED_TEXT = dict(
    checkpoints.TEXT,
    num_hidden_layers=2,
    full_attention_interval=2,  # one GDN layer, one attention layer
    layer_types=["linear_attention", "full_attention"],  # transformers ignores the interval
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,  # q_proj (gated) out 512, k/v out 128, o_proj in 256
    linear_num_key_heads=1,
    linear_key_head_dim=128,  # key_dim 128
    linear_num_value_heads=2,
    linear_value_head_dim=64,  # value_dim 128; conv_dim 2*128+128 = 384
)
ALIGNED_DENSE = dict(intermediate_size=256)
ALIGNED_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
ALIGNED_VISION = dict(checkpoints.VISION, out_hidden_size=128)


@contextlib.contextmanager
def _sizes(text: dict, dense: dict, moe: dict, vision: dict) -> Iterator[None]:
    saved = checkpoints.TEXT, checkpoints.DENSE, checkpoints.MOE, checkpoints.VISION
    checkpoints.TEXT, checkpoints.DENSE, checkpoints.MOE, checkpoints.VISION = text, dense, moe, vision
    try:
        yield
    finally:
        checkpoints.TEXT, checkpoints.DENSE, checkpoints.MOE, checkpoints.VISION = saved


def build_aligned(folder: Path, **kwargs) -> "checkpoints.Built":
    """``checkpoints.build`` with every FP8-quantized Linear dim a multiple of 128 (same keyword arguments).

    ``build`` reads the module-level size dicts at call time; they are swapped for the call and restored.
    """
    with _sizes(ALIGNED_TEXT, ALIGNED_DENSE, ALIGNED_MOE, ALIGNED_VISION):
        return checkpoints.build(Path(folder), **kwargs)


# --- transformers' own FP8 loader as a second reference -------------------------------------------------------------


@contextlib.contextmanager
def _accelerate_check_off() -> Iterator[None]:
    """transformers' FP8 quantizer refuses to start without ``accelerate``, which its dequantize path never uses."""
    from transformers.quantizers import quantizer_finegrained_fp8 as q

    saved = q.is_accelerate_available
    q.is_accelerate_available = lambda: True
    try:
        yield
    finally:
        q.is_accelerate_available = saved


def transformers_model(folder: Path) -> torch.nn.Module:
    """The twin loaded on CPU in float32 by transformers' own class, its FP8 loader dequantizing the weights.

    Trust it only on 128-aligned, per-expert checkpoints: transformers derives the block from the grid
    (rows // grid rows), which mis-sizes partial edge blocks.
    """
    import transformers
    from transformers import FineGrainedFP8Config

    config = json.loads((Path(folder) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    with _accelerate_check_off():
        model = cls.from_pretrained(str(folder), dtype=torch.float32,
                                    quantization_config=FineGrainedFP8Config(dequantize=True))
    return model.eval()


def logits_of(model: torch.nn.Module, input_ids) -> np.ndarray:
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    with torch.no_grad():
        return model(input_ids=ids).logits.float().numpy()


def transformers_logits(folder: Path, input_ids) -> np.ndarray:
    """Logits [batch, seq, vocab] of the twin as transformers' FP8 loader (dequantize=True) reads it, CPU float32."""
    return logits_of(transformers_model(folder), input_ids)
