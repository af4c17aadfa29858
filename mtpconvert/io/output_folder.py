"""An output folder that appears whole or not at all.

Work happens in a hidden sibling (``.OUT.partial``), guarded by a lock file so two
runs cannot write the same OUT; ``commit`` renames it into place. OUT never holds half a
model. Nothing finished is lost: once a shard is finished (its resume record is in
``RESUME_DIR``) the partial folder survives any failure — an interruption, a post-check
that fails, an exception — so ``--resume`` can reuse its shards, which are checked against
their recorded hashes before they are trusted. A failure before any shard is finished (bad
input, disk full in the first shard) removes it. A run without ``--resume`` starts from an
empty partial folder.

The lock is ``filelock.FileLock`` (``flock`` on ``.OUT.lock``): the kernel releases it when
its process ends, however it ends, so there is no stale lock to take over and no race in
taking one over. The lock file itself stays beside OUT: unlinking a lock file others may
be waiting on would let two runs hold locks on different files.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from filelock import FileLock, Timeout

from ..errors import OutputError

RESUME_DIR = ".mtpconvert-resume"  # inside the partial folder: one record per finished shard; removed before commit


class OutputFolder:
    def __init__(self, out: Path, *, overwrite: bool = False, resume: bool = False):
        self.out = Path(out)
        self.overwrite = overwrite
        self.resume = resume
        self.tmp = self.out.parent / f".{self.out.name}.partial"
        self.lock = self.out.parent / f".{self.out.name}.lock"
        self._lock: Optional[FileLock] = None

    def __enter__(self) -> "OutputFolder":
        if self.out.exists() and not self.overwrite:
            raise OutputError("output folder already exists", file=self.out, hint="pass --overwrite to replace it")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create parent folder: {e.strerror}", file=self.out.parent) from e
        self._acquire()
        try:
            if self.tmp.exists() and not self.resume:
                shutil.rmtree(self.tmp)
            self.tmp.mkdir(exist_ok=True)
        except BaseException:
            self._release()
            raise
        return self

    def _acquire(self) -> None:
        lock = FileLock(str(self.lock))
        try:
            lock.acquire(timeout=0)  # never wait: a second run on the same OUT is refused at once
        except Timeout:
            raise OutputError("another mtpconvert process is writing this output", file=self.out,
                              hint="wait for it to finish (its lock goes when it exits, however it ends)") from None
        self._lock = lock

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def path(self, name: str) -> Path:
        return self.tmp / name

    def write_json(self, name: str, obj: dict, indent: int = 4) -> None:
        with open(self.path(name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
            f.write("\n")

    def holds_finished_work(self) -> bool:
        """A shard is finished (its resume record written), here or by an earlier run being resumed."""
        records = self.tmp / RESUME_DIR
        return records.is_dir() and any(records.glob("*.json"))

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
            if exc is not None and self.tmp.exists():
                if self.holds_finished_work():
                    _name_kept_partial(exc, self.tmp)
                else:
                    shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self._release()


def _name_kept_partial(exc: BaseException, partial: Path) -> None:
    """Tell the caller, on the exception itself, where the finished shards wait for --resume."""
    try:
        exc.kept_partial = partial
    except AttributeError:  # a type without a __dict__: the caller just cannot name the folder
        pass


def describe_os_error(e: OSError, path: Path) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError("disk full while writing the output", file=path)
    return OutputError(f"cannot write output: {e.strerror}", file=path)
