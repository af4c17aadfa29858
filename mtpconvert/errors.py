"""Errors that name what went wrong and where.

Every failure a user can cause (bad files, bad config, bad options) raises a
``ConvertError`` subclass; the CLI prints its message and exits non-zero. Anything
else escaping is a bug in mtpconvert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Kept:
    """Finished work a failed or interrupted run left for ``--resume``: its partial folder,
    and the post-check that failed (None: the failure came before the checks, or an interruption)."""

    partial: Path
    failed_check: Optional[str] = None  # "verify" | "smoke"
    smoke_mode: Optional[str] = None  # the smoke that ran when it failed: "full" | "layerwise"


class ConvertError(Exception):
    """A problem with the input or the options, described for the user."""

    exit_code = 2
    default_code = "error"
    kept: Optional[Kept] = None  # set where finished shards survive the failure (see api)

    def __init__(
        self,
        message: str,
        *,
        file: Optional[Path | str] = None,
        key: Optional[str] = None,
        hint: Optional[str] = None,
        code: Optional[str] = None,
    ):
        self.code = code or self.default_code
        self.file = str(file) if file is not None else None
        self.key = key
        self.hint = hint
        self.detail = message
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.file:
            where.append(f"file {self.file}")
        if self.key:
            where.append(f"key {self.key!r}")
        text = self.detail
        if where:
            text = f"{text} ({', '.join(where)})"
        if self.hint:
            text = f"{text}\n  hint: {self.hint}"
        return text


class SafetensorsError(ConvertError):
    default_code = "bad-safetensors"
    """A safetensors file is malformed or hostile."""


class LayoutError(ConvertError):
    default_code = "layout"
    """Tensors are missing, unexpected, or have the wrong shape for the config."""


class ConfigError(ConvertError):
    default_code = "config-invalid"
    """config.json is missing, malformed, or unsupported."""


class OptionsError(ConvertError):
    default_code = "options"
    """The command-line options contradict each other or the checkpoint."""


class OutputError(ConvertError):
    default_code = "output"
    """The output folder cannot be written safely."""
