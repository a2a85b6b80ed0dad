#!/usr/bin/env bash
# Issue 25 on one H200 (no internet; py3.12 wheels for the test deps carried in .whl/):
#   STAGE=tests  the GPU tests of the one step loop (graphs, batching, invariance, FP8, MoE, image path)
#   STAGE=bench  before/after, side by side: `bench step --preset release --layers 4` (eager + graph step)
#                and a whole 4-layer engine request (`--e2e-request`), for the tree in .before.tgz (git archive
#                of the commit before the change, without assets) and this tree, alternating A B A B
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
case "${STAGE:-tests}" in
tests)
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  timeout ${TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_cuda.py tests/test_batch_invariant.py \
    tests/test_fp8_gpu.py tests/test_moe_grouped.py tests/test_image_path_gpu.py tests/test_parallel.py} 2>&1 | tail -25 ;;
bench)
  rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf .before.tgz -C /tmp/before && cp -r ditkv/assets /tmp/before/ditkv/
  for round in 1 2; do
    for side in before after; do
      tree=$PWD; [ $side = before ] && tree=/tmp/before
      PYTHONPATH=/tmp/site:$tree timeout ${TIMEOUT:-200} python3 -m ditkv.entrypoints.cli bench step --preset release \
        --layers 4 --prefix 1024 --image 1024 --guidance 4 --moe-impl auto --repeats 5 --json \
        > "$OUT/step_$side$round.json" 2> "$OUT/step_$side$round.err"; echo "step $side $round rc=$?"
      PYTHONPATH=/tmp/site:$tree timeout ${TIMEOUT:-200} python3 -m ditkv.entrypoints.cli bench step --preset release \
        --e2e-request --layers 4 --prefix 1024 --image 1024 --guidance 4 --e2e-steps 20 --repeats 1 --json \
        > "$OUT/e2e_$side$round.json" 2> "$OUT/e2e_$side$round.err"; echo "e2e $side $round rc=$?"
    done
  done ;;
esac
