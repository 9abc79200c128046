// The key blocks a query block visits. Blocks wholly above the causal diagonal are never loaded,
// so causal attention costs half the work, not just half the useful work.
#pragma once
#include "common/types.cuh"

namespace cuflash {

template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct BlockInfo {
  int m_block;
  int seqlen_q;
  int seqlen_k;

  // Key blocks [0, n_block_end()) hold every key some row of this query block may see.
  __device__ __forceinline__ int n_block_end() const {
    int keys = seqlen_k;
    if (CAUSAL) keys = min(keys, (m_block + 1) * BLOCK_M + seqlen_k - seqlen_q);
    return keys <= 0 ? 0 : (keys + BLOCK_N - 1) / BLOCK_N;
  }

  // Whether some score of key block n must be masked: it runs past the sequence end, or its
  // last key lies after the diagonal of the block's first query. All other blocks skip the mask.
  __device__ __forceinline__ bool needs_mask(int n_block) const {
    const int last_key = (n_block + 1) * BLOCK_N - 1;
    return last_key >= seqlen_k || (CAUSAL && last_key > m_block * BLOCK_M + seqlen_k - seqlen_q);
  }
};

}  // namespace cuflash
