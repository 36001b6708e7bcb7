// sage_e4m3_sat (the hardware converter, what prepare's v_quant uses on CUDA) against quant.h's
// bit-level f32_to_e4m3_sat (the encoder the host tests hold to aiter_sage/ref.py), over all
// 2^32 float bit patterns on the GPU. Prints "checked N mismatches M first 0x...": exit 0 when
// M is 0. Built and run by op_tests/backends/test_cuda.py (run only on an sm_90 GPU).
#include <cstdint>
#include <cstdio>

#include "sage/quant.h"

__global__ void compare_all(unsigned long long* checked, unsigned long long* bad, unsigned* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long mine = 0, wrong = 0;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32);
       i += stride) {
    const float x = __uint_as_float(uint32_t(i));
    ++mine;
    if (sage_e4m3_sat(x) != sage::f32_to_e4m3_sat(x)) {
      ++wrong;
      atomicMin(first, uint32_t(i));
    }
  }
  atomicAdd(checked, mine);
  atomicAdd(bad, wrong);
}

int main() {
  unsigned long long* counts;
  unsigned* first;
  if (cudaMallocManaged(&counts, 2 * sizeof(unsigned long long)) != cudaSuccess ||
      cudaMallocManaged(&first, sizeof(unsigned)) != cudaSuccess) {
    std::printf("cuda allocation failed\n");
    return 2;
  }
  counts[0] = counts[1] = 0;
  *first = 0xffffffffu;
  compare_all<<<4096, 256>>>(counts, counts + 1, first);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  std::printf("checked %llu mismatches %llu first 0x%08x\n", counts[0], counts[1], *first);
  return counts[0] == (1ull << 32) && counts[1] == 0 ? 0 : 1;
}
