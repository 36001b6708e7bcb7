#!/bin/bash
# One device call on an H200: build the cuda modules, run the cuda op tests, the sanitizers on a
# small shape, and the side-by-side benchmark. Logs under $OUT (or ./h200_out).
#   SAGE2_SRC=DIR  a copy of SageAttention2's source (its setup.py, csrc/, sageattention/; not
#                  part of this repository): built for sm_90a in the background while the tests
#                  run, then benchmarked beside ours (op_benchmarks/nvidia/side_by_side.py).
#   FA3_PKG=DIR    FlashAttention-3's FP8 forward as built by build_fa3.sh (its kernels compiled
#                  where nvcc is, carried here): linked on this machine, then benchmarked beside
#                  ours as fa3_fp8, the fastest public FP8 attention kernel.
#   SIDE_BY_SIDE="--sweeps 3 --shapes D64 Wan"  more arguments of side_by_side.py (the bench
#                  stage): several sweeps, some of the shapes.
#   STAGE="tests bench" (all: both)  also: profile (torch-profiler kernel times, Nsight Compute
#                  metrics of ours and SageAttention2's attention kernels), variants (the
#                  attention kernel's measurement-only schedules at S 4608 / 16k / 32k, beside SA2:
#                  VARIANTS="default shared192 ..." names AITER_SAGE_CUDA_SCHEDULE's values),
#                  export_sage2 (SageAttention2's built sm90 modules to $OUT, for SAGE2_SRC
#                  of a later call), ceiling (op_benchmarks/nvidia/ceiling.py: the attention
#                  kernel beside its copies without the softmax and without the wgmmas, D 128
#                  and D 64).
set -o pipefail
OUT=${OUT:-./h200_out}; mkdir -p "$OUT"
export CXX=${CXX:-/usr/bin/g++} AITER_SAGE_CACHE_DIR=${AITER_SAGE_CACHE_DIR:-/tmp/c} PYTHONUNBUFFERED=1
export SAGE_SANITIZER_LOG_DIR=${SAGE_SANITIZER_LOG_DIR:-$OUT}  # the whole compute-sanitizer reports
STAGE=${STAGE:-all}
stage() { [[ " $STAGE " == *" $1 "* || ($STAGE == all && ($1 == tests || $1 == bench)) ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
SAGE2_PID= BASE_PYTHONPATH=$PYTHONPATH
if [[ -n $SAGE2_SRC && -f $SAGE2_SRC/setup.py ]]; then
  SAGE2_SRC=$(cd "$SAGE2_SRC" && pwd)
  # Modules built by an earlier call of this script on such a machine (STAGE export_sage2 puts
  # them under $OUT) are used as they are: the sm90 call needs _qattn_sm90 and _fused only.
  if ! ls "$SAGE2_SRC"/sageattention/_qattn_sm90*.so "$SAGE2_SRC"/sageattention/_fused*.so \
    >/dev/null 2>&1; then
    [[ -f $SAGE2_SRC/README.md ]] || : >"$SAGE2_SRC/README.md"  # its setup.py reads it
    (cd "$SAGE2_SRC" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 EXT_PARALLEL=4 \
      python3 setup.py build_ext --inplace >"$OUT/sage2_build.log" 2>&1) &
    SAGE2_PID=$!
  fi
  export PYTHONPATH=$SAGE2_SRC${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -n $FA3_PKG ]]; then
  if bash op_benchmarks/nvidia/build_fa3.sh "$FA3_PKG" >"$OUT/fa3_build.log" 2>&1; then
    export PYTHONPATH=$(cd "$FA3_PKG" && pwd)${PYTHONPATH:+:$PYTHONPATH}
  else
    tail -5 "$OUT/fa3_build.log"
  fi
fi
wait_sage2() {
  [[ -z $SAGE2_PID ]] && return
  wait "$SAGE2_PID" && echo "# SageAttention2 built from $SAGE2_SRC" || tail -20 "$OUT/sage2_build.log"
  SAGE2_PID=
}
timeout 300 python3 op_tests/cuda_smoke.py 2>&1 | tee "$OUT/smoke.log" || exit 1
if stage tests; then
  timeout 400 python3 -m pytest -q -k "cuda" op_tests/ops/test_gfx1201_sage_prepare.py \
    op_tests/ops/test_gfx1201_sage_attention.py op_tests/ops/test_contract_v2.py \
    op_tests/ops/test_long_and_guardrails.py op_tests/backends/test_cuda.py \
    2>&1 | tee "$OUT/tests.log" | tail -30
fi
ncu_kernel() {  # $1: kernel name regex; the rest: the environment of the profiled run
  local k=$1; shift
  env "$@" timeout 240 ncu --clock-control none -k "regex:$k" -s 1 -c 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section Occupancy --section LaunchStats --page raw \
    python3 op_benchmarks/nvidia/profile_h200.py -s 8192 >"$OUT/ncu_$k.txt" 2>&1
  echo "## ncu $k"
  grep -E "gpu__time_duration.sum|pipe_[a-z0-9_]*\.avg\.pct_of_peak_sustained_active|stalled_[a-z_]*_per_issue_active\.ratio|smsp__issue_active\.avg\.pct" \
    "$OUT/ncu_$k.txt" | awk '$NF + 0 > 0.05' | head -70
}
if stage profile; then
  ncu_kernel attention_kernel PYTHONPATH=$BASE_PYTHONPATH  # ours while SageAttention2 builds
  wait_sage2
  for s in 16384 32768; do
    python3 op_benchmarks/nvidia/profile_h200.py --trace -s $s --calls 3 2>&1 | tee -a "$OUT/trace.log"
  done
  ncu_kernel qk_int8_sv_f8_attn
fi
if stage variants; then
  wait_sage2
  for schedule in ${VARIANTS:-default shared192 default shared192}; do
    knob=AITER_SAGE_CUDA_SCHEDULE=$schedule
    echo "## $knob"
    env "$knob" python3 op_benchmarks/bench_gfx1201_sage_attention.py --backend cuda \
      -s 4608 16384 32768 --providers sage_core sage2_nosmooth --compare_to_ref --rounds 3 2>&1 | grep "^|" | tee -a "$OUT/variants.log"
  done
fi
if stage bench; then
  wait_sage2
  python3 op_benchmarks/nvidia/side_by_side.py ${QUICK:+--quick} $SIDE_BY_SIDE -o "$OUT/side_by_side.csv" \
    2>&1 | tee "$OUT/bench.log"
fi
if stage ceiling; then
  python3 op_benchmarks/nvidia/ceiling.py -s 16384 32768 2>&1 | tee "$OUT/ceiling.log"
  python3 op_benchmarks/nvidia/ceiling.py -s 16384 --head_dim 64 2>&1 | tee -a "$OUT/ceiling.log"
fi
if stage export_sage2; then
  wait_sage2
  cp "$SAGE2_SRC"/sageattention/_qattn_sm90*.so "$SAGE2_SRC"/sageattention/_fused*.so "$OUT/"
fi
