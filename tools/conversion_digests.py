"""sha256 of every file of a matrix of conversions: proof that a refactor changes no output byte.

    python -m tools.conversion_digests --work /tmp/digests > before.json
    ... change the code ...
    python -m tools.conversion_digests --work /tmp/digests > after.json && diff before.json after.json

Sources: the four bundled fixtures, and the tests' raw builders (VLM wrapper with vision, fused and
published-style experts, tied embeddings, bf16, two MTP layers, a config that omits the MTP count).
Options: float (source dtype, bf16, f16), affine 4/8-bit, mxfp8, ``--mtp match``, ``--mtp-bits``,
``--mtp drop``, the in-model layout, ``--keep-vision``. Conversions run through ``execute`` with no
post-checks (checks read a folder; the one file they add, ``mtplx_runtime.json`` after a passing full
smoke, holds a timestamp and is not a conversion output).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

OPTIONS = {
    "float": dict(),
    "bf16": dict(dtype="bfloat16"),
    "f16": dict(dtype="float16"),
    "q4": dict(bits=4),
    "q8": dict(bits=8, group_size=32),
    "q4-match": dict(bits=4, mtp="match"),
    "q4-mtpbits8": dict(bits=4, mtp_bits=8),
    "mxfp8-bf16": dict(bits=8, mode="mxfp8", dtype="bfloat16"),
    "q4-drop": dict(bits=4, mtp="drop"),
    "q4-inmodel": dict(bits=4, mtp_layout="in-model"),
    "float-inmodel": dict(mtp_layout="in-model"),
}
VISION_OPTIONS = {"q4-vision": dict(bits=4, keep_vision=True), "float-vision": dict(keep_vision=True)}


def folder_digest(folder: Path) -> dict:
    """Every file under ``folder`` by relative path: a link is recorded as its target, a file by hash."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def sources(work: Path) -> dict:
    from tests.checkpoints import build
    from mtpconvert.fixture import DATA

    found = {p.name: (p, False) for p in sorted(DATA.iterdir()) if p.is_dir()}
    built = {
        "vlm-dense": dict(),
        "vlm-moe-fused": dict(moe=True, experts="fused"),
        "vlm-moe-published": dict(moe=True, experts="published35", dtype="bfloat16", shards=3,
                                  shard_style="qwen35"),
        "text-dense-tied-bf16": dict(wrapper="text", tie=True, dtype="bfloat16"),
        "text-moe-2mtp": dict(wrapper="text", moe=True, mtp_layers=2),
        "vlm-dense-tie-top": dict(tie=True, tie_top_level_only=True, shards=2, shard_style="hf"),
    }
    for name, kwargs in built.items():
        path = work / "src" / name
        if not path.exists():
            build(path, seed=3, **kwargs)
        found[name] = (path, name.startswith("vlm"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (sources are built once)")
    parser.add_argument("--only", default=None, help="comma-separated source names")
    args = parser.parse_args()
    from tests.checkpoints import convert_folder

    digests = {}
    for name, (src, vision) in sources(args.work).items():
        if args.only and name not in args.only.split(","):
            continue
        for option_name, kwargs in {**OPTIONS, **(VISION_OPTIONS if vision else {})}.items():
            out = args.work / "out" / f"{name}--{option_name}"
            if out.exists():
                shutil.rmtree(out)
            try:
                convert_folder(src, out, **kwargs)
                digests[f"{name}--{option_name}"] = folder_digest(out)
            except Exception as error:  # an option a source refuses is part of the record too
                digests[f"{name}--{option_name}"] = f"{type(error).__name__}: {error}"
            shutil.rmtree(out, ignore_errors=True)
    json.dump(digests, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
