// e4m3 (float8_e4m3fn) inputs of the sm80 forward: bytes in global memory, copied asynchronously
// into a staging buffer and widened to the kernel's 16-bit Elem in shared memory, so that ldmatrix
// and mma.sync see the same swizzled 16-bit tiles as for fp16 and bf16 inputs. Every e4m3 value is
// exact in fp16 and in bf16.
#pragma once
#include "common/params.cuh"
#include "common/smem.cuh"
#include "common/e4m3.cuh"
#include "common/types.cuh"

namespace cuflash {

// The softmax's score scales for a CTA of (batch, head_kv): FwdParams' scale_log2 and
// softcap_tanh_scale, read where they are used, as the 16-bit kernels always have.
template <class Params, bool SOFTCAP>
struct ScoreScales {
  const Params& p;
  __device__ __forceinline__ ScoreScales(const Params& params, int, int) : p(params) {}
  __device__ __forceinline__ float log2() const { return p.scale_log2; }
  __device__ __forceinline__ float tanh_scale() const { return p.softcap_tanh_scale; }
};

// e4m3 inputs: those times the CTA's q and k descales, which scale the raw scores (inside the
// softcap's tanh when there is one).
template <bool SOFTCAP>
struct ScoreScales<FwdParamsFp8, SOFTCAP> {
  float log2_, tanh_;
  __device__ __forceinline__ ScoreScales(const FwdParamsFp8& p, int batch, int kv_head) {
    const float descale =
        (p.descale_q ? p.descale_q[batch * p.descale_q_batch_stride + kv_head * p.descale_q_head_stride] : 1.f) *
        (p.descale_k ? p.descale_k[batch * p.descale_k_batch_stride + kv_head * p.descale_k_head_stride] : 1.f);
    log2_ = SOFTCAP ? p.scale_log2 : p.scale_log2 * descale;
    tanh_ = SOFTCAP ? p.softcap_tanh_scale * descale : p.softcap_tanh_scale;
  }
  __device__ __forceinline__ float log2() const { return log2_; }
  __device__ __forceinline__ float tanh_scale() const { return tanh_; }
};

// The factor of O for e4m3 inputs: the scalar v descale times the CTA's entry of the array.
__device__ __forceinline__ float v_descale(const FwdParamsFp8& p, int batch, int kv_head) {
  return p.v_scale *
         (p.descale_v ? p.descale_v[batch * p.descale_v_batch_stride + kv_head * p.descale_v_head_stride] : 1.f);
}

// Where thread threadIdx.x's i-th 16-byte chunk of a ROWS x COLS e4m3 tile lies: chunk
// threadIdx.x + i * THREADS of the row-major tile, so a thread's staging bytes are compile-time
// offsets from its first. Where a pass of THREADS chunks covers a multiple of 8 whole rows
// (FIXED_COLUMN), a thread keeps its column and its swizzle (as load_tile_async, and for the same
// reason: per-chunk 64-bit offsets would stay live across the main loop and spill); otherwise
// (d192: 12 chunks per row, 256 threads, where ptxas spills nothing) each chunk computes its own.
template <int ROWS, int COLS, int THREADS>
struct StagedChunks {
  static constexpr int CHUNKS_PER_ROW = COLS / 16;
  static constexpr int PER_THREAD = ROWS * CHUNKS_PER_ROW / THREADS;
  static constexpr bool FIXED_COLUMN = THREADS % CHUNKS_PER_ROW == 0 && (THREADS / CHUNKS_PER_ROW) % 8 == 0;
  static constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;  // FIXED_COLUMN only
  static_assert(COLS % 16 == 0 && ROWS * CHUNKS_PER_ROW % THREADS == 0, "tile must split evenly over the CTA");

  static __device__ __forceinline__ int row(int i) {
    return FIXED_COLUMN ? threadIdx.x / CHUNKS_PER_ROW + i * ROWS_PER_PASS
                        : (threadIdx.x + i * THREADS) / CHUNKS_PER_ROW;
  }
  static __device__ __forceinline__ int col(int i) {
    return (FIXED_COLUMN ? threadIdx.x : threadIdx.x + i * THREADS) % CHUNKS_PER_ROW * 16;
  }
  static __device__ __forceinline__ int staging_offset(int i) { return (threadIdx.x + i * THREADS) * 16; }
};

// Copies rows [0, rows_valid) x cols [0, cols_valid) of a ROWS x COLS e4m3 tile into `staging`
// (StagedChunks' order), zero-filling the rest; widen_staged_tile then has each thread widen the
// chunks it copied. cols_valid is a multiple of 8, so a chunk is whole, half or empty.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void stage_tile_async(u8* staging, const u8* src, i64 row_stride, int rows_valid,
                                                 int cols_valid) {
  typedef StagedChunks<ROWS, COLS, THREADS> C;
  if constexpr (C::FIXED_COLUMN) {
    const int col = C::col(0);
    const int bytes = min(16, max(0, cols_valid - col));
    const u8* from = src + C::row(0) * row_stride + col;
#pragma unroll
    for (int i = 0; i < C::PER_THREAD; ++i) {
      const bool inside = bytes > 0 && C::row(i) < rows_valid;
      cp_async_16(staging + C::staging_offset(i), inside ? from : src, inside ? bytes : 0);
      from += C::ROWS_PER_PASS * row_stride;
    }
  } else {
#pragma unroll
    for (int i = 0; i < C::PER_THREAD; ++i) {
      const int row = C::row(i), col = C::col(i);
      const int bytes = row < rows_valid ? min(16, max(0, cols_valid - col)) : 0;
      cp_async_16(staging + C::staging_offset(i), bytes > 0 ? src + row * row_stride + col : src, bytes);
    }
  }
}

// Widens this thread's chunks of a staged tile (stage_tile_async, after this thread's copies have
// landed) into the swizzled 16-bit tile. No other thread reads them, so no barrier comes between.
template <int ROWS, int COLS, int ROW_ELEMS, int THREADS, class Elem>
__device__ __forceinline__ void widen_staged_tile(u16* tile, const u8* staging) {
  typedef StagedChunks<ROWS, COLS, THREADS> C;
#pragma unroll
  for (int i = 0; i < C::PER_THREAD; ++i) {
    const uint4 bytes = *reinterpret_cast<const uint4*>(staging + C::staging_offset(i));
    const u32 words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    u32 wide[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      wide[2 * w] = widen_e4m3_pair<Elem>(words[w], 0x1404u);      // bytes 0, 1
      wide[2 * w + 1] = widen_e4m3_pair<Elem>(words[w], 0x3424u);  // bytes 2, 3
    }
    const int row = C::row(i), col = C::col(i);
    *reinterpret_cast<uint4*>(tile + swizzle<ROW_ELEMS>(row, col)) = make_uint4(wide[0], wide[1], wide[2], wide[3]);
    *reinterpret_cast<uint4*>(tile + swizzle<ROW_ELEMS>(row, col + 8)) =
        make_uint4(wide[4], wide[5], wide[6], wide[7]);
  }
}

// A tile load of a kernel whose inputs are Input: 16-bit inputs straight into the swizzled tile;
// e4m3 bytes into `staging`, for land_tile to widen into `tile`. e4m3 rows are staged ROW_ELEMS
// wide (the columns past cols_valid zero-filled): head_dim 96 then stages 8 chunks per row, a
// fixed column per thread (StagedChunks), where 6 chunks per row computed per chunk spilled past
// the allowance on sm_90a.
template <class Input, int ROWS, int COLS, int ROW_ELEMS, int THREADS>
__device__ __forceinline__ void fetch_tile_async(u16* tile, u8* staging, const typename InputStorage<Input>::type* src,
                                                 i64 row_stride, int rows_valid, int cols_valid) {
  if constexpr (InputStorage<Input>::fp8) {
    stage_tile_async<ROWS, ROW_ELEMS, THREADS>(staging, src, row_stride, rows_valid, cols_valid);
  } else {
    load_tile_async<ROWS, COLS, ROW_ELEMS, THREADS>(tile, src, row_stride, rows_valid, cols_valid);
  }
}

// After cp_async_wait and before the barrier that publishes `tile`: widens this thread's staged
// e4m3 chunks (fetch_tile_async's ROW_ELEMS-wide rows); nothing for 16-bit inputs.
template <class Input, int ROWS, int ROW_ELEMS, int THREADS, class Elem>
__device__ __forceinline__ void land_tile(u16* tile, const u8* staging) {
  if constexpr (InputStorage<Input>::fp8) widen_staged_tile<ROWS, ROW_ELEMS, ROW_ELEMS, THREADS, Elem>(tile, staging);
}

}  // namespace cuflash
