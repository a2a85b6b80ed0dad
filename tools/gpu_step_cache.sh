#!/usr/bin/env bash
# Issue 35 on one GPU. `bash tools/gpu_step_cache.sh smoke` (tiny model: eager and graphs-in-parts, batched vs
# alone, graphs vs eager; the GPU tests; the prefix cache on vs off, tools/gpu_prefix_cache_smoke.py), `bash tools/gpu_step_cache.sh release LAYERS [STEPS]` (release geometry,
# random FP8 weights, one 1024^2 CFG request, graphs on, Fn=1 Bn=0: forced cached fractions 0.3 / 0.5 / 0.7
# alternated with no cache, the cached-step cost, and the cache_config unset vs {"type": "none"} A/B).
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "${1:-smoke}" in
smoke)
  timeout 200 python3 tools/gpu_step_cache_smoke.py > "$OUT/smoke.json" 2> /tmp/smoke.err; echo "rc=$?"
  tail -3 /tmp/smoke.err; cat "$OUT/smoke.json"; echo
  timeout 200 python3 -m pytest -q -m gpu tests/test_cuda.py 2>&1 | tail -4
  timeout 150 python3 tools/gpu_prefix_cache_smoke.py > "$OUT/prefix.json" 2> /tmp/prefix.err; echo "rc=$?"
  tail -3 /tmp/prefix.err; cat "$OUT/prefix.json"; echo ;;
release)
  L=${2:-4}; S=${3:-50}
  run "sc$L" 420 python3 -m ditkv.entrypoints.cli bench step --preset release --prefix 1024 --image 1024 --guidance 4 \
    --json --e2e-request --layers "$L" --quantization fp8 --e2e-steps "$S" --repeats 2 \
    --cache-config '{"type": "fbcache", "Fn": 1, "Bn": 0}' --cached-fraction 0.3,0.5,0.7
  python3 -c "import json,sys; r=json.load(open('$OUT/sc$L.json')); print(json.dumps({k: v for k, v in r.items() if k not in ('machine',)})[:3000])" ;;
noneab)
  L=${2:-4}
  run "none$L" 300 python3 -m ditkv.entrypoints.cli bench step --preset release --prefix 1024 --image 1024 --guidance 4 \
    --json --e2e-request --layers "$L" --quantization fp8 --e2e-steps 20 --repeats 3 --cache-none-ab
  python3 -c "import json; r=json.load(open('$OUT/none$L.json')); print(json.dumps({k: v for k, v in r.items() if k != 'machine'})[:2000])" ;;
esac
