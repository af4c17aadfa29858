"""Build a raw checkpoint with a vision tower for the ``--keep-vision`` interop variant.

The bundled fixtures (``mtpconvert/fixture/data``) are text-only: their config has no
``vision_config`` and their shards no ``model.visual.*`` tensors. This writes the **trained** dense
fixture (backbone, MTP head, tokenizer: unchanged bytes) plus a random vision tower made with
transformers' own ``Qwen3_5ForConditionalGeneration`` (the vision dimensions of
``tests/checkpoints.py``'s ``VISION``, randomised like its ``build`` helpers), with the config's
``vision_config``. The head keeps drafting well (trained), and the converted folder loads in mlx-vlm
as a VLM (vision tower present, loaded strictly).

Run with the project venv (needs torch, transformers, safetensors):
    python -m interop.vision_fixture OUT [--fixture mtpconvert/fixture/data/tiny-qwen35-mtp]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# tests/checkpoints.py's VISION, with the output width set to the fixture's hidden size
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=8, spatial_merge_size=2,
              temporal_patch_size=2)


def build(out: Path, fixture: Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = json.loads((fixture / "config.json").read_text())
    text = dict(config["text_config"])
    vision = dict(VISION, out_hidden_size=text["hidden_size"])
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    g = torch.Generator().manual_seed(seed)
    visual = {}
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            # as tests/checkpoints.py _randomise: zero-centred 1-D params, scaled-normal matrices
            v = 0.1 * torch.randn(p.shape, generator=g) if p.ndim == 1 else (
                torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)
            visual[f"model.visual.{name}"] = v.to(torch.float32)
    vision_config = model.config.vision_config.to_dict()

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in fixture.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    tensors = {}
    for f in sorted(fixture.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    dtype = next(iter(tensors.values())).dtype
    tensors.update({k: v.to(dtype).contiguous() for k, v in visual.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["vision_config"] = {k: v for k, v in vision_config.items() if k not in ("transformers_version",)}
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if getattr(model.config, k, None) is not None:
            config[k] = getattr(model.config, k)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--fixture", type=Path, default=ROOT / "mtpconvert" / "fixture" / "data" / "tiny-qwen35-mtp")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(build(a.out, a.fixture, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
