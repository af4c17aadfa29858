"""Is mtpconvert's backbone what mlx_lm.convert writes from the same source, and is the head all there?

Compares every tensor of OURS's backbone shards (every ``*.safetensors`` at its top level but the
``mtp.safetensors`` sidecar) with MLX's (``mlx_lm.convert``'s folder): the same keys, and for each the
same dtype, shape and bytes (sha256 of the stored bytes, read in 16 MiB pieces, so a folder of any
size is checked in little memory). With ``--source RAW`` (a GLM source) it also counts the head: the sidecar's
``mtp.*`` tensors against the raw nextn layer's (``model.layers.{num_hidden_layers}.*`` in RAW; the
per-expert ``experts.{e}.{proj}`` are stacked into one ``switch_mlp.{proj}`` each, a whole
``kv_b_proj`` is split into ``embed_q`` + ``unembed_out``), and checks each has its MLX shape.

    python -m benchmarks.same_backbone /tmp/out-ours /tmp/out-mlx --source /tmp/synth-glm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import sys
from pathlib import Path

PER_EXPERT = re.compile(r"^(?P<mlp>(?:.*\.)?mlp)\.experts\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h, 8 + n


def tensors(files) -> dict:
    """key -> (dtype, shape, sha256 of its bytes)."""
    out = {}
    for path in files:
        h, base = header(path)
        with open(path, "rb", buffering=0) as f:
            for key, info in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                a, b = info["data_offsets"]
                f.seek(base + a)
                digest, left = hashlib.sha256(), b - a
                while left:
                    chunk = f.read(min(left, 1 << 24))
                    digest.update(chunk)
                    left -= len(chunk)
                out[key] = (info["dtype"], tuple(info["shape"]), digest.hexdigest())
    return out


def head_count(source: Path, sidecar: dict) -> list[str]:
    """Problems with the sidecar against the raw nextn layer (empty: none)."""
    n = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    prefix = f"model.layers.{n}."
    raw = {}
    for path in sorted(source.glob("*.safetensors")):
        raw.update({k: v for k, v in header(path)[0].items() if k.startswith(prefix)})
    expect = {}
    for key, info in raw.items():
        rest = key[len(prefix):]
        if (m := PER_EXPERT.match(rest)) is not None:
            name = f"mtp.{m['mlp']}.switch_mlp.{m['proj']}.weight"
            e, shape = expect.get(name, (0, tuple(info["shape"])))
            expect[name] = (e + 1, shape)
        elif rest == "self_attn.kv_b_proj.weight":
            expect["mtp.self_attn.embed_q.weight"] = (1, None)
            expect["mtp.self_attn.unembed_out.weight"] = (1, None)
        else:
            rest = {"shared_head.norm.weight": "shared_head_norm.weight"}.get(rest, rest)
            expect[f"mtp.{rest}"] = (1, tuple(info["shape"]))
    problems = [f"missing from the sidecar: {k}" for k in sorted(set(expect) - set(sidecar))]
    problems += [f"not from the nextn layer: {k}" for k in sorted(set(sidecar) - set(expect))]
    for name, (count, shape) in expect.items():
        got = sidecar.get(name)
        if got is None or shape is None:
            continue
        want = (count, *shape) if count > 1 else shape
        if got[1] != want:
            problems.append(f"{name}: shape {list(got[1])}, expected {list(want)}")
    print(f"head: {len(raw)} raw nextn tensors (model.layers.{n}.*) -> {len(expect)} expected mtp.* tensors; "
          f"the sidecar holds {len(sidecar)}")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ours", type=Path, help="mtpconvert's output folder")
    ap.add_argument("mlx", type=Path, help="mlx_lm.convert's output folder, same source and bits")
    ap.add_argument("--source", type=Path, help="the raw source: also count the head in mtp.safetensors")
    args = ap.parse_args(argv)
    ours = tensors(p for p in sorted(args.ours.glob("*.safetensors")) if p.name != "mtp.safetensors")
    theirs = tensors(sorted(args.mlx.glob("*.safetensors")))
    problems = [f"only in ours: {k}" for k in sorted(set(ours) - set(theirs))]
    problems += [f"only in mlx_lm's: {k}" for k in sorted(set(theirs) - set(ours))]
    same = [k for k in ours if k in theirs and ours[k] == theirs[k]]
    problems += [f"{k}: ours {ours[k][:2]} {ours[k][2][:12]}, mlx_lm's {theirs[k][:2]} {theirs[k][2][:12]}"
                 for k in sorted(ours) if k in theirs and ours[k] != theirs[k]]
    print(f"backbone: {len(ours)} tensors in ours, {len(theirs)} in mlx_lm's, {len(same)} with the same "
          "dtype, shape and bytes")
    if args.source:
        sidecar = tensors([args.ours / "mtp.safetensors"])
        problems += head_count(args.source, sidecar)
    for p in problems:
        print("  " + p)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
