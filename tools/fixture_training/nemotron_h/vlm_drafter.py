"""The Nemotron-H folder's head as mlx-vlm 0.7.10's ``nemotron_h_mtp`` drafter: greedy acceptance measured in MLX.
Needs mlx-vlm, not torch."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from interop.probes._common import generated_ids  # the probes' reading of a generate_step stream
from tools.fixture_training.glm.acceptance import bootstrap_ci, greedy_prompts


def mlx_vlm_check(args) -> None:
    """Greedy MTP decoding with mlx-vlm's nemotron_h target and ``load_drafter(FOLDER, kind="mtp")`` (the root-folder
    route of ``--draft-model FOLDER``), on a float32 copy of the folder (mlx's CPU gather_mm takes float32 only)."""
    from importlib.metadata import version

    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    src = Path(args.folder)
    prompts = greedy_prompts(np.load(Path(args.stage) / "heldout.npy"), 0, args.prompt, args.per_file)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32"
        f32.mkdir()
        for f in src.iterdir():
            if f.suffix == ".safetensors":
                mx.save_safetensors(str(f32 / f.name), {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()},
                                    metadata={"format": "pt"})
            elif f.is_file():
                shutil.copy(f, f32 / f.name)
        model = load_model(f32)
        drafter, kind = load_drafter(str(f32), kind="mtp")
        same, per_prompt, t0 = True, [], time.time()
        for p in prompts:
            ids = mx.array(p[None].astype(np.int32))
            plain, _ = generated_ids(generate_step(ids, model, None, None, max_tokens=args.generate,
                                                   temperature=0.0), args.generate)
            spec, _ = generated_ids(generate_step(ids, model, None, None, max_tokens=args.generate, temperature=0.0,
                                                  draft_model=drafter, draft_kind=kind), args.generate)
            same &= plain == spec
            per_prompt.append([sum(drafter.accept_lens or []), sum(drafter.draft_lens or [])])
    hits, totals = np.array([a for a, _ in per_prompt]), np.array([d for _, d in per_prompt])
    res = {"mlx_vlm": version("mlx-vlm"), "mlx": version("mlx"), "drafter": type(drafter).__name__, "kind": kind,
           "prompts": len(prompts), "prompt_tokens": args.prompt, "generated_tokens": args.generate,
           "proposed": int(totals.sum()), "accepted": int(hits.sum()),
           "acceptance": round(int(hits.sum()) / max(int(totals.sum()), 1), 4),
           "acceptance_ci95": bootstrap_ci(hits, totals), "lossless": bool(same), "seconds": round(time.time() - t0, 1),
           "method": "the torch greedy prompts; mlx_vlm.generate.generate_step at temperature 0 with and without "
                     "the drafter (one draft per round); accepted / proposed drafts from the drafter's "
                     "accept_lens / draft_lens, pooled over prompts; 95% interval: bootstrap over prompts"}
    print(json.dumps(res))
    if args.record:
        _record(src, res, args)


def _record(src: Path, res: dict, args) -> None:
    """The result into the folder's training.json (with the command) and README.md."""
    import mlx.core as mx

    from tools.fixture_training.nemotron_h.readme import write_readme

    rec_path = src / "training.json"
    record = json.loads(rec_path.read_text())
    record["acceptance_mlx_vlm"] = res
    line = (f"python -m tools.fixture_training.nemotron_h mlx-vlm {args.folder} --stage {args.stage} --record  "
            f"# mlx-vlm {res['mlx_vlm']}, mlx {res['mlx']}, same CPU")
    record["commands"] = [c for c in record["commands"] if " mlx-vlm " not in c] + [line]
    rec_path.write_text(json.dumps(record, indent=1) + "\n")
    corpus = record["corpus"]
    manifest = {"python": corpus["python"], "licence": corpus["licence"], "train_files": corpus["train_files"],
                "heldout_files": corpus["heldout_files"], "train_tokens": corpus["train_tokens"],
                "vocab_size": record["tokenizer"]["vocab_size"]}
    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    n_params = sum(math.prod(v.shape) for f in set(index["weight_map"].values()) for v in mx.load(str(src / f)).values())
    write_readme(src, record, manifest, n_params, cfg)
    print(f"recorded in {rec_path} and README.md")
