#!/usr/bin/env bash
# Issue 34 on one GPU: the single engine's AR phase. `bash tools/gpu_ar.sh smoke` (tiny model: batched vs
# solo, decode graphs vs eager; then 4 bf16 layers), `bash tools/gpu_ar.sh full` (32 FP8
# layers: decode at 1, 16 and 64 concurrent, eager and with decode graphs; needs an H200: 75 GB of weights),
# `bash tools/gpu_ar.sh gemv [LAYERS]` (the FP8 GEMV pass of decode on and off at 1 / 4 / 16 rows, after its GPU
# tests), `bash tools/gpu_ar.sh instruct [LAYERS]` (8 concurrent 512-token texts, then a 1024^2 image in 8 steps, one row,
# with and without the text: images/min, AR latency, peak memory), `bash tools/gpu_ar.sh ab OLD_SRC` (plain
# text-to-image before vs after: the same `bench step --e2e-request` from OLD_SRC and from here, alternated).
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
case "${1:-smoke}" in smoke) run smoke 200 python3 tools/gpu_ar_smoke.py; cat "$OUT/smoke.json"; echo ;; esac
case "${1:-smoke}" in
instruct)
  run instruct 560 python3 -m ditkv.entrypoints.cli bench ar --layers "${2:-32}" --quantization fp8 --concurrency 8 \
    --new-tokens 512 --prompt-tokens 1000 --image 1024 --steps 8 --graphs on --plain --json
  summary "$OUT/instruct.json" ;;
ab)
  old=$2
  E="bench step --preset release --prefix 1024 --image 1024 --guidance 4 --json --e2e-request --layers 8"
  E="$E --quantization fp8 --e2e-steps 20 --repeats 2 --max-num-seqs 1 4"
  for i in 1 2; do
    (cd "$old" && export PYTHONPATH=/tmp/site:$PWD && run "old$i" 150 python3 -m ditkv.entrypoints.cli $E)
    run "new$i" 150 python3 -m ditkv.entrypoints.cli $E
  done ;;
smoke)
  run ar4 300 python3 -m ditkv.entrypoints.cli bench ar --layers 4 --quantization none --concurrency 1,16 --json
  summary "$OUT/ar4.json" ;;
full)  # graphs at every concurrency and the Instruct case, eager at R = 1 (host-bound; see docs/ar-phase.md)
  run ar32 330 python3 -m ditkv.entrypoints.cli bench ar --layers 32 --quantization fp8 --concurrency 1,16,64 \
    --graphs on --instruct --json
  summary "$OUT/ar32.json"
  run ar32one 200 python3 -m ditkv.entrypoints.cli bench ar --layers 32 --quantization fp8 --concurrency 1 \
    --graphs both --fp8-gemv-rows 0,2 --json
  summary "$OUT/ar32one.json" ;;
gemv)  # the FP8 GEMV pass of decode on and off (A/B in one run), LAYERS (default 16) on one GPU, after its GPU tests
  DITKV_TRITON_GPU_TESTS=1 timeout 200 python3 -m pytest -q -m gpu tests/test_fp8_gemv.py tests/test_triton_decode.py \
    tests/test_fp8_gpu.py 2>&1 | tail -4
  timeout 150 python3 tools/profile_ar_decode.py --layers "${2:-16}" --rows 1 2>&1 | tail -32
  run gemv 330 python3 -m ditkv.entrypoints.cli bench ar --layers "${2:-16}" --quantization fp8 --concurrency 1,2,4 \
    --graphs on --fp8-gemv-rows 0,1,2,4 --json
  summary "$OUT/gemv.json" ;;
esac
