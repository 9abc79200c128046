// The sm80 forward's view of a KV cache (FwdParamsPaged): each sequence's lengths, and K/V
// tiles gathered row by row through the page table with cp.async.
#pragma once
#include "common/page_table.cuh"
#include "common/params.cuh"
#include "common/seqlen.cuh"
#include "common/smem.cuh"
#include "common/types.cuh"

namespace cuflash {

// A sequence of a KV-cache forward: its queries as sequence_of finds them (k_begin unused: keys
// are found by position, CachedRows), its keys the cached ones and then the appended ones.
__device__ __forceinline__ Sequence cached_sequence_of(const FwdParamsPaged& p, int batch) {
  Sequence seq = {0, 0, p.seqlen_q, 0};
  if (p.cu_seqlens_q != nullptr) {
    seq.q_begin = p.cu_seqlens_q[batch];
    seq.seqlen_q = p.seq_end_q[batch] - seq.q_begin;
  }
  // In a mixed batch the short sequences are kv_decode's: none of their rows here.
  if (seq.seqlen_q < p.min_rows) seq.seqlen_q = 0;
  const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_seqlen;
  // Packed appends (cu_seqlens_k_new; a packed q's, which append as many as their queries, pass
  // cu_seqlens_q there), or new_keys each.
  const int appended =
      p.cu_seqlens_k_new != nullptr ? p.cu_seqlens_k_new[batch + 1] - p.cu_seqlens_k_new[batch] : p.new_keys;
  seq.seqlen_k = cached + appended;
  return seq;
}

// Where the key positions of one sequence live: dimension-0 entry (page) and row within it.
struct CachedRows {
  SequencePages pages;  // pages.pages null: a contiguous cache
  int batch;

  __device__ __forceinline__ CachedRows(const FwdParamsPaged& p, int b)
      : pages(p.page_table != nullptr ? SequencePages(p.page_table, p.page_table_stride, b, p.page_size)
                                      : SequencePages(nullptr, 0, 0, p.page_size)),
        batch(b) {}

  // Element offset of position `pos` in a cache of these (dimension 0, row) strides.
  __device__ __forceinline__ i64 offset(int pos, i64 page_stride, i64 row_stride) const {
    if (pages.pages == nullptr) return i64(batch) * page_stride + i64(pos) * row_stride;
    return i64(pages.page_of(pos)) * page_stride + i64(pages.row_of(pos)) * row_stride;
  }
};

// load_tile_async of key positions [first, first + ROWS) of a cache (src: its kv head's column
// in entry 0), each row found through `rows`; positions past rows_valid are zero-filled and not
// looked up (their page-table entries may be out of range). Each thread copies adjacent chunks of
// one row, so that it looks up one row per tile: a look-up per chunk (load_tile_async's layout,
// a thread per column) held more addresses across the main loop than it has registers for.
template <int ROWS, int COLS, int ROW_ELEMS, int THREADS>
__device__ __forceinline__ void load_cached_tile_async(u16* tile, const u16* src, const CachedRows& rows, int first,
                                                       i64 page_stride, i64 row_stride, int rows_valid,
                                                       int cols_valid) {
  constexpr int CHUNKS_PER_ROW = COLS / 8;
  constexpr int PER_THREAD = ROWS * CHUNKS_PER_ROW / THREADS;
  constexpr int ROW_THREADS = CHUNKS_PER_ROW / PER_THREAD;
  static_assert(PER_THREAD * THREADS == ROWS * CHUNKS_PER_ROW, "tile must split evenly over the CTA");
  static_assert(ROW_THREADS * PER_THREAD == CHUNKS_PER_ROW, "a thread's chunks must lie in one row");
  const int row = threadIdx.x / ROW_THREADS;
  const int first_col = (threadIdx.x % ROW_THREADS) * PER_THREAD * 8;
  const bool row_inside = row < rows_valid;
  const u16* from = row_inside ? src + rows.offset(first + row, page_stride, row_stride) : src;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int col = first_col + i * 8;
    const bool inside = row_inside && col < cols_valid;
    cp_async_16(tile + swizzle<ROW_ELEMS>(row, col), inside ? from + col : src, inside ? 16 : 0);
  }
}

}  // namespace cuflash
