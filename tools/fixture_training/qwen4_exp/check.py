"""The qwen4_exp fixture through the consumers (MLX): ``mtpconvert convert`` with its default checks at float32 and
4 bits, our smoke's numbers, and mlx-vlm 0.7.10's ``qwen4_exp_mtp`` drafter on ``OUT/mtp`` against plain greedy on
held-out prompts; recorded in training.json and README.md (``--no-record``: printed only)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.fixture_training.glm.acceptance import bootstrap_ci


def conversions(folder: Path, tmp: Path) -> dict:
    """{name: smoke numbers} of ``api.convert`` with the default checks (verify, then the smoke ``auto`` picks)."""
    from mtpconvert import api
    from mtpconvert.options import ConvertOptions, QuantOptions

    out = {}
    for name, opts in (("float32", ConvertOptions(dtype="float32")),
                       ("q4", ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32)))):
        t0 = time.time()
        result = api.convert(folder, tmp / name, opts)  # raises GateFailed where a check fails
        smoke = result.checks.smoke
        gain = smoke.mlp_gain_paired
        out[name] = {"smoke_mode": result.checks.smoke_mode, "acceptance": round(smoke.acceptance, 4),
                     "identical_to_plain_greedy": bool(getattr(smoke, "identical", True)),
                     "per_prompt": [round(a, 4) for a in getattr(smoke, "per_prompt", [])],
                     "mlp_gain": None if gain is None else round(gain.gain, 4), "ok": bool(smoke.ok),
                     "seconds": round(time.time() - t0, 1)}
    return out


def broken_smokes(base: Path, tmp: Path) -> dict:
    """{edit: our smoke's numbers} on the float32 conversion broken each way ``broken.EDITS`` names."""
    from mtpconvert import api
    from tools.fixture_training.qwen4_exp.broken import EDITS, break_folder

    out = {}
    for edit in EDITS:
        folder = tmp / f"broken-{edit}"
        changed = break_folder(base, folder, edit)
        smoke = api.smoke(folder)
        out[edit] = {"tensors_changed": changed, "acceptance": round(smoke.acceptance, 4), "ok": bool(smoke.ok),
                     "per_prompt": [round(a, 4) for a in smoke.per_prompt]}
    return out


def mlx_vlm_drafting(folder: Path, prompts: list, tokens: int, block_size=None) -> dict:
    """mlx-vlm's target on the converted folder and ``load_drafter(folder/mtp, kind="mtp")``: greedy decoding of each
    prompt with and without the drafter; accepted / proposed drafts from the drafter's accept_lens / draft_lens."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    from interop.probes._common import generated_ids

    model = load_model(folder)
    drafter, kind = load_drafter(str(folder / "mtp"), kind="mtp")
    hits, totals, rounds, same, t0 = [], [], 0, True, time.time()
    for ids in prompts:
        prompt = mx.array([ids])
        plain, _ = generated_ids(generate_step(prompt, model, None, None, max_tokens=tokens, temperature=0.0), tokens)
        spec, _ = generated_ids(generate_step(prompt, model, None, None, max_tokens=tokens, temperature=0.0,
                                              draft_model=drafter, draft_kind=kind, draft_block_size=block_size),
                                tokens)
        same &= plain == spec
        hits.append(sum(drafter.accept_lens or []))
        totals.append(sum(drafter.draft_lens or []))
        rounds += len(drafter.draft_lens or [])
    hits, totals = np.array(hits), np.array(totals)
    return {"drafter": type(drafter).__name__, "draft_block_size": block_size, "proposed": int(totals.sum()),
            "accepted": int(hits.sum()), "rounds": rounds,
            "acceptance": round(float(hits.sum() / max(totals.sum(), 1)), 4),
            "acceptance_ci95": bootstrap_ci(hits, totals), "identical_to_plain_greedy": bool(same),
            "seconds": round(time.time() - t0, 1)}


def mlx_vlm_acceptance(folder: Path, prompts: list, tokens: int) -> dict:
    from importlib.metadata import version

    one = mlx_vlm_drafting(folder, prompts, tokens, block_size=2)
    default = mlx_vlm_drafting(folder, prompts, tokens)
    return {"mlx_vlm": version("mlx-vlm"), "mlx": version("mlx"), "drafter": one.pop("drafter"),
            "prompts": len(prompts), "generated_tokens": tokens, "one_draft": one, "default": default,
            "method": "held-out stdlib prompts (mtpconvert.fixture.text.heldout_prompts, one of 48+ tokens per "
                      "held-out file); the float32 conversion's backbone in mlx_vlm.utils.load_model, its head as "
                      "load_drafter(OUT/mtp, kind='mtp'); mlx_vlm.generate.generate_step at temperature 0 with and "
                      "without the drafter, draft_block_size 2 (one draft a round) and the drafter's default; "
                      "accepted / proposed pooled over prompts; 95% interval: bootstrap over prompts"}


def check_folder(args) -> None:
    from mtpconvert.fixture.text import heldout_prompts

    folder = Path(args.folder)
    _, prompts, _ = heldout_prompts(folder, per_file=1, prompt_tokens=48, files=args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        ours = {"conversions": conversions(folder, Path(tmp)),
                "broken": broken_smokes(Path(tmp) / "float32", Path(tmp)),
                "method": "mtpconvert convert with its default checks (verify, then the decoding smoke on its "
                          "default prompts, 48 tokens each, depth 1), float32 and 4-bit (group 32, head as "
                          "mtpconvert's default); acceptance, identity with plain greedy and MLP gain as the "
                          "smoke reports them. broken: mtpconvert smoke on the float32 conversion edited as "
                          "tools/fixture_training/qwen4_exp/broken.py says"}
        vlm = mlx_vlm_acceptance(Path(tmp) / "float32", prompts, args.tokens)
    print(json.dumps({"acceptance_mtpconvert": ours, "acceptance_mlx_vlm": vlm}, indent=1))
    if args.no_record:
        return
    rec_path = folder / "training.json"
    record = json.loads(rec_path.read_text())
    record["acceptance_mtpconvert"], record["acceptance_mlx_vlm"] = ours, vlm
    line = f"python -m tools.fixture_training.qwen4_exp check {args.folder}"
    record["commands"] = [c for c in record["commands"] if " check " not in c] + [line]
    rec_path.write_text(json.dumps(record, indent=1) + "\n")
    rewrite_readme(folder, record)
    print(f"recorded in {rec_path} and README.md")


def rewrite_readme(folder: Path, record: dict) -> None:
    import math

    from safetensors import safe_open

    from tools.fixture_training.qwen4_exp.readme import write_readme

    corpus = record["corpus"]
    manifest = {"python": corpus["python"], "licence": corpus["licence"], "train_files": corpus["train_files"],
                "heldout_files": corpus["heldout_files"], "train_tokens": corpus["train_tokens"],
                "vocab_size": record["tokenizer"]["vocab_size"]}
    n_params = 0
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(f), "np") as st:
            n_params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys()
                            if st.get_slice(k).get_dtype() != "I64")
    write_readme(folder, record, manifest, n_params)
