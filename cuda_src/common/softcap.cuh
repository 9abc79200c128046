// Softcap (Gemma 2, Grok): scaled scores x become softcap * tanh(x / softcap). The host folds
// the constants: the kernel computes t = tanh(s * scale / softcap) from the raw scores s, and the
// softmax takes t with softcap * log2(e) as its scale, so nothing else changes.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// t = tanh(s * tanh_scale), tanh_scale = scale / softcap, by tanh.approx.f32: one MUFU op per
// score where 1 - 2 / (exp(2y) + 1) took two (exp2, rcp) and three ALU ops, and the softcap
// forward was bound by those issue slots (1.43x the call without softcap at d128, 1.19x with
// this). Its error, up to 2^-11 relative, is that of rounding the score to fp16, far inside what
// the correctness rule's low-precision baseline spends on rounding S: measured against float64,
// err / bound of out, dq, dk and dv did not grow in any of 24 cases.
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

}  // namespace cuflash
