// A paged KV cache's page table: row b lists the pages of sequence b in order, so that position
// pos of the sequence lies in page row[pos / page_size], at row pos % page_size of that page. The
// entries past a sequence's last page may hold anything: only positions inside it are looked up.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// Sequence b's row of a page table of `stride` entries a row.
struct SequencePages {
  const int* pages;
  int page_size;

  __device__ __forceinline__ SequencePages(const int* table, int stride, int b, int page_size)
      : pages(table + i64(b) * stride), page_size(page_size) {}

  // The page holding positions index * page_size up to the next index's.
  __device__ __forceinline__ int entry(int index) const { return pages[index]; }
  // The page holding position pos, and pos's row in it.
  __device__ __forceinline__ int page_of(int pos) const { return entry(pos / page_size); }
  __device__ __forceinline__ int row_of(int pos) const { return pos % page_size; }
};

}  // namespace cuflash
