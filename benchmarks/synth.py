"""Write a synthetic raw Qwen3.5 / Qwen3-Next / GLM checkpoint shaped like a published one, without holding it
in memory.

Shapes, key names, dtypes and config come from tests/data/layouts/<model>/ (the published tables);
``--layers N`` keeps the first N decoder layers (plus the MTP head) so large models fit this machine.
Tensors are written one at a time in chunks (random values, zero-centred norms, ``[C,1,K]`` conv1d),
into shards named as the release names them (Qwen3.5: ``model.safetensors-000NN-of-000MM.safetensors``,
Qwen3-Next and GLM: ``model-000NN-of-000MM.safetensors``) with an index. Decoder layers are
``model.language_model.layers.N.`` (Qwen3.5) or ``model.layers.N.`` (Qwen3-Next, GLM: flat keys).
A GLM release's nextn head is one more layer, ``model.layers.{num_hidden_layers}.``: with ``--layers N``
it is kept whole and renumbered to ``model.layers.N.`` (the index the cut config's ``num_hidden_layers``
gives it); a GLM folder also gets a small stand-in ``tokenizer.json`` (mlx_lm.convert loads one).
``--sparse`` writes headers only (files keep their full size as holes): enough for
header-only work such as ``verify`` at full model size.

    python -m benchmarks.synth Qwen3.5-27B /tmp/synth-27b --layers 8 --shard-gb 1
    python -m benchmarks.synth Qwen3.5-122B-A10B /tmp/synth-122b --sparse
    python -m benchmarks.synth Qwen3-Next-80B-A3B-Instruct /tmp/synth-next --layers 2
    python -m benchmarks.synth GLM-4.5-Air /tmp/synth-glm --layers 2
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

import numpy as np

from tools import layouts  # the vendored published tables

GLM_TYPES = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # Qwen3.5 nested, Qwen3-Next flat


def load_table(model: str, layers: int | None, root: Path = layouts.LAYOUTS):
    config = layouts.config(model, root)
    tc0 = config.get("text_config", config)
    # GLM (DeepSeek-V3-style nextn): the head is layers num_hidden_layers .. + num_nextn_predict_layers - 1
    full = tc0.get("num_hidden_layers")
    nextn = range(full, full + int(tc0.get("num_nextn_predict_layers") or 0)) if isinstance(full, int) else range(0)
    rows = []
    for key, shape, dtype, _shard in layouts.rows(model, root):
        m = LAYER.match(key)
        if key.startswith("model.visual."):
            continue  # the vision tower is not converted by default; leave it out of the benchmark
        if layers is not None and m and int(m.group(1)) >= layers:
            i = int(m.group(1))
            if i not in nextn:
                continue
            # keep the nextn layer whole, at the index the cut config's num_hidden_layers gives it
            key = f"{key[:m.start(1)]}{layers + i - full}{key[m.end(1):]}"
        rows.append((key, list(shape), dtype))
    if layers is not None:
        tc = config.get("text_config", config)
        tc["num_hidden_layers"] = layers
        if isinstance(tc.get("layer_types"), list):
            tc["layer_types"] = tc["layer_types"][:layers]
    return config, rows


def shard_name(config: dict, i: int, total: int) -> str:
    """The release's shard names: Qwen3-Next's and GLM's ``model-000NN-of-000MM``, else Qwen3.5's."""
    if config.get("model_type") in ("qwen3_next", *GLM_TYPES):
        return f"model-{i:05d}-of-{total:05d}.safetensors"
    return f"model.safetensors-{i:05d}-of-{total:05d}.safetensors"


def nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]


POOL_ELEMS = 1 << 25


def fill(f, key: str, shape, dtype: str, rng: np.random.Generator, pool: np.ndarray,
         chunk_elems: int = 1 << 24) -> None:
    """Write N(0, scale) values: windows of one pre-drawn normal pool at random offsets.

    Drawing fresh normals runs at ~60 M values/s (minutes for a 27B-shaped source); the
    benchmarks only need realistic magnitudes, not independent values.
    """
    n = int(np.prod(shape, dtype=np.int64))
    scale = 0.02 if not key.endswith(("norm.weight", "A_log", "dt_bias")) else 0.1
    done = 0
    while done < n:
        m = min(chunk_elems, n - done)
        start = int(rng.integers(0, len(pool) - m + 1))
        x = pool[start:start + m] * np.float32(scale)
        if dtype == "F32":
            f.write(x.tobytes())
        elif dtype == "F16":
            f.write(x.astype(np.float16).tobytes())
        else:  # BF16: the high half of float32
            f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        done += m


def write(model: str, out: Path, layers: int | None, shard_gb: float, sparse: bool, seed: int = 0,
          root: Path = layouts.LAYOUTS) -> dict:
    config, rows = load_table(model, layers, root)
    out.mkdir(parents=True, exist_ok=True)
    limit = int(shard_gb * (1 << 30))
    shards, cur, size = [], [], 0
    for row in rows:
        b = nbytes(row[1], row[2])
        if cur and size + b > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(row)
        size += b
    shards.append(cur)
    total = len(shards)
    weight_map, total_bytes = {}, 0
    rng = np.random.default_rng(seed)
    pool = None if sparse else rng.standard_normal(POOL_ELEMS, dtype=np.float32)
    for i, rows_i in enumerate(shards, 1):
        name = shard_name(config, i, total)
        header, off = {}, 0
        for key, shape, dtype in rows_i:
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes(shape, dtype)]}
            off += nbytes(shape, dtype)
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            if sparse:
                f.truncate(8 + len(raw) + off)
            else:
                for key, shape, dtype in rows_i:
                    fill(f, key, shape, dtype, rng, pool)
        total_bytes += off
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if config.get("model_type") in GLM_TYPES and not (out / "tokenizer.json").exists():
        # mlx_lm.convert loads a tokenizer, and transformers has no file-less one for GLM (Qwen's loads
        # without files): a small byte-level BPE stands in for the release's tokenizer.json
        from mtpconvert.fixture.language import MarkovLanguage, write_tokenizer
        write_tokenizer(out, MarkovLanguage().words, 512)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
    return {"shards": total, "bytes": total_bytes, "tensors": len(weight_map)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a folder name under the layouts folder, e.g. Qwen3.5-27B, "
                    "Qwen3-Next-80B-A3B-Instruct or GLM-4.5-Air")
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--sparse", action="store_true", help="headers only (holes for the data)")
    ap.add_argument("--layouts", type=Path, default=layouts.LAYOUTS, help="folder of published layouts "
                    "(default: the copy vendored in tests/data/layouts)")
    args = ap.parse_args(argv)
    info = write(args.model, args.out, args.layers, args.shard_gb, args.sparse, root=args.layouts)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
