#!/usr/bin/env bash
# Create (or reuse) the pinned venv of every interop runtime, outside the repo, in
#   ${MTPCONVERT_INTEROP_CACHE:-$HOME/.cache/mtpconvert/interop}/venvs/<name>
# Extra arguments go to interop/run.py, e.g. --runtimes mlx-vlm,mlx-lm-0.32 or --with-pr990.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/run.py" --setup-only "$@"
