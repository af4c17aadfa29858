"""Write the block-FP8 twin of a raw checkpoint the way Qwen ships its FP8 releases, one tensor in memory at a time.

Files ``layers-{i}.safetensors``, ``mtp.safetensors`` and ``outside.safetensors`` with an index; the
Linears of attention, linear attention, MLP and experts as F8_E4M3 plus a BF16 ``weight_scale_inv``
per 128x128 block (amax / 448); everything else as stored. For the FP8-vs-BF16 source benchmark
(``convert_bench.py --fp8-twin``): the twin of a synthetic 27B-shaped source converts to an output
of the same shapes and bytes.

    python -m benchmarks.synth Qwen3.5-27B /tmp/synth --layers 4 --shard-gb 2
    python -m benchmarks.fp8_twin /tmp/synth /tmp/synth-fp8
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

BLOCK = 128
FP8_LINEARS = re.compile(r"\.(in_proj_qkv|in_proj_z|out_proj|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                         r"\.weight$")
LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def block_fp8(w: mx.array):
    """(F8_E4M3 codes as uint8, bf16 scale [ceil(out/128), ceil(in/128)]) with scale = block amax / 448."""
    rows, cols = w.shape
    pad = mx.pad(w.astype(mx.float32), [(0, -rows % BLOCK), (0, -cols % BLOCK)])
    blocks = pad.reshape(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
    scale = (mx.maximum(mx.max(mx.abs(blocks), axis=(1, 3)), 1e-12) / 448).astype(mx.bfloat16)
    grid = mx.repeat(mx.repeat(scale.astype(mx.float32), BLOCK, 0), BLOCK, 1)[:rows, :cols]
    return mx.to_fp8(w.astype(mx.float32) / grid), scale


def file_of(key: str) -> str:
    if key.startswith("mtp."):
        return "mtp.safetensors"
    m = LAYER.match(key)
    return f"layers-{m.group(1)}.safetensors" if m else "outside.safetensors"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    index_path = args.src / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())["weight_map"]
    else:  # a single-file checkpoint
        (single,) = args.src.glob("*.safetensors")
        index = {k: single.name for k in mx.load(str(single))}
    by_file = {}
    for key in index:
        by_file.setdefault(file_of(key), []).append(key)
    weight_map = {}
    for name, keys in sorted(by_file.items()):
        tensors = {}
        for key in sorted(keys):
            w = mx.load(str(args.src / index[key]))[key]  # lazy: only this tensor is read
            if FP8_LINEARS.search(key) and w.ndim == 2:
                codes, scale = block_fp8(w)
                tensors[key], tensors[key + "_scale_inv"] = codes, scale
            else:
                tensors[key] = w
            mx.eval(tensors)
        fp8_keys = {k for k in tensors if k + "_scale_inv" in tensors}
        write(args.out / name, {k: ("F8_E4M3" if k in fp8_keys else ST[v.dtype], v) for k, v in tensors.items()})
        weight_map.update({k: name for k in tensors})
        del tensors
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    config = json.loads((args.src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for f in args.src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, args.out / f.name)


ST = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}
RAW = {mx.bfloat16: mx.uint16}  # numpy has no bfloat16: its bits go out as uint16


def write(path: Path, tensors: dict) -> None:
    """A safetensors file of ``{key: (dtype name, array)}``, in key order."""
    header, offset, data = {"__metadata__": {"format": "pt"}}, 0, []
    for key in sorted(tensors):
        dtype, arr = tensors[key]
        raw = np.asarray(arr.view(RAW.get(arr.dtype, arr.dtype)))
        header[key] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        data.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for raw in data:
            f.write(raw.tobytes())


if __name__ == "__main__":
    main()
