"""`python -m mtpconvert ...` runs the CLI (where the console script is not installed)."""

from .cli import main

if __name__ == "__main__":  # not when a worker process (multiprocessing "spawn") imports it
    main()
