"""Development tools, not installed with mtpconvert: run from the repository root as ``python -m tools.<name>``."""
