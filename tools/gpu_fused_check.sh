#!/usr/bin/env bash
# Issue 24/26 follow-up on one H200 (device tool, from the repo root): the fused FP8 decoder layer
# (models/hunyuan/fp8_layer.py) and fa4 serving the real denoise step (split_backend.lead_queries).
#   STAGE=a  carry .whl + .fa4a: FP8 GPU tests; 4-layer fp8/bf16 graph step (fused) and the unfused fp8 step
#   STAGE=b  carry .whl + .fa4b, right after a (the fa4 parts meet in $HOME/parts): fa4 GPU tests; the whole
#            32-layer fp8 request on Triton, on fa4, on fa4 with fast accumulation
#   STAGE=t / q  the tests after the review mends; q also times quack's varlen FP8 GEMM (tools/gpu_quack_grouped.py)
#   STAGE=c  (fa4 installed by b on this machine) 4-layer bf16 and fp8 steps on fa4 vs Triton; fa4 decode / dense
#            timing; the prefill crossover; release-geometry accuracy with fast accumulation
set -u
source "$(dirname "$0")/gpu_common.sh"
case "${STAGE:-a}" in
a)
  nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,memory.used --format=csv
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py tests/test_image_path_gpu.py 2>&1 | tail -15
  run compare4_fused 200 $B --layers 4 --quantization fp8 --compare-bf16 --repeats 5 --attention-backend triton
  run step4_unfused 120 $B --layers 4 --quantization fp8 --repeats 5 --attention-backend triton --no-fp8-layer-fusion ;;
b)
  fa4_env
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py 2>&1 | tail -8
  run e2e_triton 170 $E2E --attention-backend triton
  run e2e_fa4 170 $E2E --attention-backend fa4
  run e2e_fa4_fastaccum 170 $E2E --attention-backend fa4 --fp8-fast-accum ;;
c1)  # carry .whl + .fa4a
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py --tb=short 2>&1 | grep -v DEBUG | tail -25
  timeout 300 python3 tools/fp8_accuracy_release.py --layers 4 --steps 50 --json-out "$OUT/fp8_accuracy_release_fast_accum.json" 2>&1 | grep "^{" ;;
c2)  # carry .whl + .fa4b, right after c1
  fa4_env
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py tests/test_fp8_gpu.py -k "fa4 or fused_fp8" --tb=short 2>&1 | grep -v "DEBUG\|Warning\|exe_args" | tail -25
  run e2e_auto_defaults 170 $E2E
  for A in triton fa4; do run step4_bf16_$A 120 $B --layers 4 --repeats 5 --attention-backend $A; done
  run step4_fp8_fa4 120 $B --layers 4 --quantization fp8 --repeats 5 --attention-backend fa4 --compare-bf16
  timeout 100 python3 tools/gpu_fa4_decode.py --json-out "$OUT/fa4_decode_dense.json" 2>&1 | tail -20
  timeout 100 python3 -m ditkv.bench.attention --block-size 64 --shapes "" --extra-block-sizes "" --flex-shapes "" \
    --prefill-shapes "1024x1025,1024x2049,1024x3073,1024x4097" --warmup 10 --rep 40 \
    --json-out "$OUT/attention_fa4_prefill_crossover.json" 2>&1 | tail -8 ;;
x1)  # carry .whl + .fa4a: the FP8 GPU tests and the 4-layer fp8 step's kernel shares after the quantizer change
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py --tb=line 2>&1 | grep -v DEBUG | tail -4
  run step4_fp8_triton 120 $B --layers 4 --quantization fp8 --repeats 5 --attention-backend triton ;;
x2)  # carry .whl + .fa4b, right after x1: the whole request with every default
  fa4_env
  run e2e_defaults 170 $E2E ;;
d)  # carry .whl + .fa4b after a call that brought .fa4a (e.g. c1): issue 26's release-step ratios, same run
  fa4_env
  run backends4_bf16 200 $B --layers 4 --repeats 5 --attention-backend fa4 --compare-backend triton
  run backends4_fp8 200 $B --layers 4 --repeats 5 --quantization fp8 --attention-backend fa4 --compare-backend triton ;;
t)  # carry .whl + .fa4a: the FP8 GPU tests after the review mends (routed_output path, QuantizedTokens.matmul)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py tests/test_moe_grouped.py --tb=short 2>&1 | grep -v DEBUG | tail -15 ;;
q)  # carry .whl + .fa4b, right after t: fa4 GPU tests; quack's varlen FP8 GEMM against torch's grouped one
  fa4_env
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py --tb=short 2>&1 | grep -v "DEBUG\|Warning\|exe_args" | tail -8
  timeout 330 python3 tools/gpu_quack_grouped.py --json-out "$OUT/quack_grouped.json" 2>&1 | grep -v "^ \|^{\|^}" | tail -45 ;;
g1)  # carry .whl + .fa4a: the FP8 GPU tests on torch's grouped GEMM (the row gather moved into scaled_grouped_mm)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py tests/test_moe_grouped.py --tb=short 2>&1 | grep -v DEBUG | tail -6 ;;
g2)  # carry .whl + .fa4b, right after g1: quack's grouped FP8 GEMM (models/fp8_quack.py): tests, probe, 4-layer steps
  fa4_env
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_quack_gpu.py tests/test_fp8_gpu.py --tb=short 2>&1 | grep -v "DEBUG\|Warning\|exe_args" | tail -8
  timeout 150 python3 tools/gpu_quack_grouped.py --json-out "$OUT/quack_grouped.json" 2>&1 | grep -v "^ \|^{\|^}" | tail -8
  run step4_fp8_quack_vs_bf16 200 $B --layers 4 --quantization fp8 --compare-bf16 --repeats 5
  run step4_fp8_torchgrouped 120 $B --layers 4 --quantization fp8 --repeats 5 --fp8-grouped-gemm torch ;;
g3)  # (fa4 installed by g2 on this machine) the whole request with every default; issue 26's same-run ratios
  fa4_env
  run e2e_defaults_quack 170 $E2E
  run backends4_bf16 170 $B --layers 4 --repeats 5 --attention-backend fa4 --compare-backend triton
  run backends4_fp8 170 $B --layers 4 --repeats 5 --quantization fp8 --attention-backend fa4 --compare-backend triton ;;
g4a)  # carry .whl + .fa4a: brings the first flash-attn-4 part only
  nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,memory.used --format=csv ;;
g4b)  # carry .whl + .fa4b, right after g4a: the 32-layer graph step, images/min at max_num_seqs 1/2/4, T = 1025
  fa4_env
  run step32_fp8_defaults 200 $B --layers 32 --quantization fp8 --repeats 3
  run e2e_throughput_defaults 250 $E2E --max-num-seqs 1 2 4
  run step4_T1025_fp8_vs_bf16 100 python3 -m ditkv.entrypoints.cli bench step --preset release --prefix 1024 --image 512 \
    --guidance 4 --json --layers 4 --quantization fp8 --compare-bf16 --repeats 5 ;;
esac
