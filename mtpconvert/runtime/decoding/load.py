"""Load a converted folder: the backbone as its library loads it, plus our MTP head.

The backbone comes from its family's adapter (``Family.backbone``: mlx-lm's ``load_model`` unchanged, which
drops ``mtp.*``, or mlx-vlm's loader); the head is built by that adapter from the backbone's own layers,
quantized exactly as config.json says, and filled from wherever the folder keeps it: the ``mtp.safetensors``
sidecar or the family's head prefix (``language_model.mtp.*``) inside the shards (experts stacked, per expert or
fused).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import infer_quant_config

from ...errors import LayoutError
from ...families import family_for
from ...families.base import RAW_TEXT, RAW_VLM, Family
from ...io.checkpoint import load_json, open_checkpoint
from ..backbone import Backbone
from .heads import stack_experts
from .locate import HEAD_PREFIXES, locate_mtp


@dataclass
class MTPModel:
    backbone: Backbone  # the loaded model, reached by role through its family's adapter
    head: nn.Module  # the head of the family's design (runtime.decoding.heads)
    config: dict

    @property
    def model(self) -> nn.Module:
        """The model as its library built it: what that library's own generate loop and caches take."""
        return self.backbone.model

    @property
    def family(self) -> Family:
        return self.backbone.family

    def embed(self, tokens: mx.array) -> mx.array:
        """The embedding the head reads: its own where it has one (GLM-4.x's nextn), else the backbone's."""
        if "embed_tokens" in self.head:
            return self.head.embed_tokens(tokens)
        return self.backbone.embed(tokens)

    def draft_logits(self, state: mx.array) -> mx.array:
        """Logits of a head state: through the head's own output projection where it has one."""
        if "shared_head" in self.head:
            return self.head.shared_head.head(self.head.readout(state))
        return self.backbone.project(self.head.readout(state))

    def logits(self, hidden: mx.array) -> mx.array:
        return self.backbone.logits(hidden)


def _mtp_weights(path: Path, family: Family) -> Dict[str, mx.array]:
    """The head's tensors by head-local name (``fc.weight``, ``layers.0...``), experts stacked."""
    located = locate_mtp(path)
    if located is None:
        return {}
    by_file = defaultdict(list)
    for name, info in located.tensors.items():
        by_file[info.file].append(name)
    weights = {}
    for file, names in by_file.items():
        stored = mx.load(str(file))
        weights.update({n: stored[located.prefix + n] for n in names})
    return stack_experts(weights, family)


def float32_experts_on_cpu(module: nn.Module) -> int:
    """Cast float expert stacks to float32 when running on the CPU; return how many were cast.

    MLX's CPU ``gather_mm`` is float32-only, so a bf16/fp16 MoE cannot run there as stored;
    in float32 it runs (quantized experts use ``gather_qmm`` and are left alone). mlx-lm's ``SwitchLinear`` and
    mlx-vlm's copy of it (its backbones and heads) alike.
    """
    if mx.default_device() != mx.cpu:
        return 0
    cast = 0
    for _, m in module.named_modules():
        float_switch = type(m) is SwitchLinear or (type(m).__name__ == "SwitchLinear" and "scales" not in m)
        if float_switch and m.weight.dtype != mx.float32:
            m.weight = m.weight.astype(mx.float32)
            cast += 1
    return cast


def _refuse_raw(path: Path) -> None:
    """A raw Hugging Face folder has an MTP head but no MLX layout yet: say so, not "no MTP head"."""
    try:
        ckpt = open_checkpoint(path)
        style = family_for(ckpt.config).style_of(ckpt.tensors)
    except Exception:  # noqa: BLE001 - loading below names what is wrong with the folder
        return
    if style in (RAW_VLM, RAW_TEXT):
        raise LayoutError("this is a raw Hugging Face checkpoint: convert it first", file=path,
                          hint=f"mtpconvert convert {path} OUT")


def load(path: Path, lazy: bool = False) -> MTPModel:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise LayoutError("not a converted model folder: no config.json", file=path)
    _refuse_raw(path)
    family = family_for(load_json(path / "config.json", "config.json"))
    backbone = family.backbone_class().load(path, family, lazy=lazy)
    config = backbone.config
    n = family.spec(config).mtp_layers or 0  # the family's count keys (Qwen3-Next also num_nextn_predict_layers)
    weights = _mtp_weights(path, family)
    if n == 0 or not weights:
        raise LayoutError(
            "no MTP head: " + ("config says mtp_num_hidden_layers=0" if n == 0
                               else f"no mtp.safetensors and no {family.head_prefix}* tensors"),
            file=path,
            hint="convert the original release with `mtpconvert convert` (stock mlx_lm.convert drops mtp.*)",
        )
    head = backbone.make_head(n)
    quant: Optional[dict] = config.get("quantization")
    if quant:
        def predicate(p, m):
            for prefix in HEAD_PREFIXES:  # config.json names a head module by either
                if (entry := quant.get(prefix + p)) is not None:
                    return entry
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return infer_quant_config(p, m, weights)

        nn.quantize(head, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"),
                    class_predicate=predicate)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise LayoutError(f"MTP weights do not fit the MTP head: {e}", file=path) from e
    float32_experts_on_cpu(backbone.model)
    float32_experts_on_cpu(head)
    if not lazy:
        mx.eval(head.parameters())
    head.eval()
    return MTPModel(backbone, head, config)
