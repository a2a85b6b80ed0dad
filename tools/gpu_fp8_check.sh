#!/usr/bin/env bash
# FP8 on one H200 (no internet; py3.12 wheels for the test deps carried in .whl/):
#   STAGE=tests  the FP8 GPU tests and the CUDA/MoE tests around them
#   STAGE=bench  `ditkv bench step --preset release` in bf16 and fp8 (JSON under $OUT)
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
case "${STAGE:-tests}" in
tests)
  timeout ${TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_fp8_gpu.py tests/test_cuda.py tests/test_moe_grouped.py} 2>&1 | tail -25 ;;
compare)  # 4 layers, bf16 vs fp8 in one run (same weights), T=4097
  timeout ${TIMEOUT:-300} python3 -m ditkv.entrypoints.cli bench step --preset release --layers 4 --quantization fp8 \
    --compare-bf16 --prefix 1024 --image 1024 --guidance 4 --moe-impl auto --repeats 5 --json \
    > "$OUT/step_release4_fp8_vs_bf16.json" 2> "$OUT/compare.err"; echo "compare rc=$?"; tail -5 "$OUT/compare.err" ;;
full)  # all 32 layers in fp8: the graph step at T=4097, then a whole 1024^2 50-step CFG request with decode
  timeout 280 python3 -m ditkv.entrypoints.cli bench step --preset release --layers 32 --quantization fp8 \
    --prefix 1024 --image 1024 --guidance 4 --moe-impl auto --repeats 3 --json \
    > "$OUT/step_release32_fp8.json" 2> "$OUT/full.err"; echo "full rc=$?"; tail -5 "$OUT/full.err"
  timeout 280 python3 -m ditkv.entrypoints.cli bench step --preset release --e2e-request --layers 32 --quantization fp8 \
    --prefix 1024 --image 1024 --guidance 4 --e2e-steps 50 --repeats 1 --json \
    > "$OUT/e2e_release32_fp8.json" 2> "$OUT/e2e.err"; echo "e2e rc=$?"; tail -5 "$OUT/e2e.err" ;;
esac
