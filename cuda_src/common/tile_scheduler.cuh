// Which (query block, head, batch) tile a CTA works on. CTAs walk the tile list with a stride of
// the grid size: a grid of one CTA per tile runs each tile once; a persistent grid (as many CTAs
// as fit on the GPU) runs several, and loads the next tile's Q and first K block while it
// finishes the current one.
#pragma once
#include "common/types.cuh"

namespace cuflash {

struct TileCoord {
  int m_block;
  int head;
  int batch;
};

template <bool CAUSAL>
struct TileScheduler {
  int m_blocks;
  int heads;
  int batches;

  __device__ __forceinline__ int count() const { return m_blocks * heads * batches; }

  // Non-causal: query blocks fastest, so CTAs running together share one head's K and V in L2.
  // Causal: query blocks slowest and in reverse, so the blocks that see the most keys (the end
  // of the sequence) start first across all heads and the grid ends on short work.
  __device__ __forceinline__ TileCoord at(int index) const {
    if (CAUSAL) {
      const int head = index % heads;
      const int rest = index / heads;
      return {m_blocks - 1 - rest / batches, head, rest % batches};
    }
    const int rest = index / m_blocks;
    return {index % m_blocks, rest % heads, rest / heads};
  }
};

}  // namespace cuflash
