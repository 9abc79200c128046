// FlashAttention-3-style forward for Hopper (sm_90a): one CTA per (query block, head, batch) of a
// producer and CONSUMERS (2 or 3) consumer warpgroups. Warpgroup 0 is the producer: one thread
// loads Q once and streams K and V tiles by TMA into a ring of STAGES shared-memory stages, each
// guarded by a full and an empty mbarrier. The consumers each own 64 query rows: S = Q K^T by wgmma
// from shared memory, the online softmax in registers (common/softmax.cuh, masks from
// common/mask.cuh), P converted to 16 bits in registers, and O += P V by wgmma with P as the
// register operand. Only O and the LSE reach global memory.
//
// e4m3 inputs (Input = e4m3) run the same pipeline on e4m3 wgmma (K = 32): tiles of 64-byte rows
// with TMA's 64-byte swizzle, P in e4m3 registers, and V transposed in shared memory by the
// producer warpgroup's otherwise idle warps (VTranspose), because 8-bit wgmma reads its B operand
// K-major only and V arrives keys x head_dim. The descales scale the scores (common/fp8.cuh,
// ScoreScales) and the final O; the output is Elem.
#include "common/bias.cuh"
#include "common/fp8.cuh"
#include "common/mask.cuh"
#include "common/philox.cuh"
#include "common/seqlen.cuh"
#include "common/softcap.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"
#include "sm90/fwd_params.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tiles.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace cuflash {
namespace sm90 {

constexpr int kConsumerRows = 64;  // one wgmma M per consumer warpgroup
constexpr int kEpilogueBarrier = 1;   // named barrier ids 1..CONSUMERS: one per consumer warpgroup
constexpr int kSchedulerBarrier = 4;  // ids 4..3 + CONSUMERS: consumer c's turn to issue wgmma (PingPong)

// The CTA's warpgroups: the producer, then CONSUMERS consumers of 64 query rows each.
template <int CONSUMERS, bool FP8, bool LEAN_PRODUCER>
struct Warpgroups {
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "named barrier ids above are laid out for at most 3");
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int BLOCK_M = kConsumerRows * CONSUMERS;
  // Registers per thread after setmaxnreg. The CTA starts with 65536 / THREADS per thread (the
  // launch bounds' cap, which ptxas allocates in full for a setmaxnreg kernel: 168 with two
  // consumers, 128 with three); the producer keeps 24, and the consumers share what it frees,
  // rounded down to setmaxnreg's multiple of 8 (240 and 160), so no increase waits for registers
  // that never come. With e4m3 inputs three of the producer's warps transpose V (VTranspose) and
  // keep 56, which leaves the consumers 224 and 152: at 40 (consumers 232) the producer spilled
  // under NVRTC 13.0 in every FP8 instantiation with 128-key blocks. LEAN_PRODUCER keeps 40 where
  // the consumers need the 8 more: d192 under a window mask spilled at 224 (NVRTC 13.5: 4 bytes).
  static constexpr int PRODUCER_REGISTERS = FP8 ? (LEAN_PRODUCER ? 40 : 56) : 24;
  static constexpr int CONSUMER_REGISTERS =
      (65536 / THREADS + (65536 / THREADS - PRODUCER_REGISTERS) / CONSUMERS) / 8 * 8;
};

// FlashAttention-3's ping-pong: the consumer warpgroups take turns, round robin, issuing their
// wgmma, so the tensor cores run one warpgroup's Q K^T and P V while the others compute their
// softmax, instead of every warpgroup's softmax falling into the same gap. A turn is a named
// barrier of two warpgroups: the owner waits on its own (bar.sync, 128 threads), the previous
// warpgroup's arrival (bar.arrive, 128 threads) completes it. All take the same number of turns
// (they walk the same key blocks); the last consumer opens with an arrival that gives consumer 0
// the first turn and leaves out its own last pass, so no arrival is left pending at exit.
template <int CONSUMERS>
struct PingPong {
  int me;
  __device__ __forceinline__ void open() const {
    if (me == CONSUMERS - 1) named_barrier_arrive(kSchedulerBarrier, 256);
  }
  __device__ __forceinline__ void wait_turn() const { named_barrier_sync(kSchedulerBarrier + me, 256); }
  __device__ __forceinline__ void pass_turn() const {
    named_barrier_arrive(kSchedulerBarrier + (me + 1) % CONSUMERS, 256);
  }
  __device__ __forceinline__ void pass_last_turn() const {
    if (me != CONSUMERS - 1) pass_turn();
  }
};

// Shared memory of one CTA, in bytes from a 1024-byte-aligned base: the Q buffers, then the K
// stages, then the V stages, then for e4m3 the stages of V's transpose. A tile of HEAD_DIM columns
// is HEAD_DIM / 64 panels of 64 columns (one swizzle row each, one TMA box each: ROW = 128 bytes
// of 16-bit elements, 128-byte swizzle, or 64 bytes of e4m3, 64-byte swizzle), every panel and
// tile a multiple of 1024 bytes so each starts on a swizzle period, as TMA and the wgmma
// descriptors assume. V's transpose (VTranspose) is BLOCK_N / 64 panels of 64 keys, HEAD_DIM rows
// of 64 bytes each.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, int Q_BUFFERS, bool FP8>
struct FwdSmem {
  static constexpr int PANELS = HEAD_DIM / 64;
  static constexpr u32 ROW = FP8 ? 64 : 128;
  static constexpr u32 Q_PANEL = BLOCK_M * ROW;
  static constexpr u32 KV_PANEL = BLOCK_N * ROW;
  static constexpr u32 Q_BYTES = PANELS * Q_PANEL;
  static constexpr u32 KV_BYTES = PANELS * KV_PANEL;
  static constexpr u32 VT_PANEL = HEAD_DIM * 64;
  static constexpr u32 VT_BYTES = FP8 ? BLOCK_N / 64 * VT_PANEL : 0;
  static constexpr u32 K = Q_BUFFERS * Q_BYTES;
  static constexpr u32 V = K + STAGES * KV_BYTES;
  static constexpr u32 VT = V + STAGES * KV_BYTES;
  static constexpr u32 BYTES = VT + STAGES * VT_BYTES;
  // Whole 64-column panels; K and V tiles of whole swizzle periods (8 rows) and k-steps of P V
  // (16 keys; for e4m3 32, and whole 64-key panels of V's transpose).
  static_assert(HEAD_DIM % 64 == 0 && BLOCK_N % (FP8 ? 64 : 16) == 0, "whole panels, swizzle periods and k-steps");
};

// Where the epilogue stages 16-bit O element (row, col) in a Q buffer of panels `panel_bytes`
// apart: 128-byte rows of 64 columns, or in an e4m3 buffer 64-byte rows of 32.
template <bool FP8>
__device__ __forceinline__ u32 staged_offset(int row, int col, u32 panel_bytes) {
  return FP8 ? swizzled_offset_64(row, col, panel_bytes) : swizzled_offset(row, col, panel_bytes);
}

// The descriptor of a K-major tile as FwdSmem lays it out (sm90/wgmma.cuh).
template <bool FP8>
__device__ __forceinline__ u64 kmajor_desc(const void* tile) {
  return FP8 ? smem_desc_sw64(tile) : smem_desc_sw128(tile);
}

// V's transpose for the e4m3 P V, written by warps 1-3 of the producer warpgroup from a V stage
// (keys x head_dim, 64-byte-swizzled panels of 64 head-dim bytes, as TMA loads it) into a stage
// of Vt (head_dim x keys, FwdSmem), with each k32 slice's keys in the order the e4m3 P registers
// hold them: Vt[d][32 s + L] = V[32 s + e4m3_key(L)][d] (sm90/tiles.cuh, pack_a_e4m3).
//
// A warp's unit is one 16-byte column g of head-dim bytes, across all SLICES k32 slices: per slice
// one ldmatrix.trans (x4), four prmt and one stmatrix (x4), 512 bytes. ldmatrix.trans reads the
// slice's 32 V rows as four 8 x 8 matrices of 16-bit pairs (keys 8m..8m+7, matrix m) and hands
// lane (c, q) = (lane / 4, lane % 4) of each the head-dim bytes 2c, 2c + 1 of keys 8m + 2q and
// 8m + 2q + 1. One prmt of matrices 0 and 1 (2 and 3) gathers head-dim byte 2c (or 2c + 1) of
// keys 2q, 2q + 1, 8 + 2q, 8 + 2q + 1 (16 more): the e4m3_key order of logical keys 4q..4q + 3
// (16 more), so stmatrix writes each register whole as 4 bytes of Vt's row. Its four matrices
// are 8 head-dim rows x 16 keys each; lanes of c >= 4 swap which of their rows 2c, 2c + 1 goes to
// which, so that every matrix's rows are distinct modulo 8 (no bank conflict in either access,
// with the 64-byte swizzle spreading the rest). All addresses are one per-lane offset plus
// compile-time steps per slice: only g moves them at run time. Slices go in pairs (two loads in
// flight, then two stores), which keeps the warps within 40 registers up to 128-key blocks.
template <class Smem, int HEAD_DIM, int BLOCK_N>
struct VTranspose {
  static constexpr int WARPS = 3;
  static constexpr int SLICES = BLOCK_N / 32;
  static constexpr int COLUMNS = HEAD_DIM / 16;
  u32 load;            // V byte offset of key `lane` of slice 0 at chunk 0 of its swizzled row
  u32 store;           // Vt byte offset of this lane's stmatrix row, column 0, for even slices (odd: ^ 32)
  u32 sel_a, sel_b;    // prmt selectors: head-dim byte 2c / 2c + 1, swapped for c >= 4

  __device__ __forceinline__ explicit VTranspose(int lane) {
    load = lane * 64 + (((lane / 2) % 4) << 4);
    // Matrix i = lane / 8 (keys 16 (i / 2) + {0..15}), row j = lane % 8: head-dim row 2j + {0, 1},
    // the odd one for matrix i odd xor j >= 4.
    const int i = lane / 8, j = lane % 8;
    const int row = 2 * j + ((i % 2) ^ (j / 4));
    const u32 off = row * 64 + (((i / 2) ^ ((row / 2) % 4)) << 4);
    store = off;
    sel_a = lane < 16 ? 0x6420u : 0x7531u;
    sel_b = lane < 16 ? 0x7531u : 0x6420u;
  }

  // One stage: every unit of warp `warp` (0..WARPS-1).
  __device__ __forceinline__ void run(const unsigned char* v, unsigned char* vt, u32 warp) const {
    const u32 v_base = smem_addr(v), vt_base = smem_addr(vt);
#pragma unroll 1
    for (u32 g = warp; g < COLUMNS; g += WARPS) {
      const u32 from = v_base + (g / 4) * Smem::KV_PANEL + (load ^ ((g % 4) << 4));
      const u32 to = vt_base + g * 16 * 64;
#pragma unroll
      for (int s0 = 0; s0 < SLICES; s0 += 2) {
        u32 r[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) ldmatrix_x4_trans(r[i], from + (s0 + i) * 32 * 64);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const u32 out[4] = {__byte_perm(r[i][0], r[i][1], sel_a), __byte_perm(r[i][0], r[i][1], sel_b),
                              __byte_perm(r[i][2], r[i][3], sel_a), __byte_perm(r[i][2], r[i][3], sel_b)};
          stmatrix_x4(to + (s0 / 2) * Smem::VT_PANEL + (i ? store ^ 32 : store), out);
        }
      }
    }
  }
};

// S = Q K^T for one warpgroup's 64 rows. Issues only; the caller fences, commits and waits.
template <class Smem, int BLOCK_N, class Elem, int NT>
__device__ __forceinline__ void issue_qk(float (&s)[1][NT][4], u64 q_desc, u64 k_desc) {
  wgmma_ss_panels<BLOCK_N, Elem, Smem::PANELS>(flat(s), q_desc, Smem::Q_PANEL, k_desc, Smem::KV_PANEL);
}

// O += P V: P from registers. 16 bits: V (keys x head_dim, row-major) MN-major for this product,
// a k16 step 16 key rows (2048 bytes). e4m3: V's transpose (VTranspose) K-major, a k32 step 32
// bytes of a 64-key panel. Issues only.
template <class Smem, int HEAD_DIM, class Input, int DT, int KSLICES>
__device__ __forceinline__ void issue_pv(float (&o)[1][DT][4], const u32 (&p)[KSLICES][4], u64 v_desc) {
#pragma unroll
  for (int j = 0; j < KSLICES; ++j) {
    if constexpr (InputStorage<Input>::fp8)
      wgmma_rs<HEAD_DIM, Input>(flat(o), p[j], desc_advance(v_desc, j / 2 * Smem::VT_PANEL + j % 2 * 32), true);
    else
      wgmma_rs<HEAD_DIM, Input, true>(flat(o), p[j], desc_advance(v_desc, 2048 * j), true);
  }
}

// P in the register-A form of P V's k-slices: pairs of 16-bit Elem, or e4m3 quadruples.
template <class Input, class Elem, int NT, int KSLICES>
__device__ __forceinline__ void pack_p(const float (&s)[1][NT][4], u32 (&p)[KSLICES][4]) {
  if constexpr (InputStorage<Input>::fp8)
    pack_a_e4m3(s, p);
  else
    pack_a<Elem>(s, p);
}

// Scores of key block n to unnormalised probabilities: softcap, ALiBi (its slope 0 where the kernel
// has none), the mask if `masked` (this warp's 16 rows start at warp_row), the online softmax's
// running max and sum, then, if `dropout`, the dropped probabilities zeroed (the sums are of the
// undropped P); `correction` is what o must be multiplied by once no P V product writes it any more.
template <int BLOCK_N, bool SOFTCAP, bool CAUSAL, bool WINDOW, int NT, class Softmax, class Scales>
__device__ __forceinline__ void probabilities(float (&s)[1][NT][4], const Mask<CAUSAL, WINDOW>& mask, bool masked,
                                              const Alibi& alibi, bool dropout, const DropoutStream& drop,
                                              Softmax& softmax, const Scales& scales, int n, int warp_row,
                                              float (&correction)[1][2]) {
  if (SOFTCAP) softcap_scores(s, scales.tanh_scale());
  if (alibi.on()) alibi.apply(s, warp_row, n * BLOCK_N);
  if (masked) mask.apply(s, warp_row, n * BLOCK_N);
  softmax.probabilities(s, scales.log2(), correction);
  if (dropout) drop_rows(s, drop, warp_row, n * BLOCK_N, threadIdx.x % 32);
}

// The tile (query block, head, batch) with linear index `tile`, in the order the CTAs take them.
// Causal: query blocks slowest and reversed, so the longest blocks of every head come first and
// the round robin over persistent CTAs hands out the longest work first. Otherwise query blocks
// fastest: CTAs that run together share a head's K and V in L2.
struct TileCoord {
  int m_block, head, batch;
};
template <bool CAUSAL, class Params>
__device__ __forceinline__ TileCoord tile_coord(const Params& p, int tile) {
  if (CAUSAL) {
    const int per_block = p.heads * p.batches;
    return {p.m_blocks - 1 - tile / per_block, tile % p.heads, (tile % per_block) / p.heads};
  }
  return {tile % p.m_blocks, (tile / p.m_blocks) % p.heads, tile / (p.m_blocks * p.heads)};
}

// HEAD_DIM: 64, 128, 192 or 256, whole 64-column panels (the real head_dim may be smaller: TMA
// zero-fills the rest, and the epilogue stores only real columns). CONSUMERS: consumer
// warpgroups, 64 query rows each. BLOCK_N keys per step, STAGES deep K/V ring. CAUSAL, WINDOW: the
// mask (common/mask.cuh); SOFTCAP: tanh-capped scores (common/softcap.cuh). Elem: f16 or bf16,
// the output's type. Input: the type of q, k and v, and of the products: Elem or e4m3.
//
// Persistent: the CTAs walk the tiles round robin (tile_coord); the host sizes the grid (one CTA
// per SM for equal tiles, one per tile where a mask makes them unequal and the hardware's block
// scheduler balances them better). The producer runs ahead across
// tiles: the next tile's K and V stream into the ring while the consumers finish this one.
// Q_BUFFERS (1 or 2) Q buffers take the tiles in turn, and a tile's Q waits only for the epilogue
// of the last tile that used its buffer, which stages O there (q_empty): with two, the next
// tile's Q arrives during this tile's main loop instead of after its epilogue, a latency that
// short tiles (short causal rows, windows) otherwise pay once per tile. Every role walks the
// same tiles and key blocks, so the ring positions, buffers and barrier phases agree without any
// other exchange. SMEM_BYTES: the dynamic shared memory the host launches with
// (dispatch.forward_kernel), checked against Smem below.
template <int HEAD_DIM, int CONSUMERS, int BLOCK_N, int STAGES, int Q_BUFFERS, int SMEM_BYTES, bool CAUSAL, bool WINDOW,
          bool SOFTCAP, class Elem, class Input = Elem>
__global__ void __launch_bounds__(Warpgroups<CONSUMERS, InputStorage<Input>::fp8, HEAD_DIM == 192 && WINDOW>::THREADS, 1)
    flash_fwd_sm90(const __grid_constant__ FwdArgsSm90<Input> p) {
  constexpr bool FP8 = InputStorage<Input>::fp8;
  using Groups = Warpgroups<CONSUMERS, FP8, HEAD_DIM == 192 && WINDOW>;
  constexpr int kBlockM = Groups::BLOCK_M;
  using Smem = FwdSmem<HEAD_DIM, kBlockM, BLOCK_N, STAGES, Q_BUFFERS, FP8>;
  static_assert(Q_BUFFERS == 1 || Q_BUFFERS == 2, "one Q buffer, or two taken by tile parity");
  static_assert(SMEM_BYTES == Smem::BYTES + kSmemAlignSlack, "the host's shared memory differs from FwdSmem");
  constexpr int NT = BLOCK_N / 8;   // 8-key column tiles of S
  constexpr int DT = HEAD_DIM / 8;  // 8-column tiles of O
  constexpr int KSLICES = FP8 ? NT / 4 : NT / 2;  // k-slices of P V: 32 keys for e4m3, else 16
  typedef typename FwdArgs<Input>::type Base;  // FwdParams, or FwdParamsFp8 with the descales
  const Base& a = p.base;
  // ALiBi (common/bias.cuh) in the causal and window kernels of two consumers (causal ALiBi calls
  // keep the causal kernel's grid order and unmasked steps): with three (d64, 160 registers each)
  // its distances spill, so d64 ALiBi calls take the two-consumer tile (dispatch.forward_kernel)
  // and the three-consumer kernels compile no trace of it. The e4m3 d192 kernels spill with it
  // too: their ALiBi calls run sm80's e4m3 kernel (dispatch.forward_choice).
  constexpr bool ALIBI = (CAUSAL || WINDOW) && CONSUMERS == 2 && !(FP8 && HEAD_DIM == 192);
  // Dropout (common/philox.cuh) in the window kernels of two consumers, 16-bit inputs only: its
  // Philox calls need registers the three-consumer split does not have, so d64 dropout calls take
  // the two-consumer tile too.
  constexpr bool DROPOUT = WINDOW && CONSUMERS == 2 && !FP8;

  // Full barriers: one arrival (the producer's expect_tx) plus the tile's bytes. Empty barriers:
  // one arrival per consumer warp once its warpgroup is done with the buffer (for K and V: its
  // wgmma have read the stage; for Q: its epilogue has read O back out of Q's buffer). e4m3: V's
  // stages go to the transposing warps (v_empty: one arrival per warp once it has read the stage),
  // which hand the consumers V's transpose (vt_full: one arrival per warp; vt_empty as v_empty of
  // 16-bit inputs).
  __shared__ u64 q_full[Q_BUFFERS], q_empty[Q_BUFFERS];
  __shared__ u64 k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  __shared__ u64 vt_full[FP8 ? STAGES : 1], vt_empty[FP8 ? STAGES : 1];
  // The barriers of P V's B operand.
  u64* const pv_full = FP8 ? vt_full : v_full;
  u64* const pv_empty = FP8 ? vt_empty : v_empty;
  using Transpose = VTranspose<Smem, HEAD_DIM, BLOCK_N>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem =
      smem_raw + ((kSmemAlignSlack - (smem_addr(smem_raw) & (kSmemAlignSlack - 1))) & (kSmemAlignSlack - 1));

  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < Q_BUFFERS; ++b) {
      mbarrier_init(&q_full[b], 1);
      mbarrier_init(&q_empty[b], CONSUMERS * 4);
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], CONSUMERS * 4);
      mbarrier_init(&v_empty[s], FP8 ? Transpose::WARPS : CONSUMERS * 4);
      if constexpr (FP8) {
        mbarrier_init(&vt_full[s], Transpose::WARPS);
        mbarrier_init(&vt_empty[s], CONSUMERS * 4);
      }
    }
    mbarrier_init_fence();
  }
  // Publishes the initialised barriers before anyone arrives or waits; the last CTA-wide barrier.
  __syncthreads();

  if (threadIdx.x < 128) {
    // Producer warpgroup. Only thread 0 issues copies; for e4m3 warps 1-3 transpose V; the rest
    // give their registers away and leave.
    setmaxnreg_dec<Groups::PRODUCER_REGISTERS>();
    if constexpr (FP8) {
      if (threadIdx.x >= 32) {
        // The same tiles and key blocks as the copies below, so the same ring positions.
        const Transpose transpose(threadIdx.x % 32);
        const int warp = threadIdx.x / 32 - 1;
        RingPosition<STAGES> pos;
        for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
          const TileCoord c = tile_coord<CAUSAL>(p, tile);
          const Sequence seq = sequence_of(a, c.batch);
          if (c.m_block * kBlockM >= seq.seqlen_q) continue;
          const Mask<CAUSAL, WINDOW> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, a.window_left, a.window_right};
          const BlockRange n_range = key_blocks<kBlockM, BLOCK_N>(mask, c.m_block);
          for (int n = n_range.end - 1; n >= n_range.begin; --n, pos.advance()) {
            mbarrier_wait(&v_full[pos.stage], pos.phase);
            mbarrier_wait(&vt_empty[pos.stage], pos.phase ^ 1);
            __syncwarp();
            transpose.run(smem + Smem::V + pos.stage * Smem::KV_BYTES, smem + Smem::VT + pos.stage * Smem::VT_BYTES,
                          warp);
            // The consumers' wgmma read the transpose through the async proxy, and the next V copy
            // overwrites what these threads read: each fences its accesses before its warp arrives.
            fence_proxy_async_shared();
            __syncwarp();
            if (threadIdx.x % 32 == 0) {
              mbarrier_arrive(&v_empty[pos.stage]);
              mbarrier_arrive(&vt_full[pos.stage]);
            }
          }
        }
        return;
      }
    }
    if (threadIdx.x != 0) return;
    prefetch_tensor_map(&p.q);
    prefetch_tensor_map(&p.k);
    prefetch_tensor_map(&p.v);
    RingPosition<STAGES> pos;
    int tiles_done = 0;  // tiles with rows, each ending in an epilogue that hands its Q buffer back
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
      const TileCoord c = tile_coord<CAUSAL>(p, tile);
      const Sequence seq = sequence_of(a, c.batch);
      const int first_row = c.m_block * kBlockM;
      if (first_row >= seq.seqlen_q) continue;  // past a packed sequence's end: no rows
      const Mask<CAUSAL, WINDOW> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, a.window_left, a.window_right};
      const BlockRange n_range = key_blocks<kBlockM, BLOCK_N>(mask, c.m_block);
      // This tile's Q buffer is free once every consumer warp has finished the epilogue of the
      // last tile that used it (a fresh barrier's parity-1 phase counts as complete, so the first
      // use does not wait).
      const int q_buffer = tiles_done % Q_BUFFERS;
      mbarrier_wait(&q_empty[q_buffer], ((tiles_done++ / Q_BUFFERS) & 1) ^ 1);
      if (n_range.begin >= n_range.end) continue;  // no keys: the consumers write zeros, nothing to load
      // A packed batch's maps have one batch of all rows; its sequences are row offsets.
      const int map_batch = a.cu_seqlens_q == nullptr ? c.batch : 0;
      const int kv_head = c.head / a.kv_group;
      // Rows past the tensor's end arrive as zeros (TMA's out-of-bounds fill); rows past a packed
      // sequence's end arrive from the next sequence and are never used (query rows: not stored;
      // key rows: masked to -inf, so P is 0 there).
      mbarrier_arrive_expect_tx(&q_full[q_buffer], Smem::Q_BYTES);
      tma_load_panels<Smem::PANELS>(smem + q_buffer * Smem::Q_BYTES, Smem::Q_PANEL, &p.q, &q_full[q_buffer], c.head,
                                    seq.q_begin + first_row, map_batch);

      // Key blocks from the last to the first, as the consumers take them (see there).
      for (int n = n_range.end - 1; n >= n_range.begin; --n, pos.advance()) {
        const int key_row = seq.k_begin + n * BLOCK_N;
        const u32 offset = pos.stage * Smem::KV_BYTES;
        // Wait for the consumers to release this stage's previous tile (the first lap does not
        // wait, as above), announce the bytes, copy.
        mbarrier_wait(&k_empty[pos.stage], pos.phase ^ 1);
        mbarrier_arrive_expect_tx(&k_full[pos.stage], Smem::KV_BYTES);
        tma_load_panels<Smem::PANELS>(smem + Smem::K + offset, Smem::KV_PANEL, &p.k, &k_full[pos.stage], kv_head,
                                      key_row, map_batch);
        mbarrier_wait(&v_empty[pos.stage], pos.phase ^ 1);
        mbarrier_arrive_expect_tx(&v_full[pos.stage], Smem::KV_BYTES);
        tma_load_panels<Smem::PANELS>(smem + Smem::V + offset, Smem::KV_PANEL, &p.v, &v_full[pos.stage], kv_head,
                                      key_row, map_batch);
      }
    }
  } else {
    // Consumer warpgroups: warps 4-7, 8-11 (and 12-15), warpgroup-aligned as wgmma requires.
    setmaxnreg_inc<Groups::CONSUMER_REGISTERS>();
    const int consumer = threadIdx.x / 128 - 1;
    const int t = threadIdx.x % 128;
    const int warp = t / 32;
    const int lane = t % 32;
    const int wg_row = consumer * kConsumerRows;  // this warpgroup's first row inside the block
    // This warpgroup's 64 rows of each panel of the first Q buffer: an A operand starting 64 rows
    // (8 swizzle periods) into the panel.
    const u64 q_desc_first = kmajor_desc<FP8>(smem + wg_row * Smem::ROW);
    const PingPong<CONSUMERS> turns{consumer};
    // P V's B operand in ring stage `stage`: V read MN-major, or V's transpose K-major.
    const auto pv_desc = [&](int stage) {
      if constexpr (FP8)
        return smem_desc_sw64(smem + Smem::VT + stage * Smem::VT_BYTES);
      else
        return smem_desc_sw128_mn(smem + Smem::V + stage * Smem::KV_BYTES, Smem::KV_PANEL);
    };
    RingPosition<STAGES> k_pos, v_pos;
    int tiles_done = 0;  // tiles with rows, as the producer counts them: they pick the Q buffer
    u32 q_phases = 0;    // bit b: the parity of buffer b's next Q copy (tiles without keys load none)

    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
      const TileCoord c = tile_coord<CAUSAL>(p, tile);
      const Sequence seq = sequence_of(a, c.batch);
      const int first_row = c.m_block * kBlockM;
      if (first_row >= seq.seqlen_q) continue;
      const Mask<CAUSAL, WINDOW> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, a.window_left, a.window_right};
      const BlockRange n_range = key_blocks<kBlockM, BLOCK_N>(mask, c.m_block);
      const int q_buffer = tiles_done++ % Q_BUFFERS;
      unsigned char* const q_tile = smem + q_buffer * Smem::Q_BYTES;

      const ScoreScales<Base, SOFTCAP> scales(a, c.batch, c.head / a.kv_group);
      // ALiBi's slope is read again at each step (an L1 hit) rather than held across the loop, one
      // register fewer where the e4m3 kernels have none to spare.
      const auto alibi = [&] {
        return Alibi{ALIBI ? alibi_slope(a, c.batch, c.head, scales.log2()) : 0.f, mask.diagonal_offset};
      };
      const bool dropout = DROPOUT && dropout_on(a);
      const DropoutStream drop = dropout_stream(a, c.batch, p.heads, c.head);
      float o[1][DT][4];
      clear(o);
      OnlineSoftmax<1, FP8 ? 8 : 0, FP8> softmax;  // e4m3 P in [0, 256]; the max as a tree (common/softmax.cuh)
      softmax.init();
      if (n_range.begin < n_range.end) {
        mbarrier_wait(&q_full[q_buffer], (q_phases >> q_buffer) & 1);
        q_phases ^= 1u << q_buffer;
        const u64 q_desc = desc_advance(q_desc_first, q_buffer * Smem::Q_BYTES);
        const int warp_row = first_row + wg_row + warp * 16;
        const int m64_block = CONSUMERS * c.m_block + consumer;  // this warpgroup's rows as a 64-row block
        float s[1][NT][4];
        u32 pv_a[KSLICES][4];
        float correction[1][2];
        // Key blocks from the last to the first: the blocks that need masking (the diagonal and
        // the sequence end) come first, a window's left edge last.
        int n = n_range.end - 1;
        turns.open();

        // The first block: S, then P (o is still zero, so its correction is moot).
        mbarrier_wait(&k_full[k_pos.stage], k_pos.phase);
        __syncwarp();  // reconverge after the spin: wgmma is .aligned
        turns.wait_turn();
        wgmma_fence();
        issue_qk<Smem, BLOCK_N, Input>(s, q_desc, kmajor_desc<FP8>(smem + Smem::K + k_pos.stage * Smem::KV_BYTES));
        wgmma_commit();
        turns.pass_turn();
        fence_registers(flat(s));
        wgmma_wait<0>();
        fence_registers(flat(s));
        // The tensor cores are done with this K stage: one arrival per warp hands it back.
        if (lane == 0) mbarrier_arrive(&k_empty[k_pos.stage]);
        probabilities<BLOCK_N, SOFTCAP>(s, mask, needs_mask<kConsumerRows, BLOCK_N>(mask, m64_block, n), alibi(),
                                        dropout, drop, softmax, scales, n, warp_row, correction);
        pack_p<Input, Elem>(s, pv_a);
        k_pos.advance();

        // Each step issues S of block n and then P V of block n + 1 (FlashAttention-3's
        // intra-warpgroup overlap): the softmax of block n runs while the tensor cores still
        // multiply P V, and the rescale of o waits for that product. The two calls below inline
        // the step twice, with the mask and without: a mask test inside the step, even one that
        // never passes, shapes ptxas's schedule of every step.
        const auto step = [&](bool masked) {
          mbarrier_wait(&k_full[k_pos.stage], k_pos.phase);
          mbarrier_wait(&pv_full[v_pos.stage], v_pos.phase);
          __syncwarp();
          turns.wait_turn();
          wgmma_fence();  // s was read by the softmax, o rescaled and pv_a packed by ordinary instructions
          issue_qk<Smem, BLOCK_N, Input>(s, q_desc, kmajor_desc<FP8>(smem + Smem::K + k_pos.stage * Smem::KV_BYTES));
          wgmma_commit();
          issue_pv<Smem, HEAD_DIM, Input>(o, pv_a, pv_desc(v_pos.stage));
          wgmma_commit();
          turns.pass_turn();
          fence_registers(flat(s));
          fence_registers(flat(o));
          fence_registers(pv_a);
          wgmma_wait<1>();  // groups complete in order: S is done, P V may still run
          fence_registers(flat(s));
          if (lane == 0) mbarrier_arrive(&k_empty[k_pos.stage]);
          probabilities<BLOCK_N, SOFTCAP>(s, mask, masked, alibi(), dropout, drop, softmax, scales, n, warp_row,
                                          correction);
          wgmma_wait<0>();  // P V is done: o may be rescaled and pv_a refilled
          fence_registers(flat(o));
          fence_registers(pv_a);
          if (lane == 0) mbarrier_arrive(&pv_empty[v_pos.stage]);
          softmax.rescale(o, correction);
          pack_p<Input, Elem>(s, pv_a);
          k_pos.advance();
          v_pos.advance();
        };
        // Three consumers (d64, 160 registers each) keep one step with the test inside: two copies
        // do not pay there (docs/kernels.md). Otherwise, without a causal or window mask only the
        // sequence's last key block needs one, and the walk takes it first; with one, the test is
        // the whole tile's, uniform across the CTA: a branch around wgmma on a value that ptxas
        // cannot prove warp-uniform (this warpgroup's rows) would serialise every wgmma of the
        // kernel. Rows of the tile that need no mask in a masked step lose nothing to it but time.
        for (--n; n >= n_range.begin; --n) {
          if (CONSUMERS == 3) {
            step(needs_mask<kConsumerRows, BLOCK_N>(mask, m64_block, n));
          } else if ((CAUSAL || WINDOW) && needs_mask<kBlockM, BLOCK_N>(mask, c.m_block, n)) {
            step(true);
          } else {
            step(false);
          }
        }

        // P V of the last block.
        mbarrier_wait(&pv_full[v_pos.stage], v_pos.phase);
        __syncwarp();
        turns.wait_turn();
        wgmma_fence();
        issue_pv<Smem, HEAD_DIM, Input>(o, pv_a, pv_desc(v_pos.stage));
        wgmma_commit();
        turns.pass_last_turn();
        fence_registers(flat(o));
        fence_registers(pv_a);
        wgmma_wait<0>();
        fence_registers(flat(o));
        if (lane == 0) mbarrier_arrive(&pv_empty[v_pos.stage]);
        v_pos.advance();
      }

      float lse[1][2];
      softmax.finalize(o, scales.log2(), lse, sink_log2(a, c.head));
      if (dropout) scale(o, a.dropout_scale);  // the kept P's 1 / (1 - p)
      if constexpr (FP8) {
        // Read here rather than held across the main loop.
        scale(o, v_descale(a, c.batch, c.head / a.kv_group));
      }

      // Epilogue: stage O in this warpgroup's own rows of the tile's Q buffer (its last wgmma has
      // read them), then write whole 16-byte chunks of the rows that exist. Ordinary stores, not a
      // TMA store: a packed sequence's last block must not write the next sequence's rows. An e4m3
      // Q buffer holds half of O's 16-bit bytes: O passes through it in two halves of its columns
      // (64-byte rows of 32 columns per panel), where a buffer of its own would not fit beside the
      // ring at d256.
      constexpr int PASSES = FP8 ? 2 : 1;
      constexpr int PASS_DT = DT / PASSES;
#pragma unroll
      for (int pass = 0; pass < PASSES; ++pass) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wg_row + warp * 16 + h * 8 + lane / 4;
#pragma unroll
          for (int dt = 0; dt < PASS_DT; ++dt)
            *reinterpret_cast<u32*>(q_tile + staged_offset<FP8>(row, dt * 8 + (lane % 4) * 2, Smem::Q_PANEL)) =
                Elem::pack(o[0][pass * PASS_DT + dt][2 * h], o[0][pass * PASS_DT + dt][2 * h + 1]);
          const int global_row = first_row + row;
          if (pass == 0 && lane % 4 == 0 && global_row < seq.seqlen_q && a.lse != nullptr)
            a.lse[c.batch * a.lse_batch_stride + c.head * a.lse_head_stride + seq.q_begin + global_row] = lse[0][h];
        }
        // The warpgroup's rows are written by all four of its warps and read across them.
        named_barrier_sync(kEpilogueBarrier + consumer, 128);

        u16* const out = static_cast<u16*>(a.o) + c.batch * a.o_batch_stride + c.head * a.o_head_stride +
                         seq.q_begin * a.o_row_stride + pass * (HEAD_DIM / PASSES);
        constexpr int CHUNKS_PER_ROW = HEAD_DIM / PASSES / 8;
#pragma unroll
        for (int i = t; i < kConsumerRows * CHUNKS_PER_ROW; i += 128) {
          const int row = wg_row + i / CHUNKS_PER_ROW;
          const int col = (i % CHUNKS_PER_ROW) * 8;
          const int global_row = first_row + row;
          if (global_row < seq.seqlen_q && pass * (HEAD_DIM / PASSES) + col < a.head_dim_v)
            *reinterpret_cast<uint4*>(out + global_row * a.o_row_stride + col) =
                *reinterpret_cast<const uint4*>(q_tile + staged_offset<FP8>(row, col, Smem::Q_PANEL));
        }
        // The next pass, and a later tile's epilogue, write these rows again, and a tile without
        // keys does so without waiting for a Q copy (q_full), so the whole warpgroup must have
        // read them first.
        named_barrier_sync(kEpilogueBarrier + consumer, 128);
      }
      // Hand the Q buffer back: its next Q copy (async proxy) overwrites what these threads wrote
      // and read here (generic proxy), so each fences its accesses before its warp arrives.
      fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&q_empty[q_buffer]);
    }
  }
}

}  // namespace sm90
}  // namespace cuflash
