// Global-memory reductions and the flag operations that order them across CTAs.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// dst[0] += a, dst[1] += b (dst 8-byte aligned). Hopper reduces a float pair in one L2 operation,
// halving the reduction traffic of dQ; older GPUs take two.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

__device__ __forceinline__ int load_acquire(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

}  // namespace cuflash
