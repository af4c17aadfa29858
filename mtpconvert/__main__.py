"""`python -m mtpconvert ...` runs the CLI (where the console script is not installed)."""

from .cli import run

run()
