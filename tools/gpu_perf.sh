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
source "$(dirname "$0")/gpu_common.sh"

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
