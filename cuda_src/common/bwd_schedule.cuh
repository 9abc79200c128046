// The order in which a backward key block visits query blocks.
//
// Every key block adds into the dQ rows of every query block it sees, with fp32 reductions. If
// all key blocks of a head walked the query blocks in the same order, they would add into the
// same rows at the same moment, and reductions to one address serialise in L2 (measured: 13-23%
// of backward time). So non-causal key block n starts at query block n * m_blocks / n_blocks and
// wraps around; causal key blocks already start at different query blocks (their first visible
// one) and walk up from there.
#pragma once
#include "common/types.cuh"

namespace cuflash {

template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct BwdSchedule {
  int m_blocks;
  int n_blocks;
  int diagonal_offset;  // seqlen_k - seqlen_q

  // The first query block that sees any key of block n (causal rows r see keys <= r + offset).
  __device__ __forceinline__ int first(int n) const {
    return CAUSAL ? max(0, n * BLOCK_N - diagonal_offset) / BLOCK_M : 0;
  }
  __device__ __forceinline__ int steps(int n) const { return max(0, m_blocks - first(n)); }

  // The query block key block n visits first; computed once per key block (a 64-bit division).
  __device__ __forceinline__ int start(int n) const {
    return CAUSAL ? first(n) : static_cast<int>(static_cast<i64>(n) * m_blocks / n_blocks);
  }
  // The query block visited at step i (0 <= i < steps(n)) by the key block that starts at `start`.
  __device__ __forceinline__ int block_at(int start, int i) const {
    const int m = start + i;
    return CAUSAL || m < m_blocks ? m : m - m_blocks;
  }
};

}  // namespace cuflash
