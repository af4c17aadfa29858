"""Hugging Face Hub: pick and download only what a conversion needs.

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

from .errors import HubError, cache_dir, endpoint, hub_api, hub_error
from ..io.checkpoint import INDEX_NAME, PICKLE_SUFFIXES, SIDECAR_FILES, VISION_SIDECAR_FILES
from ..options import DEFAULT_HUB_TIMEOUT


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

    @property
    def skipped_shards(self) -> List[str]:
        """Weight files left out on purpose (every tensor in them is dropped): the opener must not
        ask for them (``open_checkpoint(absent=...)``)."""
        return [f.name for f in self.skipped if f.name.endswith(".safetensors")]

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


def plan_pull(repo_id: str, revision: Optional[str] = None, *, token: Optional[str] = None,
              keep_vision: bool = False, keep_mtp: bool = True, cache: Optional[Path] = None,
              timeout: float = DEFAULT_HUB_TIMEOUT) -> PullPlan:
    """Resolve the revision to a commit and choose files, reading only config and index."""
    from huggingface_hub import hf_hub_download

    api = hub_api(token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True, token=token, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear HubError
        raise hub_error(e, repo_id, "model info") from e
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
            raise hub_error(e, repo_id, INDEX_NAME) from e
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
             timeout: float = DEFAULT_HUB_TIMEOUT) -> Path:
    """Fetch the plan's files at its pinned commit (resumable, cached); return the local folder."""
    from huggingface_hub import hf_hub_download

    folder: Optional[Path] = None
    for f in plan.files:
        try:
            path = hf_hub_download(plan.repo_id, f.name, revision=plan.sha, token=token, endpoint=endpoint(),
                                   cache_dir=cache_dir(cache), local_dir=local_dir, etag_timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, plan.repo_id, f.name) from e
        folder = Path(path).parent if "/" not in f.name else folder
        if on_file:
            on_file(f)
    assert folder is not None
    return folder


def fetch_stubs(plan: PullPlan, stage: Path, *, token: Optional[str] = None,
                timeout: float = DEFAULT_HUB_TIMEOUT) -> Path:
    """For ``--stream``: small files downloaded into ``stage``, each shard as a sparse stub (its
    header only, fetched with range requests), so the plan can be built before any tensor data."""
    from .sparse import fetch_sparse

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
               timeout: float = DEFAULT_HUB_TIMEOUT) -> None:
    """Download one file of the pinned commit to ``dest`` (no cache copy: a streamed shard is deleted after use)."""
    from huggingface_hub import hf_hub_download

    scratch = dest.parent / ".fetch"
    try:
        path = hf_hub_download(plan.repo_id, name, revision=plan.sha, token=token, endpoint=endpoint(),
                               local_dir=scratch, etag_timeout=timeout)
    except Exception as e:  # noqa: BLE001
        raise hub_error(e, plan.repo_id, name) from e
    os.replace(path, dest)


# ---------------------------------------------------------------- upload
