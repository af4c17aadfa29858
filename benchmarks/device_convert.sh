#!/usr/bin/env bash
# Conversion speed on an NVIDIA GPU through MLX's CUDA backend, and on the same machine's CPU
# backend: the machine's I/O floor, mtpconvert's time split, and mlx_lm.convert vs mtpconvert.
#
# Run from the repository root on a machine with CUDA 13 and Python 3.12, offline:
#   KIT      folder of wheels: mlx (cp312) and mlx-lm, the same versions as the CUDA part; a
#            base/ subfolder may hold an older mtpconvert package (the -base tools run it)
#   CUDA_TAR the mlx-cuda-13 wheel's contents as a .tar.xz (unpacked over the mlx wheel)
#   NVIDIA   site-packages/nvidia holding cuBLAS, cuDNN, NVRTC, ... for CUDA 13 (default: torch's)
#            (mlx-cuda-13 finds them at ../../nvidia relative to its libmlx.so)
#   SRC      the synthetic raw checkpoint (default /tmp/s27; made by `synth` if missing)
#   LAYERS   decoder layers of the 27B-shaped source (default 24: ~23 GB)
#   RESULTS  where the logs and JSON go (default ./gpu-results)
# Steps (arguments, in order): setup, synth, io, split, sweep, split-cpu, bench:TOOLS (convert_bench.py's
# --tools; add :N for N rounds), quantize-exact (benchmarks/quantize_exact.py), series:POINTS
# (benchmarks/series.py's points, GPU tools and mtpconvert on the CPU backend, with digests), e.g.
#   benchmarks/device_convert.sh setup synth io split bench:mlx_lm,mtpconvert-drop,mtpconvert:2
set -u -o pipefail
SRC=${SRC:-/tmp/s27}
LAYERS=${LAYERS:-24}
RESULTS=${RESULTS:-gpu-results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/tools
[ -n "${KIT:-}" ] && [ -d "$KIT/base" ] && export MTPCONVERT_BASE=$(cd "$KIT/base" && pwd)
LOG=$RESULTS/log.txt

for step in "$@"; do
  echo "== $step $(date +%T)" | tee -a "$LOG"
  case $step in
    setup)
      if [ ! -f /tmp/site/mlx/lib/libmlx.so ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "$KIT"/*.whl || exit 1
        xz -dc "$CUDA_TAR" | tar -x -C /tmp/site || exit 1
        NVIDIA=${NVIDIA:-$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')/nvidia}
        ln -sfn "$NVIDIA" /tmp/site/nvidia
      fi
      python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device(), mx.device_info())" 2>&1 | tee -a "$LOG" || exit 1
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
      (nproc; free -g; df -h "$(dirname "$SRC")") 2>&1 | tee -a "$LOG" ;;
    synth)
      [ -f "$SRC/model.safetensors.index.json" ] || python3 benchmarks/synth.py Qwen3.5-27B "$SRC" --layers "$LAYERS" 2>&1 | tee -a "$LOG" ;;
    io)
      python3 benchmarks/io_floor.py "$SRC" --json "$RESULTS/io.json" 2>&1 | tee -a "$LOG" ;;
    split)
      (cd benchmarks && python3 time_split.py "$SRC" --mtp drop --json "$RESULTS/split_gpu.json") 2>&1 | tee -a "$LOG" ;;
    sweep)
      (cd benchmarks && python3 time_split.py "$SRC" --mtp drop --sweep --json "$RESULTS/sweep.json") 2>&1 | tee -a "$LOG" ;;
    split-cpu)
      (cd benchmarks && python3 time_split.py "$SRC" --mtp drop --cpu --json "$RESULTS/split_cpu.json") 2>&1 | tee -a "$LOG" ;;
    bench:*)
      spec=${step#bench:}; tools=${spec%%:*}; rounds=1; [ "$spec" != "$tools" ] && rounds=${spec##*:}
      n=$(ls "$RESULTS"/bench*.json 2>/dev/null | wc -l)
      (cd benchmarks && python3 convert_bench.py "$SRC" --bits 4 --tools "$tools" --repeat "$rounds" --digest \
        --json "$RESULTS/bench$n.json") 2>&1 | tee -a "$LOG" ;;
    quantize-exact)
      PYTHONPATH=$PYTHONPATH:$PWD/tests python3 benchmarks/quantize_exact.py --json "$RESULTS/quantize_exact.json" 2>&1 | tee -a "$LOG" ;;
    series:*)
      (cd benchmarks && python3 series.py /tmp/series --points "${step#series:}" --digest \
        --tools mlx_lm,mtpconvert-drop,mtpconvert,mtpconvert@cpu --json "$RESULTS/series_gpu.json") 2>&1 | tee -a "$LOG" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
