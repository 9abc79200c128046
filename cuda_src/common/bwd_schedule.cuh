// The order in which a backward key block visits the query blocks that see it.
//
// Every key block adds into the dQ rows of every query block it sees, with fp32 reductions. If
// all key blocks of a head walked the query blocks in the same order, they would add into the
// same rows at the same moment, and reductions to one address serialise in L2 (docs/kernels.md).
// Without a mask every key block sees every query block, so key block n starts
// at query block n * m_blocks / n_blocks and wraps around; under a causal mask or a window the
// key blocks already start at different query blocks (their first visible one) and walk up.
#pragma once
#include "common/mask.cuh"
#include "common/types.cuh"

namespace cuflash {

struct BwdSchedule {
  int begin;  // the visited query blocks are [begin, end)
  int end;
  int start;  // the first one visited

  // ROTATE: start at the rotated block (unmasked attention); the division is once per key block.
  template <bool ROTATE>
  __device__ __forceinline__ static BwdSchedule of(BlockRange blocks, int n_block, int n_blocks) {
    const int count = blocks.end - blocks.begin;
    const int offset = ROTATE ? static_cast<int>(static_cast<i64>(n_block) * count / n_blocks) : 0;
    return {blocks.begin, blocks.end, blocks.begin + offset};
  }

  __device__ __forceinline__ int steps() const { return end - begin; }
  // The query block visited at step i (0 <= i < steps()).
  __device__ __forceinline__ int block_at(int i) const {
    const int m = start + i;
    return m < end ? m : m - (end - begin);
  }
};

}  // namespace cuflash
