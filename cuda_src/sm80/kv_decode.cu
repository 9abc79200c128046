// kv_decode (common/kv_cache.cuh): attention of the packed rows of one kv head (its group of query
// heads times the query tokens, GQA packing) over one split of the key range, reading K and V once
// per kv head and split through the page table: mma.sync m16n8k16 on the 16 packed rows, K/V
// tiles by cp.async in two stages (four of an e4m3 cache's bytes). With one split it writes out
// (and lse); with several, fp32 partial out and lse for kv_combine (generic/combine.cu). sm80
// family code (mma.sync, sm80/warp_gemm.cuh), and the decoding kernel of every GPU.
//
// The cache's element type C is q's 16-bit T, or e4m3 (an FP8 cache, values stored / descale):
// kv_decode widens its e4m3 bytes exactly to T in registers right before each mma.sync, and
// scales the scores by descale_k and the output by descale_v.
#include "common/bias.cuh"
#include "common/e4m3.cuh"
#include "common/kv_cache.cuh"
#include "common/smem.cuh"
#include "common/softcap.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

// kv_decode's tile, its template arguments from dispatch.kv_tile: ROWS packed query rows a CTA,
// KEYS keys a main-loop step, WARPS warps.
template <int ROWS_, int KEYS_, int WARPS_>
struct KvTile {
  static constexpr int ROWS = ROWS_, KEYS = KEYS_, WARPS = WARPS_, THREADS = 32 * WARPS_;
};

// e4m3 caches keep KV_FP8_STAGES steps of bytes in shared memory: a step of e4m3 holds half the
// bytes of a 16-bit one, and decoding is bound by the bytes each SM has in flight, so four stages
// (three steps in flight) take the 16-bit two stages' shared memory and keep 1.5x their bytes
// coming.
constexpr int KV_FP8_STAGES = 4;

// Shared memory of kv_decode for cache element C, head-dim bucket D (a multiple of 64, so rows
// are whole 128-byte groups for common/smem.cuh's swizzle): the Q tile; two stages of K and V
// tiles (16-bit caches), or KV_FP8_STAGES stages of e4m3 bytes, which the warps widen in registers
// (kv_scores_e4m3, kv_values_e4m3); after the loop the same bytes hold the warps' partial O for
// the merge; and the warps' row statistics. K: the tile (KvTile).
template <class C, int D, class K>
struct KvTiles {
  u16 q[K::ROWS * D];
  union {
    struct {
      u16 k[2][K::KEYS * D];
      u16 v[2][K::KEYS * D];
    } wide;
    struct {
      u8 k[KV_FP8_STAGES][K::KEYS * D];  // 16-byte chunks placed by e4m3_k_chunk
      u8 v[KV_FP8_STAGES][K::KEYS * D];  // and by e4m3_v_chunk
    } fp8;
    float o[K::WARPS][K::ROWS][D];
  };
  float m[K::WARPS][K::ROWS];  // each warp's row maxima, log2 units
  float l[K::WARPS][K::ROWS];  // and row sums
};

// Where 16-byte chunk c of key row n of an e4m3 K tile sits in its row. A warp reads a K row's
// chunks 4 kq + tig (kv_scores_e4m3) for two rows n, n + 1 at a time: flipping bit 2 for odd rows
// spreads those eight reads over the eight bank groups (rows of 64 bytes already do).
template <int D>
__device__ __forceinline__ int e4m3_k_chunk(int n, int c) {
  return D >= 128 ? c ^ ((n & 1) << 2) : c;
}
// And of an e4m3 V tile: a warp reads rows 4 tig + i (kv_values_e4m3) at lane g's D / 8 bytes, the
// quarter-warp of lanes g = 2p, 2p + 1 over four rows tig: the XOR by the row's tig gives the
// eight chunks distinct bank groups (at d64 two share one: its rows are 64 bytes).
template <int D>
__device__ __forceinline__ int e4m3_v_chunk(int n, int c) {
  static_assert(D == 64 || D == 128 || D == 256, "a bucket of KV_BUCKETS");
  const int tig = (n >> 2) & 3;
  return D == 256 ? c ^ ((tig & 1) | ((tig & 2) << 1)) : c ^ ((2 * tig) & (D / 16 - 2));
}

// How kv_decode's threads split a step's K::KEYS x D tile of cache elements C into 16-byte chunks:
// thread t copies column (t % PER_ROW) * ELEMS of rows t / PER_ROW + i * ROWS_PER_PASS, i < ROWS.
template <class C, int D, class K>
struct KvChunks {
  static constexpr int ELEMS = InputStorage<C>::fp8 ? 16 : 8;  // elements per 16-byte chunk
  static constexpr int PER_ROW = D / ELEMS;
  static constexpr int ROWS_PER_PASS = K::THREADS / PER_ROW;
  static constexpr int ROWS = K::KEYS / ROWS_PER_PASS;
  static_assert(K::THREADS % PER_ROW == 0 && K::KEYS % ROWS_PER_PASS == 0, "tile must split evenly");
};

// Where this thread's rows of one step live: block and row in the block (kv_offsets'), block -1 for
// a row past the split, which kv_issue zero-fills. Looked up a step before the copies, so the
// page-table loads' latency passes under a step's products instead of holding up the cp.async
// issue. The rows are ROWS_PER_PASS positions apart: one division places the first, the others
// carry on from it.
template <class C, int D, class K>
struct KvStepRows {
  typedef KvChunks<C, D, K> Chunks;
  int block[Chunks::ROWS];
  int row[Chunks::ROWS];

  // The rows of keys [n0, n0 + K::KEYS) of sequence b (cache positions start + n), up to n_end.
  __device__ __forceinline__ void find(const KvParams& p, int b, int start, int n0, int n_end) {
    const int n = n0 + int(threadIdx.x) / Chunks::PER_ROW;
    const int pos = start + n;
    int page = 0, in_page = pos;
    const int contiguous_block = p.page_table ? 0 : kv_batch_block(p, b);
    if (p.page_table) {
      page = pos / p.page_size;
      in_page = pos - page * p.page_size;
    }
#pragma unroll
    for (int i = 0; i < Chunks::ROWS; ++i) {
      if (i > 0) {
        in_page += Chunks::ROWS_PER_PASS;
        if (p.page_table) {
          while (in_page >= p.page_size) {
            in_page -= p.page_size;
            ++page;
          }
        }
      }
      const bool ok = n + i * Chunks::ROWS_PER_PASS < n_end;
      row[i] = in_page;
      block[i] = !ok ? -1 : p.page_table ? SequencePages(p.page_table, p.max_pages, b, p.page_size).entry(page)
                                         : contiguous_block;
    }
  }
};

// Issues the cp.async copies of one step's rows (found by `rows`) into stage `stage`, rows past
// the split zero-filled.
template <class C, int D, class K>
__device__ __forceinline__ void kv_issue(const KvParams& p, KvTiles<C, D, K>& s, int stage, int kv_head,
                                         const KvStepRows<C, D, K>& rows) {
  typedef KvChunks<C, D, K> Chunks;
  typedef typename InputStorage<C>::type S;
  const S* kc = static_cast<const S*>(p.k_cache);
  const S* vc = static_cast<const S*>(p.v_cache);
  const int col = (threadIdx.x % Chunks::PER_ROW) * Chunks::ELEMS;
  const int row0 = threadIdx.x / Chunks::PER_ROW;
  const bool col_ok = col < p.head_dim;
#pragma unroll
  for (int i = 0; i < Chunks::ROWS; ++i) {
    const int n = row0 + i * Chunks::ROWS_PER_PASS;
    const bool ok = col_ok && rows.block[i] >= 0;
    i64 k_off = 0, v_off = 0;
    if (ok) kv_offsets(p, rows.block[i], rows.row[i], kv_head, k_off, v_off);
    if constexpr (InputStorage<C>::fp8) {
      cp_async_16(s.fp8.k[stage] + n * D + 16 * e4m3_k_chunk<D>(n, col / 16), kc + k_off + col, ok ? 16 : 0);
      cp_async_16(s.fp8.v[stage] + n * D + 16 * e4m3_v_chunk<D>(n, col / 16), vc + v_off + col, ok ? 16 : 0);
    } else {
      cp_async_16(s.wide.k[stage] + swizzle<D>(n, col), kc + k_off + col, ok ? 16 : 0);
      cp_async_16(s.wide.v[stage] + swizzle<D>(n, col), vc + v_off + col, ok ? 16 : 0);
    }
  }
}

// e4m3 caches: the products read the byte tiles and widen each operand in registers right before
// its mma.sync, each byte once. Two reorderings make every thread's bytes of a fragment adjacent:
// - S = Q K^T takes K as B (n = key, k = head dim): the head-dim axis is permuted for Q and K
//   alike, which leaves Q K^T unchanged. In k step kb (kq = kb / 4), lane (g, tig)'s k indices
//   2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 are head-dim bytes 64 kq + 16 tig + 4 (kb % 4) + 0..3:
//   one 16-byte read of a K row covers four k steps.
// - n8 tile nt of the scores holds the warp's keys 4 (g / 2) + 2 nt + g % 2 at lane g, so S's
//   columns 2 tig, 2 tig + 1 of both tiles, which become P's k indices 2 tig, 2 tig + 1 and
//   2 tig + 8, 2 tig + 9 in O = P V, are keys 4 tig .. 4 tig + 3: four rows of V at one column.
//   Lane g reads D / 8 adjacent bytes of each of those rows, so the head-dim columns of O are
//   permuted too: column n = g of tile dt is head dim (D / 8) g + dt.

// Up to d128 each lane holds its Q fragments through the loop; at d256 they would not fit beside
// O's 128 registers, so each step reloads them, four k steps at a time.
template <int D>
constexpr int KV_HELD_Q_GROUPS = D <= 128 ? D / 64 : 1;

// This lane's Q fragments of k steps 4 kq .. 4 kq + 3, in the permuted head-dim order, from the
// swizzled Q tile.
template <int D>
__device__ __forceinline__ void kv_query_e4m3(u32 (&q)[4][4], const u16* q_tile, int lane, int kq) {
  const int g = lane / 4, tig = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h)  // rows g and g + 8
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4 x = *reinterpret_cast<const uint4*>(q_tile + swizzle<D>(g + 8 * h, 64 * kq + 16 * tig + 8 * half));
      q[2 * half][h] = x.x;
      q[2 * half][2 + h] = x.y;
      q[2 * half + 1][h] = x.z;
      q[2 * half + 1][2 + h] = x.w;
    }
}

// sc += Q K^T over k steps 4 kq .. 4 kq + 3 for this warp's 16 keys of an e4m3 K tile.
template <class T, int D>
__device__ __forceinline__ void kv_scores_e4m3_group(float (&sc)[1][2][4], const u32 (&q)[4][4], const u8* k_tile,
                                                     int kq, int warp, int lane) {
  const int g = lane / 4, tig = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int n = 16 * warp + 4 * (g / 2) + 2 * nt + g % 2;
    const uint4 x = *reinterpret_cast<const uint4*>(k_tile + n * D + 16 * e4m3_k_chunk<D>(n, 4 * kq + tig));
    const u32 words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 b0, b1;
      widen_e4m3_word<T>(words[j], b0, b1);
      T::mma(sc[0][nt], q[j], b0, b1);
    }
  }
}

// sc += Q K^T for this warp's 16 keys of an e4m3 K tile; `held`: kv_query_e4m3's fragments of
// every group when KV_HELD_Q_GROUPS covers them, else they come from the Q tile.
template <class T, int D>
__device__ __forceinline__ void kv_scores_e4m3(float (&sc)[1][2][4], const u32 (&held)[KV_HELD_Q_GROUPS<D>][4][4],
                                               const u16* q_tile, const u8* k_tile, int warp, int lane) {
#pragma unroll
  for (int kq = 0; kq < D / 64; ++kq) {
    if constexpr (KV_HELD_Q_GROUPS<D> == D / 64) {
      kv_scores_e4m3_group<T, D>(sc, held[kq], k_tile, kq, warp, lane);
    } else {
      u32 q[4][4];
      kv_query_e4m3<D>(q, q_tile, lane, kq);
      kv_scores_e4m3_group<T, D>(sc, q, k_tile, kq, warp, lane);
    }
  }
}

// o += P V for this warp's 16 keys of an e4m3 V tile, P the scores' registers.
template <class T, int D>
__device__ __forceinline__ void kv_values_e4m3(float (&o)[1][D / 8][4], const float (&sc)[1][2][4], const u8* v_tile,
                                               int warp, int lane) {
  constexpr int BYTES = D / 8;  // this lane's bytes of a V row
  const int g = lane / 4, tig = lane % 4;
  u32 a[4];
  register_operand<T>(sc).load(a, 0, 0);
  u32 rows[4][BYTES / 4];  // keys 4 tig + i, head dims BYTES g ..
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = 16 * warp + 4 * tig + i;
#pragma unroll
    for (int c = 0; c < BYTES; c += 16) {
      const int at = BYTES * g + c;
      const u8* src = v_tile + n * D + 16 * e4m3_v_chunk<D>(n, at / 16) + at % 16;
      if constexpr (BYTES >= 16) {
        const uint4 x = *reinterpret_cast<const uint4*>(src);
        rows[i][c / 4] = x.x;
        rows[i][c / 4 + 1] = x.y;
        rows[i][c / 4 + 2] = x.z;
        rows[i][c / 4 + 3] = x.w;
      } else {
        const uint2 x = *reinterpret_cast<const uint2*>(src);
        rows[i][0] = x.x;
        rows[i][1] = x.y;
      }
    }
  }
#pragma unroll
  for (int w = 0; w < BYTES / 4; ++w) {
    // Keys 0, 1 (and 2, 3) of head dims 4 w .. 4 w + 3 interleaved: each 16-bit half is one column's
    // pair, so widening a word gives two columns' b0 (b1).
    const u32 k01_c01 = __byte_perm(rows[0][w], rows[1][w], 0x5140);
    const u32 k01_c23 = __byte_perm(rows[0][w], rows[1][w], 0x7362);
    const u32 k23_c01 = __byte_perm(rows[2][w], rows[3][w], 0x5140);
    const u32 k23_c23 = __byte_perm(rows[2][w], rows[3][w], 0x7362);
    u32 b0[4], b1[4];
    widen_e4m3_word<T>(k01_c01, b0[0], b0[1]);
    widen_e4m3_word<T>(k01_c23, b0[2], b0[3]);
    widen_e4m3_word<T>(k23_c01, b1[0], b1[1]);
    widen_e4m3_word<T>(k23_c23, b1[2], b1[3]);
#pragma unroll
    for (int c = 0; c < 4; ++c) T::mma(o[0][4 * w + c], a, b0[c], b1[c]);
  }
}

// grid (num_splits * row_tiles, heads_kv, batch), THREADS threads. Packed row m of a kv head is
// query token m / group of query head kv_head * group + m % group; the CTA's 16 rows are one m16
// tile of mma.sync m16n8k16. Each step's KEYS keys arrive by cp.async, the next steps' copies in
// flight under this step's products (STAGES - 1 of them). Warp w takes keys 16w .. 16w + 15 of
// every step with its own online softmax and O; the warps' (max, sum, O) merge once at the end.
// T: q's type; C: the cache's (T, or e4m3 with descales); D: the head-dim bucket. ROWS, KEYS, WARPS,
// CTAS_PER_SM: the tile and the CTAs resident per SM that the host plans with (dispatch.kv_tile);
// SMEM_BYTES: the dynamic shared memory it launches with (dispatch.kv_smem_bytes).
template <class T, class C, int D, int ROWS, int KEYS, int WARPS, int CTAS_PER_SM, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, CTAS_PER_SM) kv_decode(const __grid_constant__ KvParams p) {
  typedef KvTile<ROWS, KEYS, WARPS> K;
  static_assert(ROWS == 16, "a CTA's rows are one m16 tile: each thread holds rows lane / 4 and lane / 4 + 8");
  static_assert(KEYS == 16 * WARPS, "warp w takes keys 16 w .. 16 w + 15 of a step (kv_scores_e4m3, kv_values_e4m3)");
  static_assert(SMEM_BYTES == sizeof(KvTiles<C, D, K>), "the host's shared memory differs from KvTiles");
  constexpr int THREADS = K::THREADS;
  constexpr bool FP8 = InputStorage<C>::fp8;
  constexpr int STAGES = FP8 ? KV_FP8_STAGES : 2;
  constexpr int DT = D / 8;  // n8 tiles of O per warp
  extern __shared__ __align__(128) unsigned char smem_raw[];
  KvTiles<C, D, K>& s = *reinterpret_cast<KvTiles<C, D, K>*>(smem_raw);
  const int split = blockIdx.x / p.row_tiles, tile = blockIdx.x % p.row_tiles;
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int group = p.heads / p.heads_kv;
  const int seqlen_q = kv_seqlen_q(p, b);
  const int rows = seqlen_q * group;
  const int row0 = tile * ROWS;
  // In a mixed batch the long sequences are the forward kernel's (cuflash/_core/plan.py).
  if (row0 >= rows || (p.max_decode_rows && seqlen_q > p.max_decode_rows)) return;
  const int start = kv_leftpad(p, b);
  const int seqlen_k = kv_cached(p, b) - start + kv_seqlen_new(p, b);
  const i64 first_row = kv_first_row(p, b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Keys this CTA's rows may see: row i sees [i + shift - left, i + shift + right] with
  // shift = seqlen_k - seqlen_q, within [0, seqlen_k); the union over the tile's tokens.
  const int shift = seqlen_k - seqlen_q;
  const int tok_lo = row0 / group, tok_hi = min(rows - 1, row0 + ROWS - 1) / group;
  const int key_lo = p.window_left < 0 ? 0 : max(0, tok_lo + shift - p.window_left);
  const int key_hi = p.window_right < 0 ? seqlen_k : min(seqlen_k, tok_hi + shift + p.window_right + 1);
  // This split's share, in whole steps.
  const int blocks = (max(key_hi - key_lo, 0) + KEYS - 1) / KEYS;
  const int per_split = (blocks + p.num_splits - 1) / p.num_splits;
  const int split_lo = key_lo + split * per_split * KEYS;
  const int split_hi = min(key_hi, split_lo + per_split * KEYS);
  const int steps = split_hi > split_lo ? (split_hi - split_lo + KEYS - 1) / KEYS : 0;
  KvStepRows<C, D, K> next_rows;  // the rows of the next step to issue
  if (steps > 0) {
    next_rows.find(p, b, start, split_lo, split_hi);
    kv_issue<C, D, K>(p, s, 0, kv_head, next_rows);
    cp_async_commit();
    if (steps > 1) next_rows.find(p, b, start, split_lo + KEYS, split_hi);
    // The further stages' steps (e4m3 caches).
#pragma unroll
    for (int i = 1; i < STAGES - 1 && i < steps; ++i) {
      kv_issue<C, D, K>(p, s, i, kv_head, next_rows);
      cp_async_commit();
      if (i + 1 < steps) next_rows.find(p, b, start, split_lo + (i + 1) * KEYS, split_hi);
    }
  }

  // Q rows into the swizzled tile (the rotated copy when rotary), 16 bytes per load, zeros past
  // the rows and head_dim.
  for (int i = threadIdx.x; i < ROWS * D / 8; i += THREADS) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8, m = row0 + r;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (m < rows && c < p.head_dim) {
      const int tk = m / group, hh = kv_head * group + m % group;
      const u16* src;
      if (p.q_rot) {
        src = static_cast<const u16*>(p.q_rot) + ((first_row + tk) * p.heads + hh) * p.head_dim;
      } else {
        src = static_cast<const u16*>(p.q) +
              (p.cu_seqlens_q ? (first_row + tk) * p.q_row_stride : i64(b) * p.q_batch_stride + i64(tk) * p.q_row_stride) +
              i64(hh) * p.q_head_stride;
      }
      x = *reinterpret_cast<const uint4*>(src + c);
    }
    *reinterpret_cast<uint4*>(s.q + swizzle<D>(r, c)) = x;
  }

  // This thread's rows (g and g + 8 of the tile) and their key bounds.
  const int g = lane / 4, tig = lane % 4;
  int lo[2], hi[2];
  bool live[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = row0 + g + 8 * h;
    live[h] = m < rows;
    const int token = live[h] ? m / group : 0;
    lo[h] = max(split_lo, p.window_left < 0 ? 0 : token + shift - p.window_left);
    hi[h] = min(split_hi, p.window_right < 0 ? seqlen_k : token + shift + p.window_right + 1);
    if (!live[h]) hi[h] = lo[h];  // sees nothing
  }
  // The keys both live rows see: steps inside them need no mask. A dead row's results are never
  // written, so its scores may stay unmasked.
  int lo_max = split_lo, hi_min = split_hi;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (live[h]) {
      lo_max = max(lo_max, lo[h]);
      hi_min = min(hi_min, hi[h]);
    }
  }
  // An e4m3 cache's descales: k's scales the scores (inside a softcap's tanh), v's the output.
  // An e4m3 q's descale scales the scores as k's does.
  const float descale_k = kv_descale(p.descale_k, p.descale_k_scalar, p, b, kv_head) *
                          kv_descale(p.descale_q, p.descale_q_scalar, p, b, kv_head);
  const float score_log2 = p.softcap_scale > 0.f ? p.scale_log2 : p.scale_log2 * descale_k;
  const float tanh_scale = p.softcap_scale * descale_k;
  // ALiBi (common/bias.cuh): each of this thread's rows has its own head's slope, in raw score
  // units, and its distance to the first key of a step's column of this thread.
  float alibi_slope_raw[2], alibi_distance0[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = row0 + g + 8 * h;
    alibi_slope_raw[h] = alibi_slope(p, b, kv_head * group + m % group, score_log2);
    alibi_distance0[h] = float(m / group + shift - 16 * warp);
  }

  // 16-bit caches' ldmatrix addresses: Q as the A operand, this warp's 16 keys of K (B of
  // S = Q K^T) and of V (B of O = P V, read k-major), in stage 0; a stage is KEYS * D * 2 bytes
  // further.
  const FragmentAddress<D> q_frag(s.q, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const FragmentAddress<D> k_frag(s.wide.k[0], 16 * warp + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const FragmentAddress<D> v_frag(s.wide.v[0], 16 * warp + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  constexpr u32 STAGE_BYTES = KEYS * D * 2;
  // e4m3 caches: Q's fragments held through the loop (the Q tile written above).
  u32 q_e4m3[KV_HELD_Q_GROUPS<D>][4][4];
  if constexpr (FP8 && KV_HELD_Q_GROUPS<D> == D / 64) {
    __syncthreads();  // the Q tile, written by every thread, is in place
#pragma unroll
    for (int kq = 0; kq < D / 64; ++kq) kv_query_e4m3<D>(q_e4m3[kq], s.q, lane, kq);
  }

  float o[1][DT][4];
  clear(o);
  OnlineSoftmax<1> softmax;
  softmax.init();
  for (int step = 0; step < steps; ++step) {
    const int n0 = split_lo + step * KEYS;
    if (step + STAGES - 1 < steps) {
      kv_issue<C, D, K>(p, s, u32(step + STAGES - 1) % STAGES, kv_head, next_rows);
      cp_async_commit();
      if (step + STAGES < steps) next_rows.find(p, b, start, n0 + STAGES * KEYS, split_hi);
      cp_async_wait<STAGES - 1>();
    } else {
      cp_async_wait_at_most<STAGES - 2>(steps - 1 - step);  // the steps after this one may stay in flight
    }
    __syncthreads();  // this step's tiles (and, the first time, Q) are in place
    const u32 stage = (step & 1) * STAGE_BYTES;
    const int fp8_stage = u32(step) % STAGES;

    float sc[1][2][4];
    clear(sc);
    if constexpr (FP8) {
      kv_scores_e4m3<T, D>(sc, q_e4m3, s.q, s.fp8.k[fp8_stage], warp, lane);
    } else {
      u32 q_tiles[1][4], k_tiles[4];
      warp_gemm<D / 16, T>(sc, q_tiles, k_tiles, smem_operand<false>(q_frag), smem_operand<false>(k_frag, stage));
    }
    if (p.softcap_scale > 0.f) softcap_scores(sc, tanh_scale);
    if (p.alibi_slopes != nullptr) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int column = (FP8 ? 4 * tig + 2 * nt : 8 * nt + 2 * tig) + (e & 1), h = e / 2;
          sc[0][nt][e] = fmaf(-alibi_slope_raw[h], fabsf(alibi_distance0[h] - float(n0 + column)), sc[0][nt][e]);
        }
    }
    // Only steps that cross a bound of this thread's live rows need masking.
    if (n0 < lo_max || n0 + KEYS > hi_min) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // e4m3 caches: kv_scores_e4m3's key order.
          const int key = n0 + 16 * warp + (FP8 ? 4 * tig + 2 * nt : 8 * nt + 2 * tig) + (e & 1), h = e / 2;
          if (key < lo[h] || key >= hi[h]) sc[0][nt][e] = kNegInf;
        }
    }
    softmax.update(sc, o, score_log2);
    if constexpr (FP8) {
      kv_values_e4m3<T, D>(o, sc, s.fp8.v[fp8_stage], warp, lane);
    } else {
      u32 p_tiles[1][4], v_tiles[4];
      warp_gemm<1, T>(o, p_tiles, v_tiles, register_operand<T>(sc), smem_operand<true>(v_frag, stage));
    }
    __syncthreads();  // every warp is done with this stage before the next issue overwrites it
  }

  // Merge the warps: each row's max M over the warps, its sum L = sum_w l_w 2^(m_w - M), and
  // O = sum_w 2^(m_w - M) O_w / L, through shared memory (the tiles are free now).
  float m_log2[2], l_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = softmax.row_sum[0][h];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    l_row[h] = sum;
    m_log2[h] = softmax.row_max[0][h] == kNegInf ? kNegInf : softmax.row_max[0][h] * score_log2;
    if (tig == 0) {
      s.m[warp][g + 8 * h] = m_log2[h];
      s.l[warp][g + 8 * h] = sum;
    }
  }
  __syncthreads();
  // With one split the rows take their head's sink here; several splits leave it to kv_combine.
  const bool split_out = p.num_splits > 1;
  const auto merged_warps = [&](int r) {
    const MergedRow row = merge_rows<WARPS>([&](int w) { return s.m[w][r]; }, [&](int w) { return s.l[w][r]; });
    return split_out ? row : with_sink(row, sink_log2(p, kv_head * group + (row0 + r) % group));
  };
  const float descale_v = kv_descale(p.descale_v, p.descale_v_scalar, p, b, kv_head);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    const MergedRow merged = merged_warps(r);
    const float factor = merged.sum > 0.f ? fast_exp2(m_log2[h] - merged.base) * descale_v / merged.sum : 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      // e4m3 caches' O columns are permuted (kv_values_e4m3): column n of tile dt is head dim
      // (D / 8) n + dt.
      s.o[warp][r][FP8 ? (D / 8) * (2 * tig) + dt : 8 * dt + 2 * tig] = o[0][dt][2 * h] * factor;
      s.o[warp][r][FP8 ? (D / 8) * (2 * tig + 1) + dt : 8 * dt + 2 * tig + 1] = o[0][dt][2 * h + 1] * factor;
    }
  }
  __syncthreads();

  // Epilogue: pairs of columns of the 16 rows, coalesced along each row.
  const i64 total_rows = p.cu_seqlens_q ? i64(p.cu_seqlens_q[p.batch]) : i64(p.batch) * p.seqlen_q;
  for (int i = threadIdx.x; i < ROWS * D / 2; i += THREADS) {
    const int r = i / (D / 2), c = 2 * (i % (D / 2)), m = row0 + r;
    if (m >= rows || c >= p.head_dim) continue;
    float x0 = 0.f, x1 = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      x0 += s.o[w][r][c];
      x1 += s.o[w][r][c + 1];
    }
    const int token = m / group, head = kv_head * group + m % group;
    const i64 grow = first_row + token;
    if (split_out) {
      *reinterpret_cast<float2*>(p.out_partial + ((i64(split) * p.heads + head) * total_rows + grow) * p.head_dim + c) =
          make_float2(x0, x1);
    } else {
      u16* out = static_cast<u16*>(p.out) +
                 (p.cu_seqlens_q ? grow * p.o_row_stride : i64(b) * p.o_batch_stride + i64(token) * p.o_row_stride) +
                 i64(head) * p.o_head_stride;
      *reinterpret_cast<u32*>(out + c) = T::pack(x0, x1);
    }
  }
  if (threadIdx.x < ROWS && row0 + int(threadIdx.x) < rows && (split_out || p.lse)) {
    const int r = threadIdx.x, m = row0 + r;
    const MergedRow merged = merged_warps(r);
    const float lse = row_lse(merged.max, merged.sum);
    const int token = m / group, head = kv_head * group + m % group;
    const i64 grow = first_row + token;
    if (split_out) {
      p.lse_partial[(i64(split) * p.heads + head) * total_rows + grow] = lse;
    } else {
      p.lse[p.cu_seqlens_q ? i64(head) * total_rows + grow : (i64(b) * p.heads + head) * p.seqlen_q + token] = lse;
    }
  }
}

}  // namespace cuflash
