// Online softmax over the score tiles a thread holds (FlashAttention-2): a running row maximum and
// a running row sum in registers, the output accumulator rescaled when the maximum grows, and
// the division by the sum deferred to the very end. Its pieces stand alone too, for kernels whose
// rows are spread differently (decoding): a row's rescale, partial rows merged, the LSE.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// The softmax runs in exp2's units (scores times scale_log2 = softmax_scale * log2 e, set on the
// host: one FFMA and one MUFU.EX2 per score) and reports its LSE in natural log.
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;

// The natural-log LSE of a row from its maximum (times scale_log2: in exp2's units) and its sum of
// 2^(x - maximum) over its scores x in exp2's units; a sum held 2^LOG2_OFFSET times too large
// (OnlineSoftmax's) is taken back out here. A row that saw no key has sum 0 and LSE -inf.
template <int LOG2_OFFSET = 0>
__device__ __forceinline__ float row_lse(float max, float sum, float scale_log2 = 1.f) {
  return sum == 0.f ? kNegInf : (max * scale_log2 + fast_log2(sum) - LOG2_OFFSET) * kLn2;
}

// The online-softmax step of one row whose running maximum row_max and sum row_sum are in exp2's
// units (scores already times scale_log2), for kernels that find a step's row maximum m across the
// threads sharing the row themselves (MLA decoding): moves the row to m (at least row_max),
// rescaling the sum, and returns the factor the row's output accumulator takes. `base` is what the
// step's probabilities are exp2(x - base) of: m, or 0 while the row has seen no key (m = -inf),
// whose -inf scores then give 0 rather than exp2(-inf + inf) = NaN.
__device__ __forceinline__ float rescale_row(float& row_max, float& row_sum, float m, float& base) {
  base = m == kNegInf ? 0.f : m;
  const float correction = fast_exp2(row_max - base);
  row_max = m;
  row_sum *= correction;
  return correction;
}

// Partial softmax rows merged: N parts of one row kept apart (by warps or warpgroups), part i with
// maximum max(i) and sum sum(i) of 2^(x - max(i)), in exp2's units.
struct MergedRow {
  float max;   // the parts' largest maximum
  float base;  // max, or 0 where no part saw a key
  float sum;   // of 2^(x - base) over every part: part i's output takes exp2(max(i) - base) / sum
};
template <int N, class Max, class Sum>
__device__ __forceinline__ MergedRow merge_rows(const Max& max, const Sum& sum) {
  MergedRow row;
  row.max = max(0);
#pragma unroll
  for (int i = 1; i < N; ++i) row.max = fmaxf(row.max, max(i));
  row.base = row.max == kNegInf ? 0.f : row.max;
  row.sum = sum(0) * fast_exp2(max(0) - row.base);
#pragma unroll
  for (int i = 1; i < N; ++i) row.sum += sum(i) * fast_exp2(max(i) - row.base);
  return row;
}

// A row with its sink (common/bias.cuh): the sink, in exp2's units, joins the row's sum once as
// one more term 2^sink, the maximum moving to it if larger. A sink of -inf is no sink. A row that
// saw no key (sum 0) ends with sum 1 at maximum = sink: its LSE is the sink, and its output, which
// takes 2^(max(i) - base) / sum of nothing, stays 0.
__device__ __forceinline__ MergedRow with_sink(MergedRow row, float sink) {
  if (sink == kNegInf) return row;
  const float top = fmaxf(row.max, sink);
  // row.sum == 0 guards 0 * 2^(row.base - top) = 0 * inf for a far smaller sink.
  const float sum = (row.sum == 0.f ? 0.f : row.sum * fast_exp2(row.base - top)) + fast_exp2(sink - top);
  return {top, top, sum};
}

// MT 16-row tiles per warp; each thread owns two rows of each (lane/4 and lane/4 + 8).
// LOG2_OFFSET: the probabilities are 2^LOG2_OFFSET times exp(s - row max), in [0, 2^LOG2_OFFSET]
// (the running sum in the same units, taken back out of the LSE): an e4m3 P (sm90's FP8 forward)
// with offset 8 keeps values down to 2^-14 of the row's largest out of e4m3's subnormals, where
// [0, 1] would lose relative precision below 2^-6 (FlashAttention-3 offsets by 8 likewise). The
// largest value, 256, is exact in e4m3, whose limit is 448.
// TREE_MAX: the row maximum as a pairwise tree (depth log2(NT) + 1) instead of one chain of NT
// dependent max instructions; the same result and instruction count, a shorter wait before the
// exponentials (sm90's FP8 forward, where that wait is on the critical path between products).
template <int MT, int LOG2_OFFSET = 0, bool TREE_MAX = false>
struct OnlineSoftmax {
  float row_max[MT][2];  // in raw score units
  float row_sum[MT][2];  // partial: this thread's columns only, summed over the quad at the end

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mt][h] = kNegInf;
        row_sum[mt][h] = 0.f;
      }
    }
  }

  // Turns scores s into unnormalised probabilities p = exp2(s * scale_log2 - max * scale_log2)
  // and rescales the accumulator o by exp2(old_max - new_max) in the same units.
  template <int NT, int DT>
  __device__ __forceinline__ void update(float (&s)[MT][NT][4], float (&o)[MT][DT][4],
                                         float scale_log2) {
    float correction[MT][2];
    probabilities(s, scale_log2, correction);
    rescale(o, correction);
  }

  // update's first half: the probabilities, the running max and sum, and per row the factor the
  // accumulator must take (rescale). Apart so that a kernel whose P V product is still writing o
  // asynchronously (sm90) computes the next block's probabilities meanwhile.
  template <int NT>
  __device__ __forceinline__ void probabilities(float (&s)[MT][NT][4], float scale_log2, float (&correction)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float block_max = row_max[mt][h];
        if constexpr (TREE_MAX) {
          float m[NT];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) m[nt] = fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
#pragma unroll
          for (int w = 1; w < NT; w *= 2) {
#pragma unroll
            for (int nt = 0; nt + w < NT; nt += 2 * w) m[nt] = fmaxf(m[nt], m[nt + w]);
          }
          block_max = fmaxf(block_max, m[0]);
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            block_max = fmaxf(block_max, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          }
        }
        // The four threads of a quad hold the same two rows.
        block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 1));
        block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 2));
        // A row with no visible key yet keeps max = -inf; subtracting 0 instead keeps
        // exp2(-inf - (-inf)) = NaN out and leaves p = 0.
        const float max_scaled = block_max == kNegInf ? 0.f : block_max * scale_log2;
        correction[mt][h] = fast_exp2(row_max[mt][h] * scale_log2 - max_scaled);
        row_max[mt][h] = block_max;
        const float shift = max_scaled - LOG2_OFFSET;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            // One FFMA and one MUFU per score: the scale is folded into the exponent.
            const float p = fast_exp2(fmaf(s[mt][nt][2 * h + e], scale_log2, -shift));
            s[mt][nt][2 * h + e] = p;
            sum += p;
          }
        }
        row_sum[mt][h] = row_sum[mt][h] * correction[mt][h] + sum;
      }
    }
  }

  // update's second half: o times its rows' correction.
  template <int DT>
  __device__ __forceinline__ void rescale(float (&o)[MT][DT][4], const float (&correction)[MT][2]) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * h] *= correction[mt][h];
          o[mt][dt][2 * h + 1] *= correction[mt][h];
        }
      }
    }
  }

  // Normalises o by the row sums and returns the natural-log LSE of row h of tile mt in lse.
  // A row that saw no key has sum 0: its output stays 0 and its LSE is -inf. `sink`: the head's
  // attention sink in exp2's units (with_sink; common/bias.cuh), -inf for none, which leaves the
  // rows as they were.
  template <int DT>
  __device__ __forceinline__ void finalize(float (&o)[MT][DT][4], float scale_log2,
                                           float (&lse)[MT][2], float sink = kNegInf) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = row_sum[mt][h];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        float inv;
        if (sink == kNegInf) {
          inv = sum == 0.f ? 0.f : 1.f / sum;
          lse[mt][h] = row_lse<LOG2_OFFSET>(row_max[mt][h], sum, scale_log2);
        } else {
          // The row's sum counts 2^(x - base) with base = max * scale_log2 - LOG2_OFFSET.
          const bool seen = row_max[mt][h] != kNegInf;
          const float base = seen ? row_max[mt][h] * scale_log2 - LOG2_OFFSET : 0.f;
          const MergedRow row = with_sink({seen ? base : kNegInf, base, sum}, sink);
          inv = sum == 0.f ? 0.f : fast_exp2(base - row.base) / row.sum;
          lse[mt][h] = row_lse(row.max, row.sum);
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * h] *= inv;
          o[mt][dt][2 * h + 1] *= inv;
        }
      }
    }
  }
};

}  // namespace cuflash
