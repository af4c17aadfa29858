"""The command line: parses, calls ``mtpconvert.api``, renders. Commands live in one module per group."""

from ..blas import startup as _blas_startup

_blas_startup()  # as the `mtpconvert` command: re-run under an optimized BLAS before mlx loads (mtpconvert.blas)

from .main import app, main, run  # noqa: E402

__all__ = ["app", "main", "run"]
