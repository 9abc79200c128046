// Multi-head latent attention decoding (DeepSeek's MLA, cuflash.mla_decode): every query head
// attends one shared latent head of D dims (576: 512 latent + 64 rotary) in a paged cache, whose
// first DV dims (512) are also the values. The body below is shared by the sm80 and sm90 kernels
// (sm80/mla_decode.cu, sm90/mla_decode.cu), which differ only in how they multiply (Product).
//
// One CTA of two warpgroups per (tile of 64 packed query rows, key split, sequence). The rows are
// the sequence's query tokens times the heads, token-major, so a step reads each cache row once
// for all of them. Per step of KEYS keys:
//   - the step's cache rows arrive in shared memory (copies issued one step ahead), once: the
//     keys' D columns feed S = Q K^T, their first DV columns P V;
//   - warpgroup w takes S for keys w KEYS/2 .. (w + 1) KEYS/2 - 1 over all 64 rows and D;
//   - the two exchange their row maxima through shared memory, so both scale by the same
//     running maximum, and write P (16-bit) for their keys into one shared tile;
//   - warpgroup w accumulates O's columns w DV/2 .. (w + 1) DV/2 - 1 over every key of the step.
// Each warpgroup's row sums cover its own keys; they are added at the end. One split writes out
// (and lse); several write fp32 partials that kv_combine merges (generic/combine.cu).
//
// Shared-memory tiles use the 128-byte swizzle of 64-column panels (sm90/wgmma.cuh): 16-byte chunk
// c of row r at chunk c ^ (r % 8). wgmma reads K as a K-major operand and V, the same bytes, as an
// MN-major one; ldmatrix reads both with their row addresses.
#pragma once
#include "common/e4m3.cuh"
#include "common/page_table.cuh"
#include "common/params.cuh"
#include "common/smem.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"

namespace cuflash {

// The tile the body is written for; the kernels take the host's (dispatch.mla_kernel: ROWS, KEYS,
// WARPS) as template arguments and assert that its rows and warps are these. KEYS, the keys of a
// step, is each family's own.
constexpr int kMlaRows = 64;      // packed query rows per CTA: one wgmma M, four warps of m16
constexpr int kMlaThreads = 256;  // two warpgroups

// Where the chunks of a row past its first DV dims come from: the rope array's row, placed so that
// the row's chunk index addresses both halves alike, or (single array) the row itself.
template <int DV, class S>
__device__ __forceinline__ const S* rope_part(const S* row, const void* rope, i64 rope_offset) {
  return rope ? static_cast<const S*>(rope) + rope_offset - DV : row;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of 64-column panels `panel` bytes apart.
__device__ __forceinline__ u32 mla_chunk(int row, int chunk, u32 panel) {
  return (chunk / 8) * panel + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

template <int D, int KEYS>
struct MlaSmem {
  static constexpr u32 Q_PANEL = kMlaRows * 128, KV_PANEL = KEYS * 128;
  static constexpr u32 Q = 0;
  static constexpr u32 KV = Q + (D / 64) * Q_PANEL;
  static constexpr u32 KV_STAGE = (D / 64) * KV_PANEL;
  static constexpr u32 P = KV + 2 * KV_STAGE;                // kMlaRows x KEYS, one panel
  static constexpr u32 EXCHANGE = P + kMlaRows * 128;        // [2 warpgroups][kMlaRows] floats
  static constexpr u32 BYTES = EXCHANGE + 2 * kMlaRows * 4;  // dispatch.mla_smem_bytes, checked by the kernels
  static_assert(KEYS <= 64, "P's rows are one 128-byte panel of 16-bit keys");
};

// The cache rows of one step into a shared stage: thread t copies row t / TPR, chunks t % TPR +
// TPR j. A 16-bit cache goes by cp.async (issue, then land: wait for this thread's copies); an
// e4m3 cache is loaded into registers at issue and widened exactly to T into the stage at land,
// each thread its own chunks, so neither needs the CTA between its halves.
template <class T, class C, int D, int DV, int KEYS>
struct MlaCacheLoader {
  static constexpr int TPR = kMlaThreads / KEYS, CHUNKS = D / 8 / TPR;
  static_assert(D % (8 * TPR) == 0 && DV % (8 * TPR) == 0, "every thread copies as many chunks, of one part each");
  static constexpr bool kFp8 = InputStorage<C>::fp8;
  uint2 staged[kFp8 ? CHUNKS : 1];  // e4m3: 8 bytes, one 16-bit chunk, each

  typedef typename InputStorage<C>::type S;
  int page = 0;  // of this thread's row at the next issue: looked up a step ahead of it

  // The page-table entry of this thread's row at a later issue: a global load whose latency would
  // otherwise stall the copies' issue, and the products behind it, every step.
  __device__ __forceinline__ void lookup(const MlaParams& p, int b, int first_key, int kv_len) {
    const int pos = first_key + int(threadIdx.x) / TPR;
    if (pos < kv_len) page = SequencePages(p.page_table, p.max_pages, b, p.page_size).page_of(pos);
  }

  // Copies the rows of the step at first_key, whose pages lookup found.
  __device__ __forceinline__ void issue(const MlaParams& p, unsigned char* stage, int first_key, int kv_len) {
    const int row = threadIdx.x / TPR, lane_chunk = threadIdx.x % TPR;
    // Row `pos` of sequence b, or nothing past its length (the stage then holds zeros: masked
    // keys must be finite, as 0 * NaN is not 0).
    const int pos = first_key + row;
    const bool valid = pos < kv_len;
    const S* latent = static_cast<const S*>(p.kv_cache);
    const S* rope = latent;
    if (valid) {
      const i64 in_page = pos % p.page_size;
      latent += i64(page) * p.kv_page_stride + in_page * p.kv_row_stride;
      rope = rope_part<DV>(latent, p.kv_rope, i64(page) * p.kv_rope_page_stride + in_page * p.kv_rope_row_stride);
    }
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int chunk = lane_chunk + TPR * j;
      // TPR divides DV / 8, so which part a chunk is in is known at compile time.
      const S* src = (TPR * j >= DV / 8 ? rope : latent) + 8 * chunk;  // 8 elements a chunk
      if constexpr (kFp8) {
        staged[j] = valid ? __ldg(reinterpret_cast<const uint2*>(src)) : make_uint2(0, 0);
      } else {
        cp_async_16(stage + mla_chunk(row, chunk, KEYS * 128), valid ? src : latent, valid ? 16 : 0);
      }
    }
    if constexpr (!kFp8) cp_async_commit();
  }

  __device__ __forceinline__ void land(unsigned char* stage, int, int) {
    if constexpr (kFp8) {
      const int row = threadIdx.x / TPR, lane_chunk = threadIdx.x % TPR;
#pragma unroll
      for (int j = 0; j < CHUNKS; ++j) {
        uint4 wide;
        widen_e4m3_word<T>(staged[j].x, wide.x, wide.y);
        widen_e4m3_word<T>(staged[j].y, wide.z, wide.w);
        *reinterpret_cast<uint4*>(stage + mla_chunk(row, lane_chunk + TPR * j, KEYS * 128)) = wide;
      }
    } else {
      cp_async_wait<0>();
    }
  }
};

// What one CTA computes: its sequence, its tile of packed query rows, the key steps of its split,
// and where this thread's two rows (my_row and my_row + 8 of its warp's 16) stop seeing keys.
template <int KEYS>
struct MlaWork {
  int b, split, rows, first_row, kv_len, step_begin, step_end, tile_key_end_min;
  int my_key_end[2];
  float descale, scale_log2;

  __device__ __forceinline__ explicit MlaWork(const MlaParams& p) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row_tile = blockIdx.x % p.row_tiles;
    split = blockIdx.x / p.row_tiles;
    b = blockIdx.y;
    rows = p.heads * p.seqlen_q;
    kv_len = p.cache_seqlens[b];
    descale = p.descale_kv ? p.descale_kv[b] : p.descale_kv_scalar;
    scale_log2 = p.scale_log2 * descale;
    first_row = row_tile * kMlaRows;
    const int last_row = min(rows, first_row + kMlaRows) - 1;
    tile_key_end_min = key_end(p, first_row);
    const int tile_key_end_max = key_end(p, last_row);
#pragma unroll
    for (int h = 0; h < 2; ++h) my_key_end[h] = key_end(p, min(last_row, first_row + 16 * warp + lane / 4 + 8 * h));
    // Whole steps of KEYS, so only kv_len and the causal bound mask keys.
    const int steps = (kv_len + KEYS - 1) / KEYS;
    const int per_split = (steps + p.num_splits - 1) / p.num_splits;
    step_begin = split * per_split;
    step_end = min(min(steps, step_begin + per_split), (max(tile_key_end_max, 0) + KEYS - 1) / KEYS);
  }

  // Keys a row sees: all kv_len, or with causal those up to its token's place at the end of the
  // sequence (token t of seqlen_q is position kv_len - seqlen_q + t).
  __device__ __forceinline__ int key_end(const MlaParams& p, int row) const {
    return p.causal ? kv_len - p.seqlen_q + 1 + row / p.heads : kv_len;
  }

  // Where packed row `row` (token row / heads, head row % heads) goes: its element offset in out,
  // its index in lse (batch, heads, seqlen_q), and with several splits its row of this split's
  // partials (splits, heads, batch x seqlen_q) in out_partial (times DV) and lse_partial.
  __device__ __forceinline__ i64 out_offset(const MlaParams& p, int row) const {
    return i64(b) * p.o_batch_stride + i64(row / p.heads) * p.o_row_stride + i64(row % p.heads) * p.o_head_stride;
  }
  __device__ __forceinline__ i64 lse_index(const MlaParams& p, int row) const {
    return (i64(b) * p.heads + row % p.heads) * p.seqlen_q + row / p.heads;
  }
  __device__ __forceinline__ i64 partial_row(const MlaParams& p, int row) const {
    return (i64(split) * p.heads + row % p.heads) * (i64(p.batch) * p.seqlen_q) + i64(b) * p.seqlen_q + row / p.heads;
  }
};

// Scores (this thread's 4 NT of a step's, keys key0 + 8 nt + e) to exp2's units, keys at or past
// a row's end to -inf (tested only in a `masked` step, one that crosses a row's end); the
// maximum of each of the thread's two rows over its quad's scores folded into m.
template <int NT, int KEYS>
__device__ __forceinline__ void mla_scale_and_mask(float (&s)[4 * NT], const MlaWork<KEYS>& w, int key0, bool masked,
                                                   float (&m)[2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * nt + 2 * h + e];
        x = (masked && key0 + 8 * nt + e >= w.my_key_end[h]) ? kNegInf : x * w.scale_log2;
        m[h] = fmaxf(m[h], x);
      }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = fmaxf(m[h], __shfl_xor_sync(~0u, m[h], 1));
    m[h] = fmaxf(m[h], __shfl_xor_sync(~0u, m[h], 2));
  }
}

// This thread's probabilities of a step: its scores s (NT 8-column tiles of rows my_row and
// my_row + 8, exp2's units) to exp2(s - base) in place, added to the rows' sums, and written as
// 16-bit P into p_tile (kMlaRows rows of 64 keys, one swizzled panel) from key column col0.
template <class T, int NT>
__device__ __forceinline__ void mla_probabilities(float (&s)[4 * NT], const float (&base)[2], float (&row_sum)[2],
                                                  unsigned char* p_tile, int my_row, int col0, int lane) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float& p0 = s[4 * nt + 2 * h];
      float& p1 = s[4 * nt + 2 * h + 1];
      p0 = fast_exp2(p0 - base[h]);
      p1 = fast_exp2(p1 - base[h]);
      row_sum[h] += p0 + p1;
      const int r = my_row + 8 * h, col = col0 + 8 * nt + 2 * (lane % 4);
      *reinterpret_cast<u32*>(p_tile + r * 128 + (((col / 8) ^ (r % 8)) * 16) + (col % 8) * 2) = T::pack(p0, p1);
    }
}

// Q's ROWS packed rows into their swizzled tile (64-column panels of ROWS x 128 bytes) by cp.async,
// committed as one group: TPR threads a row, thread t copying row t / TPR's chunks t % TPR + TPR j
// (so which part a chunk is in is known at compile time); rows past the sequence's are zeros.
template <int D, int DV, int ROWS = kMlaRows>
__device__ __forceinline__ void mla_load_q(const MlaParams& p, unsigned char* tile, int b, int first_row, int rows) {
  constexpr int TPR = ROWS >= 32 ? kMlaThreads / ROWS : 8;
  static_assert(D % (8 * TPR) == 0 && DV % (8 * TPR) == 0, "every thread copies as many chunks, of one part each");
  if (ROWS * TPR < kMlaThreads && int(threadIdx.x) >= ROWS * TPR) {
    cp_async_commit();
    return;
  }
  const int row = first_row + threadIdx.x / TPR;
  const bool valid = row < rows;
  const int t = valid ? row / p.heads : 0, h = valid ? row % p.heads : 0;
  const u16* latent = static_cast<const u16*>(p.q) + i64(b) * p.q_batch_stride + i64(t) * p.q_row_stride +
                      i64(h) * p.q_head_stride;
  const u16* rope = rope_part<DV>(latent, p.q_rope, i64(b) * p.q_rope_batch_stride + i64(t) * p.q_rope_row_stride +
                                                        i64(h) * p.q_rope_head_stride);
#pragma unroll
  for (int j = 0; j < D / 8 / TPR; ++j) {
    const int chunk = threadIdx.x % TPR + TPR * j;
    cp_async_16(tile + mla_chunk(threadIdx.x / TPR, chunk, ROWS * 128),
                (TPR * j >= DV / 8 ? rope : latent) + 8 * chunk, valid ? 16 : 0);
  }
  cp_async_commit();
}

// The end of a CTA: out (one split) or the fp32 partials, and lse. Warpgroup wg holds O's columns
// wg DV/2 .. (wg + 1) DV/2 - 1 of this thread's two rows, scaled by the running maximum row_max
// (exp2's units), and row_sum, this thread's part of its warpgroup's row sums under the same
// maximum; `exchange` is 2 x kMlaRows floats of shared memory that no thread reads any more.
template <class T, int DV, int KEYS>
__device__ __forceinline__ void mla_write_out(const MlaParams& p, const MlaWork<KEYS>& w, float (&o)[DV / 4],
                                              const float (&row_max)[2], float (&row_sum)[2], float* exchange) {
  constexpr int ON = DV / 16;  // 8-column tiles of a warpgroup's O (DV / 2 columns)
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int my_row = 16 * warp + lane / 4;
  // The row sums over both warpgroups' keys: this thread's columns, its quad's, then the other
  // warpgroup's. The barrier orders the writes after every earlier read of the buffer.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(~0u, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(~0u, row_sum[h], 2);
  }
  __syncthreads();
  if (lane % 4 == 0) {
    exchange[wg * kMlaRows + my_row] = row_sum[0];
    exchange[wg * kMlaRows + my_row + 8] = row_sum[1];
  }
  __syncthreads();

  const bool one_split = p.num_splits == 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = my_row + 8 * h, row = w.first_row + r;
    if (row >= w.rows) continue;
    const float total = exchange[r] + exchange[kMlaRows + r];
    const float lse = row_lse(row_max[h], total);
    const float inv = total == 0.f ? 0.f : w.descale / total;
    const int col0 = wg * (DV / 2) + 2 * (lane % 4);
    if (one_split) {
      u16* out = static_cast<u16*>(p.out) + w.out_offset(p, row);
#pragma unroll
      for (int nt = 0; nt < ON; ++nt)
        *reinterpret_cast<u32*>(out + col0 + 8 * nt) = T::pack(o[4 * nt + 2 * h] * inv, o[4 * nt + 2 * h + 1] * inv);
      if (p.lse && wg == 0 && lane % 4 == 0) p.lse[w.lse_index(p, row)] = lse;
    } else {
      const i64 at = w.partial_row(p, row);
      float* out = p.out_partial + at * DV;
#pragma unroll
      for (int nt = 0; nt < ON; ++nt)
        *reinterpret_cast<float2*>(out + col0 + 8 * nt) =
            make_float2(o[4 * nt + 2 * h] * inv, o[4 * nt + 2 * h + 1] * inv);
      if (wg == 0 && lane % 4 == 0) p.lse_partial[at] = lse;
    }
  }
}

template <class T, class C, class Product, int D, int DV, int KEYS>
__device__ __forceinline__ void mla_decode_body(const MlaParams& p, unsigned char* smem) {
  typedef MlaSmem<D, KEYS> L;
  constexpr int SN = KEYS / 16;  // 8-column tiles of a warpgroup's scores (KEYS / 2 keys)
  constexpr int ON = DV / 16;    // 8-column tiles of a warpgroup's O (DV / 2 columns)
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const MlaWork<KEYS> w(p);
  const int b = w.b, kv_len = w.kv_len, step_begin = w.step_begin, step_end = w.step_end;
  MlaCacheLoader<T, C, D, DV, KEYS> loader;

  mla_load_q<D, DV>(p, smem + L::Q, b, w.first_row, w.rows);
  if (step_begin < step_end) {
    loader.lookup(p, b, step_begin * KEYS, kv_len);
    loader.issue(p, smem + L::KV, step_begin * KEYS, kv_len);
    loader.lookup(p, b, (step_begin + 1) * KEYS, kv_len);
  }

  float o[DV / 4], s[KEYS / 4];
#pragma unroll
  for (int i = 0; i < DV / 4; ++i) o[i] = 0.f;
  float row_max[2] = {kNegInf, kNegInf};  // in units of scale_log2 (exp2's argument)
  float row_sum[2] = {0.f, 0.f};           // this thread's columns of its warpgroup's keys
  float* exchange = reinterpret_cast<float*>(smem + L::EXCHANGE);
  const int my_row = 16 * warp + lane / 4;  // and my_row + 8

  for (int n = step_begin; n < step_end; ++n) {
    unsigned char* stage = smem + L::KV + ((n - step_begin) % 2) * L::KV_STAGE;
    // This thread's P V of the previous step is done (so its registers may be rescaled), and its
    // copies of this step's rows have landed; the barrier makes every thread's visible, and says
    // both warpgroups' previous P V are done: the other stage and the P tile are free.
    Product::drain(o);
    loader.land(stage, n * KEYS, kv_len);
    Product::publish();
    __syncthreads();
    // S in flight (wgmma) while the next step's copies are issued; mma.sync computes it after.
    Product::template scores_issue<T, D, KEYS>(s, smem + L::Q, stage + wg * (KEYS / 2) * 128);
    if (n + 1 < step_end) {
      loader.issue(p, smem + L::KV + ((n + 1 - step_begin) % 2) * L::KV_STAGE, (n + 1) * KEYS, kv_len);
      loader.lookup(p, b, (n + 2) * KEYS, kv_len);
    }
    Product::template scores_finish<T, D, KEYS>(s, smem + L::Q, stage + wg * (KEYS / 2) * 128, warp, lane);
    float step_max[2] = {kNegInf, kNegInf};
    mla_scale_and_mask<SN>(s, w, n * KEYS + wg * (KEYS / 2) + 2 * (lane % 4), (n + 1) * KEYS > w.tile_key_end_min,
                           step_max);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (lane % 4 == 0) exchange[wg * kMlaRows + my_row + 8 * h] = step_max[h];
    // Both warpgroups' maxima of this step (the buffer is rewritten only after the next step's
    // first barrier, which each thread reaches after reading it).
    __syncthreads();
    float correction[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = my_row + 8 * h;
      const float m = fmaxf(row_max[h], fmaxf(exchange[r], exchange[kMlaRows + r]));
      correction[h] = rescale_row(row_max[h], row_sum[h], m, base[h]);
    }
    unsigned char* p_tile = smem + L::P;
    mla_probabilities<T, SN>(s, base, row_sum, p_tile, my_row, wg * (KEYS / 2), lane);
#pragma unroll
    for (int nt = 0; nt < ON; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * nt + e] *= correction[e / 2];
    // P of both warpgroups in the tile before either multiplies it.
    Product::publish();
    __syncthreads();
    Product::template pv<T, DV, KEYS>(o, p_tile, stage + wg * (DV / 128) * L::KV_PANEL, warp, lane);
  }
  Product::drain(o);
  mla_write_out<T, DV, KEYS>(p, w, o, row_max, row_sum, exchange);
}

}  // namespace cuflash
