// MLA decoding on Hopper (common/mla_decode.cuh): the products by wgmma from shared memory. S = Q K^T
// is m64n(KEYS/2) per warpgroup over D / 16 k-steps, Q and K both K-major; O += P V is m64n(DV/2)
// with P K-major and V, the cache rows' first DV columns, read MN-major from the same stage.
#include "common/mla_decode.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/tiles.cuh"
#include "sm90/wgmma.cuh"

namespace cuflash {
namespace sm90 {

struct MlaWgmma {
  // The previous P V's accumulators are final (it is the only group in flight).
  template <int R>
  static __device__ __forceinline__ void drain(float (&o)[R]) {
    wgmma_wait<0>();
    fence_registers(o);
  }
  // wgmma reads shared memory through the async proxy: the generic writes before a barrier (the
  // cp.async copies, the widened e4m3 rows, P) are fenced into it first.
  static __device__ __forceinline__ void publish() { fence_proxy_async_shared(); }

  // s = Q K^T, issued, then waited for (the caller issues copies in between).
  template <class T, int D, int KEYS>
  static __device__ __forceinline__ void scores_issue(float (&s)[KEYS / 4], const unsigned char* q,
                                                      const unsigned char* k) {
    wgmma_fence();
    wgmma_ss_panels<KEYS / 2, T, D / 64>(s, smem_desc_sw128(q), kMlaRows * 128, smem_desc_sw128(k), KEYS * 128);
    wgmma_commit();
    fence_registers(s);
  }
  template <class T, int D, int KEYS>
  static __device__ __forceinline__ void scores_finish(float (&s)[KEYS / 4], const unsigned char*,
                                                       const unsigned char*, int, int) {
    wgmma_wait<0>();
    fence_registers(s);
  }

  // Issued, not waited for: the next step's drain waits, after its copies are issued.
  template <class T, int DV, int KEYS>
  static __device__ __forceinline__ void pv(float (&o)[DV / 4], const unsigned char* p, const unsigned char* v, int,
                                            int) {
    wgmma_fence();
    const u64 p_desc = smem_desc_sw128(p), v_desc = smem_desc_sw128_mn(v, KEYS * 128);
#pragma unroll
    for (int k = 0; k < KEYS / 16; ++k)
      wgmma_ss_t<DV / 2, T, false, true>(o, desc_advance(p_desc, 32 * k), desc_advance(v_desc, 16 * 128 * k), true);
    wgmma_commit();
    fence_registers(o);
  }
};

// T: q's type; C: the cache's (T, or e4m3 with descale_kv). ROWS, KEYS, WARPS: the host's tile
// (dispatch.mla_kernel); SMEM_BYTES: the dynamic shared memory it launches with
// (dispatch.mla_smem_bytes), checked against MlaSmem.
template <class T, class C, int D, int DV, int ROWS, int KEYS, int WARPS, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1) mla_decode_sm90(const __grid_constant__ MlaParams p) {
  static_assert(ROWS == kMlaRows && WARPS * 32 == kMlaThreads, "the body's tile (common/mla_decode.cuh)");
  static_assert(SMEM_BYTES == MlaSmem<D, KEYS>::BYTES + kSmemAlignSlack,
                "the host's shared memory differs from MlaSmem");
  extern __shared__ unsigned char smem_raw[];
  // wgmma's descriptors take 1024-byte-aligned tiles (sm90/tiles.cuh).
  unsigned char* smem = smem_raw + ((kSmemAlignSlack - smem_addr(smem_raw) % kSmemAlignSlack) % kSmemAlignSlack);
  mla_decode_body<T, C, MlaWgmma, D, DV, KEYS>(p, smem);
}


// A 16-bit cache whose steps of 64 rows each lie in one page (pages of a multiple of 64 rows, or
// one page per sequence) comes by TMA instead: one thread issues a step's boxes (64 rows x 64
// columns, 128-byte swizzled as the stages are laid out) on the stage's mbarrier. The SM's copy
// engine streams a step faster than the threads' 16-byte cp.async do (docs/mla.md), and the
// other threads issue no copies.
struct MlaParamsTma {
  TensorMap kv_cache;  // (pages, page_size, 1, its head dim), boxes of 64 rows x 64 columns
  TensorMap kv_rope;   // the split form's rotary cache; else kv_cache's again
  MlaParams base;
};
static_assert(sizeof(MlaParamsTma) == 512, "params.py MLA_PARAMS_TMA mirrors MlaParamsTma");

// Thread `issuer`'s copies of one step: its 64 rows from row first_key % page_size of `page`,
// D / 64 boxes of 64 columns, on `bar` with the bytes announced.
template <int D, int DV, int KEYS>
__device__ __forceinline__ void mla_issue_step(const MlaParamsTma& maps, unsigned char* stage, u64* bar, int first_key,
                                               int page) {
  const MlaParams& p = maps.base;
  mbarrier_arrive_expect_tx(bar, D * KEYS * 2);
  const int row = first_key % p.page_size;
#pragma unroll
  for (int panel = 0; panel < D / 64; ++panel) {
    // Past DV the columns are the rotary ones: the split form's own array from column 0.
    const bool rope = panel >= DV / 64 && p.kv_rope != nullptr;
    tma_load(stage + panel * (KEYS * 128), rope ? &maps.kv_rope : &maps.kv_cache, bar,
             64 * (rope ? panel - DV / 64 : panel), 0, row, page);
  }
}

// Rows valid .. KEYS - 1 of a landed step to zeros, by THREADS threads from `thread`: a page's
// rows beyond the sequence's end hold whatever was written there, possibly NaN, and masked keys
// must be finite, as 0 * NaN is not 0. The writers fence and barrier before wgmma reads them.
template <int D, int KEYS, int THREADS>
__device__ __forceinline__ void mla_zero_rows(unsigned char* stage, int valid, int thread) {
  for (int i = thread; i < (KEYS - valid) * (D / 8); i += THREADS)
    *reinterpret_cast<uint4*>(stage + mla_chunk(valid + i / (D / 8), i % (D / 8), KEYS * 128)) = make_uint4(0, 0, 0, 0);
}

// A warpgroup's wait for a step's boxes; then, in a step that reaches past the sequence's end,
// its rows from `valid` on zeroed by the warpgroup, fenced into the async proxy and barriered
// (`barrier`, 128 threads), so that wgmma reads finite keys.
template <int D, int KEYS>
__device__ __forceinline__ void mla_land_step(u64* full, u32 parity, unsigned char* stage, int valid, int barrier) {
  mbarrier_wait(full, parity);
  if (valid < KEYS) {
    mla_zero_rows<D, KEYS, 128>(stage, valid, threadIdx.x % 128);
    fence_proxy_async_shared();
    named_barrier_sync(barrier, 128);
  }
}

// With the copies off the threads, the TMA kernel also reorders the work: the two warpgroups'
// roles alternate step by step, so that one's softmax runs while the other's products do
// (FlashMLA's schedule; docs/mla.md compares it with both warpgroups in lockstep).
// Step i's owner, warpgroup i % 2, alone computes S = Q K^T for it (all 64 rows, m64n64: Q read
// once a step, not once per warpgroup) and its softmax, scaling by the running maximum after step i - 1, which the previous
// owner published; it publishes P (16-bit, one shared tile) and the new maximum (kMlaReady), and
// both accumulate P V into their halves of O's columns, the owner with P from its registers.
// Order of a warpgroup's work at step i:
//   owner:     wait for the step's boxes; S; wait for S and for its own P V of step i - 1; once
//              both warpgroups' P V of step i - 1 are done (empty), thread 0 of the warpgroup
//              issues step i + 1 into that stage; softmax; P and the maximum out; P V
//   non-owner: wait for its P V of step i - 1 (registers), say so (empty); wait for kMlaReady;
//              rescale O; P V with P from shared memory
// Thread 0 issues steps 0 and 1; the owner of step i issues step i + 1, the stage's previous
// step (i - 1) being one it did not own.
constexpr int kMlaReady = 1;   // named barrier, 256 threads: the owner's P and maximum are out
constexpr int kMlaZeroed = 2;  // + warpgroup, 128 threads: the owner's zeroed rows are written

template <int D, int KEYS>
struct MlaAlternatingSmem {
  static constexpr u32 FULL = MlaSmem<D, KEYS>::BYTES;  // [2] a stage's boxes landed
  static constexpr u32 EMPTY = FULL + 2 * 8;  // [2] all 256 threads' P V of a stage's step done
  static constexpr u32 BYTES = EMPTY + 2 * 8;  // dispatch.mla_smem_bytes
};

template <class T, int D, int DV, int KEYS>
__device__ __forceinline__ void mla_decode_alternating(const MlaParamsTma& maps, unsigned char* smem) {
  const MlaParams& p = maps.base;
  typedef MlaSmem<D, KEYS> L;
  typedef MlaAlternatingSmem<D, KEYS> A;
  constexpr int SN = KEYS / 8;  // 8-column tiles of a step's scores
  constexpr int ON = DV / 16;   // 8-column tiles of a warpgroup's O (DV / 2 columns)
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const MlaWork<KEYS> w(p);
  const int blocks = max(w.step_end - w.step_begin, 0);
  u64* full = reinterpret_cast<u64*>(smem + A::FULL);
  u64* empty = reinterpret_cast<u64*>(smem + A::EMPTY);
  const auto first_key = [&](int i) { return (w.step_begin + i) * KEYS; };
  const auto stage_of = [&](int i) { return smem + L::KV + (i % 2) * L::KV_STAGE; };
  const auto page_of = [&](int i) {
    const int key = first_key(i);
    return key < w.kv_len ? SequencePages(p.page_table, p.max_pages, w.b, p.page_size).page_of(key) : 0;
  };
  const bool issuer = threadIdx.x % 128 == 0;
  int ahead_page = 0;  // an issuer's: the page of the step it issues next, looked up two steps ahead
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&maps.kv_cache);
    prefetch_tensor_map(&maps.kv_rope);
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kMlaThreads);
    }
    mbarrier_init_fence();
    for (int i = 0; i < 2 && i < blocks; ++i) mla_issue_step<D, DV, KEYS>(maps, stage_of(i), &full[i], first_key(i), page_of(i));
    ahead_page = page_of(3);
  } else if (threadIdx.x == 128) {
    ahead_page = page_of(2);
  }
  mla_load_q<D, DV>(p, smem + L::Q, w.b, w.first_row, w.rows);
  // Q's copies, everyone's, are in shared memory and handed to wgmma; the barriers are initialised.
  cp_async_wait<0>();
  fence_proxy_async_shared();
  __syncthreads();

  float o[DV / 4], s[KEYS / 2];
  u32 p_regs[KEYS / 16][4];
#pragma unroll
  for (int i = 0; i < DV / 4; ++i) o[i] = 0.f;
  float row_max[2] = {kNegInf, kNegInf};  // after the last step seen, in exp2's units
  float row_sum[2] = {0.f, 0.f};           // this thread's columns of the steps it owned
  float* exchange = reinterpret_cast<float*>(smem + L::EXCHANGE);  // [step parity][kMlaRows] maxima
  unsigned char* p_tile = smem + L::P;
  const int my_row = 16 * warp + lane / 4;  // and my_row + 8

  for (int i = 0; i < blocks; ++i) {
    const int n = w.step_begin + i;
    unsigned char* stage = stage_of(i);
    const u64 v_desc = smem_desc_sw128_mn(stage + wg * (DV / 128) * L::KV_PANEL, L::KV_PANEL);
    if (i % 2 == wg) {
      mla_land_step<D, KEYS>(&full[i % 2], (i / 2) % 2, stage, w.kv_len - first_key(i), kMlaZeroed + wg);
      wgmma_fence();
      wgmma_ss_panels<KEYS, T, D / 64>(s, smem_desc_sw128(smem + L::Q), L::Q_PANEL, smem_desc_sw128(stage),
                                       L::KV_PANEL);
      wgmma_commit();
      fence_registers(s);
      // S, and this warpgroup's P V of step i - 1 (which read the P tile), are done.
      wgmma_wait<0>();
      fence_registers(s);
      fence_registers(o);
      if (i >= 1) {
        mbarrier_arrive(&empty[(i - 1) % 2]);
        if (issuer && i + 1 < blocks) {
          mbarrier_wait(&empty[(i - 1) % 2], ((i - 1) / 2) % 2);
          mla_issue_step<D, DV, KEYS>(maps, stage_of(i + 1), &full[(i + 1) % 2], first_key(i + 1), ahead_page);
          ahead_page = page_of(i + 3);
        }
      }
      float m[2] = {row_max[0], row_max[1]};
      mla_scale_and_mask<SN>(s, w, n * KEYS + 2 * (lane % 4), (n + 1) * KEYS > w.tile_key_end_min, m);
      float base[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float correction = rescale_row(row_max[h], row_sum[h], m[h], base[h]);
#pragma unroll
        for (int nt = 0; nt < ON; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) o[4 * nt + 2 * h + e] *= correction;
        if (lane % 4 == 0) exchange[(i % 2) * kMlaRows + my_row + 8 * h] = m[h];
      }
      mla_probabilities<T, SN>(s, base, row_sum, p_tile, my_row, 0, lane);
      pack_a<T, SN>(reinterpret_cast<const float(&)[1][SN][4]>(s), p_regs);
      // P and the maxima to the other warpgroup, whose P V reads P through the async proxy.
      fence_proxy_async_shared();
      named_barrier_arrive(kMlaReady, kMlaThreads);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < KEYS / 16; ++k)
        wgmma_rs<DV / 2, T, true>(o, p_regs[k], desc_advance(v_desc, 16 * 128 * k), true);
      wgmma_commit();
      fence_registers(o);
      fence_registers(p_regs);
    } else {
      // Its P V of step i - 1 (registers) is done: O may be rescaled, and the stage refilled as
      // far as this warpgroup goes.
      wgmma_wait<0>();
      fence_registers(o);
      if (i >= 1) mbarrier_arrive(&empty[(i - 1) % 2]);
      named_barrier_sync(kMlaReady, kMlaThreads);
      // The boxes have landed (the owner waited); this wait is the acquire for this warpgroup.
      mbarrier_wait(&full[i % 2], (i / 2) % 2);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float base;
        const float correction =
            rescale_row(row_max[h], row_sum[h], exchange[(i % 2) * kMlaRows + my_row + 8 * h], base);
#pragma unroll
        for (int nt = 0; nt < ON; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) o[4 * nt + 2 * h + e] *= correction;
      }
      MlaWgmma::pv<T, DV, KEYS>(o, p_tile, stage + wg * (DV / 128) * L::KV_PANEL, warp, lane);
    }
  }
  wgmma_wait<0>();
  fence_registers(o);
  mla_write_out<T, DV, KEYS>(p, w, o, row_max, row_sum, exchange);
}

// T: q's and the cache's 16-bit type. ROWS, KEYS, WARPS, SMEM_BYTES: as for mla_decode_sm90, the
// shared memory checked against MlaAlternatingSmem.
template <class T, int D, int DV, int ROWS, int KEYS, int WARPS, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1) mla_decode_alternating_sm90(const __grid_constant__ MlaParamsTma p) {
  static_assert(ROWS == kMlaRows && WARPS * 32 == kMlaThreads, "the body's tile (common/mla_decode.cuh)");
  static_assert(SMEM_BYTES == MlaAlternatingSmem<D, KEYS>::BYTES + kSmemAlignSlack,
                "the host's shared memory differs from MlaAlternatingSmem");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((kSmemAlignSlack - smem_addr(smem_raw) % kSmemAlignSlack) % kSmemAlignSlack);
  mla_decode_alternating<T, D, DV, KEYS>(p, smem);
}

// At <= 32 packed query rows (16 heads, one or two tokens) a 64-row tile is three quarters or half
// padding, and its products, not the copies, bound a step (docs/mla.md). There the products are
// transposed so that the rows are wgmma's N (16 or 32): S^T = K Q^T (m64, the step's keys, by R,
// over D) and O^T = V^T P^T (DV / 64 m64 tiles, V^T read MN-major from the stage, by R, over the
// keys), a quarter or half of the work. The two warpgroups then need nothing from each other per
// step: warpgroup w takes the steps i = w mod 2, each in its own stage, with its own running
// maxima and O^T, like two key splits of one CTA, merged in shared memory at the end. A
// warpgroup refills its stage with step i + 2 once its P V of step i is done, so that one stage
// loads while the other warpgroup computes (dispatch.MLA_NARROW_MIN_KEYS: where this pays).
//
// In the m64nR accumulators of a warpgroup, thread (warp w, lane l) holds rows 16 w + l / 4 (+ 8)
// (keys, or V's columns) and columns 8 j + 2 (l % 4) + e (query rows). A query row's maximum over
// the step's keys is over the lanes of equal l % 4 and then the four warps (through shared memory).
constexpr int kMlaNarrowStep = 1;  // + warpgroup, 128 threads: the warps' maxima, P^T written

template <int D, int DV, int R, int KEYS>
struct MlaNarrowSmem {
  static constexpr u32 Q_PANEL = R * 128, KV_PANEL = KEYS * 128;
  static constexpr u32 Q = 0;
  static constexpr u32 KV = Q + (D / 64) * Q_PANEL;          // [2] stages, one per warpgroup
  static constexpr u32 KV_STAGE = (D / 64) * KV_PANEL;
  static constexpr u32 P = KV + 2 * KV_STAGE;                // [2] P^T tiles, R rows x 64 keys
  static constexpr u32 MAXIMA = P + 2 * R * 128;             // [2][4 warps][R] floats
  static constexpr u32 TOTALS = MAXIMA + 2 * 4 * R * 4;      // [2][4 warps][R] row sums, then [2][R] maxima
  static constexpr u32 FULL = TOTALS + 2 * 4 * R * 4 + 2 * R * 4;  // [2] mbarriers, a stage's step landed
  static constexpr u32 BYTES = FULL + 2 * 8;                 // dispatch.mla_narrow_smem_bytes
  static constexpr u32 OUT_STRIDE = DV + 4;  // floats a row of the merged O (at KV): +4 spreads the banks
  static_assert(KV % 1024 == 0 && P % 1024 == 0, "wgmma's descriptors take 1024-byte-aligned tiles");
  static_assert(R * OUT_STRIDE * 4 <= 2 * KV_STAGE, "the merged O fits in the stages");
};

template <class T, int D, int DV, int R, int KEYS>
__device__ __forceinline__ void mla_decode_narrow(const MlaParamsTma& maps, unsigned char* smem) {
  const MlaParams& p = maps.base;
  constexpr int CN = R / 4;       // query rows (columns) a thread holds: 8 j + 2 (l % 4) + e
  constexpr int VT = DV / 64;     // m64 tiles of O^T
  typedef MlaNarrowSmem<D, DV, R, KEYS> L;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const MlaWork<KEYS> w(p);
  const int blocks = max(w.step_end - w.step_begin, 0);
  u64* full = reinterpret_cast<u64*>(smem + L::FULL);
  unsigned char* stage = smem + L::KV + wg * L::KV_STAGE;
  unsigned char* p_tile = smem + L::P + wg * R * 128;
  float* maxima = reinterpret_cast<float*>(smem + L::MAXIMA) + wg * 4 * R;
  const auto first_key = [&](int i) { return (w.step_begin + i) * KEYS; };
  const auto page_of = [&](int i) {
    const int key = first_key(i);
    return key < w.kv_len ? SequencePages(p.page_table, p.max_pages, w.b, p.page_size).page_of(key) : 0;
  };
  const bool issuer = threadIdx.x % 128 == 0;
  int ahead_page = 0;  // an issuer's: the page of its warpgroup's next step, looked up a step ahead
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&maps.kv_cache);
    prefetch_tensor_map(&maps.kv_rope);
    mbarrier_init(&full[0], 1);
    mbarrier_init(&full[1], 1);
    mbarrier_init_fence();
    for (int i = 0; i < 2 && i < blocks; ++i)
      mla_issue_step<D, DV, KEYS>(maps, smem + L::KV + i * L::KV_STAGE, &full[i], first_key(i), page_of(i));
  }
  if (issuer) ahead_page = page_of(wg + 2);
  mla_load_q<D, DV, R>(p, smem + L::Q, w.b, 0, w.rows);
  // Q's copies, everyone's, are in shared memory and handed to wgmma; the barriers are initialised.
  cp_async_wait<0>();
  fence_proxy_async_shared();
  __syncthreads();

  // This thread's query row c, and its accumulator of key (or V column) row h, in an m64nR tile.
  const auto col_of = [&](int c) { return 8 * (c / 2) + 2 * (lane % 4) + c % 2; };
  const auto acc = [](int c, int h) { return 4 * (c / 2) + 2 * h + c % 2; };
  int col_key_end[CN];  // where each of this thread's query rows stops seeing keys
#pragma unroll
  for (int c = 0; c < CN; ++c) col_key_end[c] = w.key_end(p, col_of(c));
  float o[VT][R / 2], s[R / 2];
#pragma unroll
  for (int t = 0; t < VT; ++t)
#pragma unroll
    for (int e = 0; e < R / 2; ++e) o[t][e] = 0.f;
  float row_max[CN], row_sum[CN];  // exp2's units; row_sum over this thread's two keys of each step
#pragma unroll
  for (int c = 0; c < CN; ++c) {
    row_max[c] = kNegInf;
    row_sum[c] = 0.f;
  }
  const u64 q_desc = smem_desc_sw128(smem + L::Q), k_desc = smem_desc_sw128(stage);
  const u64 p_desc = smem_desc_sw128(p_tile);

  for (int i = wg; i < blocks; i += 2) {
    mla_land_step<D, KEYS>(&full[wg], (i / 2) % 2, stage, w.kv_len - first_key(i), kMlaNarrowStep + wg);
    wgmma_fence();
    wgmma_ss_panels<R, T, D / 64>(s, k_desc, L::KV_PANEL, q_desc, L::Q_PANEL);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);

    // Scaled and masked scores; each query row's maximum over this warp's 16 keys.
    const bool masked = first_key(i) + KEYS > w.tile_key_end_min;
    float m[CN];
#pragma unroll
    for (int c = 0; c < CN; ++c) {
      m[c] = kNegInf;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& x = s[acc(c, h)];
        const int key = first_key(i) + 16 * warp + lane / 4 + 8 * h;
        x = (masked && key >= col_key_end[c]) ? kNegInf : x * w.scale_log2;
        m[c] = fmaxf(m[c], x);
      }
      m[c] = fmaxf(m[c], __shfl_xor_sync(~0u, m[c], 4));
      m[c] = fmaxf(m[c], __shfl_xor_sync(~0u, m[c], 8));
      m[c] = fmaxf(m[c], __shfl_xor_sync(~0u, m[c], 16));
      if (lane < 4) maxima[warp * R + col_of(c)] = m[c];
    }
    named_barrier_sync(kMlaNarrowStep + wg, 128);
#pragma unroll
    for (int c = 0; c < CN; ++c) {
      const int col = col_of(c);
      float step_max = fmaxf(fmaxf(maxima[col], maxima[R + col]), fmaxf(maxima[2 * R + col], maxima[3 * R + col]));
      float base;
      const float correction = rescale_row(row_max[c], row_sum[c], fmaxf(row_max[c], step_max), base);
#pragma unroll
      for (int t = 0; t < VT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) o[t][acc(c, h)] *= correction;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float pv = fast_exp2(s[acc(c, h)] - base);
        row_sum[c] += pv;
        // P^T's row `col` (a query row), key 16 warp + l / 4 + 8 h: K-major B of O^T's product.
        const int key = 16 * warp + lane / 4 + 8 * h;
        *reinterpret_cast<u16*>(p_tile + col * 128 + (((key / 8) ^ (col % 8)) * 16) + (key % 8) * 2) = static_cast<u16>(T::pack(pv, 0.f));
      }
    }
    // P^T whole before wgmma reads it; every thread has read the maxima before they are rewritten.
    fence_proxy_async_shared();
    named_barrier_sync(kMlaNarrowStep + wg, 128);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < KEYS / 16; ++k)
#pragma unroll
      for (int t = 0; t < VT; ++t)
        wgmma_ss_t<R, T, true, false>(o[t], desc_advance(smem_desc_sw128_mn(stage + t * L::KV_PANEL, L::KV_PANEL),
                                                         16 * 128 * k),
                                      desc_advance(p_desc, 32 * k), true);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < VT; ++t) fence_registers(o[t]);
    if (i + 2 < blocks) {
      // Every warp's P V has read the stage (and the P^T tile) before it is refilled.
      named_barrier_sync(kMlaNarrowStep + wg, 128);
      if (issuer) {
        mla_issue_step<D, DV, KEYS>(maps, stage, &full[wg], first_key(i + 2), ahead_page);
        ahead_page = page_of(i + 4);
      }
    }
  }

  // Merge the warpgroups: each query row's sum over the four warps of each, then both maxima.
  float* totals = reinterpret_cast<float*>(smem + L::TOTALS);
  float* final_max = totals + 2 * 4 * R;
#pragma unroll
  for (int c = 0; c < CN; ++c) {
    row_sum[c] += __shfl_xor_sync(~0u, row_sum[c], 4);
    row_sum[c] += __shfl_xor_sync(~0u, row_sum[c], 8);
    row_sum[c] += __shfl_xor_sync(~0u, row_sum[c], 16);
    if (lane < 4) {
      totals[(wg * 4 + warp) * R + col_of(c)] = row_sum[c];
      if (warp == 0) final_max[wg * R + col_of(c)] = row_max[c];
    }
  }
  __syncthreads();
  float* merged = reinterpret_cast<float*>(smem + L::KV);  // R x OUT_STRIDE: the stages are free
  const bool one_split = p.num_splits == 1;
  float scale[CN];
#pragma unroll
  for (int c = 0; c < CN; ++c) {
    const int col = col_of(c);
    const MergedRow both = merge_rows<2>(
        [&](int g) { return final_max[g * R + col]; },
        [&](int g) {
          return totals[(g * 4) * R + col] + totals[(g * 4 + 1) * R + col] + totals[(g * 4 + 2) * R + col] +
                 totals[(g * 4 + 3) * R + col];
        });
    scale[c] = both.sum == 0.f ? 0.f : fast_exp2(row_max[c] - both.base) * w.descale / both.sum;
    if (wg == 0 && warp == 0 && lane < 4 && col < w.rows) {
      const float lse = row_lse(both.max, both.sum);
      if (one_split) {
        if (p.lse) p.lse[w.lse_index(p, col)] = lse;
      } else {
        p.lse_partial[w.partial_row(p, col)] = lse;
      }
    }
  }
  // O = (both warpgroups' O^T, each scaled to the merged maximum and sum), transposed into rows.
  for (int g = 0; g < 2; ++g) {
    if (wg == g) {
#pragma unroll
      for (int t = 0; t < VT; ++t)
#pragma unroll
        for (int c = 0; c < CN; ++c)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float x = o[t][acc(c, h)] * scale[c];
            float& at = merged[col_of(c) * L::OUT_STRIDE + 64 * t + 16 * warp + lane / 4 + 8 * h];
            at = g == 0 ? x : at + x;
          }
    }
    __syncthreads();
  }
  // Rows out, 16 bytes a thread at a time.
  if (one_split) {
    for (int i = threadIdx.x; i < w.rows * (DV / 8); i += kMlaThreads) {
      const int row = i / (DV / 8), v = 8 * (i % (DV / 8));
      const float* src = merged + row * L::OUT_STRIDE + v;
      u16* out = static_cast<u16*>(p.out) + w.out_offset(p, row) + v;
      *reinterpret_cast<uint4*>(out) = make_uint4(T::pack(src[0], src[1]), T::pack(src[2], src[3]),
                                                  T::pack(src[4], src[5]), T::pack(src[6], src[7]));
    }
  } else {
    for (int i = threadIdx.x; i < w.rows * (DV / 4); i += kMlaThreads) {
      const int row = i / (DV / 4), v = 4 * (i % (DV / 4));
      *reinterpret_cast<float4*>(p.out_partial + w.partial_row(p, row) * DV + v) =
          *reinterpret_cast<const float4*>(merged + row * L::OUT_STRIDE + v);
    }
  }
}

// T: q's and the cache's 16-bit type; R: 16 or 32 query rows. KEYS, WARPS, SMEM_BYTES: as for
// mla_decode_sm90, the shared memory checked against MlaNarrowSmem.
template <class T, int D, int DV, int R, int KEYS, int WARPS, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1) mla_decode_narrow_sm90(const __grid_constant__ MlaParamsTma p) {
  static_assert(KEYS == 64, "S^T's M, a step's keys, is one m64 wgmma of a warpgroup");
  static_assert(WARPS * 32 == kMlaThreads, "two warpgroups, each taking every other step");
  static_assert(SMEM_BYTES == MlaNarrowSmem<D, DV, R, KEYS>::BYTES + kSmemAlignSlack,
                "the host's shared memory differs from MlaNarrowSmem");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((kSmemAlignSlack - smem_addr(smem_raw) % kSmemAlignSlack) % kSmemAlignSlack);
  mla_decode_narrow<T, D, DV, R, KEYS>(p, smem);
}

}  // namespace sm90
}  // namespace cuflash
