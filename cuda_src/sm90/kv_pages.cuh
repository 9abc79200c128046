// K and V tiles of a KV cache (common/kv_pages.cuh) for the sm90 forward: gathered row by row
// through the page table by the producer warpgroup with cp.async, into the 128-byte-swizzled
// panels that a TMA copy writes and the wgmma descriptors read (sm90/tiles.cuh). A page table
// scatters a tile's rows over pages of any size, which whole TMA boxes of one sequence cannot
// follow.
#pragma once
#include "common/kv_pages.cuh"
#include "common/smem.cuh"
#include "common/types.cuh"
#include "sm90/tiles.cuh"

namespace cuflash {
namespace sm90 {

// Key positions [first, first + ROWS) of a cache (src: its kv head's column in entry 0) into a
// tile of HEAD_DIM / 64 panels `panel_bytes` apart, by the 128 threads of a warpgroup (`thread`
// 0..127). A row goes to LANES adjacent lanes, one 16-byte chunk each, so that a warp's copy
// instruction reads whole rows (whole 32-byte sectors) and each thread looks up one page per
// pass of 128 / LANES rows. Positions past rows_valid and columns past cols_valid are zero-filled
// and not read: page-table entries past a sequence's end may be anything, and P V must meet
// zeros there, never a stale NaN (0 x NaN is NaN).
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void gather_cached_tile(unsigned char* tile, u32 panel_bytes, const u16* src,
                                                   const CachedRows& rows, int first, i64 page_stride, i64 row_stride,
                                                   int rows_valid, int cols_valid, int thread) {
  constexpr int CHUNKS = HEAD_DIM / 8;
  static_assert(CHUNKS <= 32, "a row within one warp");
  constexpr int LANES = CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;  // a power of two: rows never straddle warps
  constexpr int ROWS_PER_PASS = 128 / LANES;
  static_assert(ROWS % ROWS_PER_PASS == 0, "whole passes");
  const int chunk = thread % LANES;
  if (chunk >= CHUNKS) return;  // d192: the last 8 lanes of each row
  const int col = chunk * 8;
  const bool col_inside = col < cols_valid;
  // Four passes' page look-ups in flight at a time: all of them (16 at d128) spilled the
  // producer's 56 registers (sm90/flash_fwd.cu, Warpgroups).
#pragma unroll 4
  for (int pass = 0; pass < ROWS / ROWS_PER_PASS; ++pass) {
    const int row = thread / LANES + pass * ROWS_PER_PASS;
    const bool inside = col_inside && row < rows_valid;
    const u16* from = inside ? src + rows.offset(first + row, page_stride, row_stride) + col : src;
    cp_async_16(tile + swizzled_offset(row, col, panel_bytes), from, inside ? 16 : 0);
  }
}

}  // namespace sm90
}  // namespace cuflash
