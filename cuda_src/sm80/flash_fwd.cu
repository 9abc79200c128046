// FlashAttention-2 forward for compute capability 8.0 and newer: a CTA works on (query block,
// head, batch) tiles (one each, or several in a persistent grid); K and V tiles stream through
// shared memory with cp.async while the warps run mma.sync m16n8k16 with fp32 accumulators;
// softmax stays in registers. Only O and the LSE reach global memory.
#include "common/block_info.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/smem.cuh"
#include "common/softmax.cuh"
#include "common/tile_scheduler.cuh"
#include "common/types.cuh"

namespace cuflash {

// HEAD_DIM: the head-dim bucket (the real head_dim may be smaller; the rest is zero-filled).
// BLOCK_M query rows per CTA, BLOCK_N keys per step, WARPS warps each owning BLOCK_M / WARPS
// query rows. Elem: f16 or bf16.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool CAUSAL, class Elem>
__global__ void __launch_bounds__(WARPS * 32)
    flash_fwd_sm80(const __grid_constant__ FwdParams p) {
  constexpr int THREADS = WARPS * 32;
  // Shared row pitch: a power of two of at least 64 elements, so rows are whole 128-byte swizzle
  // groups (see swizzle()) and a tile splits into 16-byte chunks evenly over the CTA.
  constexpr int ROW_ELEMS = HEAD_DIM <= 64 ? 64 : HEAD_DIM <= 128 ? 128 : 256;
  constexpr int MT = BLOCK_M / (16 * WARPS);            // 16-row tiles per warp
  constexpr int NT = BLOCK_N / 8;                       // 8-key tiles of S
  constexpr int DT = HEAD_DIM / 8;                      // 8-column tiles of O
  constexpr int KSTEPS = HEAD_DIM / 16;
  static_assert(MT >= 1 && BLOCK_M % (16 * WARPS) == 0, "whole 16-row tiles per warp");
  static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "mma k-steps of 16");

  extern __shared__ __align__(128) unsigned char smem[];
  u16* const sQ = reinterpret_cast<u16*>(smem);
  u16* const sK = sQ + BLOCK_M * ROW_ELEMS;
  u16* const sV = sK + BLOCK_N * ROW_ELEMS;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_row = warp * MT * 16;  // first row of this warp inside the block
  const TileScheduler<CAUSAL> scheduler{(p.seqlen_q + BLOCK_M - 1) / BLOCK_M, p.heads, p.batch};
  const int tiles = scheduler.count();
  const Mask<CAUSAL> mask{p.seqlen_k, p.seqlen_k - p.seqlen_q};

  // Fragment rows of this thread: Q and V use ldmatrix matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
  // in that order; K's B fragments pair (keys 0-7 | 8-15) with (k 0-7 | 8-15) the other way round.
  const FragmentAddress<ROW_ELEMS> q_frag(sQ, warp_row + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const FragmentAddress<ROW_ELEMS> k_frag(sK, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const FragmentAddress<ROW_ELEMS> v_frag(sV, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  // Issues the cp.async loads a tile starts with, Q and its last key block (the first one
  // visited), as one commit group; a tile that sees no key loads nothing.
  auto load_first_tiles = [&](const TileCoord& t) {
    const int n_end = BlockInfo<BLOCK_M, BLOCK_N, CAUSAL>{t.m_block, p.seqlen_q, p.seqlen_k}.n_block_end();
    if (n_end == 0) return;
    const int first_row = t.m_block * BLOCK_M;
    load_tile_async<BLOCK_M, ROW_ELEMS, THREADS>(
        sQ, static_cast<const u16*>(p.q) + t.batch * p.q_batch_stride + t.head * p.q_head_stride +
                first_row * p.q_row_stride,
        p.q_row_stride, p.seqlen_q - first_row, p.head_dim);
    const int last_key = (n_end - 1) * BLOCK_N;
    load_tile_async<BLOCK_N, ROW_ELEMS, THREADS>(
        sK, static_cast<const u16*>(p.k) + t.batch * p.k_batch_stride +
                (t.head / p.kv_group) * p.k_head_stride + last_key * p.k_row_stride,
        p.k_row_stride, p.seqlen_k - last_key, p.head_dim);
    cp_async_commit();
  };

  int index = blockIdx.x;
  TileCoord tile = scheduler.at(index);
  load_first_tiles(tile);

  while (true) {
    const int next_index = index + gridDim.x;
    const BlockInfo<BLOCK_M, BLOCK_N, CAUSAL> info{tile.m_block, p.seqlen_q, p.seqlen_k};
    const int n_end = info.n_block_end();
    const int first_row = tile.m_block * BLOCK_M;
    const int kv_head = tile.head / p.kv_group;
    const u16* k = static_cast<const u16*>(p.k) + tile.batch * p.k_batch_stride + kv_head * p.k_head_stride;
    const u16* v = static_cast<const u16*>(p.v) + tile.batch * p.v_batch_stride + kv_head * p.v_head_stride;

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    OnlineSoftmax<MT> softmax;
    softmax.init();

    // Key blocks run from the last to the first, so the blocks that need masking (the diagonal
    // and the sequence end) come first and the rest run the mask-free path.
    for (int n = n_end - 1; n >= 0; --n) {
      // K[n] (and Q) have landed, and every warp has finished P.V of the previous step, so the
      // single V buffer is free for V[n].
      cp_async_wait<0>();
      __syncthreads();
      load_tile_async<BLOCK_N, ROW_ELEMS, THREADS>(
          sV, v + n * BLOCK_N * p.v_row_stride, p.v_row_stride, p.seqlen_k - n * BLOCK_N, p.head_dim);
      cp_async_commit();

      float s[MT][NT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

      // S = Q K^T. A fragments of Q (rows x k) and B fragments of K (keys x k, i.e. K^T
      // column-major) both come from row-major tiles with plain ldmatrix.
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], q_frag.at(mt * 16, ks * 16));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          u32 b[4];
          ldmatrix_x4(b, k_frag.at(np * 16, ks * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Elem::mma(s[mt][2 * np], a[mt], b[0], b[1]);
            Elem::mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      if (info.needs_mask(n)) mask.apply(s, first_row + warp_row, n * BLOCK_N);

      // V[n] has landed and every warp is done reading Q and K[n]: prefetch K[n-1] under the
      // softmax and P.V below or, after the last block, the next tile's Q and first K block,
      // so a persistent CTA starts its next tile with its operands already in flight.
      cp_async_wait<0>();
      __syncthreads();
      if (n > 0) {
        load_tile_async<BLOCK_N, ROW_ELEMS, THREADS>(
            sK, k + (n - 1) * BLOCK_N * p.k_row_stride, p.k_row_stride,
            p.seqlen_k - (n - 1) * BLOCK_N, p.head_dim);
        cp_async_commit();
      } else if (next_index < tiles) {
        load_first_tiles(scheduler.at(next_index));
      }

      softmax.update(s, o, p.scale_log2);

      // O += P V. The S accumulator of key tiles 2t and 2t+1 is, element for element, the A
      // fragment of k-step t, so P never leaves registers. V (keys x d, row-major) gives the B
      // fragments through ldmatrix.trans.
#pragma unroll
      for (int kt = 0; kt < BLOCK_N / 16; ++kt) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = Elem::pack(s[mt][2 * kt][0], s[mt][2 * kt][1]);
          a[mt][1] = Elem::pack(s[mt][2 * kt][2], s[mt][2 * kt][3]);
          a[mt][2] = Elem::pack(s[mt][2 * kt + 1][0], s[mt][2 * kt + 1][1]);
          a[mt][3] = Elem::pack(s[mt][2 * kt + 1][2], s[mt][2 * kt + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          u32 b[4];
          ldmatrix_x4_trans(b, v_frag.at(kt * 16, dp * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Elem::mma(o[mt][2 * dp], a[mt], b[0], b[1]);
            Elem::mma(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    // A tile that sees no key skipped the loop and with it the prefetch; nothing reads Q or K
    // now, so the next tile's loads can go out here.
    if (n_end == 0 && next_index < tiles) load_first_tiles(scheduler.at(next_index));

    float lse[MT][2];
    softmax.finalize(o, p.scale_log2, lse);

    // Epilogue straight from registers: shared memory is busy with the next tile's Q and K.
    // Each quad writes 16 contiguous bytes per row, and the two halves of a 32-byte sector come
    // from consecutive stores of the same threads, so L2 merges them before DRAM.
    u16* out = static_cast<u16*>(p.o) + tile.batch * p.o_batch_stride + tile.head * p.o_head_stride;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = first_row + warp_row + mt * 16 + h * 8 + lane / 4;
        if (row >= p.seqlen_q) continue;
        u16* out_row = out + row * p.o_row_stride;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          const int col = dt * 8 + (lane % 4) * 2;
          if (col < p.head_dim) {
            *reinterpret_cast<u32*>(out_row + col) = Elem::pack(o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
          }
        }
        if (lane % 4 == 0) {
          p.lse[(static_cast<i64>(tile.batch) * p.heads + tile.head) * p.seqlen_q + row] = lse[mt][h];
        }
      }
    }

    if (next_index >= tiles) break;
    index = next_index;
    tile = scheduler.at(index);
  }
}

}  // namespace cuflash
