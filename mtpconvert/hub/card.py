"""The model card of an output folder, from the folder's own config and index metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..io.checkpoint import INDEX_NAME

CARD_TEMPLATE = """---
library_name: mlx
base_model: {base_model}
pipeline_tag: text-generation
tags:
- mlx
- mtp
- speculative-decoding
- {model_type}
---

# {repo_id}

MLX conversion of [{base_model}](https://huggingface.co/{base_model}) (revision `{revision}`)
**with its Multi-Token-Prediction (MTP) head kept**, made with mtpconvert {version}.

| | |
|---|---|
| backbone | {backbone} |
| MTP head | {mtp} |
| dtype | {dtype} |
| MTP layers | {mtp_layers} |
| verify | {verify} |
| smoke (greedy MTP draft acceptance, depth 1) | {smoke} |

Conversion command:

```bash
{command}
```

## Use

Stock mlx-lm loads it (and ignores the MTP weights):

```python
from mlx_lm import load, generate
model, tokenizer = load("{repo_id}")
```

MTP speculative decoding with the bundled runtime:

```bash
pip install mtpconvert
mtpconvert bench {repo_id_local} --depth 1
```

```python
from mtpconvert.runtime.load import load
from mtpconvert.runtime.speculative import mtp_generate
m = load("path/to/this/folder")
tokens, stats = mtp_generate(m, prompt_ids, max_tokens=256)
```
"""


def reproduce_command(meta: dict, config: dict) -> str:
    """The command that makes this folder again, from its own metadata (never any token)."""
    q = config.get("quantization") or {}
    parts = ["mtpconvert pull-and-quantize", meta.get("source_repo", "<source repo>")]
    if meta.get("source_revision"):
        parts += ["--revision", meta["source_revision"]]
    if q:
        parts += ["--bits", str(q["bits"]), "--group-size", str(q["group_size"])]
        if q.get("mode", "affine") != "affine":
            parts += ["--q-mode", q["mode"]]
    if meta.get("dtype"):
        parts += ["--dtype", meta["dtype"]]
    policy = meta.get("mtp_policy", "keep")
    if policy not in ("keep", None):
        parts += ["--mtp", policy] if policy in ("match", "drop") else ["--mtp-bits", str(policy).split("-")[-1]]
    return " ".join(parts)


def model_card(folder: Path, repo_id: str, *, smoke_acceptance: Optional[float] = None,
               verify_ok: Optional[bool] = None) -> str:
    """The README.md for an output folder, from its own config and index metadata."""
    from .. import __version__

    config = json.loads((folder / "config.json").read_text())
    meta = json.loads((folder / INDEX_NAME).read_text()).get("metadata", {}).get("mtpconvert", {})
    q = config.get("quantization")
    backbone = f"{q['bits']}-bit, group {q['group_size']}, {q.get('mode', 'affine')}" if q else "not quantized"
    policy = meta.get("mtp_policy", "?")
    if not meta.get("mtp_layers"):
        mtp = "none (dropped)"
    elif policy == "keep":
        mtp = f"kept at {meta.get('dtype', 'source dtype')} (not quantized)"
    else:
        mtp = f"policy `{policy}` (see config.json for per-tensor settings)"
    return CARD_TEMPLATE.format(
        base_model=meta.get("source_repo", "unknown"), revision=meta.get("source_revision", "unknown"),
        repo_id=repo_id, repo_id_local=folder.name, version=__version__,
        model_type=config.get("model_type", "qwen3_5"), backbone=backbone, mtp=mtp,
        dtype=meta.get("dtype", "?"), mtp_layers=meta.get("mtp_layers", 0),
        verify="passed" if verify_ok else ("failed" if verify_ok is False else "not run"),
        smoke=f"{smoke_acceptance:.1%}" if smoke_acceptance is not None else "not run",
        command=reproduce_command(meta, config),
    )
