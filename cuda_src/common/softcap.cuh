// Softcap (Gemma 2, Grok): scaled scores x become softcap * tanh(x / softcap). The host folds
// the constants: the kernel computes t = tanh(s * scale / softcap) from the raw scores s, and the
// softmax takes t with softcap * log2(e) as its scale, so nothing else changes.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// t = tanh(s * tanh_scale), tanh_scale = scale / softcap, by tanh.approx.f32: one MUFU op per
// score where 1 - 2 / (exp(2y) + 1) took two (exp2, rcp) and three ALU ops, and the softcap
// forward was bound by those issue slots (docs/kernels.md, softcap). Its error, up to 2^-11
// relative, is that of rounding the capped score to fp16, which the
// correctness rule's low-precision baseline spends too; not so for the slope 1 - t^2 that the
// backward needs (softcap_slope below).
// Saturates to exactly +-1 for large |y|; masks are applied after it, so it never sees -inf.
template <int MT, int NT>
__device__ __forceinline__ void softcap_scores(float (&s)[MT][NT][4], float tanh_scale) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = fast_tanh(s[mt][nt][e] * tanh_scale);
}

// The backward keeps y = s * tanh_scale (types.cuh's scale(), in place) and takes from it each
// score's t = fast_tanh(y), as the forward computed it so that P matches the forward's lse, and
// the slope d(tanh(y)) / dy below.
// 1 - tanh(y)^2 as sech(y)^2 = 4 u / (1 + u)^2 with u = exp(-2 |y|): relative accuracy where tanh
// saturates. From tanh.approx's t, whose absolute error reaches 2^-11, 1 - t^2 was 1% off at
// |y| = 2 and wholly lost where t rounds to 1, which put dQ and dK past the correctness rule's
// bound at small softcaps (docs/kernels.md, softcap).
__device__ __forceinline__ float softcap_slope(float y) {
  constexpr float kMinus2Log2e = -2.8853900817779268f;
  const float u = fast_exp2(kMinus2Log2e * fabsf(y));
  const float v = 1.f + u;
  return 4.f * u * fast_rcp(v * v);
}

}  // namespace cuflash
