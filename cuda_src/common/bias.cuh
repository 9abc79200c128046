// What shifts the softmax besides the scores, read from run-time pointers (null: absent):
//
// ALiBi (Press et al., flash-attn's alibi_slopes): query i and key j of a sequence take the bias
// -slope * |i + seqlen_k - seqlen_q - j|, added to the (softcapped) score in natural-log units
// before the mask, aligned bottom-right like the masks (common/mask.cuh). The kernels hold scores
// in the raw units the softmax multiplies by scale_log2 (softmax_scale * log2 e, or softcap *
// log2 e; common/softcap.cuh), so the slope is taken into those units once per tile: slope *
// log2(e) / scale_log2. Per score it then costs one add (the distance, from a per-row float and a
// compile-time column offset) and one FFMA with the absolute value as an operand modifier. It is
// read by the WINDOW kernels and by sm90's causal forward kernels of two consumers: ALiBi calls run
// those (dispatch.make_mask, dispatch.forward_kernel), so the other kernels carry no trace of it.
//
// Attention sinks (gpt-oss): a logit per query head that joins each row's softmax denominator
// once, after the last key block (common/softmax.cuh, with_sink), so it costs a row's epilogue.
#pragma once
#include "common/softmax.cuh"
#include "common/types.cuh"

namespace cuflash {

struct Alibi {
  float slope;          // in raw score units; 0: no bias
  int diagonal_offset;  // seqlen_k - seqlen_q

  __device__ __forceinline__ bool on() const { return slope != 0.f; }

  // Scores of one warp in the m16n8 accumulator layout (as Mask::apply): thread `lane` holds rows
  // lane/4 and lane/4 + 8 of each 16-row tile, keys 2*(lane%4) + {0, 1} of each 8-key tile.
  template <int MT, int NT>
  __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int first_row, int first_key) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = first_row + mt * 16 + half * 8 + lane / 4;
        const float distance0 = float(row + diagonal_offset - first_key - (lane % 4) * 2);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][half * 2 + e];
            x = fmaf(-slope, fabsf(distance0 - float(nt * 8 + e)), x);
          }
      }
    }
  }

  // The bias of one (query, key) pair, for kernels whose layouts differ (the sm90 backward's S^T,
  // decoding's packed rows).
  __device__ __forceinline__ float bias(int query, int key) const {
    return -slope * fabsf(float(query + diagonal_offset - key));
  }
};

// The Alibi of (batch, head) for a Params with alibi_slopes and alibi_batch_stride (FwdParams,
// BwdParams, KvParams), whose scores reach the softmax times scale_log2.
template <class Params>
__device__ __forceinline__ float alibi_slope(const Params& p, int batch, int head, float scale_log2) {
  return p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[batch * p.alibi_batch_stride + head] * (kLog2e / scale_log2);
}

// A head's sink in exp2 units (OnlineSoftmax::finalize, with_sink), -inf without sinks.
template <class Params>
__device__ __forceinline__ float sink_log2(const Params& p, int head) {
  return p.sinks == nullptr ? kNegInf : p.sinks[head] * kLog2e;
}

}  // namespace cuflash
