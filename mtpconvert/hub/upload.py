"""Upload an output folder (with its card) to the Hub in one commit."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import hub_api, hub_error


def upload(folder: Path, repo_id: str, *, token: Optional[str] = None, private: bool = False,
           card: Optional[str] = None, message: Optional[str] = None) -> str:
    """Create the repo if needed and upload the folder (with its card) in one commit; return the commit url."""
    folder = Path(folder)
    if card is not None:
        (folder / "README.md").write_text(card, encoding="utf-8")
    api = hub_api(token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True, token=token)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", token=token,
                                 commit_message=message or "Upload MLX conversion with MTP head (mtpconvert)",
                                 ignore_patterns=[".*", "**/.*"])
    except Exception as e:  # noqa: BLE001
        raise hub_error(e, repo_id, "upload") from e
    return str(getattr(info, "commit_url", info))
