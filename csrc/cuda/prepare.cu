// module_gfx1201_sage_prepare for NVIDIA GPUs: the SIMT prepare kernels of csrc/simt/prepare.hip,
// compiled as CUDA through the platform shim's __CUDACC__ branch (csrc/include/sage/platform.h):
// one source, so the cuda prepare is bit-identical to ref.prepare exactly as the gfx12 one is.
// Built with --fmad=false and IEEE division/sqrt (jit_driver's nvcc toolchain; no fast math):
// every step of quant.h stays one correctly rounded operation.
#define SAGE_PREPARE_BACKEND "cuda"
#include "simt/prepare.hip"
