"""Probe: mlx-vlm (PyPI) on a GLM nextn folder. ``python -m interop.probes.mlx_vlm_glm OUT RAW IDS_JSON MAX_TOKENS``

* the backbone through ``mlx_vlm.utils.load_model(OUT)`` and plain greedy ``generate_step``;
* the head through ``load_drafter(OUT/mtp, kind="mtp")`` -- what ``mlx_vlm generate --draft-model OUT/mtp``
  does -- and MTP greedy decoding on the same ids (``draft_lens`` proposed, ``accept_lens`` accepted);
* mlx-vlm's own splitter for the model type run over the raw release ``RAW`` (what ``mlx_vlm convert --mtp``
  would write), compared key by key with the drafter folder's weights: the same names, shapes and values.

Prints one JSON object; an exception is reported in it (``error``), never as a traceback only.
"""

import json
import sys
import traceback
from pathlib import Path

from interop.probes._common import generated_ids


def ours_name(split_key: str) -> str:
    """Our head's name for a key of mlx-vlm's split: the glm_moe_dsa splitter already writes ``mtp.*`` as we
    do; the glm4_moe_lite one writes ``model.*`` / ``model.mtp_block.*`` / ``lm_head`` (the values are the same)."""
    if split_key.startswith("mtp."):
        return split_key
    if split_key == "lm_head.weight":
        return "mtp.shared_head.head.weight"
    rest = split_key[len("model."):]
    return "mtp." + (rest[len("mtp_block."):] if rest.startswith("mtp_block.") else rest)


def main(out: Path, raw: Path, prompts, max_tokens: int) -> dict:
    import importlib.metadata

    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter
    from mlx_vlm.utils import load_model

    result = {"version": importlib.metadata.version("mlx-vlm"), "error": None}
    config = json.loads((raw / "config.json").read_text())
    splitter = get_mtp_splitter(source_config=config)
    draft_config, split = splitter.prepare(raw)
    split = {ours_name(k): v for k, v in split.items()}
    ours = {}
    for f in sorted((out / "mtp").glob("*.safetensors")):
        ours.update(mx.load(str(f)))
    differ = sorted(k for k in set(split) & set(ours) if split[k].shape != ours[k].shape
                    or not mx.array_equal(split[k].astype(mx.float32), ours[k].astype(mx.float32)).item())
    result["splitter"] = {"model_type": draft_config["model_type"], "keys": len(split),
                          "only_split": sorted(set(split) - set(ours)), "only_ours": sorted(set(ours) - set(split)),
                          "differ": differ}

    model = load_model(out)
    result["backbone_tokens"] = [generated_ids(generate_step(mx.array([p], dtype=mx.int32), model, None, None,
                                                       max_tokens=max_tokens, temperature=0.0), max_tokens)[0]
                                 for p in prompts]
    try:
        drafter, kind = load_drafter(str(out / "mtp"), kind="mtp")
    except Exception as e:  # noqa: BLE001 - reported: the table predicts which model types have no drafter
        result["head_found"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        return result
    result["head_found"], result["drafter_class"] = True, type(drafter).__name__
    mtp, proposed, accepted = [], 0, 0
    for p in prompts:
        mtp.append(generated_ids(generate_step(mx.array([p], dtype=mx.int32), model, None, None, max_tokens=max_tokens,
                                         temperature=0.0, draft_model=drafter, draft_kind=kind), max_tokens)[0])
        proposed += sum(getattr(drafter, "draft_lens", []) or [])
        accepted += sum(getattr(drafter, "accept_lens", []) or [])
    result.update(mtp_tokens=mtp, proposed=proposed, accepted=accepted)
    return result


if __name__ == "__main__":
    out_dir, raw_dir, ids, n = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    try:
        res = main(out_dir, raw_dir, ids, n)
    except Exception as e:  # noqa: BLE001
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(res))
