"""The command line: parses, calls ``mtpconvert.api``, renders. Commands live in one module per group."""

from .main import app, main, run

__all__ = ["app", "main", "run"]
