"""A raw Qwen3.8-Flash-Next (``qwen4_exp``) source whose n-gram ("PLE") tables have the release's part shape, for
the conversion's memory bound: row width 160 (16 hash heads over a 2560-wide PLE embedding) and ~2.5 M rows a
part, as the release's 128 parts of ~3.2e8 rows are; the rest of the model is the tiny one transformers' own
classes build (``tests.checkpoints_qwen4_exp``), stored in BF16.

A whole release table (~51 B parameters) does not fit this machine's disk, so each PLE layer's table here has
``--parts`` parts of ``--rows-per-part`` rows (the config's ``ngram_vocab_size_base`` chosen so the prime-sized
heads add up to that, the hashing buffers recomputed to match); ``--parts-per-file`` of them share a shard file,
as the release packs several parts a file. Values are random (a memory benchmark: nothing decodes them).

    python -m benchmarks.synth_qwen4_exp /tmp/synth-q4x --ple-layers 2 --parts 4 --parts-per-file 2
    python -m benchmarks.convert_bench /tmp/synth-q4x --bits 4 --tools mtpconvert --repeat 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.synth import POOL_ELEMS, fill
from mtpconvert.families.qwen4_exp.spec import ngram_table_rows, primes_after

HEADS_PER_NGRAM, NGRAM_SIZE, PLE_DIM = 8, 3, 2560  # the release's: 16 hash heads, rows 160 wide
NGRAM_HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
TABLE = ".ple.ple_embedding.ngram_embedding.shard_"


def _tiny(folder: Path, ple_layers: int, parts: int):
    """The tiny release (transformers' classes) with the release's hashing shape and ``ple_layers`` PLE layers."""
    from tests.checkpoints_qwen4_exp import build

    def edit(text):
        text.update(heads_per_ngram=HEADS_PER_NGRAM, ngram_size=NGRAM_SIZE, ple_embed_dim=PLE_DIM,
                    split_ngram_parts=parts, make_ngram_vocab_size_divisible_by=128 * parts,
                    ple_layer_ids=[1, 3][:ple_layers])

    return build(folder, text_edit=edit)


def _base_for(rows: int) -> int:
    """An ``ngram_vocab_size_base`` whose first PLE layer's 16 prime-sized heads add up to about ``rows``."""
    return max(NGRAM_HEADS, rows // NGRAM_HEADS)


def _buffers(base: int, p: int):
    primes = np.array(primes_after(base - 1, (p + 1) * NGRAM_HEADS)[p * NGRAM_HEADS:], dtype=np.int64)
    return primes, np.concatenate([[0], np.cumsum(primes)[:-1]]).astype(np.int64)


def _as_stored(value):
    """(safetensors dtype, bytes): float tensors as BF16 (the release's dtype), integer buffers as stored."""
    a = value.detach().cpu()
    if a.is_floating_point():
        bits = a.float().numpy().view(np.uint32)
        return "BF16", ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    return "I64", a.numpy().astype(np.int64).tobytes()


def _header(small: dict, big: list) -> tuple:
    """(safetensors header, data bytes) of a shard holding ``small`` {key: (dtype, shape, bytes)}, then each ``big``
    (key, shape) in BF16."""
    header, off = {}, 0
    for key, (dtype, shape, raw) in small.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    for key, shape in big:
        n = int(np.prod(shape, dtype=np.int64)) * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    return header, off


def _write_shard(path: Path, small: dict, big: list, rng, pool) -> dict:
    header, _ = _header(small, big)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in small.values():
            f.write(data)
        for key, shape in big:
            fill(f, key, shape, "BF16", rng, pool)
    return header


def _small_tensors(tiny, tc: dict, base: int, parts: int) -> tuple:
    """({key: (dtype, shape, bytes)} of everything but the n-gram tables, the hashing buffers recomputed for
    ``base``; [(key, shape)] of the tables' parts at the new row counts)."""
    small, layers = {}, set()
    for key, value in tiny.tensors.items():
        if TABLE in key:
            layers.add(key.split(TABLE)[0])
        else:
            small[key] = (*_as_stored(value)[:1], tuple(value.shape), _as_stored(value)[1])
    big = []
    for p, layer in enumerate(sorted(layers, key=lambda k: int(k.split(".layers.")[1].split(".")[0]))):
        rows = ngram_table_rows(base, NGRAM_HEADS, p, tc["make_ngram_vocab_size_divisible_by"])
        vocab, offsets = _buffers(base, p)
        buffers = f"{layer}.ple.ple_embedding."
        small[buffers + "ngram_heads_vocab_sizes"] = ("I64", vocab.shape, vocab.tobytes())
        small[buffers + "ngram_heads_offsets"] = ("I64", offsets.shape, offsets.tobytes())
        big += [(f"{layer}{TABLE}{i}.weight", (rows // parts, PLE_DIM // NGRAM_HEADS)) for i in range(parts)]
    return small, big


def write(out: Path, ple_layers: int, parts: int, rows_per_part: int, parts_per_file: int, seed: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = _tiny(Path(tmp) / "tiny", ple_layers, parts)
        config = json.loads((tiny.path / "config.json").read_text())
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if (tiny.path / extra).exists():
                shutil.copy(tiny.path / extra, out / extra)
    tc = config["text_config"]
    base = _base_for(parts * rows_per_part)
    tc.update(ngram_vocab_size_base=base, dtype="bfloat16")
    small, big = _small_tensors(tiny, tc, base, parts)
    files = [(small, [])] + [({}, big[i:i + parts_per_file]) for i in range(0, len(big), parts_per_file)]
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(POOL_ELEMS, dtype=np.float32)
    weight_map, total = {}, 0
    for i, (tensors, tables) in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        header = _write_shard(out / name, tensors, tables, rng, pool)
        weight_map.update({k: name for k in header})
        total += _header(tensors, tables)[1]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    return {"files": len(files), "bytes": total, "table_parts": len(big), "part_shape": list(big[0][1]),
            "largest_file_bytes": max((out / n).stat().st_size for n in set(weight_map.values()))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ple-layers", type=int, default=2, choices=(1, 2))
    ap.add_argument("--parts", type=int, default=4, help="n-gram table parts a PLE layer (split_ngram_parts)")
    ap.add_argument("--rows-per-part", type=int, default=2_500_000, help="about the release's ~2.5 M")
    ap.add_argument("--parts-per-file", type=int, default=2)
    args = ap.parse_args(argv)
    print(json.dumps(write(args.out, args.ple_layers, args.parts, args.rows_per_part, args.parts_per_file)))


if __name__ == "__main__":
    main()
