// Which (query, key) pairs take part, per row and per tile, for every kernel. The one rule
// (cuflash/_cpu/reference.py key_bounds, flash-attn's semantics): with offset = seqlen_k - seqlen_q,
// query i sees key j iff 0 <= j < seqlen_k, j <= i + offset + right (right >= 0) and
// j >= i + offset - left (left >= 0). Aligned bottom-right, so the last query's window ends at
// the last key. Causal attention is right = 0 with no left bound.
//
// CAUSAL fixes right = 0 at compile time; WINDOW reads left and right at run time, -1 leaving a
// side unbounded. Mask<false, false> sees every key of the sequence and Mask<true, false> is the
// plain causal mask: neither pays for a bound it does not have.
#pragma once
#include "common/types.cuh"

namespace cuflash {

template <bool CAUSAL, bool WINDOW = false>
struct Mask {
  int seqlen_k;
  int diagonal_offset;  // seqlen_k - seqlen_q
  int window_left = -1;   // read only when WINDOW
  int window_right = -1;  // read only when WINDOW (callers fold causal in as 0)

  __device__ __forceinline__ int seqlen_q() const { return seqlen_k - diagonal_offset; }

  // Query `row` sees keys [key_begin(row), key_end(row)), both in [0, seqlen_k); empty when
  // key_begin >= key_end. Both are non-decreasing in row, which the block ranges below rely on.
  __device__ __forceinline__ int key_begin(int row) const {
    if (!WINDOW || window_left < 0) return 0;
    return min(seqlen_k, max(0, row + diagonal_offset - window_left));
  }
  __device__ __forceinline__ int key_end(int row) const {
    int end = seqlen_k;
    if (CAUSAL) end = min(end, row + diagonal_offset + 1);
    if (WINDOW && window_right >= 0) end = min(end, row + diagonal_offset + window_right + 1);
    return max(0, end);
  }

  // The inverse, for kernels that walk key blocks: key `key` is seen by queries
  // [query_begin(key), query_end(key)), both in [0, seqlen_q).
  __device__ __forceinline__ int query_begin(int key) const {
    int begin = 0;
    if (CAUSAL) begin = max(begin, key - diagonal_offset);
    if (WINDOW && window_right >= 0) begin = max(begin, key - diagonal_offset - window_right);
    return min(seqlen_q(), begin);
  }
  __device__ __forceinline__ int query_end(int key) const {
    if (!WINDOW || window_left < 0) return seqlen_q();
    return max(0, min(seqlen_q(), key - diagonal_offset + window_left + 1));
  }

  // Whether `key` falls outside [begin, end), all three relative to one block's first key as the
  // kernels keep them: only a window bounds keys from below. The one test every kernel's masking
  // shares (apply here; the backward's P, which must become 0 rather than -inf).
  __device__ __forceinline__ static bool outside(int key, int begin, int end) {
    return key >= end || (WINDOW && key < begin);
  }

  // Scores of one warp in the m16n8 accumulator layout: thread `lane` holds rows lane/4 and
  // lane/4 + 8 of each 16-row tile, columns 2*(lane%4) and 2*(lane%4)+1 of each 8-column tile.
  // Masked scores become -inf.
  template <int MT, int NT>
  __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int first_row, int first_key) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = first_row + mt * 16 + half * 8 + lane / 4;
        const int begin = key_begin(row) - first_key;
        const int end = key_end(row) - first_key;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = nt * 8 + (lane % 4) * 2 + e;
            if (outside(key, begin, end)) s[mt][nt][half * 2 + e] = kNegInf;
          }
        }
      }
    }
  }
};

// Half-open range of block indices.
struct BlockRange {
  int begin;
  int end;
};

// Tiles of BLOCK_M queries by BLOCK_N keys. Blocks outside these ranges are never loaded, so the
// cost follows the causal triangle or the window, not the sequence.

// The key blocks that some query of block m_block sees (forward, dQ).
template <int BLOCK_M, int BLOCK_N, bool CAUSAL, bool WINDOW>
__device__ __forceinline__ BlockRange key_blocks(const Mask<CAUSAL, WINDOW>& mask, int m_block) {
  const int first_row = m_block * BLOCK_M;
  const int last_row = min(first_row + BLOCK_M, mask.seqlen_q()) - 1;
  const int begin = mask.key_begin(first_row);
  const int end = mask.key_end(last_row);
  if (begin >= end) return {0, 0};
  return {begin / BLOCK_N, (end + BLOCK_N - 1) / BLOCK_N};
}

// The query blocks that see some key of block n_block (dK, dV).
template <int BLOCK_M, int BLOCK_N, bool CAUSAL, bool WINDOW>
__device__ __forceinline__ BlockRange query_blocks(const Mask<CAUSAL, WINDOW>& mask, int n_block) {
  const int first_key = n_block * BLOCK_N;
  const int last_key = min(first_key + BLOCK_N, mask.seqlen_k) - 1;
  const int begin = mask.query_begin(first_key);
  const int end = mask.query_end(last_key);
  if (begin >= end) return {0, 0};
  return {begin / BLOCK_M, (end + BLOCK_M - 1) / BLOCK_M};
}

// Whether some (query, key) pair of tile (m_block, n_block) with query < seqlen_q is masked,
// keys past seqlen_k included. Rows past seqlen_q do not count: their results are never stored.
// The other tiles are the kernels' unmasked steps: they skip Mask::apply, and the sm90 kernels run
// them in a copy of the step compiled without the mask.
template <int BLOCK_M, int BLOCK_N, bool CAUSAL, bool WINDOW>
__device__ __forceinline__ bool needs_mask(const Mask<CAUSAL, WINDOW>& mask, int m_block, int n_block) {
  const int first_row = m_block * BLOCK_M;
  const int first_key = n_block * BLOCK_N;
  // The first row has the tightest end and the last row the tightest begin.
  if (first_key + BLOCK_N > mask.key_end(first_row)) return true;
  if (WINDOW) return first_key < mask.key_begin(min(first_row + BLOCK_M, mask.seqlen_q()) - 1);
  return false;
}

}  // namespace cuflash
