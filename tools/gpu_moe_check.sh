#!/usr/bin/env bash
# On one H200: every GPU-marked test (TESTS=... narrows them), then the release-geometry denoise step
# with the per-expert loop and with the grouped GEMM (4 layers, random weights), eager and as a CUDA graph. Writes logs and
# JSON under ${OUT:-./out}; every step has its own time cap and a failing step does not stop the
# rest. Expected: about 2 minutes; worst case (every cap hit) about 5.5.
#   bash tools/gpu_moe_check.sh
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # ditkv's own needs (msgspec, pyzmq, ...) if carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
ENV="$OUT/env.txt"
{ date -u; nvidia-smi -L; python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("capability", torch.cuda.get_device_capability(0), "has _grouped_mm", hasattr(torch, "_grouped_mm"))
for mod in ("msgspec", "zmq", "yaml", "safetensors", "triton"):
    try:
        __import__(mod)
        print("import", mod, "ok")
    except Exception as e:  # noqa: BLE001 - a report line, not a failure
        print("import", mod, "MISSING:", e)
EOF
} >"$ENV" 2>&1

t0=$SECONDS  # 1. every GPU-marked test (grouped MoE: bf16 equality, no sync, graph capture/replay)
timeout ${TEST_CAP:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=15 ${TESTS:-tests/} >"$OUT/pytest.log" 2>&1
echo "pytest -m gpu ${TESTS:-tests/} rc=$? $((SECONDS - t0))s" >>"$ENV"

# 2. release step, 4 layers, P=1024, 2 CFG rows: T=4097 (1024 px) with the loop and the grouped MoE on
# the same weights, T=1025 (512 px) grouped; each also times the denoise step as a CUDA graph
for run in "4097 1024 loop,grouped" "1025 512 grouped"; do
  set -- $run
  t0=$SECONDS
  timeout 150 python3 -m ditkv.entrypoints.cli bench step --preset release --layers 4 --prefix 1024 \
    --image "$2" --guidance 4 --moe-impl "$3" --json >"$OUT/step_release_T$1.json" 2>"$OUT/step_release_T$1.log"
  echo "bench step release T=$1 --moe-impl $3 rc=$? $((SECONDS - t0))s" >>"$ENV"
done

python3 - "$OUT" >"$OUT/summary.txt" 2>&1 <<'EOF'  # 3. one line per (T, impl, phase) and the graph
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
keys = ("step_ms", "layer_ms", "attn_block_ms", "moe_ms", "rest_ms", "step_ms_32_layers", "mfu", "mfu_nominal",
        "mfu_32_layers", "layer_mfu", "moe_mfu", "peak_gib", "step_transient_gib")
for T in ("4097", "1025"):
    try:
        res = json.loads((out / f"step_release_T{T}.json").read_text())
    except Exception as e:  # noqa: BLE001
        print(T, "no result:", e)
        continue
    print(f"T={T} KV bytes/request", res["kv_bytes_per_request"], "(32 layers:", res["kv_bytes_per_request_32_layers"],
          ") weights", res["weights_bytes"])
    for impl, r_impl in res["moe_impls"].items():
        for ph in ("denoise", "recompute"):
            r = r_impl[ph]
            print(f"  {impl}->{r_impl['resolved']} {ph:9s} "
                  + " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys))
    print("  graph", res.get("graph"))
EOF
cat "$ENV" "$OUT/summary.txt"; tail -5 "$OUT/pytest.log"
