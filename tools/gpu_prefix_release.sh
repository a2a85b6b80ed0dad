#!/usr/bin/env bash
# Issue 36 on one GPU: `bash tools/gpu_prefix_release.sh LAYERS [REQUESTS]` runs `ditkv bench prefix --geometry release`
# (random FP8 release weights, LAYERS decoder layers, 1024^2 CFG requests): the `system` case (a ~1k-token system
# prompt shared by every request: time to the first denoise step off vs on, time saved over the shared share) and the
# `nohit` case (requests that share nothing: the cache's cost, on/off), cache off and on alternated in one process.
# BI=1 runs the engines under batch_invariant (cache on == off bit for bit on a GPU).
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
L=${1:-16}; N=${2:-8}
run "prefix$L${BI:+bi}" 560 python3 -m ditkv.entrypoints.cli bench prefix --geometry release --layers "$L" --quantization fp8 \
  --cases system,nohit --requests "$N" --json ${BI:+--batch-invariant}
python3 - "$OUT/prefix$L${BI:+bi}.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, c in r["cases"].items():
    e = c["engine"]
    print(name, {k: e[k] for k in ("device", "layers", "ttfs_mean_off_s", "ttfs_mean_on_s", "ttfs_ratio", "total_ratio",
                                   "ttfs_later_mean_off_s", "ttfs_later_mean_on_s", "hit_share_of_first_step",
                                   "time_saved", "time_saved_over_share", "bit_identical")})
PY
