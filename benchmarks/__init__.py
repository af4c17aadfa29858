"""Benchmarks, not installed with mtpconvert: run from the repository root as ``python -m benchmarks.<name>``
(README.md lists them)."""
