#!/usr/bin/env bash
# Issue 9, reduced topology on a 2-GPU host: 1 AR (TP=1, cuda:0) + 1 DiT (TP=1, cuda:1), KV over
# kv_connector cuda, legacy vs native. Writes logs and JSON under ${OUT:-./out}. Each step has its
# own time cap so a slow step cannot take the later ones with it.
#   bash tools/bench_transfer_gpu.sh
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
B="python3 -m ditkv.entrypoints.cli bench transfer --json --transports cuda --height 512 --width 512 --steps 2 --guidance 2.0"
{ date -u; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count(), \
torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else '-')"; } >"$OUT/env.txt" 2>&1
t0=$SECONDS
timeout 70 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/test_cuda_transport.py \
  -k "not example_yaml" -rs >"$OUT/pytest.log" 2>&1; echo "pytest rc=$? $((SECONDS - t0))s" >>"$OUT/env.txt"
for run in A B; do  # two independent 100-request runs per implementation (same prompt/seed set)
  t0=$SECONDS
  timeout 65 $B --concurrency 8 --requests 100 --runs 1 >"$OUT/bench$run.json" 2>>"$OUT/bench.err"
  echo "bench $run rc=$? $((SECONDS - t0))s" >>"$OUT/env.txt"
done
t0=$SECONDS  # the debug variant: 20 sequential requests
timeout 35 $B --concurrency 1 --requests 20 --runs 1 >"$OUT/debug.json" 2>>"$OUT/bench.err"
echo "debug rc=$? $((SECONDS - t0))s" >>"$OUT/env.txt"
t0=$SECONDS  # the example YAML (Triton attention, AR cuda:0 -> DiT cuda:1)
timeout 30 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_transport.py -k example_yaml \
  >>"$OUT/pytest.log" 2>&1; echo "yaml rc=$? $((SECONDS - t0))s" >>"$OUT/env.txt"
cat "$OUT/env.txt"; tail -5 "$OUT/pytest.log"; cat "$OUT/bench.err" | grep "bench transfer" || true
