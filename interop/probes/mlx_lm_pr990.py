"""Probe: the mlx-lm PR #990 branch (AirRunner/mlx-lm ``feat/mtp-native``; not on PyPI).

Backbone and head come from the branch's own ``mlx_lm.utils.load_model`` (it globs
``model*.safetensors``; the index is not read). The head is part of the model: ``qwen3_5``'s
``TextModel`` builds ``mtp`` when ``mtp_num_hidden_layers > 0`` and its sanitize keeps every key
containing ``mtp.`` (``mtp.X`` is prefixed to ``language_model.mtp.X``); with no such key it
raises. MoE MTP experts must be per expert (``experts.{e}.{proj}.weight``) or fused
(``experts.gate_up_proj``): stacked ``switch_mlp`` raises KeyError. The draft loop
(``mtp_generate_step``) feeds the head the pre-norm hidden state.

Plain greedy uses the branch's ``generate_step``; MTP greedy ``mtp_generate_step(temp=0)``, whose
yields carry ``from_draft``: accepted = drafts emitted, proposed = accepted + rejected verifies.
"""

import sys
from pathlib import Path

from interop.probes._common import (file_head_norm_mean, head_tensor_locations, run_probe, top_logprobs,
                                    version_of)


def body(folder, prompts, max_tokens, result):
    result["version"] = version_of("mlx-lm") + "+pr990"
    import importlib

    import mlx.core as mx

    gen_mod = importlib.import_module("mlx_lm.generate")  # the package re-exports a function of that name
    from mlx_lm.utils import load_model

    if not hasattr(gen_mod, "mtp_generate_step"):
        raise RuntimeError("this mlx-lm has no mtp_generate_step: not the PR #990 branch")
    folder = Path(folder)
    result["detail"]["head_files"] = head_tensor_locations(folder)
    model, _config = load_model(folder)
    lm = model.language_model
    result["detail"]["final_norm_mean"] = round(float(lm.model.norm.weight.astype(mx.float32).mean()), 4)
    outs, lps = [], []
    for p in prompts:
        toks = []
        for i, (tok, logprobs) in enumerate(gen_mod.generate_step(mx.array(p, dtype=mx.uint32), model,
                                                                  max_tokens=max_tokens)):
            if i == 0:
                lps.append(top_logprobs(logprobs))
            toks.append(int(tok))
        outs.append(toks)
    result["backbone_tokens"] = outs
    result["backbone_logprobs"] = lps

    result["head_found"] = hasattr(lm, "mtp")
    if not result["head_found"]:
        return
    result["head_norm_mean"] = {"file": file_head_norm_mean(folder),
                                "loaded": round(float(lm.mtp.norm.weight.astype(mx.float32).mean()), 4)}
    mtp_out, proposed, accepted = [], 0, 0
    for p in prompts:
        toks, after_draft, first = [], False, True
        for tok, _lp, from_draft in gen_mod.mtp_generate_step(mx.array(p, dtype=mx.uint32), model,
                                                               max_tokens=max_tokens, temp=0.0):
            toks.append(int(tok))
            if from_draft:
                accepted += 1
                proposed += 1
                after_draft = True
            elif first:
                first = False
            elif after_draft:
                after_draft = False  # the bonus token after an accepted draft
            else:
                proposed += 1  # the target's token after a rejected draft
        mtp_out.append(toks)
    result["mtp_tokens"] = mtp_out
    result["proposed"], result["accepted"] = proposed, accepted


if __name__ == "__main__":
    sys.exit(run_probe("mlx-lm-pr990", body))
