#!/usr/bin/env bash
# The benchmarks that run on an NVIDIA GPU through MLX's CUDA backend (and, where a step says so,
# on the same machine's CPU backend or on this repository's CPU). Run from the repository root:
#
#   benchmarks/device.sh STEP [STEP ...]
#
# Steps run in the order given; every step appends to $RESULTS/log.txt. A failed part1 or setup, or a
# failed conversion in batched, stops the run (exit 1); an unknown step exits 2.
#
# Set-up (once per machine; every later step finds MLX CUDA in /tmp/site):
#   part1           copy .gpu/a/cuda.part0 to /tmp: the first half of the mlx-cuda-13 wheel's contents
#                   as a .tar.xz, split so that each call's carry stays under 64 MiB (the second half,
#                   .gpu/b/cuda.part1, comes with the call that runs `setup`)
#   setup           unless /tmp/site already holds MLX: install the wheels in $KIT into /tmp/site
#                   (offline, no dependencies), unpack the mlx-cuda-13 contents over them ($CUDA_TAR,
#                   else /tmp/cuda.part0 + .gpu/b/cuda.part1, else none: $KIT holds the mlx-cuda-13
#                   wheel itself) and link $NVIDIA as /tmp/site/nvidia; then log the versions, the
#                   GPU, the cores, memory and disk
# Conversion speed (docs/performance.md), on the synthetic raw checkpoint $SRC:
#   synth           write $SRC (benchmarks/synth.py Qwen3.5-27B, $LAYERS decoder layers, default 24)
#   io              the machine's I/O floor (benchmarks/io_floor.py)           -> io.json
#   split           time split, default device (time_split.py --mtp drop)      -> split_gpu.json
#   sweep           execute() under each pipeline setting (time_split.py --sweep) -> sweep.json
#   split-cpu       time split on MLX's CPU backend (time_split.py --cpu)      -> split_cpu.json
#   bench:TOOLS[:N] convert_bench.py --tools TOOLS --repeat N --digest        -> benchN.json
#   quantize-exact  GPU quantization against the CPU kernel's bytes (quantize_exact.py) -> quantize_exact.json
#   series:POINTS   series.py's points with mlx_lm, mtpconvert-drop, mtpconvert, mtpconvert@cpu
#                   and digests                                                 -> series_gpu.json
# Runtime (docs/performance.md "Runtime step costs", docs/cuda.md, docs/batched.md):
#   runtime         the bundled fixture's demo and `mtpconvert bench` on its bf16 (depths 1-3) and
#                   q4-mtp-keep (depth 1) folders (SKIP_FIXTURE=1 skips them), then runtime_cost.py on
#                   a 27B-shaped 4-bit model ($LAYERS layers, default 16), depths 1-3
#                   -> device.txt demo.txt fixture_bench.json fixture_q4_bench.json runtime_27b.{json,txt}
#   fixtures        convert the text fixtures (bf16 and --bits 4) and run gpu_fixture_bench.py on each,
#                   depths 1 and 2                                              -> runtime_fixture_*.json
#   cost            runtime_cost.py on a 27B-shaped 4-bit model ($LAYERS layers, default 8), depths 1-2
#                                                                               -> runtime_27b_${LAYERS}l.json
#   batched         `mtpconvert bench --concurrency $LEVELS --depth 1 --depth 2 --json` on the text
#                   fixtures (dense bf16; MoE bf16, float32 on the CPU backend: CPU gather_mm),
#                   8 held-out prompts x $MAXTOK tokens per stream              -> batched_{dense,moe}.json
#                   On this repository's CPU: PY=.venv/bin/python MAXTOK=64 benchmarks/device.sh batched
# Training MoE fixture candidates (docs/runtime.md "Broken conversions"):
#   train-moe       start, in the background, one `python -m tools.fixture_training train` run per $MOE_SHAPES
#                   entry on the stage in $STAGE (made by its `prepare`), in /tmp/train
#   train-wait      wait for them
#   train-eval      export each to the raw layout, convert it to float32, run mtp_mlp_ablation.py
#                                                                  -> ablation_NAME.json, cand_NAME.tgz
# E.g. the conversion tables of docs/performance.md:
#   KIT=wheels CUDA_TAR=mlx-cuda-13.tar.xz RESULTS=out benchmarks/device.sh setup synth io split \
#       bench:mlx_lm,mtpconvert-drop-base,mtpconvert-drop,mtpconvert:2 sweep io
#
# Environment:
#   RESULTS  where the logs and JSON go (default $OUT, else ./gpu-results)
#   PY       the Python that runs every step (default python3)
#   KIT      folder of wheels for `setup`: mlx (cp312) and mlx-lm, the same version as the CUDA part,
#            and the mlx-cuda-13 wheel where no CUDA_TAR / split parts are given (default $WHEELS,
#            else .gpu/kit); a base/ subfolder may hold an older mtpconvert package: the -base tools
#            of convert_bench.py run it
#   CUDA_TAR the mlx-cuda-13 wheel's contents as a .tar.xz (unpacked over the mlx wheel)
#   NVIDIA   site-packages/nvidia holding cuBLAS, cuDNN, NVRTC, ... for CUDA 13 (default: torch's);
#            mlx-cuda-13 finds them at ../../nvidia relative to its libmlx.so
#   SRC      the conversion benchmarks' synthetic raw checkpoint (default /tmp/s27)
#   LAYERS   decoder layers of the 27B-shaped models (default per step: synth 24, runtime 16, cost 8)
#   LAYOUTS  published layouts for `runtime` (default ../shared/layouts where it exists, else the
#            copy vendored in tests/data/layouts)
#   TMO      per-command timeout in s for fixtures/cost (default 480) and batched (default 540)
#   LEVELS, MAXTOK, VARIANTS, CONV   batched: concurrency levels (1,2,4,8), tokens per stream (128),
#            fixtures ("dense moe"), where the conversions go (/tmp/conv-batched)
#   STAGE, TRAIN_ARGS, MOE_SHAPES    train-*: the prepared stage (.devfixture/stage), the common
#            training options, the candidates as name:options separated by |
set -u -o pipefail
RESULTS=${RESULTS:-${OUT:-gpu-results}}
PY=${PY:-python3}
KIT=${KIT:-${WHEELS:-.gpu/kit}}
SRC=${SRC:-/tmp/s27}
FIX=mtpconvert/fixture/data
STAGE=${STAGE:-.devfixture/stage}
TRAIN_ARGS=${TRAIN_ARGS:-"--steps 1000 --warmup 100 --batch 64 --save-at 0.5 --logs 20 --eval-every 2"}
# name:train options, one candidate each (the shipped MoE fixture: 8 experts x 64, top 2, shared 128)
MOE_SHAPES=${MOE_SHAPES:-"s32:--shared-expert-size 32|e16k4:--experts 16 --top-k 4 --shared-expert-size 32|i128:--expert-size 128 --shared-expert-size 32"}
mkdir -p "$RESULTS"; RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
[ -d "$KIT/base" ] && export MTPCONVERT_BASE=$(cd "$KIT/base" && pwd)
LOG=$RESULTS/log.txt

for step in "$@"; do
  echo "== $step $(date +%T)" | tee -a "$LOG"
  case $step in
    part1) cp .gpu/a/cuda.part0 /tmp/cuda.part0 && ls -la /tmp/cuda.part0 || exit 1 ;;
    setup)
      if [ ! -f /tmp/site/mlx/lib/libmlx.so ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "$KIT"/*.whl || exit 1
        if [ -n "${CUDA_TAR:-}" ]; then
          xz -dc "$CUDA_TAR" | tar -x -C /tmp/site || exit 1
        elif [ -f /tmp/cuda.part0 ]; then
          cat /tmp/cuda.part0 .gpu/b/cuda.part1 | xz -dc | tar -x -C /tmp/site || exit 1
        fi
        nvidia=${NVIDIA:-$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)/nvidia}
        [ -d "$nvidia" ] && ln -sfn "$nvidia" /tmp/site/nvidia
      fi
      "$PY" -c "
import mlx.core as mx, mlx_lm
try:
    import transformers; t = ' transformers ' + transformers.__version__
except ImportError:
    t = ''
print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__ + t, mx.default_device(), mx.device_info())" 2>&1 \
        | tee -a "$LOG" || exit 1
      "$PY" -V 2>&1 | tee -a "$LOG"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
      (nproc; free -g; df -h "$(dirname "$SRC")") 2>&1 | tee -a "$LOG" ;;

    # conversion speed
    synth)
      [ -f "$SRC/model.safetensors.index.json" ] || "$PY" -m benchmarks.synth Qwen3.5-27B "$SRC" --layers "${LAYERS:-24}" 2>&1 | tee -a "$LOG" ;;
    io)
      "$PY" -m benchmarks.io_floor "$SRC" --json "$RESULTS/io.json" 2>&1 | tee -a "$LOG" ;;
    split)
      "$PY" -m benchmarks.time_split "$SRC" --mtp drop --json "$RESULTS/split_gpu.json" 2>&1 | tee -a "$LOG" ;;
    sweep)
      "$PY" -m benchmarks.time_split "$SRC" --mtp drop --sweep --json "$RESULTS/sweep.json" 2>&1 | tee -a "$LOG" ;;
    split-cpu)
      "$PY" -m benchmarks.time_split "$SRC" --mtp drop --cpu --json "$RESULTS/split_cpu.json" 2>&1 | tee -a "$LOG" ;;
    bench:*)
      spec=${step#bench:}; tools=${spec%%:*}; rounds=1; [ "$spec" != "$tools" ] && rounds=${spec##*:}
      n=$(ls "$RESULTS"/bench*.json 2>/dev/null | wc -l)
      "$PY" -m benchmarks.convert_bench "$SRC" --bits 4 --tools "$tools" --repeat "$rounds" --digest \
        --json "$RESULTS/bench$n.json" 2>&1 | tee -a "$LOG" ;;
    quantize-exact)
      "$PY" -m benchmarks.quantize_exact --json "$RESULTS/quantize_exact.json" 2>&1 | tee -a "$LOG" ;;
    series:*)
      "$PY" -m benchmarks.series /tmp/series --points "${step#series:}" --digest \
        --tools mlx_lm,mtpconvert-drop,mtpconvert,mtpconvert@cpu --json "$RESULTS/series_gpu.json" 2>&1 | tee -a "$LOG" ;;

    # runtime
    runtime)
      "$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())" 2>&1 \
        | tee "$RESULTS/device.txt" || exit 1
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$RESULTS/device.txt" 2>&1
      if [ -z "${SKIP_FIXTURE:-}" ]; then
        "$PY" -m mtpconvert.demo --out /tmp/demo 2>&1 | tee "$RESULTS/demo.txt"
        "$PY" -m mtpconvert bench /tmp/demo/bf16 --depth 1 --depth 2 --depth 3 --max-tokens 96 --json \
          > "$RESULTS/fixture_bench.json" 2> "$RESULTS/fixture_bench.err"
        "$PY" -m mtpconvert bench /tmp/demo/q4-mtp-keep --depth 1 --max-tokens 96 --json \
          > "$RESULTS/fixture_q4_bench.json" 2> "$RESULTS/fixture_q4_bench.err"
      fi
      layouts=(); l=${LAYOUTS:-../shared/layouts}; [ -d "$l" ] && layouts=(--layouts "$(cd "$l" && pwd)")
      "$PY" -m benchmarks.runtime_cost Qwen3.5-27B /tmp/rt27 --layers "${LAYERS:-16}" --bits 4 \
        --depth 1 --depth 2 --depth 3 "${layouts[@]}" --json "$RESULTS/runtime_27b.json" 2>&1 \
        | tee "$RESULTS/runtime_27b.txt" ;;
    fixtures)
      for name in text-qwen35-mtp text-qwen35-moe-mtp; do
        for prec in bf16 q4; do
          out=/tmp/conv/$name-$prec; extra=(); [ $prec = q4 ] && extra=(--bits 4)
          [ -d "$out" ] || timeout "${TMO:-480}" "$PY" -m mtpconvert convert "$FIX/$name" "$out" --no-smoke "${extra[@]}" >> "$LOG" 2>&1
          timeout "${TMO:-480}" "$PY" -m benchmarks.gpu_fixture_bench "$FIX/$name" "$out" --depth 1 --depth 2 \
            --json "$RESULTS/runtime_fixture_${name#text-qwen35-}_$prec.json" >> "$LOG" 2>&1
          echo "$name $prec rc=$? $(date +%T)" | tee -a "$LOG"
        done
      done ;;
    cost)
      layers=${LAYERS:-8}
      timeout "${TMO:-480}" "$PY" -m benchmarks.runtime_cost Qwen3.5-27B /tmp/rt27 --layers "$layers" --bits 4 \
        --depth 1 --depth 2 --json "$RESULTS/runtime_27b_${layers}l.json" 2>&1 | tee "$RESULTS/runtime_27b.txt" ;;
    batched)
      dtype=$("$PY" -c "import mlx.core as mx; print('float32' if mx.default_device() == mx.cpu else 'bfloat16')")
      for variant in ${VARIANTS:-dense moe}; do
        name=text-qwen35-mtp; [ $variant = moe ] && name=text-qwen35-moe-mtp
        conv_dtype=bfloat16; [ $variant = moe ] && conv_dtype=$dtype
        out=${CONV:-/tmp/conv-batched}/$name-$conv_dtype
        [ -d "$out" ] || timeout "${TMO:-540}" "$PY" -m mtpconvert convert "$FIX/$name" "$out" --no-smoke \
          --dtype "$conv_dtype" >> "$LOG" 2>&1 || exit 1
        # the held-out prompts as NUL-separated texts -> repeated -p options
        mapfile -d '' texts < <("$PY" -c "
import sys
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
texts, _, _ = heldout_prompts(text_fixture_path('$variant'), per_file=1, prompt_tokens=32, files=8)
sys.stdout.write(''.join(t + '\0' for t in texts))")
        args=(); for t in "${texts[@]}"; do args+=(-p "$t"); done
        timeout "${TMO:-540}" "$PY" -m mtpconvert bench "$out" "${args[@]}" --concurrency "${LEVELS:-1,2,4,8}" \
          --depth 1 --depth 2 --max-tokens "${MAXTOK:-128}" --json > "$RESULTS/batched_$variant.json" 2>> "$LOG"
        echo "$variant rc=$? $(date +%T)" | tee -a "$LOG"
      done ;;

    # MoE fixture candidates
    train-moe)
      mkdir -p /tmp/train
      IFS='|' read -ra shapes <<< "$MOE_SHAPES"
      for spec in "${shapes[@]}"; do
        name=${spec%%:*}; opts=${spec#*:}
        echo "python -m tools.fixture_training train --stage stage --variant moe --out run-$name $TRAIN_ARGS $opts" \
          > "/tmp/train/$name.cmd"
        # shellcheck disable=SC2086  # options lists
        nohup "$PY" -m tools.fixture_training train --stage "$STAGE" --variant moe --out "/tmp/train/$name" \
          $TRAIN_ARGS $opts > "/tmp/train/$name.log" 2>&1 &
        echo "$name: $opts (pid $!)" | tee -a "$LOG"
      done ;;
    train-wait)
      while pgrep -f "tools.fixture_training train" > /dev/null; do sleep 5; done
      tail -n 2 /tmp/train/*.log | tee -a "$LOG" ;;
    train-eval)
      for run in /tmp/train/*/; do
        name=$(basename "$run"); cand=/tmp/cand/$name
        "$PY" -m tools.fixture_training export --stage "$STAGE" --run "$run" --variant moe --out "$cand" \
          --commands "python -m tools.fixture_training prepare --stage stage" "$(cat "/tmp/train/$name.cmd")" \
          "python -m tools.fixture_training export --stage stage --run run-$name --variant moe" 2>&1 | tee -a "$LOG"
        "$PY" -m mtpconvert convert "$cand" "/tmp/cand/$name-f32" --dtype float32 --no-smoke >> "$LOG" 2>&1
        "$PY" -m benchmarks.mtp_mlp_ablation "/tmp/cand/$name-f32" --heldout "$STAGE/heldout.npy" \
          --json "$RESULTS/ablation_$name.json" 2>&1 | tee -a "$LOG"
        tar czf "$RESULTS/cand_$name.tgz" -C /tmp/cand "$name"
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
