// Softcap (Gemma 2, Grok): scaled scores x become softcap * tanh(x / softcap). The host folds
// the constants: the kernel computes t = tanh(s * scale / softcap) from the raw scores s, and the
// softmax takes t with softcap * log2(e) as its scale, so nothing else changes.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// tanh(y) = 1 - 2 / (exp(2y) + 1) with exp2_scale = 2 * log2(e) * scale / softcap applied to
// the raw score: two MUFU ops and three ALU ops per score. Its absolute error is a few fp32 ulps
// of 1 (the score's error is that times softcap), where tanh.approx.f32 is off by up to 2^-11
// relative, as much as rounding the score to fp16, which the correctness rule's baseline
// already spends. exp2 overflowing to +inf gives exactly 1, underflowing to 0 exactly -1.
template <int MT, int NT>
__device__ __forceinline__ void softcap_scores(float (&s)[MT][NT][4], float exp2_scale) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float r = fast_rcp(fast_exp2(s[mt][nt][e] * exp2_scale) + 1.f);
        s[mt][nt][e] = fmaf(-2.f, r, 1.f);
      }
}

}  // namespace cuflash
