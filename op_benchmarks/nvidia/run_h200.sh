#!/bin/bash
# One device call on an H200: build the cuda modules, run the cuda op tests, the sanitizer on a
# small shape, and the benchmark. Logs under $OUT (or ./h200_out).
set -o pipefail
OUT=${OUT:-./h200_out}; mkdir -p "$OUT"
export CXX=${CXX:-/usr/bin/g++} AITER_SAGE_CACHE_DIR=${AITER_SAGE_CACHE_DIR:-/tmp/c} PYTHONUNBUFFERED=1
export SAGE_SANITIZER_LOG_DIR=$OUT  # the whole compute-sanitizer reports
STAGE=${STAGE:-all}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 op_tests/cuda_smoke.py 2>&1 | tee "$OUT/smoke.log" || exit 1
if [[ $STAGE == all || $STAGE == tests ]]; then
  timeout 300 python3 -m pytest -q -k "cuda" op_tests/ops/test_gfx1201_sage_prepare.py \
    op_tests/ops/test_gfx1201_sage_attention.py op_tests/ops/test_contract_v2.py op_tests/ops/test_long_and_guardrails.py $( [ -f op_tests/backends/test_cuda.py ] && echo op_tests/backends/test_cuda.py) \
    2>&1 | tee "$OUT/tests.log" | tail -30
fi
if [[ $STAGE == all || $STAGE == bench ]]; then
  python3 op_benchmarks/bench_gfx1201_sage_attention.py --backend cuda -s 4096 16384 32768 \
    --providers sage sage_core sdpa_cudnn sdpa_flash --compare_to_ref -o "$OUT/bench_d128.csv" \
    2>&1 | tee "$OUT/bench.log"
  python3 op_benchmarks/bench_gfx1201_sage_attention.py --backend cuda -s 16384 --head_dim 64 \
    --providers sage sage_core sdpa_cudnn sdpa_flash --compare_to_ref -o "$OUT/bench_d64.csv" \
    2>&1 | tee -a "$OUT/bench.log"
  python3 op_benchmarks/bench_gfx1201_sage_attention.py --backend cuda -s 16384 --pv_dtype fp16 \
    --providers sage sage_core sdpa_cudnn --compare_to_ref -o "$OUT/bench_fp16.csv" \
    2>&1 | tee -a "$OUT/bench.log"
fi
