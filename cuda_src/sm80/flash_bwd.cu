// FlashAttention-2 backward for compute capability 8.0 and newer, the main kernel between the
// preprocess (delta = rowsum(dO * O)) and convert kernels of generic/flash_bwd_helpers.cu:
//   flash_bwd_sm80: a CTA keeps one key block's K and V in shared memory, walks the query blocks
//     that can see them, recomputes P = exp(S - lse) from the forward's log-sum-exp (no stored P,
//     nothing that grows with seqlen_q x seqlen_k), accumulates dK and dV in registers and adds
//     its share of dQ into an fp32 buffer with reductions (deterministic mode: several key blocks
//     per CTA, in order, into the CTA's own buffer).
#include "common/atomics.cuh"
#include "common/bias.cuh"
#include "common/bwd_schedule.cuh"
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

// P = exp2(S * scale * log2(e) - lse * log2(e)) recomputed from the forward's LSE, 0 where masked
// (a row that saw no key has lse = -inf and every score masked, so no inf * 0), and
// dS = P * (dP - delta), for one warp's S_MT x 16 rows by 32 keys; both to shared memory as
// 16-bit pairs for the next three products. EDGE: some score of the block is masked.
// With a softcap, s holds y = score * scale / softcap (softcap.cuh), the softmax saw softcap * t
// with t = tanh(y), and the chain rule through it multiplies dS by 1 - t^2 (softcap_slope; the
// factor scale of d(softcap * t) / d(score) is applied with dK's and dQ's).
// Dropout's keep mask of one warp's S_MT x 16 rows from `first_row` by 32 keys from `first_key`
// (positions in the sequence), in one register: bit 16 mt + 4 nt + r for register r of n8 tile nt
// of 16-row tile mt (keep_bits), all ones without dropout. Read by the WINDOW kernels only. The
// stream is made per step rather than held across the loop.
template <bool WINDOW, int S_MT>
__device__ __forceinline__ u32 keep_mask(const BwdParams& p, int batch, int head, int first_row, int first_key) {
  static_assert(S_MT <= 2, "16 bits per 16-row tile");
  if (!WINDOW || !dropout_on(p)) return ~0u;
  const DropoutStream drop = dropout_stream(p, batch, p.heads, head);
  u32 kept = 0;
#pragma unroll
  for (int mt = 0; mt < S_MT; ++mt)
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      bool keep[2][4];
      keep_rows(drop, first_row + 16 * mt, first_key + 16 * pair, threadIdx.x % 32, keep);
      kept |= keep_bits(keep) << (16 * mt + 8 * pair);
    }
  return kept;
}

// ALiBi's bias joins the score as in the forward (after the tanh); it is constant in the score,
// so dS needs nothing more. Dropout (WINDOW kernels; `kept` from keep_mask, the forward's mask M
// regenerated): P's tile holds P M, dV's operand (its 1 / (1 - p) is applied to dV once, in the
// epilogue), and dS = P (dP M / (1 - p) - delta), `dp_scale` being 1 / (1 - p), or 1 without
// dropout; delta = rowsum(dO O) is rowsum(P dP M / (1 - p)), as it was rowsum(P dP).
// `stores` holds this thread's P addresses (StoreAddress); dS sits one P tile further on.
template <bool EDGE, bool SOFTCAP, int BLOCK_M, int BLOCK_N, class Elem, int S_MT, bool CAUSAL, bool WINDOW>
__device__ __forceinline__ void softmax_to_smem(const float (&s)[S_MT][4][4], const float (&dp)[S_MT][4][4],
                                                const StoreAddress<BLOCK_N>& stores, const float* lse,
                                                const float* delta, int first_local_row, int first_local_key, int m,
                                                int first_key, const Mask<CAUSAL, WINDOW>& mask, const Alibi& alibi,
                                                u32 kept, float dp_scale, const BwdParams& p) {
  constexpr u32 kDsOffset = BLOCK_M * BLOCK_N * 2;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < S_MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int local_row = first_local_row + mt * 16 + h * 8 + lane / 4;
      const int row = m * BLOCK_M + local_row;
      const float lse_log2 = lse[local_row] * kLog2e;
      const float row_delta = delta[local_row];
      // Rows past the sequence end are zero-filled with lse = delta = 0: harmless unmasked.
      const int key_begin = EDGE && WINDOW ? mask.key_begin(row) - first_key : 0;
      const int key_end = EDGE ? mask.key_end(row) - first_key : 0;
      const float distance0 = float(row + alibi.diagonal_offset - first_key - first_local_key - (lane % 4) * 2);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int key = first_local_key + nt * 8 + (lane % 4) * 2;
        float pv[2], dsv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float score = SOFTCAP ? fast_tanh(s[mt][nt][2 * h + e]) : s[mt][nt][2 * h + e];
          if (alibi.on()) score = fmaf(-alibi.slope, fabsf(distance0 - float(nt * 8 + e)), score);
          pv[e] = fast_exp2(fmaf(score, p.scale_log2, -lse_log2));
          // Masked: 0, not exp2(-inf - lse), which is NaN for a row without keys (lse = -inf).
          if (EDGE && Mask<CAUSAL, WINDOW>::outside(key + e, key_begin, key_end)) pv[e] = 0.f;
          if (WINDOW) {
            // Without dropout fmaf(dP, 1, -delta) is dP - delta exactly.
            const bool keep = (kept >> (16 * mt + 4 * nt + 2 * h + e)) & 1;
            dsv[e] = pv[e] * fmaf(keep ? dp[mt][nt][2 * h + e] : 0.f, dp_scale, -row_delta);
            if (!keep) pv[e] = 0.f;
          } else {
            dsv[e] = pv[e] * (dp[mt][nt][2 * h + e] - row_delta);
          }
          if (SOFTCAP) dsv[e] *= softcap_slope(s[mt][nt][2 * h + e]);
        }
        const u32 at = stores.at(mt * 16 + h * 8, nt);
        st_shared_u32(at, Elem::pack(pv[0], pv[1]));
        st_shared_u32(at + kDsOffset, Elem::pack(dsv[0], dsv[1]));
      }
    }
  }
}

// One CTA per (key block, head, batch), WARPS warps, CTAS_PER_SM resident per SM (the register
// budget; dispatch.py). Each step handles BLOCK_M query rows with five products, in three warp
// layouts chosen so that each warp's tile is as square as the registers allow (shared-memory
// reads per multiply-add fall with the tile's area over its perimeter):
//   S = Q K^T, dP = dO V^T:   warps as KEY_WARPS (32 keys) x ROW_WARPS (BLOCK_M / ROW_WARPS rows);
//   dV += P^T dO, dK += dS^T Q: warps as KEY_WARPS (32 keys) x ROW_WARPS (head_dim slices), the
//                               accumulators living in registers for the whole loop;
//   dQ = dS K:                 warps as Q_ROW_WARPS (rows) x Q_D_WARPS (head_dim slices).
// P and dS go through shared memory between the layouts.
// SMEM_BYTES: the dynamic shared memory the host launches with (dispatch.backward_kernels), checked
// against the tiles below. CAUSAL, WINDOW: the mask (common/mask.cuh); SOFTCAP: tanh-capped scores
// (common/softcap.cuh). OWN_V_DIM: v, dout and dv have a head dim of their own (BwdParams::
// head_dim_v), else q's: a separate instantiation, so that the kernels of equal head dims keep one
// column bound in the main loop (a second one moved ptxas's spills by -200 to +270 bytes).
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int CTAS_PER_SM, int SMEM_BYTES, bool CAUSAL, bool WINDOW,
          bool SOFTCAP, bool DETERMINISTIC, bool OWN_V_DIM, class Elem>
__global__ void __launch_bounds__(WARPS * 32, CTAS_PER_SM) flash_bwd_sm80(const __grid_constant__ BwdParams p) {
  constexpr int THREADS = WARPS * 32;
  constexpr int ROW_ELEMS = (HEAD_DIM + 63) / 64 * 64;
  constexpr int KSTEPS = HEAD_DIM / 16;
  constexpr int KEY_WARPS = BLOCK_N / 32;
  constexpr int ROW_WARPS = WARPS / KEY_WARPS;
  constexpr int S_MT = BLOCK_M / ROW_WARPS / 16;  // 16-row tiles of S per warp
  constexpr int KV_COLS = HEAD_DIM / ROW_WARPS;  // dK, dV columns per warp
  constexpr int KV_NT = KV_COLS / 8;
  constexpr int Q_D_WARPS = (HEAD_DIM / 4) % 16 == 0 ? 4 : 2;
  constexpr int Q_ROWS = BLOCK_M / (WARPS / Q_D_WARPS);
  constexpr int Q_MT = Q_ROWS / 16;
  constexpr int Q_COLS = HEAD_DIM / Q_D_WARPS;
  constexpr int Q_NT = Q_COLS / 8;
  static_assert(BLOCK_N % 64 == 0 && KEY_WARPS * ROW_WARPS == WARPS, "32 keys per warp, P rows of 64k");
  static_assert(S_MT >= 1 && KV_COLS % 16 == 0 && Q_COLS % 16 == 0 && Q_MT >= 1, "whole 16 x 16 steps");

  extern __shared__ __align__(128) unsigned char smem[];
  u16* const sK = reinterpret_cast<u16*>(smem);
  u16* const sV = sK + BLOCK_N * ROW_ELEMS;
  u16* const sQ = sV + BLOCK_N * ROW_ELEMS;   // two buffers: the next step's Q loads under this one
  u16* const sdO = sQ + 2 * BLOCK_M * ROW_ELEMS;
  u16* const sP = sdO + 2 * BLOCK_M * ROW_ELEMS;  // BLOCK_M x BLOCK_N
  u16* const sdS = sP + BLOCK_M * BLOCK_N;
  // The rows' log-sum-exp and delta, two buffers like Q: staged with the Q block so that the
  // softmax after the first two products reads shared memory, not global memory at L2 latency
  // with two warps per scheduler to hide it.
  float* const sLse = reinterpret_cast<float*>(sdS + BLOCK_M * BLOCK_N);
  float* const sDelta = sLse + 2 * BLOCK_M;
  static_assert(SMEM_BYTES == ((2 * BLOCK_N + 4 * BLOCK_M) * ROW_ELEMS + 2 * BLOCK_M * BLOCK_N) * sizeof(u16) +
                                  4 * BLOCK_M * sizeof(float),
                "the host's shared memory differs from the tiles and statistics");
  constexpr u32 kQBufferBytes = BLOCK_M * ROW_ELEMS * 2;

  // Default mode: one key block per CTA. Causal key blocks differ in length, so the grid puts
  // them slowest and the longest (the first, seeing every query) are dispatched first.
  // Deterministic mode: grid (dq_splits, heads, batch); CTA s takes key blocks s, s + dq_splits,
  // ... one after the other and adds their dQ into its own fp32 split: one writer per buffer, in
  // program order, so the sums repeat bitwise with no ordering between CTAs. Interleaving the key
  // blocks gives every split the same share of causal work.
  // A packed batch's grid covers its longest sequence; CTAs past a shorter one's end leave.
  const int head = CAUSAL && !DETERMINISTIC ? blockIdx.x : blockIdx.y;
  const int batch = CAUSAL && !DETERMINISTIC ? blockIdx.y : blockIdx.z;
  const Sequence seq = sequence_of(p, batch);
  const int n_blocks = (seq.seqlen_k + BLOCK_N - 1) / BLOCK_N;
  const int split = DETERMINISTIC ? blockIdx.x : 0;
  const int n_first = DETERMINISTIC || !CAUSAL ? blockIdx.x : blockIdx.z;
  const int n_stride = DETERMINISTIC ? p.dq_splits : n_blocks;
  if (n_first >= n_blocks) return;
  const int kv_head = head / p.kv_group;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int kw = warp % KEY_WARPS;  // 32-key slice (S, dP, dK, dV)
  const int rw = warp / KEY_WARPS;  // row slice of S and dP, head_dim slice of dK and dV
  const int qd = warp % Q_D_WARPS;  // head_dim slice of dQ
  const int qr = warp / Q_D_WARPS;  // row slice of dQ
  const Mask<CAUSAL, WINDOW> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
  const Alibi alibi{WINDOW ? alibi_slope(p, batch, head, p.scale_log2) : 0.f, mask.diagonal_offset};
  // Dropout (common/philox.cuh) in the window kernels, as ALiBi; read from the params where used,
  // not held across the loop. dp_scale: 1 / (1 - p), 1 without dropout (softmax_to_smem), and
  // likewise dV's scale.
  const auto dp_scale = [&] { return WINDOW && dropout_on(p) ? p.dropout_scale : 1.f; };

  const u16* q = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                 seq.q_begin * p.q_row_stride;
  const u16* dout = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride +
                    seq.q_begin * p.do_row_stride;
  const u16* k = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                 seq.k_begin * p.k_row_stride;
  const u16* v = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                 seq.k_begin * p.v_row_stride;
  const i64 stats_offset = batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_begin;
  const int v_cols = OWN_V_DIM ? p.head_dim_v : p.head_dim;  // of V, dO and dV
  auto load_q_block = [&](int m, int buffer) {
    const int row = m * BLOCK_M;
    load_tile_async<BLOCK_M, HEAD_DIM, ROW_ELEMS, THREADS>(sQ + buffer * BLOCK_M * ROW_ELEMS, q + row * p.q_row_stride,
                                                           p.q_row_stride, seq.seqlen_q - row, p.head_dim);
    load_tile_async<BLOCK_M, HEAD_DIM, ROW_ELEMS, THREADS>(sdO + buffer * BLOCK_M * ROW_ELEMS,
                                                           dout + row * p.do_row_stride, p.do_row_stride,
                                                           seq.seqlen_q - row, v_cols);
    static_assert(2 * BLOCK_M <= THREADS, "one thread per staged statistic");
    if (threadIdx.x < 2 * BLOCK_M) {
      const int r = threadIdx.x % BLOCK_M;
      const float* stats = (threadIdx.x < BLOCK_M ? p.lse : p.delta) + stats_offset;
      const bool inside = row + r < seq.seqlen_q;
      cp_async_4((threadIdx.x < BLOCK_M ? sLse : sDelta) + buffer * BLOCK_M + r, inside ? stats + row + r : stats,
                 inside ? 4 : 0);
    }
  };

  // Operand addresses (see FragmentAddress): A fragments of Q and dO (rows x d), B fragments of K
  // and V as K^T / V^T, transposed A fragments of P and dS (P^T, dS^T: keys x rows), transposed B
  // fragments of dO and Q (rows x d as k x n) and of K (keys x d), A fragments of dS (rows x keys).
  const int a_row = lane % 8 + ((lane / 8) % 2) * 8;
  const int b_row = lane % 8 + (lane / 16) * 8;
  const FragmentAddress<ROW_ELEMS> q_a(sQ, rw * (BLOCK_M / ROW_WARPS) + a_row, lane / 16);
  const FragmentAddress<ROW_ELEMS> do_a(sdO, rw * (BLOCK_M / ROW_WARPS) + a_row, lane / 16);
  const FragmentAddress<ROW_ELEMS> k_b(sK, kw * 32 + b_row, (lane / 8) % 2);
  const FragmentAddress<ROW_ELEMS> v_b(sV, kw * 32 + b_row, (lane / 8) % 2);
  const FragmentAddress<BLOCK_N> p_t(sP, b_row, (lane / 8) % 2, kw * 32);
  const FragmentAddress<BLOCK_N> ds_t(sdS, b_row, (lane / 8) % 2, kw * 32);
  const FragmentAddress<ROW_ELEMS> do_bt(sdO, a_row, lane / 16, rw * KV_COLS);
  const FragmentAddress<ROW_ELEMS> q_bt(sQ, a_row, lane / 16, rw * KV_COLS);
  const FragmentAddress<ROW_ELEMS> k_bt(sK, a_row, lane / 16, qd * Q_COLS);
  const FragmentAddress<BLOCK_N> ds_a(sdS, qr * Q_ROWS + a_row, lane / 16);
  // Stores of P and dS: rows of this warp's S tile, 32 keys from kw * 32, in the m16n8 layout.
  const int first_local_row = rw * (BLOCK_M / ROW_WARPS);
  const StoreAddress<BLOCK_N> p_stores(sP, first_local_row + lane / 4, kw * 32 + (lane % 4) * 2);
  // This thread's dQ reduction target in a step's block of the fp32 buffer (rows of HEAD_DIM):
  // after the lane-pair swap the even lane owns row lane / 4, the odd lane row lane / 4 + 8.
  const int dq_thread_row = qr * Q_ROWS + (lane % 2) * 8 + lane / 4;
  const int dq_thread_col = qd * Q_COLS + (lane % 4 / 2) * 4;
  float* const dq_head = p.dq_accum + split * p.dq_split_stride + batch * p.dq_batch_stride +
                         head * p.dq_head_stride + static_cast<i64>(seq.q_begin) * HEAD_DIM;

  for (int n_block = n_first; n_block < n_blocks; n_block += n_stride) {
    const int first_key = n_block * BLOCK_N;
    const BwdSchedule schedule =
        BwdSchedule::of<!CAUSAL && !WINDOW>(query_blocks<BLOCK_M, BLOCK_N>(mask, n_block), n_block, n_blocks);
    const int steps = schedule.steps();
    // Every warp is done with the previous key block's K, V, Q and dS tiles.
    if (DETERMINISTIC) __syncthreads();
    load_tile_async<BLOCK_N, HEAD_DIM, ROW_ELEMS, THREADS>(sK, k + first_key * p.k_row_stride, p.k_row_stride,
                                                           seq.seqlen_k - first_key, p.head_dim);
    load_tile_async<BLOCK_N, HEAD_DIM, ROW_ELEMS, THREADS>(sV, v + first_key * p.v_row_stride, p.v_row_stride,
                                                           seq.seqlen_k - first_key, v_cols);
    if (steps > 0) load_q_block(schedule.block_at(0), 0);
    cp_async_commit();

    float dk[2][KV_NT][4], dv[2][KV_NT][4];
    clear(dk);
    clear(dv);

    for (int step = 0; step < steps; ++step) {
      const int m = schedule.block_at(step);
      const u32 buffer_offset = (step % 2) * kQBufferBytes;
      // Q and dO of this step (and K, V on the first) have landed; every warp is done with the
      // previous step, so its Q/dO buffer, sP and sdS can be overwritten.
      cp_async_wait<0>();
      __syncthreads();
      if (step + 1 < steps) load_q_block(schedule.block_at(step + 1), (step + 1) % 2);
      cp_async_commit();
      // Dropout's mask of this warp's scores, drawn before the products, while S and dP do not
      // take registers yet.
      const u32 kept = keep_mask<WINDOW, S_MT>(p, batch, head, m * BLOCK_M + first_local_row, first_key + kw * 32);

      // S = Q K^T and dP = dO V^T: S_MT x 16 rows by 32 keys per warp.
      float s[S_MT][4][4], dp[S_MT][4][4];
      clear(s);
      clear(dp);
      u32 q_tiles[S_MT][4], do_tiles[S_MT][4], k_tiles[4], v_tiles[4];
      warp_gemm_fused<KSTEPS, Elem>(s, q_tiles, k_tiles, smem_operand<false>(q_a, buffer_offset),
                                    smem_operand<false>(k_b), dp, do_tiles, v_tiles,
                                    smem_operand<false>(do_a, buffer_offset), smem_operand<false>(v_b));

      // Only blocks at the key sequence's end, on the causal diagonal or at a window's edges pay
      // for the mask.
      if (SOFTCAP) scale(s, p.softcap_tanh_scale);  // y, whose tanh the softmax saw (softcap.cuh)
      const bool edge = needs_mask<BLOCK_M, BLOCK_N>(mask, m, n_block);
      const float* lse = sLse + (step % 2) * BLOCK_M;
      const float* delta = sDelta + (step % 2) * BLOCK_M;
      if (edge)
        softmax_to_smem<true, SOFTCAP, BLOCK_M, BLOCK_N, Elem>(s, dp, p_stores, lse, delta, first_local_row, kw * 32,
                                                               m, first_key, mask, alibi, kept, dp_scale(), p);
      else
        softmax_to_smem<false, SOFTCAP, BLOCK_M, BLOCK_N, Elem>(s, dp, p_stores, lse, delta, first_local_row, kw * 32,
                                                                m, first_key, mask, alibi, kept, dp_scale(), p);
      __syncthreads();

      // dV += P^T dO and dK += dS^T Q: 32 keys x KV_COLS per warp, k over the BLOCK_M rows.
      u32 pt_tiles[2][4], dst_tiles[2][4], dot_tiles[4], qt_tiles[4];
      warp_gemm_fused<BLOCK_M / 16, Elem>(dv, pt_tiles, dot_tiles, smem_operand<true>(p_t),
                                          smem_operand<true>(do_bt, buffer_offset), dk, dst_tiles, qt_tiles,
                                          smem_operand<true>(ds_t), smem_operand<true>(q_bt, buffer_offset));

      // dQ = dS K: Q_ROWS x Q_COLS per warp, k over the BLOCK_N keys.
      float dq[Q_MT][Q_NT][4];
      clear(dq);
      u32 ds_tiles[Q_MT][4], kt_tiles[4];
      warp_gemm<BLOCK_N / 16, Elem>(dq, ds_tiles, kt_tiles, smem_operand<false>(ds_a), smem_operand<true>(k_bt));

      // Every key block adds into the same fp32 dQ rows (of its split in deterministic mode),
      // unscaled (the convert kernel applies the softmax scale once per element). The buffer's
      // rows are padded to the head-dim bucket, where K is zero, so only rows past the sequence
      // end (another sequence's, in a packed batch) are skipped. Lanes l and l ^ 1 hold columns
      // c..c+1 and c+2..c+3 of the same two rows: one swap gives the even lane four columns of
      // the first row and the odd lane four of the second, one 16-byte reduction each.
      const bool even = lane % 2 == 0;
      const int dq_row = m * BLOCK_M + dq_thread_row;
      float* const dq_block = dq_head + static_cast<i64>(dq_row) * HEAD_DIM + dq_thread_col;
#pragma unroll
      for (int mt = 0; mt < Q_MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < Q_NT; ++nt) {
          const float* mine = dq[mt][nt];
          const float send0 = even ? mine[2] : mine[0], send1 = even ? mine[3] : mine[1];
          const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1), got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
          float* const at = dq_block + mt * 16 * HEAD_DIM + nt * 8;
          if (dq_row + mt * 16 >= seq.seqlen_q) continue;
          if (even)
            red_add_f32x4(at, mine[0], mine[1], got0, got1);
          else
            red_add_f32x4(at, got0, got1, mine[2], mine[3]);
        }
      }
    }

    // dK (times the softmax scale) and dV of this block's keys: written directly when this CTA's
    // query head is the only one using its K/V head. Otherwise summed over the group in fp32:
    // atomically into (batch, seqlen_k, heads_kv, head_dim) and (..., head_dim_v), or, in
    // deterministic mode, stored per query head into (batch, seqlen_k, heads, head_dim) and (...,
    // head_dim_v) and summed in order by the convert kernel.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = first_key + kw * 32 + mt * 16 + h * 8 + lane / 4;
        if (key >= seq.seqlen_k) continue;
        const i64 key_row = seq.k_begin + key;  // in dk, dv (batch strides apply) and the fp32 slices
#pragma unroll
        for (int nt = 0; nt < KV_NT; ++nt) {
          const int col = rw * KV_COLS + nt * 8 + (lane % 4) * 2;
          if (col >= (OWN_V_DIM ? max(p.head_dim, v_cols) : p.head_dim)) continue;
          // Without OWN_V_DIM both are true: the stores as tight as before v had a head dim of its own.
          const bool dk_col = !OWN_V_DIM || col < p.head_dim, dv_col = !OWN_V_DIM || col < v_cols;
          const float dk0 = dk[mt][nt][2 * h] * p.scale, dk1 = dk[mt][nt][2 * h + 1] * p.scale;
          // Dropout's P M: its 1 / (1 - p) once, here.
          const float dv0 = dv[mt][nt][2 * h] * dp_scale(), dv1 = dv[mt][nt][2 * h + 1] * dp_scale();
          if (p.kv_group == 1) {
            if (dk_col)
              *reinterpret_cast<u32*>(static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + key_row * p.dk_row_stride +
                                      kv_head * p.dk_head_stride + col) = Elem::pack(dk0, dk1);
            if (dv_col)
              *reinterpret_cast<u32*>(static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + key_row * p.dv_row_stride +
                                      kv_head * p.dv_head_stride + col) = Elem::pack(dv0, dv1);
          } else if constexpr (DETERMINISTIC) {
            const i64 slice_row = (batch * p.accum_batch_rows + key_row) * p.heads + head;
            if (dk_col) *reinterpret_cast<float2*>(p.dk_accum + slice_row * p.head_dim + col) = make_float2(dk0, dk1);
            if (dv_col) *reinterpret_cast<float2*>(p.dv_accum + slice_row * v_cols + col) = make_float2(dv0, dv1);
          } else {
            const i64 slice_row = (batch * p.accum_batch_rows + key_row) * (p.heads / p.kv_group) + kv_head;
            if (dk_col) red_add_f32x2(p.dk_accum + slice_row * p.head_dim + col, dk0, dk1);
            if (dv_col) red_add_f32x2(p.dv_accum + slice_row * v_cols + col, dv0, dv1);
          }
        }
      }
    }
  }  // key blocks
}

}  // namespace cuflash
