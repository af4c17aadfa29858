"""The model card of an output folder, built with huggingface_hub's ``ModelCard`` from the folder itself.

Everything it states comes from the folder: the quantization from ``config.json``, the MTP
head's precision from its tensors, and how the folder was made from the record the command
wrote into the index metadata (``mtpconvert.provenance``). What the folder does not record is
left out (there is no ``base_model: unknown``), never guessed.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass
from importlib import metadata as dist_metadata
from pathlib import Path
from typing import Dict, List, Optional

from ..io.checkpoint import INDEX_NAME
from ..provenance import command_args
from ..runtime.decoding.locate import locate_mtp

PROMPT = "Write a haiku about the sea."


@dataclass
class Folder:
    """What a card needs to know about an output folder."""

    name: str
    config: dict
    record: dict  # index metadata "mtpconvert": what made the folder (empty for other tools' folders)
    weight_map: Dict[str, str]
    head_keys: List[str]  # the MTP head's tensor names as stored (sidecar mtp.* or in-model language_model.mtp.*)
    head_locals: List[str]  # the same, head-local (``fc.weight``, ``layers.0...``)

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config

    @property
    def grafted(self) -> dict:
        return self.record.get("mtp_grafted") or {}

    @property
    def dtype(self) -> str:
        return self.record.get("dtype") or self.text_config.get("dtype") or self.config.get("torch_dtype") or "?"


def read_folder(folder: Path) -> Folder:
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / INDEX_NAME).read_text()) if (folder / INDEX_NAME).exists() else {}
    head = locate_mtp(folder)
    head_keys = sorted(head.prefix + k for k in head.tensors) if head else []
    return Folder(folder.name, config, (index.get("metadata") or {}).get("mtpconvert") or {},
                  index.get("weight_map") or {}, head_keys, sorted(head.tensors) if head else [])


def _spec_text(spec: dict) -> str:
    return f"{spec['bits']}-bit, group {spec['group_size']}, {spec.get('mode', 'affine')}"


def backbone_text(f: Folder) -> str:
    q = f.config.get("quantization")
    return _spec_text(q) if q else f"not quantized ({f.dtype})"


def mtp_text(f: Folder) -> str:
    """The head's precision from its tensors: a linear layer is quantized when it has scales."""
    keys = set(f.head_keys)
    modules = sorted(k[: -len(".weight")] for k in keys if k.endswith(".weight"))
    if not modules:
        return "none"
    quantized = [m for m in modules if f"{m}.scales" in keys]
    if not quantized:
        return f"float ({f.dtype})"
    block = f.config.get("quantization") or {}
    specs = Counter(_spec_text(block[m] if isinstance(block.get(m), dict) else block) for m in quantized)
    kinds = "; ".join(spec if len(specs) == 1 else f"{n}× {spec}" for spec, n in specs.items())
    rest = len(modules) - len(quantized)
    family = family_of(f.config)
    projection = family.head.projection.split()[0] if family is not None else "mtp.fc"  # never quantized
    return kinds + (f" ({len(quantized)} of {len(modules)} weights; the other {rest}, e.g. norms and {projection}, "
                    f"{f.dtype})" if rest else "")


def mtp_layers_text(f: Folder) -> str:
    """The head's layer count: the config's (under any key its family reads), else (a config with no count, as
    Qwen3-Next publishes it) the layers its tensors hold."""
    family = family_of(f.config)
    keys = family.mtp_count_keys if family is not None else ()
    stated = next((f.text_config[k] for k in keys if isinstance(f.text_config.get(k), int)), None)
    if stated is not None:
        return str(stated)
    layers = family.head_layers(family.head_prefix + k for k in f.head_locals)[0] if family is not None else 0
    return f"{layers} (from its tensors: config.json has no count)" if layers else "0"


def family_of(config: dict):
    """The folder's family, None when no family takes its config."""
    from ..families import family_for

    try:
        return family_for(config)
    except Exception:  # noqa: BLE001 - a card still describes a folder no family takes
        return None


def base_model_of(f: Folder, given: Optional[str]) -> Optional[str]:
    return given or f.record.get("source_repo") or f.grafted.get("source_repo")


def _link(repo: str, revision: Optional[str]) -> str:
    at = f" (revision `{revision}`)" if revision else ""
    return f"[{repo}](https://huggingface.co/{repo}){at}"


def how_it_was_made(f: Folder, base_model: Optional[str], out_name: str) -> str:
    """Which command made the folder, as it ran; for an add-mtp folder, the backbone's origin is not claimed."""
    lines: List[str] = []
    made = command_args(f.record, out_name) if f.record.get("command") else None
    if f.grafted:
        lines.append("The backbone is an existing MLX folder; mtpconvert "
                     f"{f.grafted.get('version', '')} grafted the MTP head onto it with `add-mtp`, from "
                     + (_link(f.grafted["source_repo"], f.grafted.get("source_revision"))
                        if f.grafted.get("source_repo") else "a local copy of the original release") + ".")
        made = command_args({"command": "add-mtp", **f.grafted}, out_name)
    elif made and f.record["command"] == "convert":
        source = f"a local copy of {_link(base_model, None)}" if base_model else "a local checkpoint folder"
        lines.append(f"Converted by mtpconvert {f.record.get('version', '')} from {source}.")
    elif made:
        lines.append(f"Converted by mtpconvert {f.record.get('version', '')} from "
                     f"{_link(f.record['source_repo'], f.record.get('source_revision'))}.")
    else:
        return "How this folder was made is not recorded in it."
    libraries = f.grafted.get("libraries") or f.record.get("libraries") or {}
    if libraries:
        lines.append("Libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(libraries.items())) + ".")
    if made:
        lines += ["", "```bash", "mtpconvert " + shlex.join(made), "```"]
    return "\n".join(lines)


def install_mtpconvert() -> str:
    """How to install mtpconvert, which is not on PyPI: from its git repository when the package names it."""
    try:
        urls = dist_metadata.metadata("mtpconvert").get_all("Project-URL") or []
    except dist_metadata.PackageNotFoundError:
        urls = []
    for label, _, url in (u.partition(", ") for u in urls):
        if label.lower() in ("source", "repository") and url:
            return f'pip install "mtpconvert @ git+{url}"'
    return "pip install ./mtpconvert   # from a clone of mtpconvert's git repository (it is not on PyPI)"


def _mlx_lm_usage(repo_id: str) -> str:
    return f"""Stock mlx-lm loads it (and ignores the MTP weights):

```bash
pip install mlx-lm   # on Linux also: pip install "mlx[cpu]"
```

```python
from mlx_lm import load, generate

model, tokenizer = load("{repo_id}")
print(generate(model, tokenizer, prompt="{PROMPT}", max_tokens=64))
```
"""


def _mlx_vlm_usage(repo_id: str, draft: str, first: bool) -> str:
    local = repo_id.split("/")[-1]
    who = "mlx-vlm loads it" if first else "mlx-vlm also loads it"
    return f"""{who} and drafts with its MTP head (`--draft-model {draft.replace("OUT", local)}`: the route the table \
above marks usable):

```bash
pip install mlx-vlm   # on Linux also: pip install "mlx[cpu]"
hf download {repo_id} --local-dir {local}
python -m mlx_vlm.generate --model {local} --draft-model {draft.replace("OUT", local)} --draft-kind mtp \\
    --prompt "{PROMPT}" --max-tokens 64
```
"""


def usage(repo_id: str, report) -> str:
    """How to run the folder: with each library its compat table (``report``) says loads it, and the mlx-vlm
    drafting route that finds the head (the whole folder, else ``OUT/mtp``)."""
    from ..compat import mlx_lm, mlx_vlm

    local = repo_id.split("/")[-1]
    rows = {r.runtime: r for r in report.runtimes}
    parts = []
    if (lm := rows.get(mlx_lm.NEW[0])) and lm.backbone_exact.ok:
        parts.append(_mlx_lm_usage(repo_id))
    for name, draft in ((mlx_vlm.NAME, "OUT"), (mlx_vlm.DRAFTER_ROUTE, "OUT/mtp")):
        row = rows.get(name)
        if row and row.head_usable.ok and row.backbone_exact.ok is not False:
            parts.append(_mlx_vlm_usage(repo_id, draft, not parts))
            break
    return "## Use\n\n" + "\n".join(parts) + f"""
MTP speculative decoding with mtpconvert's runtime (mtpconvert is not on PyPI):

```bash
{install_mtpconvert()}
hf download {repo_id} --local-dir {local}
mtpconvert bench {local} --depth 1
```

```python
from huggingface_hub import snapshot_download
from mtpconvert.runtime.smoke.decode import encode_prompts
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.speculative import mtp_generate

path = snapshot_download("{repo_id}")
model = load(path)
prompt_ids = encode_prompts(path, ["{PROMPT}"])[0]
tokens, stats = mtp_generate(model, prompt_ids, max_tokens=64, depth=1)
print(stats.acceptance, stats.tokens_per_step)
```
"""


def runtimes_text(report) -> str:
    """Which MTP runtimes take the folder as it is (``report``: mtpconvert.compat's, from its headers)."""
    rows = ["| runtime | version | backbone loads exactly | MTP head usable | why |", "|---|---|---|---|---|"]
    for r in report.runtimes:
        why = r.head_usable.reason if r.backbone_exact.ok else r.backbone_exact.reason
        backbone = "n/a" if r.backbone_exact.ok is None else ("yes" if r.backbone_exact.ok else "**no**")
        rows.append(f"| {r.runtime} | {r.versions} | {backbone} | {'yes' if r.head_usable.ok else 'no'} | "
                    f"{why.replace('|', '/')} |")
    return (f"## MTP runtimes\n\nHead layout: `{report.layout}`. From the folder's headers "
            "(`mtpconvert verify` prints the same table):\n\n" + "\n".join(rows))


def card_data(f: Folder, base_model: Optional[str]):
    from huggingface_hub import ModelCardData

    quantized = bool(f.config.get("quantization"))
    extra = {"base_model_relation": "quantized"} if base_model and quantized else {}
    model_type = f.config.get("model_type")
    return ModelCardData(library_name="mlx", base_model=base_model, pipeline_tag="text-generation",
                         tags=["mlx", "mtp", "speculative-decoding", *([model_type] if model_type else [])], **extra)


def model_card(folder: Path, repo_id: str, *, smoke_acceptance: Optional[float] = None,
               verify_ok: Optional[bool] = None, base_model: Optional[str] = None) -> str:
    """The README.md for an output folder about to be uploaded to ``repo_id``."""
    from huggingface_hub import ModelCard

    from ..compat import check_folder

    f = read_folder(folder)
    report = check_folder(Path(folder))
    base = base_model_of(f, base_model)
    origin = f"MLX conversion of {_link(base, None)}" if base else "MLX conversion"
    verify = "passed" if verify_ok else ("failed" if verify_ok is False else "not run")
    smoke = f"{smoke_acceptance:.1%}" if smoke_acceptance is not None else "not run"
    body = f"""# {repo_id}

{origin} **with its Multi-Token-Prediction (MTP) head**, for MTP speculative decoding.

| | |
|---|---|
| backbone | {backbone_text(f)} |
| MTP head | {mtp_text(f)} |
| MTP layers | {mtp_layers_text(f)} |
| verify | {verify} |
| smoke (greedy MTP draft acceptance, depth 1) | {smoke} |

{runtimes_text(report)}

## How it was made

{how_it_was_made(f, base, repo_id.split("/")[-1])}

{usage(repo_id, report)}"""
    return ModelCard(f"---\n{card_data(f, base).to_yaml()}\n---\n\n{body}").content
