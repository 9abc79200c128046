// FlashAttention-2 forward for compute capability 8.0 and newer: one CTA per (query block, head,
// batch); K and V tiles stream through shared memory with cp.async while the warps run
// mma.sync m16n8k16 with fp32 accumulators; softmax stays in registers. Only O and the LSE reach
// global memory. e4m3 inputs (Input = e4m3) are staged as bytes and widened to Elem in shared
// memory (common/fp8.cuh), with their descales folded into the softmax scale and the final
// normalisation. PAGED kernels read K and V from a KV cache, through its page table
// (sm80/kv_pages.cuh).
#include "common/bias.cuh"
#include "common/fp8.cuh"
#include "sm80/kv_pages.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/philox.cuh"
#include "common/seqlen.cuh"
#include "common/smem.cuh"
#include "common/softcap.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

// HEAD_DIM: the head-dim bucket (the real head_dim may be smaller; the rest is zero-filled).
// BLOCK_M query rows per CTA, BLOCK_N keys per step, WARPS warps each owning BLOCK_M / WARPS
// query rows. SMEM_BYTES: the dynamic shared memory the host launches with
// (dispatch.forward_kernel), checked against the tiles below. CAUSAL, WINDOW: the mask
// (common/mask.cuh). SOFTCAP: tanh-capped scores (common/softcap.cuh). Elem: f16 or bf16, the
// type of the products and of O. Input: the type of q, k and v, Elem or e4m3. PAGED: k and v are
// a KV cache (FwdParamsPaged), 16-bit only. V and O have FwdParams::head_dim_v columns.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int SMEM_BYTES, bool CAUSAL, bool WINDOW, bool SOFTCAP,
          class Elem, class Input = Elem, bool PAGED = false>
__global__ void __launch_bounds__(WARPS * 32)
    flash_fwd_sm80(const __grid_constant__ typename FwdArgs<Input, PAGED>::type p) {
  typedef typename InputStorage<Input>::type Stored;
  constexpr bool FP8 = InputStorage<Input>::fp8;
  static_assert(!(FP8 && PAGED), "a KV cache is read by the 16-bit kernels only");
  constexpr int THREADS = WARPS * 32;
  constexpr int ROW_ELEMS = (HEAD_DIM + 63) / 64 * 64;  // shared row pitch, see swizzle()
  constexpr int MT = BLOCK_M / (16 * WARPS);            // 16-row tiles per warp
  constexpr int NT = BLOCK_N / 8;                       // 8-key tiles of S
  constexpr int DT = HEAD_DIM / 8;                      // 8-column tiles of O
  constexpr int KSTEPS = HEAD_DIM / 16;
  // ALiBi (common/bias.cuh) in the window kernels, but for the KV cache's with softcap, where it
  // spilled past the allowance: dispatch.kvcache_prefill sends those calls to kv_decode.
  constexpr bool ALIBI = WINDOW && !(PAGED && SOFTCAP);
  // Dropout (common/philox.cuh) in the 16-bit window kernels; the API refuses it for FP8 inputs
  // and a KV cache.
  constexpr bool DROPOUT = WINDOW && !FP8 && !PAGED;
  static_assert(MT >= 1 && BLOCK_M % (16 * WARPS) == 0, "whole 16-row tiles per warp");
  static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "mma k-steps of 16");

  extern __shared__ __align__(128) unsigned char smem[];
  u16* const sQ = reinterpret_cast<u16*>(smem);
  u16* const sK = sQ + BLOCK_M * ROW_ELEMS;
  u16* const sV = sK + BLOCK_N * ROW_ELEMS;
  // e4m3: staging for the K and V bytes after the tiles; Q's bytes are staged in sV, free until
  // the first V tile.
  u8* const k_staging = reinterpret_cast<u8*>(sV + BLOCK_N * ROW_ELEMS);
  u8* const v_staging = k_staging + BLOCK_N * ROW_ELEMS;
  u8* const q_staging = reinterpret_cast<u8*>(sV);
  static_assert(SMEM_BYTES == (BLOCK_M + 2 * BLOCK_N) * ROW_ELEMS * sizeof(u16) + (FP8 ? 2 * BLOCK_N * ROW_ELEMS : 0),
                "the host's shared memory differs from the Q, K and V tiles");
  static_assert(BLOCK_M * ROW_ELEMS <= BLOCK_N * ROW_ELEMS * sizeof(u16), "Q's bytes must fit in sV");

  // Grid (m_blocks, heads, batch), or (heads, batch, m_blocks) when causal: causal query blocks
  // near the end of the sequence see the most keys, and with the block index slowest and
  // reversed the heaviest blocks of every head start first, so the grid ends on short work.
  // Window work per block is flat, so windows keep the plain order. A packed batch's grid covers
  // its longest sequence; the CTAs past a shorter one's end leave at once.
  const int m_block = CAUSAL ? gridDim.z - 1 - blockIdx.z : blockIdx.x;
  const int head = CAUSAL ? blockIdx.x : blockIdx.y;
  const int batch = CAUSAL ? blockIdx.y : blockIdx.z;
  const Sequence seq = [&] {
    if constexpr (PAGED) {
      return cached_sequence_of(p, batch);
    } else {
      return sequence_of(p, batch);
    }
  }();
  const int first_row = m_block * BLOCK_M;
  if (first_row >= seq.seqlen_q) return;
  const int kv_head = head / p.kv_group;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  const Mask<CAUSAL, WINDOW> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
  const BlockRange n_range = key_blocks<BLOCK_M, BLOCK_N>(mask, m_block);
  const int warp_row = warp * MT * 16;  // first row of this warp inside the block

  const Stored* q = static_cast<const Stored*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                 (seq.q_begin + first_row) * p.q_row_stride;
  // A KV cache's rows are found per position (fetch_keys), from its kv head's column.
  const Stored* k = static_cast<const Stored*>(p.k) + (PAGED ? 0 : batch * p.k_batch_stride) +
                 kv_head * p.k_head_stride + seq.k_begin * p.k_row_stride;
  const Stored* v = static_cast<const Stored*>(p.v) + (PAGED ? 0 : batch * p.v_batch_stride) +
                 kv_head * p.v_head_stride + seq.k_begin * p.v_row_stride;
  // Key rows [first, first + BLOCK_N) of K or V (src, with its strides and `cols` real columns)
  // into `tile`; the columns up to HEAD_DIM are zero-filled.
  const auto fetch_keys = [&](u16* tile, u8* staging, const Stored* src, i64 batch_stride, i64 row_stride,
                              int first, int cols) {
    if constexpr (PAGED) {
      load_cached_tile_async<BLOCK_N, HEAD_DIM, ROW_ELEMS, THREADS>(
          tile, src, CachedRows(p, batch), first, batch_stride, row_stride, seq.seqlen_k - first, cols);
    } else {
      fetch_tile_async<Input, BLOCK_N, HEAD_DIM, ROW_ELEMS, THREADS>(tile, staging, src + first * row_stride,
                                                                     row_stride, seq.seqlen_k - first, cols);
    }
  };

  // Fragment rows of this thread: Q and V use ldmatrix matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
  // in that order; K's B fragments pair (keys 0-7 | 8-15) with (k 0-7 | 8-15) the other way round.
  const FragmentAddress<ROW_ELEMS> q_frag(sQ, warp_row + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const FragmentAddress<ROW_ELEMS> k_frag(sK, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const FragmentAddress<ROW_ELEMS> v_frag(sV, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  const ScoreScales<typename FwdArgs<Input, PAGED>::type, SOFTCAP> scales(p, batch, kv_head);

  float o[MT][DT][4];
  clear(o);
  OnlineSoftmax<MT> softmax;
  softmax.init();

  if (n_range.begin < n_range.end) {
    fetch_tile_async<Input, BLOCK_M, HEAD_DIM, ROW_ELEMS, THREADS>(sQ, q_staging, q, p.q_row_stride,
                                                                   seq.seqlen_q - first_row, p.head_dim);
    const int last = n_range.end - 1;
    fetch_keys(sK, k_staging, k, p.k_batch_stride, p.k_row_stride, last * BLOCK_N, p.head_dim);
    cp_async_commit();
    if constexpr (FP8) {
      // Widened now, by the thread that staged each chunk; the loop's first barrier publishes sQ
      // and frees sV for V[last].
      cp_async_wait<0>();
      land_tile<Input, BLOCK_M, ROW_ELEMS, THREADS, Elem>(sQ, q_staging);
    }

    // Key blocks run from the last to the first, so the blocks that need masking (the diagonal
    // and the sequence end) come first and the rest run the mask-free path; a window's left
    // edge comes last.
    for (int n = last; n >= n_range.begin; --n) {
      // K[n] (and Q) have landed, and every warp has finished P.V of the previous step, so the
      // single V buffer is free for V[n].
      cp_async_wait<0>();
      land_tile<Input, BLOCK_N, ROW_ELEMS, THREADS, Elem>(sK, k_staging);
      __syncthreads();
      fetch_keys(sV, v_staging, v, p.v_batch_stride, p.v_row_stride, n * BLOCK_N, p.head_dim_v);
      cp_async_commit();

      // S = Q K^T. A fragments of Q (rows x k) and B fragments of K (keys x k, i.e. K^T
      // column-major) both come from row-major tiles with plain ldmatrix.
      float s[MT][NT][4];
      clear(s);
      u32 q_tiles[MT][4], k_tiles[4];
      warp_gemm<KSTEPS, Elem>(s, q_tiles, k_tiles, smem_operand<false>(q_frag), smem_operand<false>(k_frag));

      if (SOFTCAP) softcap_scores(s, scales.tanh_scale());
      // ALiBi's slope is read again each step (an L1 hit) rather than held across the loop, where
      // its register pushed the widest kernels into spills.
      if (ALIBI && p.alibi_slopes != nullptr)
        Alibi{alibi_slope(p, batch, head, scales.log2()), mask.diagonal_offset}.apply(s, first_row + warp_row, n * BLOCK_N);
      if (needs_mask<BLOCK_M, BLOCK_N>(mask, m_block, n)) mask.apply(s, first_row + warp_row, n * BLOCK_N);

      // V[n] has landed and every warp is done reading K[n]: prefetch K[n-1] under the softmax
      // and P.V below.
      cp_async_wait<0>();
      land_tile<Input, BLOCK_N, ROW_ELEMS, THREADS, Elem>(sV, v_staging);
      __syncthreads();
      if (n > n_range.begin) {
        fetch_keys(sK, k_staging, k, p.k_batch_stride, p.k_row_stride, (n - 1) * BLOCK_N, p.head_dim);
        cp_async_commit();
      }

      softmax.update(s, o, scales.log2());
      // Dropout after the row sums, which are of the undropped P. The stream is made again each
      // step (its seed an L1 hit) rather than held across the loop, as ALiBi's slope.
      if (DROPOUT && dropout_on(p))
        drop_rows(s, dropout_stream(p, batch, CAUSAL ? gridDim.x : gridDim.y, head), first_row + warp_row,
                  n * BLOCK_N, lane);

      // O += P V: P straight from the S registers; V (keys x d, row-major) read k-major.
      u32 p_tiles[MT][4], v_tiles[4];
      warp_gemm<BLOCK_N / 16, Elem>(o, p_tiles, v_tiles, register_operand<Elem>(s), smem_operand<true>(v_frag));
    }
  }

  float lse[MT][2];
  softmax.finalize(o, scales.log2(), lse, sink_log2(p, head));
  if (DROPOUT && dropout_on(p)) scale(o, p.dropout_scale);  // the kept P's 1 / (1 - p)
  if constexpr (FP8) {
    // Read here rather than held across the main loop.
    scale(o, v_descale(p, batch, kv_head));
  }

  // Epilogue: each warp stages its own rows of O in its own rows of sQ (no other warp reads
  // them, so a warp barrier suffices) and writes them out as coalesced 16-byte rows.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row + mt * 16 + h * 8 + lane / 4;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int col = dt * 8 + (lane % 4) * 2;
        *reinterpret_cast<u32*>(sQ + swizzle<ROW_ELEMS>(row, col)) =
            Elem::pack(o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
      }
      const int global_row = first_row + row;
      if (lane % 4 == 0 && global_row < seq.seqlen_q && p.lse != nullptr) {
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_begin + global_row] = lse[mt][h];
      }
    }
  }
  __syncwarp();

  u16* out = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
             seq.q_begin * p.o_row_stride;
  constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
#pragma unroll
  for (int i = lane; i < MT * 16 * CHUNKS_PER_ROW; i += 32) {
    const int row = warp_row + i / CHUNKS_PER_ROW;
    const int col = (i % CHUNKS_PER_ROW) * 8;
    const int global_row = first_row + row;
    if (global_row < seq.seqlen_q && col < p.head_dim_v) {
      *reinterpret_cast<uint4*>(out + global_row * p.o_row_stride + col) =
          *reinterpret_cast<const uint4*>(sQ + swizzle<ROW_ELEMS>(row, col));
    }
  }
}

}  // namespace cuflash
