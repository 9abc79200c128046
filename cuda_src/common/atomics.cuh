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

// dst[0..3] += (a, b, c, d), dst 16-byte aligned.
__device__ __forceinline__ void red_add_f32x4(float* dst, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

}  // namespace cuflash
