"""Re-package a converted folder's MTP head into another on-disk layout (research tool).

mtpconvert (today) writes the head inside the model shards as ``language_model.mtp.*``.
This script rewrites such a folder into the layout variants the interop harness compares,
so the runtimes can be run on them before the converter writes them natively:

  in-model          unchanged copy (``language_model.mtp.*`` inside ``model*.safetensors``)
  sidecar           proposed default: backbone shards + index with no ``mtp.`` key; the head in a
                    root ``mtp.safetensors`` as ``mtp.*`` with safetensors metadata
                    ``{"format": "mlx"}``; config ``mlx_lm_extra_tensors.mtp_file``; per-path
                    quantization entries of the head renamed ``language_model.mtp.X`` -> ``mtp.X``
  model-mtp         the same sidecar named ``model-mtp.safetensors`` (matched by mlx-lm's
                    ``model*.safetensors`` glob: shows the double-shift hazard of mlx-lm < 0.32)
  in-model-experts  in-model, with the MTP layer's stacked ``switch_mlp`` experts split back into
                    ``experts.{e}.{proj}.weight`` (float heads only): what the mlx-lm PR #990 branch
                    can stack

Options for ``sidecar``: ``--index-lists-sidecar`` also lists the head's keys in
``model.safetensors.index.json`` (pointing at the sidecar), to check what each runtime does with it.

Run with the project venv (needs mlx):
    python interop/repack.py SRC DST --layout sidecar
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

INMODEL_PREFIX = "language_model.mtp."
LAYOUTS = ("in-model", "sidecar", "model-mtp", "in-model-experts")


def _shards(src: Path):
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values())), json.loads(index.read_text())
    return sorted(p.name for p in src.glob("model*.safetensors")), None


def _rename_quant(cfg: dict) -> None:
    for block in ("quantization", "quantization_config"):
        q = cfg.get(block)
        if isinstance(q, dict):
            cfg[block] = {("mtp." + k[len(INMODEL_PREFIX):] if k.startswith(INMODEL_PREFIX) else k): v
                          for k, v in q.items()}


def repack(src: Path, dst: Path, layout: str, index_lists_sidecar: bool = False) -> dict:
    import mlx.core as mx

    if layout not in LAYOUTS:
        raise SystemExit(f"unknown layout {layout!r}; one of {LAYOUTS}")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    cfg = json.loads((src / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    shards, index = _shards(src)
    weight_map: dict = {}
    head: dict = {}
    total = 0
    for name in shards:
        tensors = mx.load(str(src / name))
        keep = {}
        for k, v in tensors.items():
            if k.startswith(INMODEL_PREFIX) and layout in ("sidecar", "model-mtp"):
                head["mtp." + k[len(INMODEL_PREFIX):]] = v
            else:
                keep[k] = v
        if layout == "in-model-experts":
            keep = _unstack_mtp_experts(keep, int(tc.get("num_experts", 0) or 0))
        mx.save_safetensors(str(dst / name), keep, metadata={"format": "mlx"})
        for k, v in keep.items():
            weight_map[k] = name
            total += v.nbytes
    side_name = {"sidecar": "mtp.safetensors", "model-mtp": "model-mtp.safetensors"}.get(layout)
    if side_name:
        if not head:
            raise SystemExit(f"{src}: no {INMODEL_PREFIX}* tensors to move")
        mx.save_safetensors(str(dst / side_name), head, metadata={"format": "mlx"})
        if index_lists_sidecar:
            for k, v in head.items():
                weight_map[k] = side_name
                total += v.nbytes
        _rename_quant(cfg)
        cfg["mlx_lm_extra_tensors"] = {"mtp_file": side_name, "mtp_tensor_count": len(head)}
    meta = dict((index or {}).get("metadata", {}))
    meta["total_size"] = total
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    return {"layout": layout, "folder": str(dst), "head_tensors": len(head) or None,
            "index_lists_sidecar": bool(side_name and index_lists_sidecar)}


def _unstack_mtp_experts(tensors: dict, num_experts: int) -> dict:
    out = {}
    for k, v in tensors.items():
        if k.startswith(INMODEL_PREFIX) and ".mlp.switch_mlp." in k:
            if not k.endswith(".weight") or any(k.replace(".weight", s) in tensors for s in (".scales",)):
                raise SystemExit(f"{k}: quantized experts cannot be split per expert (PR #990 stacks floats)")
            base, proj = k.rsplit(".switch_mlp.", 1)  # proj = "gate_proj.weight"
            if v.shape[0] != num_experts:
                raise SystemExit(f"{k}: {v.shape[0]} experts, config says {num_experts}")
            for e in range(num_experts):
                out[f"{base}.experts.{e}.{proj}"] = v[e]
        else:
            out[k] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layout", choices=LAYOUTS, default="sidecar")
    ap.add_argument("--index-lists-sidecar", action="store_true")
    a = ap.parse_args(argv)
    print(json.dumps(repack(a.src, a.dst, a.layout, a.index_lists_sidecar)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
