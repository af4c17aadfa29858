"""Probe: stock mlx-lm (PyPI). Plain greedy decoding of the backbone exactly as
``mlx_lm.utils.load_model`` loads it (it globs ``model*.safetensors``; the index is not read).
Stock mlx-lm has no MTP decoding, so ``head_found`` is always false and the MTP fields null.

Run in the venv of the version under test (0.31.x shows the double norm shift when a
``model*.safetensors`` file holds an ``mtp.`` key; 0.32.x is the harness's baseline).
"""

import sys
from pathlib import Path

from interop.probes._common import run_probe, top_logprobs, version_of


def body(folder, prompts, max_tokens, result):
    result["version"] = version_of("mlx-lm")
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _config = load_model(Path(folder))
    lm = model.language_model if hasattr(model, "language_model") else model
    # evidence for the norm-shift state: ~1 when loaded right, ~2 after a second +1
    result["detail"]["final_norm_mean"] = round(float(lm.model.norm.weight.astype(mx.float32).mean()), 4)
    result["detail"]["input_layernorm0_mean"] = round(
        float(lm.model.layers[0].input_layernorm.weight.astype(mx.float32).mean()), 4)
    outs, lps = [], []
    for p in prompts:
        toks = []
        for i, (tok, logprobs) in enumerate(generate_step(mx.array(p, dtype=mx.uint32), model,
                                                          max_tokens=max_tokens)):
            if i == 0:
                lps.append(top_logprobs(logprobs))
            toks.append(int(tok))
        outs.append(toks)
    result["backbone_tokens"] = outs
    result["backbone_logprobs"] = lps


if __name__ == "__main__":
    sys.exit(run_probe("mlx-lm", body))
