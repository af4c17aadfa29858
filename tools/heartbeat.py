"""Run a command that is silent for a while (a quiet ``pip install``) with a stage line and a heartbeat on stderr.

    python3 -m tools.heartbeat "installing mtpconvert into .venv" [--every 5] -- CMD [ARG...]

Prints ``[make] LABEL...`` before CMD starts and ``[make] LABEL: N s`` every ``--every`` seconds while it
runs (a new line each time in a log; one line rewritten in place on a terminal), then exits with CMD's
status. Standard library only: ``make demo`` runs it with the system Python before the venv has a package.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import List, Optional, TextIO


def run(label: str, cmd: List[str], every: float = 5.0, out: TextIO = sys.stderr) -> int:
    """CMD's exit status; ``out`` gets the stage line and one line per ``every`` seconds CMD has not finished."""
    terminal = out.isatty()
    started = time.monotonic()
    out.write(f"[make] {label}...\n")
    out.flush()
    try:
        proc = subprocess.Popen(cmd)
    except OSError as e:
        out.write(f"[make] {label}: cannot run {cmd[0]!r}: {e.strerror}\n")
        return 127
    beats = 0
    while True:
        try:
            code = proc.wait(timeout=every)
            break
        except subprocess.TimeoutExpired:
            beats += 1
            # a terminal keeps one line that counts up; a log gets a line per beat, so gaps stay short there
            line = f"[make] {label}: {time.monotonic() - started:.0f} s"
            out.write(f"\r{line}" if terminal else f"{line}\n")
            out.flush()
        except KeyboardInterrupt:
            proc.wait()
            raise
    if terminal and beats:
        out.write("\n")
    return code


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="python3 -m tools.heartbeat LABEL [--every S] -- CMD [ARG...]")
    ap.add_argument("label", help="what the command does, as the stage line says it")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between heartbeat lines (default 5)")
    # the command is everything after the first --, its own options included
    split = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        ap.error("no command given: put it after --")
    if args.every <= 0:
        ap.error(f"--every must be a positive number of seconds, got {args.every}")
    return run(args.label, cmd, args.every)

if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130)
