// Attention against a KV cache (cuflash/kvcache.py): three kernels, launched in this order on one
// stream: kv_append (generic/kv_append.cu) writes the new keys and values into the cache,
// kv_decode (sm80/kv_decode.cu) attends over one split of each sequence's keys, and kv_combine
// (generic/combine.cu) merges the splits. This header is the first two's view of KvParams: each
// sequence's lengths, and where position pos of a sequence lives in the cache.
#pragma once
#include "common/page_table.cuh"
#include "common/params.cuh"
#include "common/types.cuh"

namespace cuflash {

__device__ __forceinline__ int kv_cached(const KvParams& p, int b) {
  return p.cache_seqlens ? p.cache_seqlens[b] : p.cache_seqlens_scalar;
}
__device__ __forceinline__ int kv_leftpad(const KvParams& p, int b) {
  return p.cache_leftpad ? p.cache_leftpad[b] : 0;
}
// The rotary position of sequence b's first new token (and of its queries').
__device__ __forceinline__ int kv_rotary_start(const KvParams& p, int b) {
  return p.rotary_seqlens ? p.rotary_seqlens[b] : kv_cached(p, b);
}
// Query rows of sequence b and the global row index of its first one.
__device__ __forceinline__ int kv_seqlen_q(const KvParams& p, int b) {
  return p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] : p.seqlen_q;
}
__device__ __forceinline__ i64 kv_first_row(const KvParams& p, int b) {
  return p.cu_seqlens_q ? i64(p.cu_seqlens_q[b]) : i64(b) * p.seqlen_q;
}
// New tokens of sequence b: packed by cu_seqlens_k_new, or as many as its queries when q is
// packed, or seqlen_new.
__device__ __forceinline__ int kv_seqlen_new(const KvParams& p, int b) {
  if (!p.k_new) return 0;
  if (p.cu_seqlens_k_new) return p.cu_seqlens_k_new[b + 1] - p.cu_seqlens_k_new[b];
  return p.cu_seqlens_q ? kv_seqlen_q(p, b) : p.seqlen_new;
}
// Whether the new tokens are packed (total, heads_kv, d), and the row of sequence b's first.
__device__ __forceinline__ bool kv_new_packed(const KvParams& p) { return p.cu_seqlens_k_new || p.cu_seqlens_q; }
__device__ __forceinline__ i64 kv_new_first_row(const KvParams& p, int b) {
  if (p.cu_seqlens_k_new) return p.cu_seqlens_k_new[b];
  return p.cu_seqlens_q ? i64(p.cu_seqlens_q[b]) : 0;
}
// The element offsets of the K and V rows' kv_head at row `row` of cache block `block` (a page, or
// a contiguous cache's batch row).
__device__ __forceinline__ void kv_offsets(const KvParams& p, int block, int row, int kv_head, i64& k_off,
                                           i64& v_off) {
  k_off = i64(block) * p.kc_batch_stride + i64(row) * p.kc_row_stride + i64(kv_head) * p.kc_head_stride;
  v_off = i64(block) * p.vc_batch_stride + i64(row) * p.vc_row_stride + i64(kv_head) * p.vc_head_stride;
}
// The block of a contiguous cache's sequence b: the cache row cache_batch_idx (or b) names.
__device__ __forceinline__ int kv_batch_block(const KvParams& p, int b) {
  return p.cache_batch_idx ? p.cache_batch_idx[b] : b;
}
// Where position `pos` of sequence b lives: the element offsets of its K and V rows' kv_head, in
// the page the page table names, or the cache row kv_batch_block names.
__device__ __forceinline__ void kv_rows(const KvParams& p, int b, int pos, int kv_head, i64& k_off, i64& v_off) {
  if (p.page_table) {
    const SequencePages pages(p.page_table, p.max_pages, b, p.page_size);
    kv_offsets(p, pages.page_of(pos), pages.row_of(pos), kv_head, k_off, v_off);
  } else {
    kv_offsets(p, kv_batch_block(p, b), pos, kv_head, k_off, v_off);
  }
}

// The descale of (sequence b, kv head h): the array's entry, or the scalar.
__device__ __forceinline__ float kv_descale(const float* array, float scalar, const KvParams& p, int b, int h) {
  return array ? array[i64(b) * p.heads_kv + h] : scalar;
}

}  // namespace cuflash
