#!/usr/bin/env bash
# On one H200 with flash-attn-4 installed under $FA4 (pip install --target; see docs/bench-attention.md):
#   STAGE=tests  the fa4 GPU tests, then `ditkv bench attention` at pages 64 and 128 (JSON under $OUT)
#   STAGE=step   `ditkv bench step --preset release --layers 4` with each attention backend
set -u
OUT=${OUT:-./out}
FA4=${FA4:-/tmp/fa4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$FA4:$FA4/nvidia_cutlass_dsl/python_packages:$FA4/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
case "${STAGE:-tests}" in
tests)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py tests/test_attention_candidates.py 2>&1 | tail -15
  for bs in 64 128; do
    timeout 170 python3 -m ditkv.bench.attention --block-size $bs --shapes 1024x257,1024x513,1024x1025,6700x1025,1024x4097,6700x4097 \
      --extra-block-sizes "" --prefill-shapes "1024x1025,1024x4097,6700x4097" --flex-shapes "" --warmup 10 --rep 40 \
      --json-out "$OUT/attention_bs$bs.json" 2>&1 | grep -v "^denoise" | tail -12
  done ;;
step)
  for b in cudnn fa4 triton; do
    timeout 180 python3 -m ditkv.entrypoints.cli bench step --preset release --layers 4 --prefix 1024 --image 1024 \
      --guidance 4 --moe-impl grouped --backend $b --repeats 5 --e2e-steps 2 --json > "$OUT/step_$b.json" 2> "$OUT/step_$b.err"
    echo "$b rc=$?"; tail -c 600 "$OUT/step_$b.json"; tail -3 "$OUT/step_$b.err"
  done ;;
esac
