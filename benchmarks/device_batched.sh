#!/usr/bin/env bash
# Issue 19 on the device machine (MLX CUDA): `mtpconvert bench --concurrency 1,2,4,8 --json` (batched MTP
# vs mlx-lm's BatchGenerator) on the text fixtures (dense bf16, MoE bf16), depths 1 and 2, greedy,
# 8 held-out prompts x MAXTOK tokens per stream.
# Steps (arguments): part1, setup (both run benchmarks/device_gpu_runtime.sh's steps of those names:
#   MLX CUDA into /tmp/site), batched. On the CPU: PY=.venv/bin/python RESULTS=/tmp/r LEVELS=1,2 \
#   MAXTOK=16 benchmarks/device_batched.sh batched  (MoE converts to float32 there: CPU gather_mm).
#   RESULTS (default $OUT or ./gpu-results), PY (default python3), LEVELS (default 1,2,4,8),
#   MAXTOK (default 128), TMO (per-bench timeout in s, default 540), VARIANTS (default "dense moe")
set -u -o pipefail
RESULTS=${RESULTS:-${OUT:-gpu-results}}
PY=${PY:-python3}
LEVELS=${LEVELS:-1,2,4,8}
MAXTOK=${MAXTOK:-128}
TMO=${TMO:-540}
mkdir -p "$RESULTS"; RESULTS=$(cd "$RESULTS" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/tools
LOG=$RESULTS/log.txt
FIX=mtpconvert/fixture/data
CONV=${CONV:-/tmp/conv-batched}
for step in "$@"; do
  case $step in
    part1|setup) RESULTS=$RESULTS bash "$HERE/device_gpu_runtime.sh" "$step" || exit 1 ;;
    batched)
      echo "== batched $(date +%T)" | tee -a "$LOG"
      dtype=$("$PY" -c "import mlx.core as mx; print('float32' if mx.default_device() == mx.cpu else 'bfloat16')")
      for variant in ${VARIANTS:-dense moe}; do
        name=text-qwen35-mtp; [ $variant = moe ] && name=text-qwen35-moe-mtp
        conv_dtype=bfloat16; [ $variant = moe ] && conv_dtype=$dtype
        out=$CONV/$name-$conv_dtype
        [ -d "$out" ] || timeout "$TMO" "$PY" -m mtpconvert convert "$FIX/$name" "$out" --no-smoke \
          --dtype "$conv_dtype" >> "$LOG" 2>&1 || exit 1
        # the held-out prompts as NUL-separated texts -> repeated -p options
        mapfile -d '' texts < <("$PY" -c "
import sys
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
texts, _, _ = heldout_prompts(text_fixture_path('$variant'), per_file=1, prompt_tokens=32, files=8)
sys.stdout.write(''.join(t + '\0' for t in texts))")
        args=(); for t in "${texts[@]}"; do args+=(-p "$t"); done
        timeout "$TMO" "$PY" -m mtpconvert bench "$out" "${args[@]}" --concurrency "$LEVELS" --depth 1 --depth 2 \
          --max-tokens "$MAXTOK" --json > "$RESULTS/batched_$variant.json" 2>> "$LOG"
        echo "$variant rc=$? $(date +%T)" | tee -a "$LOG"
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
