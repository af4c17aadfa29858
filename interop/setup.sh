#!/usr/bin/env bash
# Create (or reuse) the pinned venv of every interop runtime, outside the repo, in
#   ${MTPCONVERT_INTEROP_CACHE:-$HOME/.cache/mtpconvert/interop}/venvs/<name>
# from PyPI (what each installs: RUNTIMES in interop/run.py and interop/README.md). On Linux:
#   - mlx[cpu] everywhere;
#   - mtplx with its darwin-only requirements named explicitly (mlx[cpu]==0.32.2, mlx-lm<0.32,
#     transformers>=5.10,<5.17,!=5.13.0);
#   - rapid-mlx / vllm-mlx with torch==2.13.0 + torchvision==0.28.0 from PyTorch's CPU index first
#     (PyPI's matching pair, torch===2.13.0 + torchvision==0.28.0, where that index does not answer)
#     (MTPCONVERT_TORCH_INDEX overrides the index; empty = pip's own), then the runtime under a
#     constraints file pinning both.
# Extra arguments go to python -m interop.run, e.g. --runtimes mlx-vlm,mlx-lm-0.32, --with-pr990 (the
# mlx-lm PR #990 branch from GitHub; a checkout in $CACHE/src/mlx-lm-pr990 or MTPCONVERT_PR990_SRC
# is used when present), --reinstall.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the repository root on PYTHONPATH, so that this runs from any folder (relative arguments keep their meaning)
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m interop.run --setup-only "$@"
