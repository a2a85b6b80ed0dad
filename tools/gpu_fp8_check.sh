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
esac
