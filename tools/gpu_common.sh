#!/usr/bin/env bash
# Shared preamble of the H200 scripts (tools/gpu_perf.sh, tools/gpu_fused_check.sh), sourced from the repo root:
# msgspec / pyzmq wheels from WHL into /tmp/site, the flash-attn-4 parts into $HOME/parts, and two helpers:
#   fa4_env          install flash-attn-4 from the carried parts (docs/bench-attention.md "Carrying flash-attn-4")
#   run NAME T CMD.. JSON to $OUT/NAME.json, stderr to /tmp/NAME.err (its tail printed), a short summary
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

run() {  # name timeout cmd...: JSON to $OUT/name.json, stderr to /tmp/name.err, a short summary
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.json" 2> "/tmp/$name.err"  # $OUT takes at most 8 files back
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; tail -3 "/tmp/$name.err"
  python3 - "$OUT/$name.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit()
print("  backend", r.get("backend"), "calls", r.get("attention_calls"), "fp8_layer_fusion", r.get("fp8_layer_fusion"),
      "fast_accum", r.get("fp8_fast_accum"))
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
c = r.get("compare_backend")
if c:
    for kind in ("eager", "graph"):
        if c.get(kind):
            print(f"  {c['main']}/{c['other']} {kind}", [round(x, 4) for x in c[kind]["ratios"]], "median",
                  round(c[kind]["ratio_median"], 4))
for impl, res in r.get("moe_impls", {}).items():
    d = res["denoise"]
    print("  ", impl, {k: round(d[k], 3) for k in ("step_ms", "layer_ms", "attn_block_ms", "moe_ms", "rest_ms", "step_ms_32_layers")})
EOF
}

