// Shared-memory tiles: the swizzled layout, cp.async global->shared copies and ldmatrix loads.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// A tile is ROWS x ROW_ELEMS 16-bit elements, row-major. ROW_ELEMS is a multiple of 64 so a row
// spans whole 128-byte groups; within a row, 16-byte chunk c of row r sits at chunk c ^ (r % 8).
// ldmatrix reads eight rows at one logical chunk; the XOR spreads them over the eight 16-byte
// bank groups, so neither ldmatrix nor the cp.async writes conflict.
template <int ROW_ELEMS>
__device__ __forceinline__ int swizzle(int row, int col) {
  static_assert(ROW_ELEMS % 64 == 0, "rows must cover whole 128-byte groups");
  return row * ROW_ELEMS + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; src_bytes == 0 writes zeros (out-of-range rows and columns) without
// reading global memory, so padded K/V rows are exact zeros, never stale NaNs that 0 * NaN spreads.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
// 4-byte asynchronous copy for unaligned scalars (per-row statistics); src_bytes == 0 writes 0.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups are pending. The "memory" clobber keeps
// the thread's reads of its own copies below the wait.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// Waits until at most min(pending, MAX) groups are pending, `pending` known only at run time (a
// pipeline's last steps, with fewer groups behind them than stages).
template <int MAX>
__device__ __forceinline__ void cp_async_wait_at_most(int pending) {
  if constexpr (MAX > 0) {
    if (pending < MAX) {
      cp_async_wait_at_most<MAX - 1>(pending);
      return;
    }
  }
  cp_async_wait<MAX>();
}

// Copies rows [0, rows_valid) x cols [0, cols_valid) of a global tile into a swizzled shared tile,
// zero-filling the rest. Every thread of the CTA takes part.
template <int ROWS, int COLS, int ROW_ELEMS, int THREADS>
__device__ __forceinline__ void load_tile_async(u16* tile, const u16* src, i64 row_stride,
                                                int rows_valid, int cols_valid) {
  constexpr int CHUNKS_PER_ROW = COLS / 8;
  constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
  static_assert(CHUNKS % THREADS == 0, "tile must split evenly over the CTA");
  if constexpr (THREADS % CHUNKS_PER_ROW == 0 && (THREADS / CHUNKS_PER_ROW) % 8 == 0) {
    // Each pass covers a multiple of 8 rows, so a thread keeps its column and its swizzle:
    // one running global pointer and compile-time shared offsets. Recomputing row and column per
    // chunk would hold a 64-bit offset per chunk live across the main loop, and spill.
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
    const int row = threadIdx.x / CHUNKS_PER_ROW;
    const int col = (threadIdx.x % CHUNKS_PER_ROW) * 8;
    u16* dst = tile + swizzle<ROW_ELEMS>(row, col);
    const u16* from = src + row * row_stride + col;
    const bool col_inside = col < cols_valid;
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
      const bool inside = col_inside && row + i * ROWS_PER_PASS < rows_valid;
      cp_async_16(dst + i * ROWS_PER_PASS * ROW_ELEMS, inside ? from : src, inside ? 16 : 0);
      from += ROWS_PER_PASS * row_stride;
    }
  } else {
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
      const int chunk = threadIdx.x + i * THREADS;
      const int row = chunk / CHUNKS_PER_ROW;
      const int col = (chunk % CHUNKS_PER_ROW) * 8;
      const bool inside = row < rows_valid && col < cols_valid;
      const u16* from = inside ? src + row * row_stride + col : src;
      cp_async_16(tile + swizzle<ROW_ELEMS>(row, col), from, inside ? 16 : 0);
    }
  }
}

// ldmatrix addresses of one thread into a swizzled tile. A fragment load has each thread point
// at row `row` (with row % 8 == lane % 8 for every 8-row group, as all ldmatrix patterns here do)
// and at logical chunk 2*j + chunk_bit of a 16-column step. Because the row offsets between
// loads are multiples of 8, the XOR term depends only on (2*j) % 8: four precomputed addresses
// cover every load, and the rest of the offset is a compile-time immediate. Computing the
// swizzle per load instead keeps dozens of addresses live and spills.
template <int ROW_ELEMS>
struct FragmentAddress {
  u32 addr[4];

  // col_base (a multiple of 16 elements, may be a run-time value such as a warp's column offset)
  // is folded into the four addresses: adding 8 chunks to a logical chunk adds 8 to the physical
  // one, so at() stays a table lookup by compile-time offsets.
  __device__ __forceinline__ FragmentAddress(const u16* tile, int row, int chunk_bit, int col_base = 0) {
    const u32 row_start = smem_addr(tile + row * ROW_ELEMS);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int chunk = col_base / 8 + 2 * j + chunk_bit;
      addr[j] = row_start + (((chunk ^ row) & 7) | (chunk & ~7)) * 16;
    }
  }

  // Byte address at (row + row_offset, col_base + col + chunk_bit * 8); row_offset % 8 == 0 and
  // col % 16 == 0, both compile-time after unrolling.
  __device__ __forceinline__ u32 at(int row_offset, int col) const {
    const int chunk = col / 8;
    return addr[(chunk % 8) / 2] + (row_offset * ROW_ELEMS + (chunk & ~7) * 8) * 2;
  }
};

// Addresses of one thread's 4-byte stores of an m16n8 accumulator tile into a swizzled tile: row
// `row` plus multiples of 8, and columns `col` + 8 * j for j < 4, with col / 8 a multiple of 4.
// As for FragmentAddress, the XOR term depends only on j, so four addresses and compile-time row
// offsets cover every store (computing the swizzle per store cost ~90 instructions per step).
template <int ROW_ELEMS>
struct StoreAddress {
  u32 addr[4];

  __device__ __forceinline__ StoreAddress(const u16* tile, int row, int col) {
    const u32 row_start = smem_addr(tile + row * ROW_ELEMS);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int chunk = col / 8 + j;
      addr[j] = row_start + ((((chunk ^ row) & 7) | (chunk & ~7)) * 8 + col % 8) * 2;
    }
  }

  // Byte address at (row + row_offset, col + 8 * j); row_offset % 8 == 0, compile-time.
  __device__ __forceinline__ u32 at(int row_offset, int j) const { return addr[j] + row_offset * ROW_ELEMS * 2; }
};

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 value) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(value));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3]));
}

}  // namespace cuflash
