// Which (query, key) pairs take part: keys past the end of the sequence and, for causal
// attention, keys after the query's diagonal. The diagonal is aligned bottom-right: query i sees
// key j iff j <= i + seqlen_k - seqlen_q (flash-attn >= 2.1), so the last query sees every key.
#pragma once
#include "common/types.cuh"

namespace cuflash {

template <bool CAUSAL>
struct Mask {
  int seqlen_k;
  int diagonal_offset;  // seqlen_k - seqlen_q

  // One past the last key that query `row` may see.
  __device__ __forceinline__ int key_limit(int row) const {
    return CAUSAL ? min(seqlen_k, row + diagonal_offset + 1) : seqlen_k;
  }

  // Scores of one warp in the m16n8 accumulator layout: thread `lane` holds rows lane/4 and
  // lane/4 + 8 of each 16-row tile, columns 2*(lane%4) and 2*(lane%4)+1 of each 8-column tile.
  template <int MT, int NT>
  __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int first_row, int first_key) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int limit = key_limit(first_row + mt * 16 + half * 8 + lane / 4) - first_key;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (nt * 8 + (lane % 4) * 2 + e >= limit) s[mt][nt][half * 2 + e] = kNegInf;
          }
        }
      }
    }
  }
};

}  // namespace cuflash
