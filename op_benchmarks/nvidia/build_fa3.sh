#!/bin/bash
# Build FlashAttention-3's Hopper forward (its FP8 and BF16 kernels at head dims 64 and 128, no
# backward, split, paged KV, softcap, local or varlen) from a copy of its source, as the Python
# package the benchmark's fa3_fp8 provider imports (flash_attn_interface + flash_attn_3._C).
# Not part of this repository: a baseline to measure against, like SageAttention2.
#   build_fa3.sh OUT [FA3_SRC CUTLASS_DIR]
#     OUT          the package directory; put it on PYTHONPATH
#     FA3_SRC      a flash-attention checkout (its hopper/ directory is used)
#     CUTLASS_DIR  the CUTLASS checkout its csrc/cutlass submodule pins (its include/ is used)
# Needs nvcc >= 12.3 (sm_90a) and torch >= 2.9 (FA3's binding targets torch's stable ABI of 2.9,
# so it loads in any later torch). Objects are kept in OUT/obj and not rebuilt: compile them
# where nvcc is (about 8 minutes on 2 cores), carry OUT, and on the GPU's machine
# `build_fa3.sh OUT` only links them against that machine's CUDA runtime.
set -euo pipefail
OUT=$1
mkdir -p "$OUT/obj" "$OUT/flash_attn_3"
OUT=$(cd "$OUT" && pwd)
need_src() {
  [[ -n ${FA3_SRC:-} ]] && return
  [[ $# -ge 2 ]] || { echo "build_fa3.sh: $OUT/obj lacks objects: give FA3_SRC CUTLASS_DIR" >&2; exit 2; }
  FA3_SRC=$(cd "$1" && pwd)/hopper CUTLASS_INC=$(cd "$2" && pwd)/include
}
FEATURES=(BACKWARD PAGEDKV SPLIT APPENDKV LOCAL SOFTCAP PACKGQA FP16 VARLEN CLUSTER HDIM96
  HDIM192 HDIM256 SM8x)
DEFINES=(-DFLASHATTENTION_DISABLE_HDIMDIFF64 -DFLASHATTENTION_DISABLE_HDIMDIFF192)
for f in "${FEATURES[@]}"; do DEFINES+=("-DFLASHATTENTION_DISABLE_$f"); done
# What FA3's setup.py passes nvcc for sm_90a, and what torch's CUDAExtension adds to it.
NVCC_FLAGS=(-O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr --expt-extended-lambda
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
  -DCUTLASS_ENABLE_GDC_FOR_SM90 -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG
  -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC --resource-usage -diag-suppress 20013,20015)
SOURCES=(flash_prepare_scheduler)
for d in 64 128; do
  for t in e4m3 bf16; do SOURCES+=("instantiations/flash_fwd_hdim${d}_${t}_sm90"); done
done
JOBS=$(nproc)
pids=()
for src in "${SOURCES[@]}"; do
  obj=$OUT/obj/$(basename "$src").o
  [[ -f $obj ]] && continue
  need_src "${@:2}"
  (cd "$FA3_SRC" && nvcc -c "$src.cu" -o "$obj.tmp" "${NVCC_FLAGS[@]}" "${DEFINES[@]}" -I. \
    -I"$CUTLASS_INC" >"$OUT/obj/$(basename "$src").log" 2>&1 && mv "$obj.tmp" "$obj") &
  pids+=($!)
  while (($(jobs -rp | wc -l) >= JOBS)); do sleep 1; done
done
for p in "${pids[@]}"; do wait "$p" || { tail -30 "$OUT"/obj/*.log; exit 1; }; done
# The binding (flash_api_stable.cpp) against this torch's headers, then the module.
read -r TORCH_INC TORCH_LIB PY_INC CUDA_INC CUDA_LIB < <(python3 - <<'EOF'
import os, sysconfig, torch
from torch.utils import cpp_extension as ce
home, top = ce.CUDA_HOME or "/usr/local/cuda", os.path.dirname(torch.__file__)
print(os.path.join(top, "include"), os.path.join(top, "lib"), sysconfig.get_paths()["include"],
      os.path.join(home, "include"), os.path.join(home, "lib64"))
EOF
)
# torch's libraries, as a torch extension links them (their symbols are not global in Python)
TORCH_LIBS=(-lc10 -ltorch -ltorch_cpu)
[[ -f $TORCH_LIB/libtorch_cuda.so ]] && TORCH_LIBS+=(-ltorch_cuda)
CXX=${CXX:-g++}
[[ -f $OUT/obj/api.o ]] || { need_src "${@:2}"; "$CXX" -c "$FA3_SRC/flash_api_stable.cpp" -o "$OUT/obj/api.o" -O2 -std=c++17 -fPIC -w \
    -DPy_LIMITED_API=0x03090000 -DTORCH_TARGET_VERSION=0x0209000000000000 "${DEFINES[@]}" \
    -I"$FA3_SRC" -I"$CUTLASS_INC" -I"$TORCH_INC" -I"$PY_INC" -I"$CUDA_INC"; }
"$CXX" -shared -o "$OUT/flash_attn_3/_C.abi3.so" "$OUT"/obj/*.o -L"$CUDA_LIB" -lcudart \
  -L"$TORCH_LIB" "${TORCH_LIBS[@]}"
: >"$OUT/flash_attn_3/__init__.py"
[[ -f $OUT/flash_attn_interface.py ]] || { need_src "${@:2}"; cp "$FA3_SRC/flash_attn_interface.py" "$OUT/"; }
# The build flags its interface reads (FA3's setup.py writes this file).
python3 - "$OUT/flash_attn_config.py" "${FEATURES[@]}" <<'EOF'
import sys
off = set(sys.argv[2:])
names = ["BACKWARD", "SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA", "FP16", "FP8",
         "VARLEN", "CLUSTER", "HDIM64", "HDIM96", "HDIM128", "HDIM192", "HDIM256", "SM8x"]
flags = {f"FLASHATTENTION_DISABLE_{n}": n in off for n in names}
flags.update(FLASHATTENTION_ENABLE_VCOLMAJOR=False, FLASH_ATTENTION_DISABLE_HDIMDIFF64=True,
             FLASH_ATTENTION_DISABLE_HDIMDIFF192=True)
open(sys.argv[1], "w").write(f"CONFIG = {{'build_flags': {flags!r}}}\n")
EOF
echo "# FlashAttention-3 built into $OUT (PYTHONPATH=$OUT)"
