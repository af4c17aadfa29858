"""Hub access shared by pull, sparse reads and upload: the client, and its errors as one clear line."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional

from ..errors import ConvertError


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


def hub_api(token: Optional[str]):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token)


def hub_error(e: Exception, repo_id: str, what: str) -> Exception:
    """huggingface_hub and network exceptions as one clear line (never echoing headers); others unchanged."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        HFValidationError,
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
    if isinstance(e, HFValidationError):
        return HubError(f"{repo_id!r} is not a valid Hub repository id: {e}", file=what,
                        hint="a Hub id is owner/name; for a local folder use the command that takes a path")
    full = _disk_full(e)
    if full is not None:
        where = f" in {Path(full.filename).parent}" if getattr(full, "filename", None) else ""
        return HubError(f"disk full while downloading {what} from {repo_id}{where}", file=what,
                        hint="free disk space; --stream --raw-window GB keeps at most that much raw data on disk, "
                             "whatever the shard size")
    if _network(e):
        return HubError(f"could not reach the Hub for {what} in {repo_id}: {type(e).__name__}", file=what,
                        hint="check the network / HF_ENDPOINT; downloads resume where they stopped")
    return e  # not a Hub or network failure: the CLI's error table reports it for what it is


def _disk_full(e: BaseException) -> Optional[OSError]:
    """The ENOSPC/EDQUOT error behind ``e`` (huggingface_hub wraps some), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        e = e.__cause__ or e.__context__
    return None


def _network(e: BaseException) -> bool:
    """Connection, timeout and transport errors of the HTTP stacks huggingface_hub uses."""
    if isinstance(e, (OSError, TimeoutError)):
        return True
    return any(c.__module__.startswith(("httpx", "httpcore", "requests", "urllib3")) for c in type(e).__mro__)
