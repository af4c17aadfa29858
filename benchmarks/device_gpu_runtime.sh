#!/usr/bin/env bash
# Issue 17 item 5 on the device machine (MLX CUDA): `mtpconvert bench` (mlx-lm generate_step vs
# MTP) on the realistic text fixtures, bf16 and 4-bit, depths 1 and 2, greedy; then
# benchmarks/runtime_cost.py on a 27B-shaped 4-bit model (beta, delta, MTP vs mlx-lm tok/s).
# Steps (arguments): part1 (copy the CUDA wheel's first half to /tmp), setup, fixtures, cost,
#   train-moe (start, in the background, the MoE fixture candidates of $MOE_SHAPES on the stage in
#   $STAGE, made by `tools/train_text_fixture.py prepare`; runs in /tmp/train), train-wait (wait for
#   them), train-eval (export each to the raw layout, convert it to float32, run
#   benchmarks/mtp_mlp_ablation.py; $RESULTS/cand_NAME.tgz holds the exported fixture)
#   .gpu/a/cuda.part0 + .gpu/b/cuda.part1 = the mlx-cuda-13 wheel's contents as a .tar.xz (split
#   to fit the 64 MiB carry), .gpu/kit = the mlx (cp312) and mlx-lm wheels of the same version;
#   the image's nvidia package folder (torch's) holds cuBLAS/cuDNN/NVRTC for CUDA 13.
#   RESULTS (default $OUT or ./gpu-results), LAYERS (default 8), TMO (per-step timeout, default 480)
set -u -o pipefail
RESULTS=${RESULTS:-${OUT:-gpu-results}}
LAYERS=${LAYERS:-8}
TMO=${TMO:-480}
STAGE=${STAGE:-.devfixture/stage}
TRAIN_ARGS=${TRAIN_ARGS:-"--steps 1000 --warmup 100 --batch 64 --save-at 0.5 --logs 20 --eval-every 2"}
# name:train options, one candidate each (the shipped MoE fixture: 8 experts x 64, top 2, shared 128)
MOE_SHAPES=${MOE_SHAPES:-"s32:--shared-expert-size 32|e16k4:--experts 16 --top-k 4 --shared-expert-size 32|i128:--expert-size 128 --shared-expert-size 32"}
mkdir -p "$RESULTS"; RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/tools
LOG=$RESULTS/log.txt
FIX=mtpconvert/fixture/data
for step in "$@"; do
  echo "== $step $(date +%T)" | tee -a "$LOG"
  case $step in
    part1) cp .gpu/a/cuda.part0 /tmp/cuda.part0 && ls -la /tmp/cuda.part0 ;;
    setup)
      if [ ! -f /tmp/site/mlx/lib/libmlx.so ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .gpu/kit/*.whl || exit 1
        cat /tmp/cuda.part0 .gpu/b/cuda.part1 | xz -dc | tar -x -C /tmp/site || exit 1
        ln -sfn "$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')/nvidia" /tmp/site/nvidia
      fi
      python3 -c "import mlx.core as mx, mlx_lm, transformers; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, 'transformers', transformers.__version__, mx.default_device(), mx.device_info())" 2>&1 | tee -a "$LOG" || exit 1
      python3 -V 2>&1 | tee -a "$LOG"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG" ;;
    fixtures)
      for name in text-qwen35-mtp text-qwen35-moe-mtp; do
        for prec in bf16 q4; do
          out=/tmp/conv/$name-$prec; extra=(); [ $prec = q4 ] && extra=(--bits 4)
          [ -d "$out" ] || timeout "$TMO" python3 -m mtpconvert convert "$FIX/$name" "$out" --no-smoke "${extra[@]}" >> "$LOG" 2>&1
          timeout "$TMO" python3 benchmarks/gpu_fixture_bench.py "$FIX/$name" "$out" --depth 1 --depth 2 \
            --json "$RESULTS/runtime_fixture_${name#text-qwen35-}_$prec.json" >> "$LOG" 2>&1
          echo "$name $prec rc=$? $(date +%T)" | tee -a "$LOG"
        done
      done ;;
    cost)
      (cd benchmarks && timeout "$TMO" python3 runtime_cost.py Qwen3.5-27B /tmp/rt27 --layers "$LAYERS" --bits 4 \
        --depth 1 --depth 2 --json "$RESULTS/runtime_27b_${LAYERS}l.json") 2>&1 | tee "$RESULTS/runtime_27b.txt" ;;
    train-moe)
      mkdir -p /tmp/train
      IFS='|' read -ra shapes <<< "$MOE_SHAPES"
      for spec in "${shapes[@]}"; do
        name=${spec%%:*}; opts=${spec#*:}
        echo "python tools/train_text_fixture.py train --stage stage --variant moe --out run-$name $TRAIN_ARGS $opts" \
          > "/tmp/train/$name.cmd"
        # shellcheck disable=SC2086  # options lists
        nohup python3 tools/train_text_fixture.py train --stage "$STAGE" --variant moe --out "/tmp/train/$name" \
          $TRAIN_ARGS $opts > "/tmp/train/$name.log" 2>&1 &
        echo "$name: $opts (pid $!)" | tee -a "$LOG"
      done ;;
    train-wait)
      while pgrep -f "train_text_fixture.py train" > /dev/null; do sleep 5; done
      tail -n 2 /tmp/train/*.log | tee -a "$LOG" ;;
    train-eval)
      for run in /tmp/train/*/; do
        name=$(basename "$run"); cand=/tmp/cand/$name
        python3 tools/train_text_fixture.py export --stage "$STAGE" --run "$run" --variant moe --out "$cand" \
          --commands "python tools/train_text_fixture.py prepare --stage stage" "$(cat "/tmp/train/$name.cmd")" \
          "python tools/train_text_fixture.py export --stage stage --run run-$name --variant moe" 2>&1 | tee -a "$LOG"
        python3 -m mtpconvert convert "$cand" "/tmp/cand/$name-f32" --dtype float32 --no-smoke >> "$LOG" 2>&1
        python3 benchmarks/mtp_mlp_ablation.py "/tmp/cand/$name-f32" --heldout "$STAGE/heldout.npy" \
          --json "$RESULTS/ablation_$name.json" 2>&1 | tee -a "$LOG"
        tar czf "$RESULTS/cand_$name.tgz" -C /tmp/cand "$name"
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
