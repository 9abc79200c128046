// FlashAttention-2 backward for compute capability 8.0 and newer, in three launches:
//   flash_bwd_preprocess_sm80: delta = rowsum(dO * O), one warp per query row;
//   flash_bwd_sm80: one CTA per (key block, head, batch) keeps K and V in shared memory, walks the
//     query blocks that can see them, recomputes P = exp(S - lse) from the forward's log-sum-exp
//     (no stored P, nothing that grows with seqlen_q x seqlen_k), accumulates dK and dV in
//     registers and adds its share of dQ into an fp32 buffer with atomics;
//   flash_bwd_convert_sm80: fp32 accumulators -> the gradients' dtype (dQ always; dK and dV when
//     several query heads share a K/V head and their contributions were summed atomically).
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/smem.cuh"
#include "common/types.cuh"

namespace cuflash {

template <class Elem>
__global__ void __launch_bounds__(256) flash_bwd_preprocess_sm80(const __grid_constant__ BwdParams p) {
  const int row = blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  if (row >= p.seqlen_q) return;
  // head_dim <= 256: 32 lanes x 8 elements cover a row in one 16-byte load each.
  float sum = 0.f;
  if (lane * 8 < p.head_dim) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const u16*>(p.o) + batch * p.o_batch_stride +
                                                    row * p.o_row_stride + head * p.o_head_stride + lane * 8);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const u16*>(p.dout) + batch * p.do_batch_stride +
                                                    row * p.do_row_stride + head * p.do_head_stride + lane * 8);
    const u32 ow[4] = {o.x, o.y, o.z, o.w};
    const u32 dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = Elem::unpack(ow[i]);
      const float2 b = Elem::unpack(dw[i]);
      sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) p.delta[(static_cast<i64>(batch) * p.heads + head) * p.seqlen_q + row] = sum;
}

// BLOCK_N keys per CTA, BLOCK_M query rows per step, 8 warps. The five products per step use two
// warp layouts over the 64 x 64 (rows x keys) tile: S = Q K^T and dP = dO V^T with warps as
// 4 (16 rows) x 2 (32 keys); dV += P^T dO, dK += dS^T Q and dQ = dS K with warps as 4 (16 keys,
// or 16 rows for dQ) x 2 (halves of head_dim). P and dS go through shared memory between the two.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool CAUSAL, class Elem>
__global__ void __launch_bounds__(WARPS * 32) flash_bwd_sm80(const __grid_constant__ BwdParams p) {
  static_assert(BLOCK_M == 64 && BLOCK_N == 64 && WARPS == 8, "the warp layouts assume 64 x 64 and 8 warps");
  constexpr int THREADS = WARPS * 32;
  constexpr int ROW_ELEMS = (HEAD_DIM + 63) / 64 * 64;
  constexpr int KSTEPS = HEAD_DIM / 16;
  constexpr int HALF_D = HEAD_DIM / 2;  // columns of dK, dV, dQ per warp
  constexpr int DT = HALF_D / 8;
  static_assert(HALF_D % 16 == 0, "head_dim halves must be whole 16-column steps");
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(128) unsigned char smem[];
  u16* const sK = reinterpret_cast<u16*>(smem);
  u16* const sV = sK + BLOCK_N * ROW_ELEMS;
  u16* const sQ = sV + BLOCK_N * ROW_ELEMS;   // two buffers: the next step's Q loads under this one
  u16* const sdO = sQ + 2 * BLOCK_M * ROW_ELEMS;
  u16* const sP = sdO + 2 * BLOCK_M * ROW_ELEMS;  // BLOCK_M x BLOCK_N, rows of 64 elements
  u16* const sdS = sP + BLOCK_M * BLOCK_N;
  constexpr u32 kQBufferBytes = BLOCK_M * ROW_ELEMS * 2;

  const int n_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / p.kv_group;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wr = warp / 2;  // 16-row (or 16-key) slice
  const int wc = warp % 2;  // 32-key slice of S and dP, or head_dim half of dK, dV, dQ
  const int first_key = n_block * BLOCK_N;
  const Mask<CAUSAL> mask{p.seqlen_k, p.seqlen_k - p.seqlen_q};

  const u16* q = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
  const u16* dout = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride;
  load_tile_async<BLOCK_N, HEAD_DIM, ROW_ELEMS, THREADS>(
      sK, static_cast<const u16*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
              first_key * p.k_row_stride,
      p.k_row_stride, p.seqlen_k - first_key, p.head_dim);
  load_tile_async<BLOCK_N, HEAD_DIM, ROW_ELEMS, THREADS>(
      sV, static_cast<const u16*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
              first_key * p.v_row_stride,
      p.v_row_stride, p.seqlen_k - first_key, p.head_dim);
  auto load_q_block = [&](int m, int buffer) {
    const int row = m * BLOCK_M;
    load_tile_async<BLOCK_M, HEAD_DIM, ROW_ELEMS, THREADS>(sQ + buffer * BLOCK_M * ROW_ELEMS, q + row * p.q_row_stride,
                                                           p.q_row_stride, p.seqlen_q - row, p.head_dim);
    load_tile_async<BLOCK_M, HEAD_DIM, ROW_ELEMS, THREADS>(sdO + buffer * BLOCK_M * ROW_ELEMS,
                                                           dout + row * p.do_row_stride, p.do_row_stride,
                                                           p.seqlen_q - row, p.head_dim);
  };

  // Query blocks that see any key of this block: causal rows r see keys up to r + sk - sq.
  const int m_begin = CAUSAL ? max(0, first_key - (p.seqlen_k - p.seqlen_q)) / BLOCK_M : 0;
  const int m_end = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  if (m_begin < m_end) load_q_block(m_begin, 0);
  cp_async_commit();

  // Operand addresses (see FragmentAddress): A fragments of Q and dO (rows x d), B fragments of K
  // and V as K^T / V^T, transposed A fragments of P and dS (P^T, dS^T: keys x rows), transposed B
  // fragments of dO and Q (rows x d as k x n) and of K (keys x d), A fragments of dS (rows x keys).
  const FragmentAddress<ROW_ELEMS> q_a(sQ, wr * 16 + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const FragmentAddress<ROW_ELEMS> do_a(sdO, wr * 16 + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const FragmentAddress<ROW_ELEMS> k_b(sK, wc * 32 + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const FragmentAddress<ROW_ELEMS> v_b(sV, wc * 32 + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const FragmentAddress<BLOCK_N> p_t(sP, lane % 8 + (lane / 16) * 8, (lane / 8) % 2, wr * 16);
  const FragmentAddress<BLOCK_N> ds_t(sdS, lane % 8 + (lane / 16) * 8, (lane / 8) % 2, wr * 16);
  const FragmentAddress<ROW_ELEMS> do_bt(sdO, lane % 8 + ((lane / 8) % 2) * 8, lane / 16, wc * HALF_D);
  const FragmentAddress<ROW_ELEMS> q_bt(sQ, lane % 8 + ((lane / 8) % 2) * 8, lane / 16, wc * HALF_D);
  const FragmentAddress<ROW_ELEMS> k_bt(sK, lane % 8 + ((lane / 8) % 2) * 8, lane / 16, wc * HALF_D);
  const FragmentAddress<BLOCK_N> ds_a(sdS, wr * 16 + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  for (int m = m_begin; m < m_end; ++m) {
    const u32 buffer_offset = ((m - m_begin) % 2) * kQBufferBytes;
    // Q and dO of this step (and K, V on the first) have landed; every warp is done with the
    // previous step, so its Q/dO buffer, sP and sdS can be overwritten.
    cp_async_wait<0>();
    __syncthreads();
    if (m + 1 < m_end) load_q_block(m + 1, (m + 1 - m_begin) % 2);
    cp_async_commit();

    // S = Q K^T and dP = dO V^T for 16 rows x 32 keys per warp.
    float s[4][4], dp[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      u32 aq[4], ado[4];
      ldmatrix_x4(aq, q_a.at(0, ks * 16) + buffer_offset);
      ldmatrix_x4(ado, do_a.at(0, ks * 16) + buffer_offset);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        u32 bk[4], bv[4];
        ldmatrix_x4(bk, k_b.at(np * 16, ks * 16));
        ldmatrix_x4(bv, v_b.at(np * 16, ks * 16));
        Elem::mma(s[2 * np], aq, bk[0], bk[1]);
        Elem::mma(s[2 * np + 1], aq, bk[2], bk[3]);
        Elem::mma(dp[2 * np], ado, bv[0], bv[1]);
        Elem::mma(dp[2 * np + 1], ado, bv[2], bv[3]);
      }
    }

    // P = exp2(S * scale * log2(e) - lse * log2(e)) recomputed from the forward's LSE, 0 where
    // masked (a row that saw no key has lse = -inf and every score masked, so no inf * 0), and
    // dS = P * (dP - delta). Both to shared memory as 16-bit pairs for the next three products.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int local_row = wr * 16 + h * 8 + lane / 4;
      const int row = m * BLOCK_M + local_row;
      const bool row_inside = row < p.seqlen_q;
      const i64 stat = (static_cast<i64>(batch) * p.heads + head) * p.seqlen_q + row;
      const float lse_log2 = row_inside ? p.lse[stat] * kLog2e : 0.f;
      const float delta = row_inside ? p.delta[stat] : 0.f;
      const int key_limit = row_inside ? mask.key_limit(row) - first_key : 0;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int key = wc * 32 + nt * 8 + (lane % 4) * 2;
        float pv[2], dsv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pv[e] = key + e < key_limit ? fast_exp2(fmaf(s[nt][2 * h + e], p.scale_log2, -lse_log2)) : 0.f;
          dsv[e] = pv[e] * (dp[nt][2 * h + e] - delta);
        }
        *reinterpret_cast<u32*>(sP + swizzle<BLOCK_N>(local_row, key)) = Elem::pack(pv[0], pv[1]);
        *reinterpret_cast<u32*>(sdS + swizzle<BLOCK_N>(local_row, key)) = Elem::pack(dsv[0], dsv[1]);
      }
    }
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q: 16 keys x half of head_dim per warp, k over the 64 rows.
#pragma unroll
    for (int kt = 0; kt < BLOCK_M / 16; ++kt) {
      u32 apt[4], adst[4];
      ldmatrix_x4_trans(apt, p_t.at(kt * 16, 0));
      ldmatrix_x4_trans(adst, ds_t.at(kt * 16, 0));
#pragma unroll
      for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
        u32 bdo[4], bq[4];
        ldmatrix_x4_trans(bdo, do_bt.at(kt * 16, dp2 * 16) + buffer_offset);
        ldmatrix_x4_trans(bq, q_bt.at(kt * 16, dp2 * 16) + buffer_offset);
        Elem::mma(dv[2 * dp2], apt, bdo[0], bdo[1]);
        Elem::mma(dv[2 * dp2 + 1], apt, bdo[2], bdo[3]);
        Elem::mma(dk[2 * dp2], adst, bq[0], bq[1]);
        Elem::mma(dk[2 * dp2 + 1], adst, bq[2], bq[3]);
      }
    }

    // dQ += scale * dS K: 16 rows x half of head_dim per warp, k over the 64 keys; added into
    // the fp32 buffer, since every key block contributes to the same rows.
    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
#pragma unroll
    for (int kt = 0; kt < BLOCK_N / 16; ++kt) {
      u32 ads[4];
      ldmatrix_x4(ads, ds_a.at(0, kt * 16));
#pragma unroll
      for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
        u32 bk[4];
        ldmatrix_x4_trans(bk, k_bt.at(kt * 16, dp2 * 16));
        Elem::mma(dq[2 * dp2], ads, bk[0], bk[1]);
        Elem::mma(dq[2 * dp2 + 1], ads, bk[2], bk[3]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m * BLOCK_M + wr * 16 + h * 8 + lane / 4;
      if (row >= p.seqlen_q) continue;
      float* dq_row = p.dq_accum + ((static_cast<i64>(batch) * p.seqlen_q + row) * p.heads + head) * p.head_dim;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int col = wc * HALF_D + dt * 8 + (lane % 4) * 2;
        if (col < p.head_dim) {
          atomicAdd(dq_row + col, dq[dt][2 * h] * p.scale);
          atomicAdd(dq_row + col + 1, dq[dt][2 * h + 1] * p.scale);
        }
      }
    }
  }

  // dK (times the softmax scale) and dV of this block's keys: written directly when this CTA's
  // query head is the only one using its K/V head, else summed over the group in fp32.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = first_key + wr * 16 + h * 8 + lane / 4;
    if (key >= p.seqlen_k) continue;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const int col = wc * HALF_D + dt * 8 + (lane % 4) * 2;
      if (col >= p.head_dim) continue;
      const float dk0 = dk[dt][2 * h] * p.scale, dk1 = dk[dt][2 * h + 1] * p.scale;
      const float dv0 = dv[dt][2 * h], dv1 = dv[dt][2 * h + 1];
      if (p.kv_group == 1) {
        *reinterpret_cast<u32*>(static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + key * p.dk_row_stride +
                                kv_head * p.dk_head_stride + col) = Elem::pack(dk0, dk1);
        *reinterpret_cast<u32*>(static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + key * p.dv_row_stride +
                                kv_head * p.dv_head_stride + col) = Elem::pack(dv0, dv1);
      } else {
        const i64 at = ((static_cast<i64>(batch) * p.seqlen_k + key) * (p.heads / p.kv_group) + kv_head) *
                           p.head_dim + col;
        atomicAdd(p.dk_accum + at, dk0);
        atomicAdd(p.dk_accum + at + 1, dk1);
        atomicAdd(p.dv_accum + at, dv0);
        atomicAdd(p.dv_accum + at + 1, dv1);
      }
    }
  }
}

template <class Elem>
__global__ void __launch_bounds__(256) flash_bwd_convert_sm80(const __grid_constant__ ConvertParams p) {
  const i64 pair = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x;
  const int pairs_per_row = p.head_dim / 2;
  const i64 total = static_cast<i64>(p.batch) * p.seqlen * p.heads * pairs_per_row;
  if (pair >= total) return;
  const int col = static_cast<int>(pair % pairs_per_row) * 2;
  const i64 rest = pair / pairs_per_row;
  const int head = static_cast<int>(rest % p.heads);
  const int row = static_cast<int>((rest / p.heads) % p.seqlen);
  const int batch = static_cast<int>(rest / (static_cast<i64>(p.heads) * p.seqlen));
  const float2 v = *reinterpret_cast<const float2*>(p.src + pair * 2);
  *reinterpret_cast<u32*>(static_cast<u16*>(p.dst) + batch * p.dst_batch_stride + row * p.dst_row_stride +
                          head * p.dst_head_stride + col) = Elem::pack(v.x, v.y);
}

}  // namespace cuflash
