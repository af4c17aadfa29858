"""Upload an output folder (with its card) to the Hub in one commit."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

from ..io.files import contained
from .errors import hub_api, hub_error

CARD = "README.md"


def folder_operations(folder: Path, card: Optional[str]) -> list:
    """One add per file of the folder (hidden files and folders left out); the card goes up from memory.

    The card is never written into the user's folder: an upload that fails leaves it as it was,
    and a README.md already there (e.g. from mlx_lm.convert) stays local, replaced only in the repo.
    """
    from huggingface_hub import CommitOperationAdd

    operations: List[CommitOperationAdd] = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or (card is not None and rel.as_posix() == CARD):
            continue
        if path.is_dir():
            continue
        contained(folder, rel.as_posix())  # a FIFO or a link out of the folder is refused, never uploaded
        operations.append(CommitOperationAdd(path_in_repo=rel.as_posix(), path_or_fileobj=str(path)))
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode("utf-8")))
    return operations


def upload(folder: Path, repo_id: str, *, token: Optional[str] = None, private: bool = False,
           card: Optional[str] = None, message: Optional[str] = None,
           on_stage: Callable[[str], None] = lambda text: None) -> str:
    """Create the repo if needed and upload the folder (with its card) in one commit; return the commit url."""
    folder = Path(folder)
    operations = folder_operations(folder, card)
    size = sum(Path(op.path_or_fileobj).stat().st_size for op in operations if isinstance(op.path_or_fileobj, str))
    on_stage(f"uploading {len(operations)} files ({size / 1e9:.2f} GB) to {repo_id} in one commit "
             "(huggingface_hub draws the transfer)")
    api = hub_api(token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True, token=token)
        info = api.create_commit(repo_id=repo_id, operations=operations, repo_type="model", token=token,
                                 commit_message=message or "Upload MLX conversion with MTP head (mtpconvert)")
    except Exception as e:  # noqa: BLE001
        raise hub_error(e, repo_id, "upload") from e
    return str(getattr(info, "commit_url", info))
