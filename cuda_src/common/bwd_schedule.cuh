// The order in which a backward CTA (one key block) visits query blocks, and, for deterministic
// mode, the order in which key blocks add into one query block's dQ.
//
// Every key block contributes to the dQ rows of every query block it sees. If all key blocks of a
// head walked the query blocks in the same order, they would all add into the same dQ rows at the
// same moment: atomics to one address serialise in L2, and in deterministic mode, where the adds
// into one block must follow a fixed order, each CTA would wait for the one before it. So
// non-causal key block n starts at query block n * m_blocks / n_blocks and wraps around: at any
// step the key blocks of a head sit on different query blocks. Causal key blocks already start at
// different query blocks (their first visible one) and walk straight to the end.
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
  __device__ __forceinline__ int rotation(int n) const {
    return CAUSAL ? 0 : static_cast<int>(static_cast<i64>(n) * m_blocks / n_blocks);
  }
  // The query block key block n visits at step i (0 <= i < steps(n)).
  __device__ __forceinline__ int block_at(int n, int i) const {
    const int rotated = rotation(n) + i;
    return first(n) + (rotated < steps(n) ? rotated : rotated - steps(n));
  }
  // The step at which key block n visits query block m (first(n) <= m < m_blocks).
  __device__ __forceinline__ int step_of(int n, int m) const {
    const int i = m - first(n) - rotation(n);
    return i < 0 ? i + steps(n) : i;
  }

  // How many key blocks add into query block m's dQ before key block n does: those that visit m
  // at an earlier step, ties (causal blocks with the same first query block) going to the lower
  // block index, which the hardware dispatches first. A CTA only ever waits for a CTA that is
  // earlier in this order at a step it has itself already passed, so the waits cannot form a
  // cycle. Called by a whole warp; each lane counts a stride of the key blocks.
  __device__ __forceinline__ int rank(int n, int m) const {
    const int my_step = step_of(n, m);
    int before = 0;
    for (int other = threadIdx.x % 32; other < n_blocks; other += 32) {
      if (other == n || m < first(other)) continue;
      const int step = step_of(other, m);
      before += step < my_step || (step == my_step && other < n);
    }
    return __reduce_add_sync(0xffffffffu, before);
  }
};

}  // namespace cuflash
