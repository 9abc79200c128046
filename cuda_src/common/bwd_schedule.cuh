// The order in which a backward CTA (one key block) visits query blocks.
//
// Every key block adds into the dQ rows of every query block it sees.
// Default mode (fp32 reductions in any order): if all key blocks of a head walked the query
// blocks in the same order, they would add into the same rows at the same moment, and reductions
// to one address serialise in L2 (measured: 13-23% of backward time). So non-causal key block n
// starts at query block n * m_blocks / n_blocks and wraps around; causal key blocks already start
// at different query blocks (their first visible one) and walk up from there.
// Deterministic mode: key block n adds into dQ split n % splits, and into each split in key-block
// order n = s, s + splits, ..., which is also the order in which the hardware dispatches the CTAs
// of a head, so a CTA only ever waits for one that started before it. For those waits to be
// short, each key block must reach a query block at the same step as its predecessor in the
// split: the blocks of one split walk the same sequence, so a CTA trails its predecessor by one
// dQ add. Non-causal, splits make these chains `splits` times shorter (each link adds latency at
// the start) and start at different query blocks, so that they do not contend in L2. Causal
// blocks walk down from the last query block to their first visible one, in one split (the host
// passes splits = 1: causal splits would meet on the same query blocks, measured slower).
#pragma once
#include "common/types.cuh"

namespace cuflash {

template <int BLOCK_M, int BLOCK_N, bool CAUSAL, bool DETERMINISTIC>
struct BwdSchedule {
  int m_blocks;
  int n_blocks;
  int splits;
  int diagonal_offset;  // seqlen_k - seqlen_q

  // The first query block that sees any key of block n (causal rows r see keys <= r + offset).
  __device__ __forceinline__ int first(int n) const {
    return CAUSAL ? max(0, n * BLOCK_N - diagonal_offset) / BLOCK_M : 0;
  }
  __device__ __forceinline__ int steps(int n) const { return max(0, m_blocks - first(n)); }

  // The query block key block n visits at step i (0 <= i < steps(n)).
  __device__ __forceinline__ int block_at(int n, int i) const {
    if (CAUSAL) return DETERMINISTIC ? m_blocks - 1 - i : first(n) + i;
    const i64 start = DETERMINISTIC ? static_cast<i64>(n % splits) * m_blocks / splits
                                    : static_cast<i64>(n) * m_blocks / n_blocks;
    const int rotated = static_cast<int>(start) + i;
    return rotated < m_blocks ? rotated : rotated - m_blocks;
  }
};

}  // namespace cuflash
