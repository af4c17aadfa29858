"""Probe: mlx-vlm (PyPI). The backbone through ``mlx_vlm.utils.load_model`` (the index's
weight_map files when there is an index, else every root ``*.safetensors``), plain greedy through
``mlx_vlm.generate.generate_step``; the head through ``load_drafter(folder, kind="mtp")`` -- what
``mlx_vlm.generate --draft-model FOLDER --draft-kind mtp`` does -- which reads the ``mtp.*`` keys
(index weight_map first, else any root ``*.safetensors``) and MTP speculative decoding on the
same ids. Drafter statistics: ``draft_lens`` (proposed) and ``accept_lens`` (accepted).

``--drafter DIR`` (optional, after the standard arguments) loads the head from a separate
drafter folder instead: ``OUT/mtp`` (the model's config beside ``weights.safetensors``), or one
``mlx_vlm convert --mtp`` wrote (``model_type: qwen3_5_mtp``, unprefixed keys).
"""

import sys
from pathlib import Path

from interop.probes._common import (file_head_norm_mean, generated_ids, head_tensor_locations, run_probe,
                                    top_logprobs, version_of)

DRAFTER = None
if "--drafter" in sys.argv:
    i = sys.argv.index("--drafter")
    DRAFTER = sys.argv[i + 1]
    del sys.argv[i:i + 2]


def quantized_modules(module) -> dict:
    """{bits/group: count} of the quantized layers of a module (evidence of how a head was read)."""
    out = {}
    for _name, m in module.named_modules():
        if hasattr(m, "bits") and hasattr(m, "group_size") and "scales" in m:
            key = f"{m.bits}b/g{m.group_size}"
            out[key] = out.get(key, 0) + 1
    return out


def body(folder, prompts, max_tokens, result):
    result["version"] = version_of("mlx-vlm")
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load_model

    folder = Path(folder)
    model = load_model(folder)
    lm = model.language_model
    result["detail"]["final_norm_mean"] = round(float(lm.model.norm.weight.astype(mx.float32).mean()), 4)
    result["detail"]["vision_tower"] = getattr(model, "vision_tower", None) is not None
    result["detail"]["head_files"] = head_tensor_locations(folder)
    outs, lps = [], []
    for p in prompts:
        ids = mx.array([p], dtype=mx.int32)
        toks, first = generated_ids(generate_step(ids, model, None, None, max_tokens=max_tokens, temperature=0.0),
                              max_tokens)
        outs.append(toks)
        lps.append(top_logprobs(first) if first is not None else None)
    result["backbone_tokens"] = outs
    result["backbone_logprobs"] = lps

    from mlx_vlm.speculative.drafters import load_drafter

    drafter, kind = load_drafter(DRAFTER or str(folder), kind="mtp")
    result["head_found"] = True
    result["detail"]["draft_kind"] = kind
    result["detail"]["drafter_class"] = type(drafter).__name__
    result["detail"]["drafter_quantized"] = quantized_modules(drafter)
    result["head_norm_mean"] = {"file": file_head_norm_mean(folder),  # the model folder's head, either route
                                "loaded": round(float(drafter.norm.weight.astype(mx.float32).mean()), 4)}
    mtp_out, proposed, accepted = [], 0, 0
    for p in prompts:
        ids = mx.array([p], dtype=mx.int32)
        toks, _ = generated_ids(generate_step(ids, model, None, None, max_tokens=max_tokens, temperature=0.0,
                                        draft_model=drafter, draft_kind=kind), max_tokens)
        mtp_out.append(toks)
        proposed += sum(getattr(drafter, "draft_lens", []) or [])
        accepted += sum(getattr(drafter, "accept_lens", []) or [])
    result["mtp_tokens"] = mtp_out
    result["proposed"], result["accepted"] = proposed, accepted


if __name__ == "__main__":
    sys.exit(run_probe("mlx-vlm", body))
