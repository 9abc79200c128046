// Global-memory reductions.
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

}  // namespace cuflash
