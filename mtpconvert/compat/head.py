"""The MTP head as one runtime would read it.

:class:`Head` holds the head tensors found in some files under some key prefixes (prefix stripped).
Against it: the (bits, group) each quantized module was written with, read from its packed shapes,
beside the (bits, group) a runtime would build it with; the MoE expert layout (stacked, per-expert,
fused); and the canonical MLX head, the modules an MLX Qwen3.5 MTP layer holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .folder import Folder, _is_bare_head_key, _metadata, _tensors, _text

_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


@dataclass
class Head:
    """Head tensors one runtime would read, by canonical name (``fc.weight``, ``layers.0....``)."""

    files: List[str]
    tensors: Dict[str, dict]
    mlx_format: bool  # every file carries safetensors metadata format=mlx

    @property
    def quantized(self) -> List[str]:
        return sorted(k[: -len(".scales")] for k in self.tensors if k.endswith(".scales"))

    @property
    def linears(self) -> List[str]:
        """Modules with a matrix (or stacked matrices): quantized ones, and float weights of rank >= 2."""
        float_mats = [k[: -len(".weight")] for k, v in self.tensors.items()
                      if k.endswith(".weight") and len(v.get("shape") or []) >= 2]
        return sorted(set(float_mats) | set(self.quantized))

    def layers(self) -> set:
        return {int(m.group(1)) for k in self.tensors if (m := re.match(r"^layers\.(\d+)\.", k))}


def _head(folder: Folder, files: List[str], prefixes: Tuple[str, ...], bare: bool = False) -> Optional[Head]:
    """The head tensors in ``files`` under one of ``prefixes`` (stripped); with ``bare``, also
    unprefixed head keys (``fc.weight``, ``layers.0....``)."""
    tensors, used = {}, []
    for f in files:
        if f not in folder.headers:
            continue
        hit = False
        for k, v in _tensors(folder.headers[f]).items():
            p = next((p for p in prefixes if k.startswith(p)), None)
            if p is not None:
                tensors[k[len(p):]] = v
                hit = True
            elif bare and _is_bare_head_key(k):
                tensors[k] = v
                hit = True
        if hit:
            used.append(f)
    if not tensors:
        return None
    fmt = all(_metadata(folder.headers[f]).get("format") == "mlx" for f in used)
    return Head(used, tensors, fmt)


# --------------------------------------------------------------------------- precision


def _in_dims(name: str, tc: dict) -> Optional[int]:
    """Input features of a head module (needed to tell bits from packed shapes)."""
    h = tc.get("hidden_size")
    if name == "fc":
        return 2 * h if h else None
    last = name.rsplit(".", 1)[-1]
    if last in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "gate", "shared_expert_gate"):
        return h
    if last == "o_proj":
        n, d = tc.get("num_attention_heads"), tc.get("head_dim")
        return n * d if n and d else None
    if last == "down_proj":
        if ".switch_mlp." in name or ".experts." in name:
            return tc.get("moe_intermediate_size")
        if ".shared_expert." in name:
            return tc.get("shared_expert_intermediate_size")
        return tc.get("intermediate_size")
    return None


Bits = Tuple[int, int]  # (bits, group_size)
DEFAULT_DEQUANT = (4, 64)  # mtplx and vllm-mlx dequantize with these when the config has no bits


def _bits(head: Head, module: str, tc: dict) -> Optional[Bits]:
    """(bits, group_size) a quantized head module was written with, from its shapes."""
    w, s = head.tensors.get(module + ".weight"), head.tensors.get(module + ".scales")
    ind = _in_dims(module, tc)
    if not w or not s or not ind:
        return None
    wc, sc = (w.get("shape") or [0])[-1], (s.get("shape") or [0])[-1]
    if not wc or not sc or (wc * 32) % ind or ind % sc:
        return None
    return (wc * 32) // ind, ind // sc


def _quant(config: dict) -> dict:
    q = config.get("quantization") or config.get("quantization_config") or _text(config).get("quantization_config")
    return q if isinstance(q, dict) else {}


def _top(q: dict) -> Optional[Bits]:
    if "bits" in q and "group_size" in q:
        return int(q["bits"]), int(q["group_size"])
    return None


def _entry_bits(entry, q: dict) -> Optional[Bits]:
    """What a per-path quantization entry makes of a module: None = not quantized."""
    if entry is False:
        return None
    if isinstance(entry, dict):
        top = _top(q) or (None, None)
        return int(entry.get("bits", top[0])), int(entry.get("group_size", top[1]))
    return _top(q)


def _fmt_bits(b: Optional[Bits]) -> str:
    return f"{b[0]}-bit/g{b[1]}" if b else "unquantized"


def _quant_mismatches(head: Head, tc: dict, expect: Callable[[str], Optional[Bits]]) -> List[str]:
    """Quantized head modules the runtime would build with other (bits, group) than written."""
    bad = []
    for m in head.quantized:
        have = _bits(head, m, tc)
        want = expect(m)
        if have is not None and have != want:
            bad.append(f"{m} is {_fmt_bits(have)} but would be read as {_fmt_bits(want)}")
    return bad


def _without_biases(head: Head) -> List[str]:
    """Quantized modules stored without biases (mxfp4/nvfp4/mxfp8): not an affine triplet."""
    return [m for m in head.quantized if m + ".biases" not in head.tensors]


def _moe_expert_layout(head: Head) -> str:
    """stacked | per-expert | fused | none (dense) for the head's MoE layers."""
    keys = head.tensors
    if any(".mlp.switch_mlp." in k for k in keys):
        return "stacked"
    if any(".mlp.experts.gate_up_proj" in k for k in keys):
        return "fused"
    if any(_EXPERT_RE.match(k) for k in keys):
        return "per-expert"
    return "none"


# --------------------------------------------------------------------------- the canonical MLX head

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
          "mlp.shared_expert_gate")
SWITCH = ("mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj")
ROUTER = "mlp.gate"
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
HEAD_NORMS = ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm")


def _per_layer(names, n: int) -> List[str]:
    return [f"layers.{i}.{name}" for i in range(n) for name in names]


def _mlx_head_linears(moe: bool, n: int) -> List[str]:
    """Linear modules of the MLX head (MoE experts stacked as switch_mlp): what rapid-mlx builds."""
    mlp = (ROUTER,) + SHARED + SWITCH if moe else DENSE_MLP
    return ["fc"] + _per_layer(ATTN + mlp, n)


def _mlx_head_norms(n: int) -> List[str]:
    return list(HEAD_NORMS) + _per_layer(LAYER_NORMS, n)


def _missing_weights(head: Head, moe: bool, n: int) -> List[str]:
    need = [m + ".weight" for m in _mlx_head_linears(moe, n) + _mlx_head_norms(n)]
    return [k for k in need if k not in head.tensors]
