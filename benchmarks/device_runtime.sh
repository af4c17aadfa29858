#!/usr/bin/env bash
# MTP runtime cost on an NVIDIA GPU through MLX's CUDA backend.
#
# Run from the repository root on a machine with CUDA 13 and Python 3.12, with offline wheels:
#   WHEELS   folder of wheels: mlx, mlx-cuda-13, mlx-lm, and any of typer/rich/pyyaml missing there
#   NVIDIA   site-packages/nvidia folder holding cuBLAS, cuDNN, cuFFT, NVRTC, NCCL for CUDA 13
#            (mlx-cuda-13 finds them at ../../nvidia relative to its libmlx.so)
#   LAYOUTS  folder of published layouts (default ../shared/layouts)
#   RESULTS  where the logs and JSON go (default ./gpu-results)
#   LAYERS   decoder layers of the 27B-shaped model (default 16)
#   SKIP_FIXTURE=1 skips the fixture steps
# Steps: the bundled fixture's demo (acceptance, plain vs MTP tok/s), `mtpconvert bench` on its
# bf16 conversion at depths 1-3, then benchmarks/runtime_cost.py on a 27B-shaped 4-bit model.
set -u -o pipefail
RESULTS=${RESULTS:-gpu-results}
LAYOUTS=${LAYOUTS:-../shared/layouts}
LAYERS=${LAYERS:-16}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
LAYOUTS=$(cd "$LAYOUTS" && pwd)

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  [ -n "${NVIDIA:-}" ] && ln -sfn "$NVIDIA" /tmp/site/nvidia
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1

python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())" 2>&1 \
  | tee "$RESULTS/device.txt" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$RESULTS/device.txt" 2>&1

if [ -z "${SKIP_FIXTURE:-}" ]; then
  python3 -m mtpconvert.demo --out /tmp/demo 2>&1 | tee "$RESULTS/demo.txt"
  python3 -m mtpconvert bench /tmp/demo/bf16 --depth 1 --depth 2 --depth 3 --max-tokens 96 --json \
    > "$RESULTS/fixture_bench.json" 2> "$RESULTS/fixture_bench.err"
  python3 -m mtpconvert bench /tmp/demo/q4-mtp-keep --depth 1 --max-tokens 96 --json \
    > "$RESULTS/fixture_q4_bench.json" 2> "$RESULTS/fixture_q4_bench.err"
fi

cd benchmarks && python3 runtime_cost.py Qwen3.5-27B /tmp/rt27 --layers "$LAYERS" --bits 4 \
  --depth 1 --depth 2 --depth 3 --layouts "$LAYOUTS" --json "$RESULTS/runtime_27b.json" 2>&1 \
  | tee "$RESULTS/runtime_27b.txt"
