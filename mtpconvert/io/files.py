"""The one rule for opening a file of a model folder, checked before it is opened.

Every command that reads a folder (convert, verify, smoke, bench, add-mtp, upload, the runtime
loader) takes each file's path from :func:`contained` (one name) or :func:`contained_glob` (a
pattern): a plain relative name, resolving (links followed) inside the folder -- or inside the
blob store of a huggingface_hub cache snapshot, whose files are links there -- and a regular file.
A FIFO would block the open until a writer came, a device might never end, and a link out of the
folder would read (or upload, or hard-link into an output) a file the user never meant to give.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import List, Optional

from ..errors import LayoutError

SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def special_file(path: Path) -> Optional[str]:
    """What ``path`` is when it is not a regular file (links followed), else None. Checked before any
    open: opening a FIFO blocks until a writer comes, and reading a device may never end."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in SPECIAL_FILES if test(mode)), "not a regular file")


def hub_blob_store(root: Path) -> Optional[Path]:
    """huggingface_hub cache snapshots (models--X/snapshots/<sha>/) link into models--X/blobs/: allowed."""
    root = Path(root).absolute()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        blobs = root.parent.parent / "blobs"
        return blobs.resolve() if blobs.is_dir() else None
    return None


def _inside(target: Path, folder: Optional[Path]) -> bool:
    return folder is not None and (folder == target.parent or folder in target.parents)


def contained(root: Path, name: str, what: str = "file", *, file: Optional[Path] = None,
              must_exist: bool = True) -> Path:
    """``root / name``, once it is safe to open: ``name`` is a plain relative name (no absolute path,
    drive, ``.`` or ``..``), it resolves inside ``root`` (or the hub blob store of a cache snapshot),
    and what is there is a regular file -- not a FIFO, socket, device, directory or dangling link.

    ``file``: where the name came from (the index, config.json), the file of the error for a name that is
    not plain, named in the message where the path leads out of the folder (the error's file: the path). ``must_exist=False``: a name
    with nothing behind it is returned as it is (the caller says what is missing)."""
    root = Path(root)
    if not isinstance(name, str) or not name or name.startswith(("/", "\\")) or ":" in name[:3]:
        raise LayoutError(f"{what} {name!r} is not a plain relative file name", file=file or root,
                          code="file-name")
    if any(p in ("..", ".") for p in name.replace("\\", "/").split("/")):
        raise LayoutError(f"{what} {name!r} leaves the checkpoint folder", file=file or root, code="file-name")
    path = root / name
    target = path.resolve()
    if not (_inside(target, root.resolve()) or _inside(target, hub_blob_store(root))):
        named_in = f" (named in {Path(file).name})" if file is not None and Path(file).name not in what else ""
        raise LayoutError(f"{what} {name!r}{named_in} resolves outside the checkpoint folder (symlink?) to {target}",
                          file=path, code="file-outside")
    if not os.path.lexists(path):
        if must_exist:
            raise LayoutError(f"{what} {name!r} is missing", file=file or path, code="file-missing")
        return path
    if not os.path.exists(path):
        raise LayoutError(f"{what} {name!r} is a dangling link (to {target}, which does not exist)", file=path,
                          code="file-special")
    if kind := special_file(path):
        raise LayoutError(f"{what} {name!r} is {kind}, not a regular file", file=path, code="file-special")
    return path


def contained_glob(root: Path, pattern: str, what: str = "file") -> List[Path]:
    """Every entry of ``root`` matching ``pattern`` (sorted), each checked by :func:`contained`: a FIFO
    or a link out of the folder under a matching name is refused, not skipped, since the runtimes that
    glob the folder would open it."""
    root = Path(root)
    return [contained(root, p.relative_to(root).as_posix(), what) for p in sorted(root.glob(pattern))]


def same_bytes(a: Path, b: Path, chunk: int = 16 << 20) -> bool:
    """Whether two regular files hold the same bytes: the same file (a hard link, or a link to it), or the
    same size and sha256."""
    import hashlib

    if os.path.samefile(a, b):
        return True
    if os.stat(a).st_size != os.stat(b).st_size:
        return False
    digests = []
    for p in (a, b):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        digests.append(h.digest())
    return digests[0] == digests[1]
