#!/usr/bin/env bash
# Issue 34 on one H200: the single engine's AR phase. `bash tools/gpu_ar.sh smoke` (tiny model, batched vs
# solo, + 4 bf16 layers), `bash tools/gpu_ar.sh full` (32 FP8 layers: decode at 1, 16 and 64 concurrent).
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "${1:-smoke}" in
smoke)
  run smoke 200 python3 tools/gpu_ar_smoke.py
  cat "$OUT/smoke.json"
  run ar4 300 python3 -m ditkv.entrypoints.cli bench ar --layers 4 --quantization none --concurrency 1,16 --json
  cat "$OUT/ar4.json" | head -c 3000 ;;
full)
  run ar32 560 python3 -m ditkv.entrypoints.cli bench ar --layers 32 --quantization fp8 --concurrency 1,16,64 --json
  cat "$OUT/ar32.json" | head -c 4000 ;;
esac
