"""What a path in a folder is, checked before it is opened."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def special_file(path: Path) -> Optional[str]:
    """What ``path`` is when it is not a regular file (links followed), else None. Checked before any
    open: opening a FIFO blocks until a writer comes, and reading a device may never end."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in SPECIAL_FILES if test(mode)), "not a regular file")
