#!/usr/bin/env bash
# Issue 24's speed work on one H200 (no internet), run from the repo root by the device tool.
# The code runs from SRC (default: the repo; a snapshot folder when others edit the tree meanwhile, e.g.
#   git archive HEAD ditkv tests tools pyproject.toml ':(exclude)ditkv/assets' | tar x -C .fa4c/src
# plus the changed files copied over; the assets are copied from the repo on the machine);
# msgspec / pyzmq wheels from WHL; flash-attn-4 from $HOME/fa4 (installed from the carried parts, see
# docs/bench-attention.md "Carrying flash-attn-4"; files outside the repo outlive a call while the
# machine stays warm).
#   STAGE=one    keep .fa4a's part; image-path GPU tests + micro-benchmarks, fast-accum probe, the
#                32-layer fp8 e2e request on Triton attention
#   STAGE=two    install fa4 (parts + .fa4b wheels); fa4 GPU tests; e2e on fa4, then fa4 + fast accum
#   STAGE=three  4-layer fp8/bf16 graph-step ratio on fa4, images/min at max_num_seqs 1 2 4, fa4 decode /
#                dense micro-benchmarks, the prefill crossover
set -u
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
SRC=${SRC:-$ROOT}
WHL=${WHL:-$ROOT/.whl}
FA4=$HOME/fa4
mkdir -p "$OUT" "$HOME/parts"
export PYTHONUNBUFFERED=1
for p in .fa4a/cu13.part.* .fa4b/cu13.part.*; do [ -f "$p" ] && cp "$p" "$HOME/parts/"; done
ls -la "$HOME/parts"
if [ ! -d /tmp/site/msgspec ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || echo "pip site FAILED"
fi
[ -d "$SRC/ditkv/assets" ] || cp -r "$ROOT/ditkv/assets" "$SRC/ditkv/"
cd "$SRC"
export PYTHONPATH=/tmp/site:$PWD
B="python3 -m ditkv.entrypoints.cli bench step --preset release --prefix 1024 --image 1024 --guidance 4 --json"
E2E="$B --e2e-request --layers 32 --quantization fp8 --e2e-steps 50 --repeats 1"

fa4_env() {
  if [ ! -d "$FA4/flash_attn" ]; then
    cat "$HOME"/parts/cu13.part.* > /tmp/cu13.tar.xz && md5sum /tmp/cu13.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FA4" "$ROOT"/.fa4b/*.whl \
      || echo "pip fa4 FAILED"
    tar xJf /tmp/cu13.tar.xz -C "$FA4" || python3 -c "import tarfile; tarfile.open('/tmp/cu13.tar.xz').extractall('$FA4')"
  fi
  export PYTHONPATH=$FA4:$FA4/nvidia_cutlass_dsl/python_packages:$FA4/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
  python3 -c "import time; t=time.time(); import flash_attn.cute; print('flash_attn.cute import', round(time.time()-t, 1), 's')"
}

run() {  # name timeout cmd...: JSON to $OUT/name.json, stderr to $OUT/name.err, a short summary
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/$name.err"
  python3 - "$OUT/$name.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit()
if "request" in r:
    q = r["request"]
    print("  backend", r.get("backend"), "fast_accum", r.get("fp8_fast_accum"), {k: round(v, 3) for k, v in q.items()})
    for n, t in r.get("throughput", {}).items():
        print("  max_num_seqs", n, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items() if k != "latency_s"})
if "graph" in r and r["graph"]:
    print("  graph", {k: round(v, 4) for k, v in r["graph"].items()})
if "compare_bf16" in r:
    c = r["compare_bf16"]
    print("  fp8/bf16 graph", c["fp8_over_bf16"]["graph"], "bf16 graph", c["baseline"]["graph"])
for impl, res in r.get("moe_impls", {}).items():
    d = res["denoise"]
    print("  ", impl, {k: round(d[k], 3) for k in ("step_ms", "layer_ms", "attn_block_ms", "moe_ms", "rest_ms", "step_ms_32_layers")})
EOF
}

case "${STAGE:-one}" in
one)
  nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,memory.used --format=csv
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_image_path_gpu.py 2>&1 | tail -15
  timeout 200 python3 tools/gpu_image_path.py --only ${ONLY:-image,convs,gn,vae} --json-out "$OUT/image_path.json" 2>&1 | grep -v "^  " | tail -30
  timeout 60 python3 tools/gpu_fp8_fast_accum.py 2>&1 | tail -4
  run e2e_triton 200 $E2E --backend triton ;;
two)
  fa4_env
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py 2>&1 | tail -8
  run e2e_fa4 170 $E2E --attention-backend fa4
  run e2e_fa4_fastaccum 170 $E2E --attention-backend fa4 --fp8-fast-accum ;;
three)  # ATTN: the attention backend (fa4 needs the install of STAGE=two on this machine)
  [ "${ATTN:-triton}" = fa4 ] && fa4_env
  run compare4_${ATTN:-triton} 170 $B --layers 4 --quantization fp8 --compare-bf16 --repeats 5 --attention-backend ${ATTN:-triton}
  run throughput_${ATTN:-triton} 300 $E2E --attention-backend ${ATTN:-triton} --max-num-seqs 1 2 4
  run step4_fp8_nchw_image_${ATTN:-triton} 100 $B --layers 4 --quantization fp8 --repeats 5 --attention-backend ${ATTN:-triton} --no-fast-image-path ;;
four)
  fa4_env
  timeout 100 python3 tools/gpu_fa4_decode.py --json-out "$OUT/fa4_decode_dense.json" 2>&1 | tail -20
  timeout 100 python3 -m ditkv.bench.attention --block-size 64 --shapes "" --extra-block-sizes "" --flex-shapes "" \
    --prefill-shapes "1024x1025,1024x2049,1024x3073,1024x4097" --warmup 10 --rep 40 \
    --json-out "$OUT/attention_fa4_prefill_crossover.json" 2>&1 | tail -8 ;;
esac
