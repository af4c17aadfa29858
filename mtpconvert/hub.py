"""Hugging Face Hub: pick and download only what a conversion needs; upload the result with a card.

Everything goes through huggingface_hub (cache, resume, auth, retries). The token comes from
``--token`` or ``HF_TOKEN`` / the saved login and is handed to huggingface_hub only: it is never
printed, logged, or written into any file we produce.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .errors import ConvertError
from .source import INDEX_NAME, PICKLE_SUFFIXES, SIDECAR_FILES, VISION_SIDECAR_FILES


class HubError(ConvertError):
    default_code = "hub"


def endpoint() -> Optional[str]:
    """HF_ENDPOINT read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def cache_dir(explicit: Optional[Path] = None) -> Optional[str]:
    """--cache-dir, else HF_HUB_CACHE / HF_HOME read at call time, else huggingface_hub's default."""
    if explicit:
        return str(explicit)
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _api(token: Optional[str]):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token)


def _hub_error(e: Exception, repo_id: str, what: str) -> HubError:
    """Turn huggingface_hub / network exceptions into one clear line (never echoing headers)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return HubError(f"{repo_id} is gated: accept its terms on the Hub, then pass a token", file=what)
    if isinstance(e, RepositoryNotFoundError):
        return HubError(f"repository {repo_id} not found, or private and the token cannot read it (401/404)",
                        file=what, hint="check the name; set HF_TOKEN or pass --token for private repos")
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"revision not found in {repo_id}", file=what)
    if isinstance(e, EntryNotFoundError):
        return HubError(f"{what} not found in {repo_id}", file=what)
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return HubError(f"the Hub answered HTTP {status} for {what} in {repo_id}", file=what)
    return HubError(f"could not reach the Hub for {what} in {repo_id}: {type(e).__name__}", file=what,
                    hint="check the network / HF_ENDPOINT; downloads resume where they stopped")


@dataclass
class RemoteFile:
    name: str
    size: Optional[int]


@dataclass
class PullPlan:
    repo_id: str
    revision: str  # as asked
    sha: str  # resolved commit
    files: List[RemoteFile] = field(default_factory=list)
    skipped: List[RemoteFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)

    def to_json(self) -> dict:
        return {
            "repo_id": self.repo_id, "revision": self.revision, "sha": self.sha,
            "download": [{"name": f.name, "size": f.size} for f in self.files],
            "skip": [{"name": f.name, "size": f.size} for f in self.skipped],
            "download_bytes": self.total_bytes,
        }


def needed_files(siblings: Dict[str, Optional[int]], index: Optional[dict], *, keep_vision: bool,
                 keep_mtp: bool) -> List[str]:
    """Config, tokenizer/generation files, and only the shards holding tensors we keep."""
    names = {"config.json"} | {n for n in SIDECAR_FILES if n in siblings}
    if keep_vision:
        names |= {n for n in VISION_SIDECAR_FILES if n in siblings}
    if index is not None:
        names.add(INDEX_NAME)
        for key, shard in index.get("weight_map", {}).items():
            vision = ".visual." in key or key.startswith(("model.visual.", "visual."))
            mtp = key.startswith("mtp.")
            if (vision and not keep_vision) or (mtp and not keep_mtp):
                continue
            names.add(shard)
    else:
        names |= {n for n in siblings if n.endswith(".safetensors") and "/" not in n}
    return sorted(n for n in names if not n.endswith(PICKLE_SUFFIXES))


DEFAULT_TIMEOUT = 30.0  # seconds without an answer before a Hub metadata call fails


def plan_pull(repo_id: str, revision: Optional[str] = None, *, token: Optional[str] = None,
              keep_vision: bool = False, keep_mtp: bool = True, cache: Optional[Path] = None,
              timeout: float = DEFAULT_TIMEOUT) -> PullPlan:
    """Resolve the revision to a commit and choose files, reading only config and index."""
    from huggingface_hub import hf_hub_download

    api = _api(token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True, token=token, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear HubError
        raise _hub_error(e, repo_id, "model info") from e
    sha = info.sha
    siblings = {s.rfilename: s.size for s in (info.siblings or [])}
    if "config.json" not in siblings:
        raise HubError(f"{repo_id}@{sha[:12]} has no config.json", file="config.json")
    index = None
    if INDEX_NAME in siblings:
        try:
            path = hf_hub_download(repo_id, INDEX_NAME, revision=sha, token=token, endpoint=endpoint(),
                                   cache_dir=cache_dir(cache), etag_timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise _hub_error(e, repo_id, INDEX_NAME) from e
        try:
            index = json.loads(Path(path).read_text())
        except ValueError as e:
            raise HubError("index is not valid JSON", file=INDEX_NAME) from e
    elif not any(n.endswith(".safetensors") for n in siblings):
        pickles = [n for n in siblings if n.endswith(PICKLE_SUFFIXES)]
        raise HubError(f"{repo_id} has no safetensors weights" + (" (only pickle files, never loaded)" if pickles else ""),
                       file=repo_id)
    wanted = needed_files(siblings, index, keep_vision=keep_vision, keep_mtp=keep_mtp)
    missing = [n for n in wanted if n not in siblings]
    if missing:
        raise HubError(f"the index names {missing[0]!r}, which the repository does not have", file=INDEX_NAME)
    plan = PullPlan(repo_id, revision or "main", sha)
    for name in sorted(siblings):
        (plan.files if name in wanted else plan.skipped).append(RemoteFile(name, siblings[name]))
    return plan


def download(plan: PullPlan, *, token: Optional[str] = None, cache: Optional[Path] = None,
             local_dir: Optional[Path] = None, on_file: Optional[Callable[[RemoteFile], None]] = None,
             timeout: float = DEFAULT_TIMEOUT) -> Path:
    """Fetch the plan's files at its pinned commit (resumable, cached); return the local folder."""
    from huggingface_hub import hf_hub_download

    folder: Optional[Path] = None
    for f in plan.files:
        try:
            path = hf_hub_download(plan.repo_id, f.name, revision=plan.sha, token=token, endpoint=endpoint(),
                                   cache_dir=cache_dir(cache), local_dir=local_dir, etag_timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise _hub_error(e, plan.repo_id, f.name) from e
        folder = Path(path).parent if "/" not in f.name else folder
        if on_file:
            on_file(f)
    assert folder is not None
    return folder


def fetch_stubs(plan: PullPlan, stage: Path, *, token: Optional[str] = None,
                timeout: float = DEFAULT_TIMEOUT) -> Path:
    """For ``--stream``: small files downloaded into ``stage``, each shard as a sparse stub (its
    header only, fetched with range requests), so the plan can be built before any tensor data."""
    from .graft import fetch_sparse

    stage.mkdir(parents=True, exist_ok=True)
    shards = {f.name: f.size for f in plan.files if f.name.endswith(".safetensors")}
    unsized = [n for n, size in shards.items() if size is None]
    if unsized:
        raise HubError("the Hub did not report this shard's size; --stream needs it", file=unsized[0])
    for f in plan.files:
        if f.name not in shards:
            fetch_file(plan, f.name, stage / f.name, token=token, timeout=timeout)
    fetch_sparse(plan.repo_id, plan.sha, shards, stage, want=lambda key: False, token=token)
    return stage


def fetch_file(plan: PullPlan, name: str, dest: Path, *, token: Optional[str] = None,
               timeout: float = DEFAULT_TIMEOUT) -> None:
    """Download one file of the pinned commit to ``dest`` (no cache copy: a streamed shard is deleted after use)."""
    from huggingface_hub import hf_hub_download

    scratch = dest.parent / ".fetch"
    try:
        path = hf_hub_download(plan.repo_id, name, revision=plan.sha, token=token, endpoint=endpoint(),
                               local_dir=scratch, etag_timeout=timeout)
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, plan.repo_id, name) from e
    os.replace(path, dest)


# ---------------------------------------------------------------- upload

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
    from . import __version__

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


def upload(folder: Path, repo_id: str, *, token: Optional[str] = None, private: bool = False,
           card: Optional[str] = None, message: Optional[str] = None) -> str:
    """Create the repo if needed and upload the folder (with its card) in one commit; return the commit url."""
    folder = Path(folder)
    if card is not None:
        (folder / "README.md").write_text(card, encoding="utf-8")
    api = _api(token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True, token=token)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", token=token,
                                 commit_message=message or "Upload MLX conversion with MTP head (mtpconvert)",
                                 ignore_patterns=[".*", "**/.*"])
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, repo_id, "upload") from e
    return str(getattr(info, "commit_url", info))
