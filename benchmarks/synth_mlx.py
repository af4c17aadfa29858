"""A converted-shaped MLX model with random weights, built in memory: no raw checkpoint, no disk.

``build("Qwen3.5-27B", layers=64, bits=4)`` returns an ``MTPModel`` whose backbone is mlx-lm's own
module for the published config (tools/layouts, or ``--layouts``), with every Linear and the
embedding quantized as ``mlx_lm.convert -q`` would (``nn.quantize``'s default predicate; dense
Qwen3.5 has no quant_predicate), float parameters in bf16 except ``A_log`` (mlx-lm's
cast_predicate), and a bf16 MTP head (mtpconvert's default ``--mtp keep``) built by the runtime's
``MTPHead``. Same shapes, dtypes and kernels as a converted folder loaded by ``runtime.decoding.load``,
for cost measurements: a 27B-shaped 4-bit model is ~15 GB, which a GPU machine builds in seconds
(random init + ``mx.quantize`` on the device, one layer at a time) instead of writing 54 GB of raw
bf16 and converting it (more than that machine's disk). The weights are random: greedy tokens mean
nothing and the head never agrees with the backbone (use ``bench --oracle-acceptance``).

    python -m benchmarks.synth_mlx Qwen3.5-27B --layers 4        # build, print sizes and one decode step
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from tools import layouts  # the vendored published tables

ROOT = Path(__file__).resolve().parents[1]


def default_layouts() -> Path:
    shared = ROOT.parent / "shared" / "layouts"
    return shared if shared.is_dir() else layouts.LAYOUTS


def build(model: str = "Qwen3.5-27B", layers: int = None, bits: int = 4, group_size: int = 64,
          root: Path = None, seed: int = 0, config_edit=None):
    from mlx_lm.utils import _get_classes

    from mtpconvert.families import family_for
    from mtpconvert.runtime.decoding.load import MTPModel

    mx.random.seed(seed)
    config = layouts.config(model, root or default_layouts())
    tc = config.get("text_config", config)
    if layers is not None:
        tc["num_hidden_layers"] = layers
        if isinstance(tc.get("layer_types"), list):
            tc["layer_types"] = tc["layer_types"][:layers]
    if config_edit:
        config_edit(tc)
    if bits:
        config["quantization"] = {"group_size": group_size, "bits": bits}
    model_class, args_class = _get_classes(config)
    net = model_class(args_class.from_dict(config))  # lazy random parameters
    if bits:
        nn.quantize(net, group_size=group_size, bits=bits)

    def cast(path, v):
        if mx.issubdtype(v.dtype, mx.floating) and not path.endswith("A_log"):
            return v.astype(mx.bfloat16)
        return v

    net.update(tree_map_with_path(cast, net.parameters()))
    family = family_for(config)
    backbone = family.backbone_class()(net, family, config)
    for layer in backbone.layers:  # one layer's float32 init + quantization in memory at a time
        mx.eval(layer.parameters())
    mx.eval(net.parameters())
    net.eval()
    head = backbone.make_head(family.mtp_layers_in(config) or 1)
    head.update(tree_map_with_path(cast, head.parameters()))
    mx.eval(head.parameters())
    head.eval()
    return MTPModel(backbone, head, config)


def nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="Qwen3.5-27B")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--layouts", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    m = build(args.model, args.layers, args.bits, root=args.layouts)
    built = time.perf_counter() - t0
    out = m.model(mx.array([[1, 2, 3]]))
    mx.eval(out)
    print(json.dumps({"model": args.model, "layers": args.layers, "bits": args.bits, "build_s": round(built, 1),
                      "backbone_gb": round(nbytes(m.model) / 1e9, 2), "head_gb": round(nbytes(m.head) / 1e9, 2),
                      "device": str(mx.default_device()), "logits": list(out.shape)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
