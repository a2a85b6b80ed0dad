#!/usr/bin/env bash
# Issue 34 on one GPU: the single engine's AR phase. `bash tools/gpu_ar.sh smoke` (tiny model: batched vs
# solo, decode graphs vs eager; then 4 bf16 layers), `bash tools/gpu_ar.sh full` (the smoke, then 32 FP8
# layers: decode at 1, 16 and 64 concurrent, eager and with decode graphs; needs an H200: 75 GB of weights).
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
summary() {
  python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["build"], r["peak_bytes"], r["machine"])
for x in r["runs"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()})
EOF
}
run smoke 200 python3 tools/gpu_ar_smoke.py
cat "$OUT/smoke.json"; echo
case "${1:-smoke}" in
smoke)
  run ar4 300 python3 -m ditkv.entrypoints.cli bench ar --layers 4 --quantization none --concurrency 1,16 --json
  summary "$OUT/ar4.json" ;;
full)
  run ar32 500 python3 -m ditkv.entrypoints.cli bench ar --layers 32 --quantization fp8 --concurrency 1,16,64 --json
  summary "$OUT/ar32.json" ;;
esac
