"""An output folder that appears whole or not at all.

Work happens in a hidden sibling (``.OUT.partial``), guarded by a lock file so two
runs cannot write the same OUT; ``commit`` renames it into place. OUT never holds half a
model. An error (disk full, bad input) removes the partial folder; an interruption
(Ctrl-C, SIGTERM) keeps it so ``--resume`` can reuse its finished shards, which are
checked against their recorded hashes before they are trusted. A run without
``--resume`` starts from an empty partial folder.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from ..errors import OutputError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputFolder:
    def __init__(self, out: Path, *, overwrite: bool = False, resume: bool = False):
        self.out = Path(out)
        self.overwrite = overwrite
        self.resume = resume
        self.tmp = self.out.parent / f".{self.out.name}.partial"
        self.lock = self.out.parent / f".{self.out.name}.lock"
        self._locked = False

    def __enter__(self) -> "OutputFolder":
        if self.out.exists() and not self.overwrite:
            raise OutputError("output folder already exists", file=self.out, hint="pass --overwrite to replace it")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create parent folder: {e.strerror}", file=self.out.parent) from e
        self._acquire()
        if self.tmp.exists() and not self.resume:
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(exist_ok=True)
        return self

    def _acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and _pid_alive(pid):
                    raise OutputError(
                        f"another mtpconvert process (pid {pid}) is writing this output",
                        file=self.out,
                        hint=f"wait for it, or remove {self.lock} if it is gone",
                    ) from None
                self.lock.unlink(missing_ok=True)  # stale lock from a killed run
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self._locked = True
            return
        raise OutputError("could not take the output lock", file=self.lock)

    def path(self, name: str) -> Path:
        return self.tmp / name

    def write_json(self, name: str, obj: dict, indent: int = 4) -> None:
        with open(self.path(name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
            f.write("\n")

    def commit(self) -> None:
        """Move the finished folder into place (replacing OUT only with --overwrite)."""
        old: Optional[Path] = None
        if self.out.exists():
            if not self.overwrite:
                raise OutputError("output folder appeared while converting", file=self.out)
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
            if exc_type is not None and self.tmp.exists() and not interrupted:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            if self._locked:
                self.lock.unlink(missing_ok=True)
                self._locked = False


def describe_os_error(e: OSError, path: Path) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError("disk full while writing the output; nothing was kept", file=path)
    return OutputError(f"cannot write output: {e.strerror}", file=path)
