// FlashAttention-3-style backward for Hopper (sm_90a), the main kernel between the preprocess
// (delta = rowsum(dO * O)) and convert (fp32 dQ to 16 bits) kernels of generic/flash_bwd_helpers.cu.
// One CTA per (key block, head, batch) of three warpgroups. Warpgroup 0 is the producer: one
// thread loads K and V once and streams the Q and dO blocks of 64 query rows by TMA through a ring
// of STAGES stages. Warpgroups 1 and 2 are consumers, with dK and dV in registers for the whole
// loop. Per query block, in the transposed orientation so that the keys are wgmma's M:
//   S^T = K Q^T and dP^T = V dO^T   (shared-memory wgmma),
//   P^T = exp2(S^T scale log2(e) - lse log2(e)), dS^T = P^T (dP^T - delta)   (registers),
//   dV += P^T dO and dK += dS^T Q   (Q and dO read MN-major as stored),
//   dQ += dS K   (dS through shared memory, both operands MN-major; the fp32 block staged in
//                 shared memory and added to global by one bulk reduction, which warp 1 of
//                 the producer warpgroup issues).
// Two ways to share the work between the consumers (BwdLayout):
//  - up to head dim 128, and q/k 192 with v 128, blocks of 128 keys, each consumer owning 64 of
//    them for the whole step: its S^T and dP^T cover all 64 queries (at (192, 128) in two halves
//    of 32), P^T and dS^T feed dV and dK from registers, and dQ's column panels are split between
//    the consumers;
//  - v's head dim 256, blocks of 64 keys that both consumers own, each holding half of the
//    head dim's columns of dK, dV and dQ (64 + 64 + 64 fp32 registers per thread; 64 keys x 256
//    columns of dK and dV alone would be 256). Each computes S^T and dP^T for half of the query
//    block's 64 rows and stages its half of P^T and dS^T in shared memory, from where dV and dK
//    read all of them.
// P is recomputed from the forward's log-sum-exp; no buffer grows with seqlen_q x seqlen_k.
// How the key blocks' dQ terms meet (DQ_ORDER, dispatch.DQ_ORDERS):
//  - any order (default mode): one CTA per key block, bulk reductions into one fp32 dQ per head.
//  - walk (deterministic mode's short causal sequences at head dim 64): grid (dq_splits, heads,
//    batch); CTA s walks one key block of each round of dq_splits consecutive ones (K and V
//    reloaded per block) and adds dQ into its own fp32 split, each element from one thread in
//    program order (the convert kernel adds the splits in order), which amortises each CTA's
//    start over its blocks.
//  - turns (deterministic mode): the default grid, each query block's reductions applied in
//    key-block order. A counter per (batch, head, query block) holds how many key blocks have
//    added theirs; the writer warp waits for its CTA's turn before each reduction and passes the
//    turn on once the reduction is complete. The CTAs of a head share one dQ, which stays in L2
//    (the walk's per-CTA splits miss it on long sequences). Query blocks run from the last, which
//    every causal key block sees, so each key block trails the one before it by a reduction
//    rather than by the query blocks only that one sees. GQA's dK and dV are stored per query
//    head and summed in order by the convert kernel.
// The walk and turns repeat bitwise (dispatch.dq_order picks between them).
#include "common/bias.cuh"
#include "common/mask.cuh"
#include "common/philox.cuh"
#include "common/seqlen.cuh"
#include "common/softcap.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"
#include "sm90/bwd_params.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tiles.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace cuflash {
namespace sm90 {

constexpr int kBwdThreads = 384;  // producer + two consumer warpgroups
constexpr int kBwdBlockM = 64;    // query rows per step
constexpr int kDsBarrier = 1;     // named barrier of both consumers (256 threads): dS is in shared memory
constexpr int kStatsBarrier = 2;  // ids 2 and 3: one consumer warpgroup's staged lse and delta
constexpr int kDqFullBarrier = 4;   // the staged dQ block is ready for the writer warp
constexpr int kDqEmptyBarrier = 5;  // the writer's reduction has read it
// DQ_ORDER values, mirrored by dispatch.DQ_ORDERS.
constexpr int kDqAnyOrder = 0;
constexpr int kDqWalk = 1;
constexpr int kDqTurns = 2;
// fp32 dQ rows (global and staged) are the head-dim bucket plus 4 unused columns: 16 bytes of skew
// put the 8 rows a warp's accumulator stores touch at once in different banks. Mirrored by
// dispatch.SM90_BWD_DQ_ROW_PAD, which the host's shared-memory size (SMEM_BYTES) checks.
constexpr int kDqRowPad = 4;
// Registers after setmaxnreg, as in the forward: 168 at entry, the producer's freed 144 x 128
// are the consumers' extra 72 x 256.
constexpr int kBwdProducerRegisters = 24;
constexpr int kBwdConsumerRegisters = 240;

// The consumers' shares (above) and the shared memory, from a 1024-byte-aligned base: K, V, the Q
// and dO stages, two tiles of BLOCK_N keys x 64 queries (dS^T by step parity, or dS^T and P^T when
// the consumers split the head dim), the fp32 dQ block (kBwdBlockM rows of HEAD_DIM + kDqRowPad). Tiles are panels of 64 columns (one 128-byte swizzle
// row each), as TMA stores them: HEAD_DIM / 64 of Q and K, HEAD_DIM_V / 64 of V and dO; a dS^T or
// P^T tile is one such panel.
// At (192, 128) a consumer's dK and dV are 96 + 64 fp32 registers per thread, which leaves room
// for S^T and dP^T over 32 of the 64 queries at a time: QUERY_HALVES products of each per step.
// dQ's three panels go two to one consumer and one to the other, alternating by step parity.
template <int HEAD_DIM, int HEAD_DIM_V, int STAGES>
struct BwdLayout {
  static_assert((HEAD_DIM == HEAD_DIM_V && (HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256)) ||
                    (HEAD_DIM == 192 && HEAD_DIM_V == 128),
                "head dims 64, 128 and 256, and q/k 192 with v 128");
  static constexpr bool SPLIT_DIMS = HEAD_DIM_V > 128;
  static constexpr int BLOCK_N = SPLIT_DIMS ? 64 : 128;  // keys per CTA
  static constexpr int GROUP_KEYS = SPLIT_DIMS ? 0 : 64;  // key offset of consumer 1
  static constexpr int PANELS = HEAD_DIM / 64;            // of Q and K
  static constexpr int V_PANELS = HEAD_DIM_V / 64;        // of V and dO
  static constexpr int QUERY_HALVES = !SPLIT_DIMS && HEAD_DIM > 128 ? 2 : 1;
  // Of S^T, per product: with the head dim split, each consumer's half of the queries.
  static constexpr int QUERY_COLS = SPLIT_DIMS || QUERY_HALVES == 2 ? kBwdBlockM / 2 : kBwdBlockM;
  static constexpr int V_DIMS = SPLIT_DIMS ? HEAD_DIM_V / 2 : HEAD_DIM_V;  // of dV, per consumer
  static constexpr int DK_DIMS = SPLIT_DIMS ? HEAD_DIM / 2 : HEAD_DIM;     // of dK, per consumer
  static constexpr int DQ_DIMS = SPLIT_DIMS ? HEAD_DIM / 2 : 64;           // of dQ, per product
  static constexpr int DQ_CONSUMERS = PANELS > 1 ? 2 : 1;                  // 1 at head dim 64
  static constexpr u32 KV_PANEL = BLOCK_N * 128;
  // Query rows per stage of the Q/dO ring: at (192, 128) a half's, so that three half stages fit
  // where two whole ones do not, and a half's stage is refilled once that half's dV and dK are done.
  static constexpr int RING_ROWS = QUERY_HALVES == 2 ? kBwdBlockM / 2 : kBwdBlockM;
  static constexpr u32 QD_PANEL = RING_ROWS * 128;
  static constexpr u32 K_BYTES = PANELS * KV_PANEL;
  static constexpr u32 V_BYTES = V_PANELS * KV_PANEL;
  static constexpr u32 Q_BYTES = PANELS * QD_PANEL;
  static constexpr u32 DO_BYTES = V_PANELS * QD_PANEL;
  static constexpr u32 DS_BYTES = BLOCK_N * 128;
  static constexpr u32 K = 0;
  static constexpr u32 V = K_BYTES;
  static constexpr u32 Q = K_BYTES + V_BYTES;
  static constexpr u32 DO = Q + STAGES * Q_BYTES;
  static constexpr u32 DS = DO + STAGES * DO_BYTES;
  static constexpr int DQ_ROW = HEAD_DIM + kDqRowPad;
  static constexpr u32 DQ = DS + 2 * DS_BYTES;
  static constexpr u32 BYTES = DQ + kBwdBlockM * DQ_ROW * 4;
};

// Adds (a, b) to the two adjacent fp32 values at `address` (8-byte aligned) in global memory:
// GQA's dK and dV, once per key block.
__device__ __forceinline__ void reduce_add_pair(float* address, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(address), "f"(a), "f"(b) : "memory");
}

// Waits until `counter` (a query block's turn: how many key blocks have added their dQ terms)
// reaches `turn`. Acquire, then a proxy fence: the earlier turns' reductions are complete before
// this thread's bulk reduction (an async-proxy access) is issued.
__device__ __forceinline__ void wait_for_turn(const int* counter, int turn) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  } while (seen != turn);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Passes the turn on once this thread's bulk reductions have completed (tma_store_wait<0>): the
// proxy fence orders their writes before the release.
__device__ __forceinline__ void pass_turn(int* counter) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// HEAD_DIM, HEAD_DIM_V: 64, 128 or 256 both, or 192 and 128 (the real head dims may be smaller: TMA
// zero-fills, stores check columns).
// STAGES: depth of the Q/dO ring. CAUSAL, WINDOW: the mask (common/mask.cuh; a window's key
// blocks see only the query blocks its range reaches); SOFTCAP: tanh-capped scores
// (common/softcap.cuh), which run the window kernel for every mask (dispatch.backward_kernels).
// DQ_ORDER: kDqAnyOrder, kDqWalk or kDqTurns (above). Elem: f16 or bf16. SMEM_BYTES: the dynamic
// shared memory the host launches with (dispatch.backward_kernels), checked against BwdLayout.
template <int HEAD_DIM, int HEAD_DIM_V, int STAGES, int SMEM_BYTES, bool CAUSAL, bool WINDOW, bool SOFTCAP, int DQ_ORDER,
          class Elem>
__global__ void __launch_bounds__(kBwdThreads, 1) flash_bwd_sm90(const __grid_constant__ BwdParamsSm90 p) {
  using L = BwdLayout<HEAD_DIM, HEAD_DIM_V, STAGES>;
  static_assert(SMEM_BYTES == L::BYTES + kSmemAlignSlack, "the host's shared memory differs from BwdLayout");
  constexpr bool WALK = DQ_ORDER == kDqWalk;
  constexpr bool TURNS = DQ_ORDER == kDqTurns;
  // The consumer warpgroups computing dQ (at head_dim 64 only the first) and the writer warp.
  constexpr int kDqWriterThreads = 128 * L::DQ_CONSUMERS + 32;
  constexpr int DK_T = L::DK_DIMS / 8;  // a consumer's 8-column tiles of dK (at most) and dV
  constexpr int DV_T = L::V_DIMS / 8;
  const BwdParams& a = p.base;

  // Per consumer warpgroup, two buffers by step parity: the block's lse, then its delta (both 0 for
  // rows past the sequence), staged so that the softmax reads shared memory rather than holding 32
  // hoisted global loads in registers.
  __shared__ float stats[2][2][2 * kBwdBlockM];
  __shared__ u64 kv_full, kv_empty;
  // With the head dim split, Q and dO of a stage have their own barriers: the consumers are done
  // with Q (dK) before dO (dV), and the producer refills each as soon as it is free. Otherwise the
  // q barriers guard both (one wait and one arrival fewer per step).
  __shared__ u64 q_full[STAGES], q_empty[STAGES], do_full[STAGES], do_empty[STAGES];
  u64* const dout_full = L::SPLIT_DIMS ? do_full : q_full;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem =
      smem_raw + ((kSmemAlignSlack - (smem_addr(smem_raw) & (kSmemAlignSlack - 1))) & (kSmemAlignSlack - 1));

  // One key block per CTA, a head's key blocks adjacent in the grid: (key blocks, heads, batch);
  // walking CTAs walk theirs (above). Under a causal mask each walks its query blocks from the
  // last, which every key block sees, so a head's CTAs read the same Q and dO block at once, from
  // L2. sm80's order (causal key blocks slowest, longest first, each walking up from its diagonal)
  // reads them from memory, which costs most at d256, where one Q/dO stage hides little of a
  // load (docs/kernels.md). Taking turns relies on the order of the grid: a
  // CTA waits only for key blocks of lower index, dispatched before it.
  // Without a causal mask, turns interleave the key blocks of a group of turn_heads heads, key
  // block slowest: grid (key blocks x turn_heads, head groups, batch). CTAs that start together
  // then belong to different heads or are a head's consecutive key blocks, started in order, so
  // no head's CTAs queue at their first query block behind each other, as they do with one head's
  // key blocks adjacent in the grid (docs/kernels.md, determinism).
  // A packed batch's CTAs past a shorter sequence, and a last group's past the heads, leave at once.
  constexpr bool GROUPED = TURNS && !CAUSAL;
  constexpr bool LAST_FIRST = TURNS || (CAUSAL && !WALK);
  const int head = GROUPED ? blockIdx.y * a.turn_heads + blockIdx.x % a.turn_heads : blockIdx.y;
  const int batch = blockIdx.z;
  const Sequence seq = sequence_of(a, batch);
  const int n_blocks = (seq.seqlen_k + L::BLOCK_N - 1) / L::BLOCK_N;
  const int n_first = GROUPED ? blockIdx.x / a.turn_heads : blockIdx.x;
  const int n_stride = WALK ? a.dq_splits : n_blocks;
  if (n_first >= n_blocks || head >= a.heads) return;
  // The key block of the walk's round `round`: block s of even rounds and block dq_splits - 1 - s
  // of odd ones, so that under a causal mask, where a block's work falls as its index grows,
  // every CTA's total is nearly the same (in plain order CTA 0 has the most in every round).
  const auto walk_block = [&](int round) {
    return round * n_stride + (WALK && (round & 1) ? n_stride - 1 - n_first : n_first);
  };
  // The i-th query block of a key block's range (the last first: above).
  const auto query_block = [](const BlockRange& range, int i) { return LAST_FIRST ? range.end - 1 - i : range.begin + i; };
  const Mask<CAUSAL, WINDOW> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, a.window_left, a.window_right};
  // ALiBi (window kernels): the forward's bias on each score after the tanh; dS needs nothing more.
  const Alibi alibi{WINDOW ? alibi_slope(a, batch, head, a.scale_log2) : 0.f, mask.diagonal_offset};
  // Dropout (common/philox.cuh) in the window kernels without softcap, as ALiBi; read from the
  // params where used, not held across the loop. With a softcap its mask's register, live across
  // the tanh, spilled: dispatch.backward_launch gives dropout calls with softcap sm80's kernel.
  // dp_scale: 1 / (1 - p) on dP's kept elements and on dV, 1 without.
  const auto dropout = [&] { return WINDOW && !SOFTCAP && dropout_on(a); };
  const auto dp_scale = [&] { return dropout() ? a.dropout_scale : 1.f; };
  const int kv_head = head / a.kv_group;

  if (threadIdx.x == 0) {
    mbarrier_init(&kv_full, 1);
    mbarrier_init(&kv_empty, 2 * 4);  // one arrival per consumer warp
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&q_full[s], 1);
      mbarrier_init(&do_full[s], 1);
      mbarrier_init(&q_empty[s], 2 * 4);  // one arrival per consumer warp
      mbarrier_init(&do_empty[s], 2 * 4);
    }
    mbarrier_init_fence();
  }
  // Publishes the initialised barriers before anyone arrives or waits; the last CTA-wide barrier.
  __syncthreads();

  float* const dq_block = reinterpret_cast<float*>(smem + L::DQ);
  if (threadIdx.x < 128) {
    // Producer warpgroup: thread 0 issues every copy, warp 1 writes dQ; the rest give their
    // registers away.
    setmaxnreg_dec<kBwdProducerRegisters>();
    if (threadIdx.x / 32 == 1) {
      // The dQ writer: adds each staged block into global memory, so that the consumers only
      // stage it and never issue, or wait for, a reduction inside their step. The walk's split
      // and the turn counters as above.
      const int split = WALK ? blockIdx.x : 0;
      float* const dq = a.dq_accum + split * a.dq_split_stride + batch * a.dq_batch_stride + head * a.dq_head_stride;
      int* const turns = TURNS ? a.dq_turns + (static_cast<i64>(batch) * a.heads + head) * a.dq_turn_blocks : nullptr;
      const bool elected = threadIdx.x % 32 == 0;
      // The staging block starts free; then one arrival per reduction that has read it (the
      // consumers wait once more at the end, matching the count).
      named_barrier_arrive(kDqEmptyBarrier, kDqWriterThreads);
      for (int round = 0, n_block; (n_block = walk_block(round)) < n_blocks; ++round) {
        const BlockRange m_range = query_blocks<kBwdBlockM, L::BLOCK_N>(mask, n_block);
        // Walk: a key block reduces into each query block's rows once, so only the previous
        // block's reductions can target the rows this one's will; they complete first, and the
        // adds into every element apply in key-block order.
        if (WALK && elected) tma_store_wait<0>();
        for (int i = 0; i < m_range.end - m_range.begin; ++i) {
          const int m = query_block(m_range, i);
          named_barrier_sync(kDqFullBarrier, kDqWriterThreads);
          if (elected) {
            // Turns: this key block's place among those that see query block m (mask.cuh's
            // key_blocks, the exact inverse of query_blocks).
            if (TURNS) wait_for_turn(turns + m, n_block - key_blocks<kBwdBlockM, L::BLOCK_N>(mask, m).begin);
            // The block's rows inside the sequence, contiguous in global memory.
            const int rows = min(kBwdBlockM, seq.seqlen_q - m * kBwdBlockM);
            bulk_reduce_add_f32(dq + static_cast<i64>(seq.q_begin + m * kBwdBlockM) * L::DQ_ROW, dq_block,
                                rows * L::DQ_ROW * 4);
            tma_store_commit();
            tma_store_wait_read<0>();
          }
          __syncwarp();
          named_barrier_arrive(kDqEmptyBarrier, kDqWriterThreads);
          if (TURNS && elected) {
            tma_store_wait<0>();
            pass_turn(turns + m);
          }
        }
      }
      return;
    }
    if (threadIdx.x != 0) return;
    prefetch_tensor_map(&p.q);
    prefetch_tensor_map(&p.k);
    prefetch_tensor_map(&p.v);
    prefetch_tensor_map(&p.dout);
    const int map_batch = a.cu_seqlens_q == nullptr ? batch : 0;
    RingPosition<STAGES> pos;
    int blocks_loaded = 0;
    for (int round = 0, n_block; (n_block = walk_block(round)) < n_blocks; ++round) {
      const BlockRange m_range = query_blocks<kBwdBlockM, L::BLOCK_N>(mask, n_block);
      if (m_range.begin >= m_range.end) continue;
      // K and V are overwritten once every consumer warp is done with the previous block's.
      if (blocks_loaded > 0) mbarrier_wait(&kv_empty, (blocks_loaded - 1) & 1);
      ++blocks_loaded;
      mbarrier_arrive_expect_tx(&kv_full, L::K_BYTES + L::V_BYTES);
      const int key_row = seq.k_begin + n_block * L::BLOCK_N;
      tma_load_panels<L::PANELS>(smem + L::K, L::KV_PANEL, &p.k, &kv_full, kv_head, key_row, map_batch);
      tma_load_panels<L::V_PANELS>(smem + L::V, L::KV_PANEL, &p.v, &kv_full, kv_head, key_row, map_batch);
      // Each query block in kBwdBlockM / RING_ROWS stages.
      constexpr int kParts = kBwdBlockM / L::RING_ROWS;
      for (int unit = 0; unit < (m_range.end - m_range.begin) * kParts; ++unit, pos.advance()) {
        const int m = query_block(m_range, unit / kParts);
        // Rows past the tensor arrive as zeros, rows past a packed sequence from the next one:
        // their lse is taken as +inf below, so P and dS are 0 there.
        const int row = seq.q_begin + m * kBwdBlockM + unit % kParts * L::RING_ROWS;
        mbarrier_wait(&q_empty[pos.stage], pos.phase ^ 1);
        mbarrier_arrive_expect_tx(&q_full[pos.stage], L::SPLIT_DIMS ? L::Q_BYTES : L::Q_BYTES + L::DO_BYTES);
        tma_load_panels<L::PANELS>(smem + L::Q + pos.stage * L::Q_BYTES, L::QD_PANEL, &p.q, &q_full[pos.stage], head,
                                   row, map_batch);
        if constexpr (L::SPLIT_DIMS) {
          mbarrier_wait(&do_empty[pos.stage], pos.phase ^ 1);
          mbarrier_arrive_expect_tx(&do_full[pos.stage], L::DO_BYTES);
        }
        tma_load_panels<L::V_PANELS>(smem + L::DO + pos.stage * L::DO_BYTES, L::QD_PANEL, &p.dout,
                                     &dout_full[pos.stage], head, row, map_batch);
      }
    }
    return;
  }

  // Consumer warpgroups 1 and 2: keys consumer * GROUP_KEYS .. + 63 of each block.
  setmaxnreg_inc<kBwdConsumerRegisters>();
  const int consumer = threadIdx.x / 128 - 1;
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int group_row = consumer * L::GROUP_KEYS;  // this warpgroup's first key inside the block
  // The first of this warpgroup's query columns of S^T (with the head dim split), and of its
  // head-dim columns of dK and dV (BwdLayout).
  const int split_query_col0 = L::SPLIT_DIMS ? consumer * L::QUERY_COLS : 0;
  const int dk_col0 = L::SPLIT_DIMS ? consumer * L::DK_DIMS : 0;
  const int dv_col0 = L::SPLIT_DIMS ? consumer * L::V_DIMS : 0;
  const u64 k_desc = smem_desc_sw128(smem + L::K + group_row * 128);
  const u64 v_desc = smem_desc_sw128(smem + L::V + group_row * 128);
  const float* const lse = a.lse + batch * a.lse_batch_stride + head * a.lse_head_stride + seq.q_begin;
  const float* const delta = a.delta + batch * a.lse_batch_stride + head * a.lse_head_stride + seq.q_begin;
  // A constant at head_dim 128: with the test `consumer < PANELS` there (always true), ptxas spilled
  // 200-240 bytes in every d128 kernel.
  const bool computes_dq = L::DQ_CONSUMERS == 2 || consumer == 0;
  // The pad columns are reduced into global's pad columns, which nothing reads: zeros, not
  // whatever shared memory held.
  for (int i = t; i < kBwdBlockM * kDqRowPad; i += 128)
    if (consumer == 0) dq_block[i / kDqRowPad * L::DQ_ROW + HEAD_DIM + i % kDqRowPad] = 0.f;
  RingPosition<STAGES> pos;
  int blocks_loaded = 0;
  int step = 0;  // over the CTA's whole walk: the parity of the dS and statistics buffers

  for (int round = 0, n_block; (n_block = walk_block(round)) < n_blocks; ++round) {
    const BlockRange m_range = query_blocks<kBwdBlockM, L::BLOCK_N>(mask, n_block);
    // The two keys of this thread's accumulator rows, inside the sequence.
    const int key0 = n_block * L::BLOCK_N + group_row + warp * 16 + lane / 4;
    float dk[1][DK_T][4], dv[1][DV_T][4];
    clear(dk);
    clear(dv);

    if (m_range.begin < m_range.end) {
      // The query range each of this thread's two keys is seen by (mask.query_begin/end); none
      // for a key past the sequence (its row of K holds zeros or the next sequence's key).
      int query_begin[2], query_end[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = key0 + 8 * h;
        query_begin[h] = mask.query_begin(key);
        query_end[h] = key < seq.seqlen_k ? mask.query_end(key) : query_begin[h];
      }
      mbarrier_wait(&kv_full, blocks_loaded & 1);
      ++blocks_loaded;
      // One query block m of this key block. The body is inlined twice, with the mask and without:
      // the per-element test of the queries each key is seen by (two compares and a select on
      // every score) is only needed where needs_mask says some pair of the block is left out; the
      // choice is uniform across the CTA, and no product is in flight between steps, so the branch
      // does not serialise any wgmma.
      const auto query_step = [&](int m, bool masked) {
        // The current stage's Q and dO tiles (a half stage's, at (192, 128), follow pos from half to
        // half), and the first row of a product's queries in it (a half stage holds only its half's).
        const auto q_stage = [&] { return smem + L::Q + pos.stage * L::Q_BYTES; };
        const auto do_stage = [&] { return smem + L::DO + pos.stage * L::DO_BYTES; };
        const auto row_in_stage = [](int query_col0) { return L::RING_ROWS == kBwdBlockM ? query_col0 : 0; };
        // dS^T alternates per step between the two tiles where each consumer keeps P^T in
        // registers: a warp still reading the previous one (its dQ product) has passed this step's
        // barrier only after finishing the one before. With the head dim split, both consumers
        // compute dQ, so both have passed the previous step's dQ-empty barrier, after their dQ
        // products, before either writes the next dS^T; the second tile holds P^T.
        unsigned char* const ds_tile = smem + L::DS + (L::SPLIT_DIMS ? 0 : (step % 2) * L::DS_BYTES);
        constexpr int NQ = L::QUERY_COLS / 8;  // 8-column tiles of one S^T product
        // Stage this block's statistics (the other parity's buffer may still be read by slower
        // warps of the warpgroup; this one was last read two steps ago, before the previous
        // barrier): thread t copies lse (t < 64) or delta (t >= 64) of row t % 64, asynchronously,
        // before the products; they are waited for once those run. Staged before them, their L2
        // latency stood between every step's start and its first product.
        // A row past the sequence copies nothing (zero): the masked copy of the step, which the
        // sequence's last block takes, leaves its P at 0.
        float* const step_stats = stats[consumer][step % 2];
        {
          const int query = m * kBwdBlockM + t % kBwdBlockM;
          cp_async_4(step_stats + t, (t < kBwdBlockM ? lse : delta) + min(query, seq.seqlen_q - 1),
                     query < seq.seqlen_q ? 4 : 0);
          cp_async_commit();
        }
        mbarrier_wait(&q_full[pos.stage], pos.phase);
        if constexpr (L::SPLIT_DIMS) mbarrier_wait(&do_full[pos.stage], pos.phase);
        __syncwarp();  // reconverge after the spins: wgmma is .aligned

        // P^T and dS^T of queries query_col0 .. + QUERY_COLS - 1, 16-bit A fragments.
        u32 p_a[NQ / 2][4], ds_a[NQ / 2][4];
        const auto scores = [&](int query_col0, bool first) {
          // Dropout's keep mask of these keys x queries, bit 4 nt + r for register r of n8 tile nt
          // (keep_bits); all kept without dropout. Drawn before the products, while S^T and dP^T
          // take no registers yet; the stream is made per step rather than held across the loop.
          // keep_keys shuffles between lanes l and l ^ 4, so every lane draws here, in both copies
          // of the step (masked or not).
          static_assert(NQ <= 8, "one bit per score of a thread's row of S^T in a 32-bit mask");
          u32 kept = ~0u;
          if (dropout()) {
            const DropoutStream drop = dropout_stream(a, batch, a.heads, head);
            kept = 0;
#pragma unroll
            for (int pair = 0; pair < NQ / 2; ++pair) {
              bool keep[2][4];
              keep_keys(drop, key0 - lane / 4, m * kBwdBlockM + query_col0 + 16 * pair, lane, keep);
              kept |= keep_bits(keep) << (8 * pair);
            }
          }
          float s[1][NQ][4], dp[1][NQ][4];
          wgmma_fence();
          // S^T = K Q^T and dP^T = V dO^T over these query columns, K-major operands (a later
          // half starts 32 rows, 4096 bytes, into the Q and dO panels: a whole number of swizzle
          // periods).
          wgmma_ss_panels<L::QUERY_COLS, Elem, L::PANELS>(
              flat(s), k_desc, L::KV_PANEL, smem_desc_sw128(q_stage() + row_in_stage(query_col0) * 128),
              L::QD_PANEL);
          wgmma_commit();
          wgmma_ss_panels<L::QUERY_COLS, Elem, L::V_PANELS>(
              flat(dp), v_desc, L::KV_PANEL,
              smem_desc_sw128(do_stage() + row_in_stage(query_col0) * 128), L::QD_PANEL);
          wgmma_commit();
          if (first) {
            cp_async_wait<0>();
            named_barrier_sync(kStatsBarrier + consumer, 128);
          }
          fence_registers(flat(s));
          fence_registers(flat(dp));
          // With a softcap, dS needs dP^T beside each score's tanh slope: both products first.
          wgmma_wait<SOFTCAP ? 0 : 1>();
          fence_registers(flat(s));
          // P^T: columns are queries query_col0 + 8 nt + 2 (lane % 4) + e of the block.
          const int stat_base = query_col0 + 2 * (lane % 4);
          const int query_base = m * kBwdBlockM + stat_base;
          float distance0[2];  // ALiBi's query - key (+ offset) of this thread's first column, per key
#pragma unroll
          for (int h = 0; h < 2; ++h) distance0[h] = float(query_base + alibi.diagonal_offset - key0 - 8 * h);
          const auto keeps = [&](int nt, int r) { return !WINDOW || ((kept >> (4 * nt + r)) & 1); };
          // dP^T M / (1 - p) - delta, times a factor per score, in place of dP^T: with a softcap
          // the tanh's slope (s holds y), without one P (s holds P, undropped).
          const auto weigh_dp = [&] {
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float row_delta = step_stats[kBwdBlockM + stat_base + 8 * nt + e];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const float x = s[0][nt][2 * h + e];
                  float& y = dp[0][nt][2 * h + e];
                  // Without dropout fmaf(dP, 1, -delta) is dP - delta exactly.
                  const float dp_delta =
                      WINDOW ? fmaf(keeps(nt, 2 * h + e) ? y : 0.f, dp_scale(), -row_delta) : y - row_delta;
                  y = dp_delta * (SOFTCAP ? softcap_slope(x) : x);
                }
              }
          };
          if constexpr (SOFTCAP) {
            fence_registers(flat(dp));
            scale(s, a.softcap_tanh_scale);  // y, whose tanh the softmax saw (softcap.cuh)
            // The tanh's slope first, so that its temporaries are not live beside P's.
            weigh_dp();
          }
#pragma unroll
          for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int query = query_base + 8 * nt + e;
              // A row that saw no key (lse = -inf) or lies past the sequence (lse 0) only occurs in
              // masked blocks, where the select makes P 0, never inf * 0.
              const float lse_log2 = step_stats[stat_base + 8 * nt + e] * kLog2e;
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const bool seen = !masked || (query >= query_begin[h] && query < query_end[h]);
                // With a softcap, s holds y = score * scale / softcap and the softmax saw softcap t,
                // t = tanh(y).
                const float y = s[0][nt][2 * h + e];
                float score = SOFTCAP ? fast_tanh(y) : y;
                if (alibi.on()) score = fmaf(-alibi.slope, fabsf(distance0[h] + float(8 * nt + e)), score);
                const float prob = seen ? fast_exp2(fmaf(score, a.scale_log2, -lse_log2)) : 0.f;
                s[0][nt][2 * h + e] = prob;
                // d(softcap t) / d(score) = scale (1 - t^2), the slope taken above; scale is
                // applied with dK's and dQ's.
                if constexpr (SOFTCAP) dp[0][nt][2 * h + e] *= prob;
              }
            }
          if constexpr (!SOFTCAP) {
            wgmma_wait<0>();
            fence_registers(flat(dp));
            // dS^T = P^T (dP^T M / (1 - p) - delta).
            weigh_dp();
          }
          // dV's operand: P^T M (its 1 / (1 - p) applied to dV in the epilogue).
          if (dropout()) {
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
              for (int r = 0; r < 4; ++r)
                if (!keeps(nt, r)) s[0][nt][r] = 0.f;
          }
          pack_a<Elem>(s, p_a);
          pack_a<Elem>(dp, ds_a);
        };

        // This consumer's keys of query columns col0 .. + QUERY_COLS - 1 of a (keys x 64 queries)
        // tile in shared memory, rows = keys: dQ's A operand read MN-major, and with the head dim
        // split, dV's and dK's read K-major.
        const auto store_tile = [&](unsigned char* tile, const u32(&values)[NQ / 2][4], int col0) {
#pragma unroll
          for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = group_row + warp * 16 + h * 8 + lane / 4;
              *reinterpret_cast<u32*>(tile + swizzled_offset(row, col0 + 8 * nt + 2 * (lane % 4), L::DS_BYTES)) =
                  values[nt / 2][(nt % 2) * 2 + h];
            }
        };
        // Q's and dO's panels of this consumer's dK and dV columns, read MN-major: K = the 64
        // queries (4 k16 steps of 16 rows, 2048 bytes).
        const auto q_mn = [&] { return smem_desc_sw128_mn(q_stage() + (dk_col0 / 64) * L::QD_PANEL, L::QD_PANEL); };
        const auto do_mn = [&] { return smem_desc_sw128_mn(do_stage() + (dv_col0 / 64) * L::QD_PANEL, L::QD_PANEL); };
        // dQ = dS K: M = the 64 queries, K = the block's keys (k16 steps of 16 rows), N = DQ_DIMS
        // columns from col0 (from K's panel col0 / 64). Split by columns rather than by keys, each
        // element has one writer: two warpgroups adding into the same elements at once contend
        // for them (docs/kernels.md).
        float dq_part[1][L::DQ_DIMS / 8][4];
        const auto issue_dq = [&](int col0) {
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < L::BLOCK_N / 16; ++j) {
            const u64 ds_desc = desc_advance(smem_desc_sw128_mn(ds_tile, L::DS_BYTES), 2048 * j);
            const u64 k_mn =
                desc_advance(smem_desc_sw128_mn(smem + L::K + (col0 / 64) * L::KV_PANEL, L::KV_PANEL), 2048 * j);
            wgmma_ss_t<L::DQ_DIMS, Elem, true, true>(flat(dq_part), ds_desc, k_mn, j > 0);
          }
          wgmma_commit();
          fence_registers(flat(dq_part));
        };
        // Writes dq_part (accumulator rows are queries) into the staged block's columns from col0;
        // the first of a step's writes waits for the writer's previous reduction to have read it.
        const auto stage_dq = [&](int col0, bool first) {
          if (first) named_barrier_sync(kDqEmptyBarrier, kDqWriterThreads);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float* const row = dq_block + (warp * 16 + h * 8 + lane / 4) * L::DQ_ROW + col0 + 2 * (lane % 4);
#pragma unroll
            for (int nt = 0; nt < L::DQ_DIMS / 8; ++nt)
              *reinterpret_cast<float2*>(row + 8 * nt) = make_float2(dq_part[0][nt][2 * h], dq_part[0][nt][2 * h + 1]);
          }
        };
        // The step's staged columns go to the writer warp, whose bulk reduction reads them through
        // the async proxy.
        const auto publish_dq = [&] {
          fence_proxy_async_shared();
          named_barrier_arrive(kDqFullBarrier, kDqWriterThreads);
        };
        // A panel of dQ over the block's keys, issued, waited for and staged.
        const auto dq_panel = [&](int col0, bool first) {
          issue_dq(col0);
          wgmma_wait<0>();
          fence_registers(flat(dq_part));
          stage_dq(col0, first);
        };
        if constexpr (L::SPLIT_DIMS) {
          scores(split_query_col0, true);
          // Both halves of P^T and dS^T in shared memory before dK += dS^T Q and dV += P^T dO read
          // them (K-major A, 32 bytes per k16 step); dK first, whose completion frees Q's stage.
          unsigned char* const p_tile = smem + L::DS + L::DS_BYTES;
          store_tile(ds_tile, ds_a, split_query_col0);
          store_tile(p_tile, p_a, split_query_col0);
          // The stores are ordinary (generic proxy), wgmma reads through the async proxy.
          fence_proxy_async_shared();
          named_barrier_sync(kDsBarrier, 256);
          // dK, dV and dQ issued together, then waited for in that order: Q's stage is free once dK
          // completes, dO's once dV does.
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < 4; ++j)
            wgmma_ss_t<L::DK_DIMS, Elem, false, true>(flat(dk), desc_advance(smem_desc_sw128(ds_tile), 32 * j),
                                                      desc_advance(q_mn(), 2048 * j), true);
          wgmma_commit();
#pragma unroll
          for (int j = 0; j < 4; ++j)
            wgmma_ss_t<L::V_DIMS, Elem, false, true>(flat(dv), desc_advance(smem_desc_sw128(p_tile), 32 * j),
                                                     desc_advance(do_mn(), 2048 * j), true);
          wgmma_commit();
          issue_dq(consumer * L::DQ_DIMS);
          fence_registers(flat(dk));
          fence_registers(flat(dv));
          wgmma_wait<2>();
          fence_registers(flat(dk));
          if (lane == 0) mbarrier_arrive(&q_empty[pos.stage]);
          wgmma_wait<1>();
          fence_registers(flat(dv));
          if (lane == 0) mbarrier_arrive(&do_empty[pos.stage]);
          wgmma_wait<0>();
          fence_registers(flat(dq_part));
          stage_dq(consumer * L::DQ_DIMS, true);
          publish_dq();
        } else {
#pragma unroll
          for (int half = 0; half < L::QUERY_HALVES; ++half) {
            if (half > 0) {
              // The previous half's dV and dK products read p_a and ds_a, which scores rewrites,
              // and its half stage, which one arrival per warp then frees.
              fence_registers(flat(dk));
              fence_registers(flat(dv));
              wgmma_wait<0>();
              fence_registers(flat(dk));
              fence_registers(flat(dv));
              if (L::RING_ROWS < kBwdBlockM) {
                if (lane == 0) mbarrier_arrive(&q_empty[pos.stage]);
                pos.advance();
                mbarrier_wait(&q_full[pos.stage], pos.phase);
                __syncwarp();  // reconverge after the spin: wgmma is .aligned
              }
            }
            const int query_col0 = half * L::QUERY_COLS;
            scores(query_col0, half == 0);
            // dV += P^T dO and dK += dS^T Q from registers, N = the head dim, K = these queries.
            wgmma_fence();
#pragma unroll
            for (int j = 0; j < L::QUERY_COLS / 16; ++j)
              wgmma_rs<L::V_DIMS, Elem, true>(flat(dv), p_a[j], desc_advance(do_mn(), 2048 * (row_in_stage(query_col0) / 16 + j)),
                                              true);
#pragma unroll
            for (int j = 0; j < L::QUERY_COLS / 16; ++j)
              wgmma_rs<L::DK_DIMS, Elem, true>(flat(dk), ds_a[j], desc_advance(q_mn(), 2048 * (row_in_stage(query_col0) / 16 + j)),
                                               true);
            wgmma_commit();
            store_tile(ds_tile, ds_a, query_col0);
          }
          fence_proxy_async_shared();
          named_barrier_sync(kDsBarrier, 256);
          // dV and dK first: their A registers (P, dS) die here, which leaves room for dQ's
          // accumulator (at head_dim 128, issuing dQ beside them spilled 144 bytes).
          fence_registers(flat(dk));
          fence_registers(flat(dv));
          wgmma_wait<0>();
          fence_registers(flat(dk));
          fence_registers(flat(dv));
          // Every product of this step that reads Q and dO is done: one arrival per warp frees the stage.
          if (lane == 0) mbarrier_arrive(&q_empty[pos.stage]);
          if (computes_dq) {
            // Three panels: two to one consumer and one to the other, by step parity (the
            // consumers meet at every step's barriers, so over two steps both compute as much).
            const bool two = L::PANELS == 3 && (step + consumer) % 2 == 0;
            dq_panel(L::PANELS == 3 ? (two ? 0 : 128) : consumer * 64, true);
            if (two) dq_panel(64, false);
            publish_dq();
          }
        }
      };
      // Taking turns under a mask keeps the one copy with the test: with two, ptxas moves loop
      // state to local memory inside the step. ((192, 128)'s step spills with one copy or two, and
      // is faster with two: docs/kernels.md.)
      constexpr bool kUnmaskedCopy = !(TURNS && (CAUSAL || WINDOW));
      for (int i = 0; i < m_range.end - m_range.begin; ++i, pos.advance(), ++step) {
        const int m = query_block(m_range, i);
        // A block with rows past the sequence's end takes the masked copy too: those rows staged lse
        // 0 (nothing to copy), and only the mask's select makes their P 0.
        if (!kUnmaskedCopy || needs_mask<kBwdBlockM, L::BLOCK_N>(mask, m, n_block) ||
            (m + 1) * kBwdBlockM > seq.seqlen_q) {
          query_step(m, true);
        } else {
          query_step(m, false);
        }
      }
      // This warp's last reads of K (dQ) and V (dP^T) are done: the producer may reload them.
      if (lane == 0) mbarrier_arrive(&kv_empty);
    }

    // dK takes the softmax scale here (dQ in the convert kernel), dV dropout's 1 / (1 - p) (P^T M
    // was its operand). Rows past the sequence's keys and
    // columns past head_dim (dK) or head_dim_v (dV) are not written. Each key's stores go through
    // one row pointer at constant offsets (8 columns apart): recomputing a 64-bit address and
    // reloading parameters per 4-byte store made the epilogue ~2,900 instructions against ~300.
    // GQA: the group's query heads add into fp32 slices, or, in the orders that repeat bitwise
    // (walk, turns), each stores its own slice (summed in order by the convert).
    const int dk_col = dk_col0 + 2 * (lane % 4), dv_col = dv_col0 + 2 * (lane % 4);
    // dK's tiles inside head_dim (dV's: inside head_dim_v).
    const auto dk_tile = [&](int dt) { return 8 * dt + dk_col < a.head_dim; };
    const auto dv_tile = [&](int dt) { return 8 * dt + dv_col < a.head_dim_v; };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key0 + 8 * h;
      if (key >= seq.seqlen_k) continue;
      const i64 key_row = seq.k_begin + key;
      if (a.kv_group == 1) {
        u32* const dk_row = reinterpret_cast<u32*>(static_cast<u16*>(a.dk) + batch * a.dk_batch_stride +
                                                   key_row * a.dk_row_stride + kv_head * a.dk_head_stride + dk_col);
        u32* const dv_row = reinterpret_cast<u32*>(static_cast<u16*>(a.dv) + batch * a.dv_batch_stride +
                                                   key_row * a.dv_row_stride + kv_head * a.dv_head_stride + dv_col);
        // Column 8 dt + col: 32-bit word 4 dt past the row pointer.
#pragma unroll
        for (int dt = 0; dt < DK_T; ++dt)
          if (dk_tile(dt)) dk_row[4 * dt] = Elem::pack(dk[0][dt][2 * h] * a.scale, dk[0][dt][2 * h + 1] * a.scale);
#pragma unroll
        for (int dt = 0; dt < DV_T; ++dt)
          if (dv_tile(dt)) dv_row[4 * dt] = Elem::pack(dv[0][dt][2 * h] * dp_scale(), dv[0][dt][2 * h + 1] * dp_scale());
      } else {
        constexpr bool kOwnSlice = DQ_ORDER != kDqAnyOrder;
        const i64 slice = kOwnSlice ? head : kv_head;
        const i64 slices = kOwnSlice ? a.heads : a.heads / a.kv_group;
        const i64 slice_row = (batch * a.accum_batch_rows + key_row) * slices + slice;
        float* const dk_row = a.dk_accum + slice_row * a.head_dim + dk_col;
        float* const dv_row = a.dv_accum + slice_row * a.head_dim_v + dv_col;
        const auto put = [&](float* address, float x0, float x1) {
          if constexpr (kOwnSlice)
            *reinterpret_cast<float2*>(address) = make_float2(x0, x1);
          else
            reduce_add_pair(address, x0, x1);
        };
#pragma unroll
        for (int dt = 0; dt < DK_T; ++dt)
          if (dk_tile(dt)) put(dk_row + 8 * dt, dk[0][dt][2 * h] * a.scale, dk[0][dt][2 * h + 1] * a.scale);
#pragma unroll
        for (int dt = 0; dt < DV_T; ++dt)
          if (dv_tile(dt)) put(dv_row + 8 * dt, dv[0][dt][2 * h] * dp_scale(), dv[0][dt][2 * h + 1] * dp_scale());
      }
    }
  }
  // The writer's last arrival: the staged block outlives the last reduction's reads.
  if (computes_dq) named_barrier_sync(kDqEmptyBarrier, kDqWriterThreads);
}

}  // namespace sm90
}  // namespace cuflash
