// Attention against a KV cache (cuflash/kvcache.py): three kernels, launched in this order on one
// stream.
//
// kv_append: the new keys and values written into the cache in place at cache_seqlens (through
//   the page table when paged), the keys rotated first; and q rotated into a scratch copy. One
//   CTA per (token, sequence); elementwise, it moves a few KB per call. An e4m3 cache gets the new
//   tokens quantized: x / descale in float32, saturated to +-448, rounded to nearest even.
// kv_decode: attention of the packed rows of one kv head (its group of query heads times the
//   query tokens, GQA packing) over one split of the key range, reading K and V once per kv head
//   and split through the page table. Scores and products on CUDA cores in fp32. With one split
//   it writes out (and lse); with several, fp32 partial out and lse for kv_combine.
// kv_combine: the splits merged through their lse; also cuflash.combine's kernel.
//
// The cache's element type C is q's 16-bit T, or e4m3 (an FP8 cache, values stored / descale):
// kv_decode widens its e4m3 tiles exactly to T and scales the scores by descale_k and the output
// by descale_v.
#include "common/e4m3.cuh"
#include "common/types.cuh"

namespace cuflash {

struct KvParams {
  // Pointers first (params.py KV_POINTERS fills them per call).
  const void* q;             // (batch, seqlen_q, heads, d), or packed (total_q, heads, d)
  void* k_cache;             // contiguous (batch_cache, seqlen_cache, heads_kv, d) or paged (pages, page_size, heads_kv, d)
  void* v_cache;
  const void* k_new;         // (batch, seqlen_new, heads_kv, d) or packed (total_q, heads_kv, d); null: no append
  const void* v_new;
  void* out;                 // like q
  float* lse;                // (batch, heads, seqlen_q) or (heads, total_q); null: not wanted
  float* out_partial;        // (splits, heads, rows, d) fp32, rows = batch * seqlen_q or total_q
  float* lse_partial;        // (splits, heads, rows)
  const int* cache_seqlens;  // (batch,); null: cache_seqlens_scalar
  const int* page_table;     // (batch, max_pages); null: a contiguous cache
  const int* cache_batch_idx;
  const int* cache_leftpad;
  const int* cu_seqlens_q;   // (batch + 1,); null: fixed-length q
  const void* rotary_cos;    // (seqlen_ro, rotary_dim / 2), q's type or fp32 (rotary_fp32)
  const void* rotary_sin;
  void* q_rot;               // rotated q, contiguous (rows, heads, d) in q's type; null: no rotary
  const float* descale_k;    // e4m3 cache: (batch, heads_kv) float32; null: descale_k_scalar
  const float* descale_v;
  // Strides in elements: batch (or page), row, head.
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 kc_batch_stride, kc_row_stride, kc_head_stride;
  i64 vc_batch_stride, vc_row_stride, vc_head_stride;
  i64 kn_batch_stride, kn_row_stride, kn_head_stride;
  i64 vn_batch_stride, vn_row_stride, vn_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  int batch, seqlen_q, heads, heads_kv, head_dim;
  int page_size, max_pages, capacity;
  int cache_seqlens_scalar, seqlen_new;
  int rotary_dim, rotary_interleaved, rotary_per_row, rotary_fp32;
  int num_splits, row_tiles;
  int window_left, window_right;  // -1 unbounded; causal is right = 0
  float scale_log2;               // softmax_scale * log2(e), or softcap * log2(e) with a softcap
  float softcap_scale;            // softmax_scale / softcap; 0: no softcap
  float descale_k_scalar, descale_v_scalar;  // e4m3 cache without descale arrays (1 otherwise)
};

template <class T>
__device__ __forceinline__ float load_elem(const void* p, i64 i) {
  return T::unpack(u32(static_cast<const u16*>(p)[i])).x;
}
template <class T>
__device__ __forceinline__ void store_elem(void* p, i64 i, float x) {
  static_cast<u16*>(p)[i] = u16(T::pack(x, 0.f) & 0xffffu);
}

__device__ __forceinline__ int kv_cached(const KvParams& p, int b) {
  return p.cache_seqlens ? p.cache_seqlens[b] : p.cache_seqlens_scalar;
}
__device__ __forceinline__ int kv_leftpad(const KvParams& p, int b) {
  return p.cache_leftpad ? p.cache_leftpad[b] : 0;
}
// Query rows of sequence b and the global row index of its first one.
__device__ __forceinline__ int kv_seqlen_q(const KvParams& p, int b) {
  return p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] : p.seqlen_q;
}
__device__ __forceinline__ i64 kv_first_row(const KvParams& p, int b) {
  return p.cu_seqlens_q ? i64(p.cu_seqlens_q[b]) : i64(b) * p.seqlen_q;
}
// New tokens of sequence b: as many as its queries when q is packed.
__device__ __forceinline__ int kv_seqlen_new(const KvParams& p, int b) {
  if (!p.k_new) return 0;
  return p.cu_seqlens_q ? kv_seqlen_q(p, b) : p.seqlen_new;
}
// Element offset of (logical position, kv head) of sequence b in a cache with the given strides.
__device__ __forceinline__ i64 kv_slot(const KvParams& p, int b, int position, int kv_head, i64 batch_stride,
                                       i64 row_stride, i64 head_stride) {
  i64 block, row;
  if (p.page_table) {
    block = p.page_table[i64(b) * p.max_pages + position / p.page_size];
    row = position % p.page_size;
  } else {
    block = p.cache_batch_idx ? p.cache_batch_idx[b] : b;
    row = position;
  }
  return block * batch_stride + row * row_stride + i64(kv_head) * head_stride;
}

// The descale of (sequence b, kv head h): the array's entry, or the scalar.
__device__ __forceinline__ float kv_descale(const float* array, float scalar, const KvParams& p, int b, int h) {
  return array ? array[i64(b) * p.heads_kv + h] : scalar;
}

// Element access of a cache of C for q's type T: C = T stores 16-bit values; C = e4m3 stores
// x / descale, saturated to +-448 and rounded to nearest even (cuflash.quantize_fp8's rounding).
template <class T, class C>
struct KvStore {
  typedef u16 S;
  static __device__ __forceinline__ void at(void* p, i64 i, float x, float) { store_elem<T>(p, i, x); }
};
template <class T>
struct KvStore<T, e4m3> {
  typedef u8 S;
  static __device__ __forceinline__ void at(void* p, i64 i, float x, float descale) {
    const float y = fminf(fmaxf(__fdiv_rn(x, descale), -E4M3_MAX), E4M3_MAX);
    static_cast<u8*>(p)[i] = to_e4m3(y);
  }
};

template <class T>
__device__ __forceinline__ float rotary_table(const KvParams& p, const void* table, i64 i) {
  return p.rotary_fp32 ? static_cast<const float*>(table)[i] : load_elem<T>(table, i);
}

// Rotates (or copies, past rotary_dim) one head's row of d values from src to dst at position pos;
// each thread of the CTA takes pairs of dimensions. dst holds Store's elements (descale: an e4m3
// cache's).
template <class T, class Store>
__device__ void rotate_row(const KvParams& p, const void* src, void* dst, int pos, float descale) {
  const int half = p.rotary_dim / 2;
  for (int j = threadIdx.x; j < p.head_dim / 2; j += blockDim.x) {
    int a, c;  // the pair's two dimensions
    if (j < half) {
      a = p.rotary_interleaved ? 2 * j : j;
      c = p.rotary_interleaved ? 2 * j + 1 : j + half;
    } else {
      a = 2 * j;
      c = 2 * j + 1;
    }
    float x0 = load_elem<T>(src, a), x1 = load_elem<T>(src, c);
    if (j < half) {
      const float cs = rotary_table<T>(p, p.rotary_cos, i64(pos) * half + j);
      const float sn = rotary_table<T>(p, p.rotary_sin, i64(pos) * half + j);
      const float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
      x0 = y0;
      x1 = y1;
    }
    Store::at(dst, a, x0, descale);
    Store::at(dst, c, x1, descale);
  }
}

// grid (max(seqlen_new, seqlen_q) tokens, batch). Half-split pairs past rotary_dim are not pairs
// of the table: rotate_row copies dimensions 2j, 2j+1 there, which for j >= rotary_dim / 2 lie past
// rotary_dim in both styles.
template <class T, class C>
__global__ void kv_append(const __grid_constant__ KvParams p) {
  typedef KvStore<T, C> Store;
  typedef typename Store::S S;
  const int t = blockIdx.x, b = blockIdx.y;
  const int cached = kv_cached(p, b);
  if (t < kv_seqlen_new(p, b)) {
    const int pos = cached + t;
    const i64 new_row = p.cu_seqlens_q ? i64(p.cu_seqlens_q[b]) + t : i64(t);
    for (int h = 0; h < p.heads_kv; ++h) {
      const u16* kn = static_cast<const u16*>(p.k_new) + (p.cu_seqlens_q ? 0 : i64(b) * p.kn_batch_stride) +
                      new_row * p.kn_row_stride + i64(h) * p.kn_head_stride;
      const u16* vn = static_cast<const u16*>(p.v_new) + (p.cu_seqlens_q ? 0 : i64(b) * p.vn_batch_stride) +
                      new_row * p.vn_row_stride + i64(h) * p.vn_head_stride;
      S* kc = static_cast<S*>(p.k_cache) + kv_slot(p, b, pos, h, p.kc_batch_stride, p.kc_row_stride, p.kc_head_stride);
      S* vc = static_cast<S*>(p.v_cache) + kv_slot(p, b, pos, h, p.vc_batch_stride, p.vc_row_stride, p.vc_head_stride);
      const float dk = kv_descale(p.descale_k, p.descale_k_scalar, p, b, h);
      const float dv = kv_descale(p.descale_v, p.descale_v_scalar, p, b, h);
      if (p.rotary_dim) {
        rotate_row<T, Store>(p, kn, kc, pos, dk);
      } else {
        for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) Store::at(kc, c, load_elem<T>(kn, c), dk);
      }
      for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) Store::at(vc, c, load_elem<T>(vn, c), dv);
    }
  }
  if (p.q_rot && t < kv_seqlen_q(p, b)) {
    const int pos = cached + (p.rotary_per_row ? t : 0);
    const i64 row = kv_first_row(p, b) + t;
    for (int h = 0; h < p.heads; ++h) {
      const u16* src = static_cast<const u16*>(p.q) + (p.cu_seqlens_q ? 0 : i64(b) * p.q_batch_stride) +
                       (p.cu_seqlens_q ? row : i64(t)) * p.q_row_stride + i64(h) * p.q_head_stride;
      u16* dst = static_cast<u16*>(p.q_rot) + (row * p.heads + h) * p.head_dim;
      rotate_row<T, KvStore<T, T>>(p, src, dst, pos, 1.f);
    }
  }
}

constexpr int KV_ROWS = 16;      // packed query rows per CTA
constexpr int KV_KEYS = 64;      // keys per main-loop step
constexpr int KV_THREADS = 128;  // 8 threads per row: KV_ROWS * 8
constexpr int KV_LANES = KV_THREADS / KV_ROWS;

// Shared memory of kv_decode for head-dim bucket D: q rows in fp32, K and V tiles in 16 bits with
// rows padded by 16 bytes (8 rows' reads of one column fall in 8 different banks), and P.
template <int D>
struct KvSmem {
  static constexpr int PITCH = D + 8;
  float q[KV_ROWS][D];
  u16 k[KV_KEYS][PITCH];
  u16 v[KV_KEYS][PITCH];
  float p[KV_ROWS][KV_KEYS];
};

// grid (num_splits * row_tiles, heads_kv, batch), KV_THREADS threads. Packed row m of a kv head is
// query token m / group of query head kv_head * group + m % group.
template <class T, class C, int D>
__global__ void __launch_bounds__(KV_THREADS, 4) kv_decode(const __grid_constant__ KvParams p) {
  typedef typename KvStore<T, C>::S S;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  KvSmem<D>& s = *reinterpret_cast<KvSmem<D>*>(smem_raw);
  const int split = blockIdx.x / p.row_tiles, tile = blockIdx.x % p.row_tiles;
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int group = p.heads / p.heads_kv;
  const int seqlen_q = kv_seqlen_q(p, b);
  const int rows = seqlen_q * group;
  const int row0 = tile * KV_ROWS;
  if (row0 >= rows) return;
  const int start = kv_leftpad(p, b);
  const int seqlen_k = kv_cached(p, b) - start + kv_seqlen_new(p, b);
  const i64 first_row = kv_first_row(p, b);

  // This thread's row and its lanes.
  const int r = threadIdx.x / KV_LANES, lane = threadIdx.x % KV_LANES;
  const int m = row0 + r;
  const bool row_valid = m < rows;
  const int token = row_valid ? m / group : 0, head = kv_head * group + (row_valid ? m % group : 0);

  // Q rows into shared memory (rotated copy when rotary).
  for (int i = threadIdx.x; i < KV_ROWS * D; i += KV_THREADS) {
    const int rr = i / D, c = i % D, mm = row0 + rr;
    float x = 0.f;
    if (mm < rows && c < p.head_dim) {
      const int tk = mm / group, hh = kv_head * group + mm % group;
      if (p.q_rot) {
        x = load_elem<T>(p.q_rot, ((first_row + tk) * p.heads + hh) * p.head_dim + c);
      } else {
        const i64 off = (p.cu_seqlens_q ? (first_row + tk) * p.q_row_stride
                                        : i64(b) * p.q_batch_stride + i64(tk) * p.q_row_stride) +
                        i64(hh) * p.q_head_stride + c;
        x = load_elem<T>(p.q, off);
      }
    }
    s.q[rr][c] = x;
  }

  // Keys this CTA's rows may see: row i sees [i + shift - left, i + shift + right] with
  // shift = seqlen_k - seqlen_q, within [0, seqlen_k); the union over the tile's tokens.
  const int shift = seqlen_k - seqlen_q;
  const int tok_lo = row0 / group, tok_hi = min(rows - 1, row0 + KV_ROWS - 1) / group;
  int key_lo = p.window_left < 0 ? 0 : max(0, tok_lo + shift - p.window_left);
  int key_hi = p.window_right < 0 ? seqlen_k : min(seqlen_k, tok_hi + shift + p.window_right + 1);
  // This split's share, in whole key blocks.
  const int blocks = (max(key_hi - key_lo, 0) + KV_KEYS - 1) / KV_KEYS;
  const int per_split = (blocks + p.num_splits - 1) / p.num_splits;
  const int split_lo = key_lo + split * per_split * KV_KEYS;
  const int split_hi = min(key_hi, split_lo + per_split * KV_KEYS);
  // This row's own bounds.
  const int my_lo = p.window_left < 0 ? 0 : token + shift - p.window_left;
  const int my_hi = p.window_right < 0 ? seqlen_k : token + shift + p.window_right + 1;

  constexpr int COLS = D / KV_LANES;  // output columns per thread: lane + KV_LANES * j
  float o[COLS];
#pragma unroll
  for (int j = 0; j < COLS; ++j) o[j] = 0.f;
  float row_max = kNegInf, row_sum = 0.f;
  const S* kc = static_cast<const S*>(p.k_cache);
  const S* vc = static_cast<const S*>(p.v_cache);
  // An e4m3 cache's descales: k's scales the scores (inside a softcap's tanh), v's the output.
  const float descale_k = kv_descale(p.descale_k, p.descale_k_scalar, p, b, kv_head);
  const float descale_v = kv_descale(p.descale_v, p.descale_v_scalar, p, b, kv_head);
  const float score_log2 = p.softcap_scale > 0.f ? p.scale_log2 : p.scale_log2 * descale_k;
  const float tanh_scale = p.softcap_scale * descale_k;

  for (int n0 = split_lo; n0 < split_hi; n0 += KV_KEYS) {
    __syncthreads();  // the previous step's K, V and P reads are done (and Q is stored)
    // K and V rows of this step, 16 bytes per load, through the page table.
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < KV_KEYS * CHUNKS; i += KV_THREADS) {
      const int n = i / CHUNKS, c = (i % CHUNKS) * 8;
      uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
      if (n0 + n < split_hi && c < p.head_dim) {
        const int pos = start + n0 + n;
        const S* kp = kc + kv_slot(p, b, pos, kv_head, p.kc_batch_stride, p.kc_row_stride, p.kc_head_stride) + c;
        const S* vp = vc + kv_slot(p, b, pos, kv_head, p.vc_batch_stride, p.vc_row_stride, p.vc_head_stride) + c;
        if constexpr (InputStorage<C>::fp8) {  // 8 bytes widened to 8 values of T
          const uint2 kb = *reinterpret_cast<const uint2*>(kp), vb = *reinterpret_cast<const uint2*>(vp);
          kx = make_uint4(widen_e4m3_pair<T>(kb.x, 0x1404u), widen_e4m3_pair<T>(kb.x, 0x3424u),
                          widen_e4m3_pair<T>(kb.y, 0x1404u), widen_e4m3_pair<T>(kb.y, 0x3424u));
          vx = make_uint4(widen_e4m3_pair<T>(vb.x, 0x1404u), widen_e4m3_pair<T>(vb.x, 0x3424u),
                          widen_e4m3_pair<T>(vb.y, 0x1404u), widen_e4m3_pair<T>(vb.y, 0x3424u));
        } else {
          kx = *reinterpret_cast<const uint4*>(kp);
          vx = *reinterpret_cast<const uint4*>(vp);
        }
      }
      *reinterpret_cast<uint4*>(&s.k[n][c]) = kx;
      *reinterpret_cast<uint4*>(&s.v[n][c]) = vx;
    }
    __syncthreads();

    // Scores of this row against keys lane + KV_LANES * j.
    constexpr int KEYS_PER_LANE = KV_KEYS / KV_LANES;
    float sc[KEYS_PER_LANE];
    float step_max = kNegInf;
#pragma unroll
    for (int j = 0; j < KEYS_PER_LANE; ++j) {
      const int n = lane + KV_LANES * j, key = n0 + n;
      float acc = 0.f;
#pragma unroll 8
      for (int c = 0; c < D; c += 2) {
        const float2 kk = T::unpack(*reinterpret_cast<const u32*>(&s.k[n][c]));
        acc += s.q[r][c] * kk.x + s.q[r][c + 1] * kk.y;
      }
      float x = p.softcap_scale > 0.f ? tanhf(acc * tanh_scale) * score_log2 : acc * score_log2;
      if (!row_valid || key >= split_hi || key < my_lo || key >= my_hi) x = kNegInf;
      sc[j] = x;
      step_max = fmaxf(step_max, x);
    }
#pragma unroll
    for (int off = KV_LANES / 2; off > 0; off /= 2) step_max = fmaxf(step_max, __shfl_xor_sync(~0u, step_max, off));
    const float new_max = fmaxf(row_max, step_max);
    const float base = new_max == kNegInf ? 0.f : new_max;
    const float alpha = exp2f(row_max - base);  // 0 when nothing was seen (exp2(-inf))
    float step_sum = 0.f;
#pragma unroll
    for (int j = 0; j < KEYS_PER_LANE; ++j) {
      const float e = exp2f(sc[j] - base);
      s.p[r][lane + KV_LANES * j] = e;
      step_sum += e;
    }
#pragma unroll
    for (int off = KV_LANES / 2; off > 0; off /= 2) step_sum += __shfl_xor_sync(~0u, step_sum, off);
    row_sum = row_sum * alpha + step_sum;
    row_max = new_max;
    __syncwarp();  // the row's P, written by its KV_LANES lanes of this warp
#pragma unroll
    for (int j = 0; j < COLS; ++j) o[j] *= alpha;
    for (int n = 0; n < KV_KEYS; ++n) {
      const float pn = s.p[r][n];
#pragma unroll
      for (int j = 0; j < COLS; j += 2) {
        // columns lane*2 + KV_LANES*2*(j/2) and the next: pairs of 16-bit values
        const int c = 2 * lane + 2 * KV_LANES * (j / 2);
        const float2 vv = T::unpack(*reinterpret_cast<const u32*>(&s.v[n][c]));
        o[j] += pn * vv.x;
        o[j + 1] += pn * vv.y;
      }
    }
  }

  // Epilogue: this thread's columns 2 * lane + 2 * KV_LANES * (j / 2) + (j % 2).
  if (!row_valid) return;
  const bool empty = row_sum == 0.f;
  const float inv = empty ? 0.f : descale_v / row_sum;
  const float lse = empty ? kNegInf : (row_max + log2f(row_sum)) * 0.69314718055994531f;
  const i64 grow = first_row + token;  // global row
  if (p.num_splits == 1) {
    u16* out = static_cast<u16*>(p.out) +
               (p.cu_seqlens_q ? grow * p.o_row_stride : i64(b) * p.o_batch_stride + i64(token) * p.o_row_stride) +
               i64(head) * p.o_head_stride;
#pragma unroll
    for (int j = 0; j < COLS; j += 2) {
      const int c = 2 * lane + 2 * KV_LANES * (j / 2);
      if (c < p.head_dim) *reinterpret_cast<u32*>(out + c) = T::pack(o[j] * inv, o[j + 1] * inv);
    }
    if (p.lse && lane == 0) {
      const i64 at = p.cu_seqlens_q ? i64(head) * (p.cu_seqlens_q[p.batch]) + grow
                                    : (i64(b) * p.heads + head) * p.seqlen_q + token;
      p.lse[at] = lse;
    }
  } else {
    const i64 total_rows = p.cu_seqlens_q ? i64(p.cu_seqlens_q[p.batch]) : i64(p.batch) * p.seqlen_q;
    const i64 at = (i64(split) * p.heads + head) * total_rows + grow;
    float* out = p.out_partial + at * p.head_dim;
#pragma unroll
    for (int j = 0; j < COLS; j += 2) {
      const int c = 2 * lane + 2 * KV_LANES * (j / 2);
      if (c < p.head_dim) *reinterpret_cast<float2*>(out + c) = make_float2(o[j] * inv, o[j + 1] * inv);
    }
    if (lane == 0) p.lse_partial[at] = lse;
  }
}

struct CombineParams {
  const float* out_partial;
  const float* lse_partial;
  void* out;
  float* lse;  // null: not wanted
  // Strides in elements: split, batch, row, head.
  i64 op_split_stride, op_batch_stride, op_row_stride, op_head_stride;
  i64 lp_split_stride, lp_batch_stride, lp_row_stride, lp_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 l_batch_stride, l_row_stride, l_head_stride;
  int splits, batch, seqlen, heads, head_dim;
};

struct store_f32 {
  static __device__ __forceinline__ void at(void* p, i64 i, float x) { static_cast<float*>(p)[i] = x; }
};
template <class T>
struct store_16 {
  static __device__ __forceinline__ void at(void* p, i64 i, float x) { store_elem<T>(p, i, x); }
};

// One warp per (batch, row, head), COMBINE_WARPS per CTA; grid.x covers batch * seqlen * heads.
constexpr int COMBINE_WARPS = 4;

template <class Store>
__global__ void __launch_bounds__(COMBINE_WARPS * 32) kv_combine(const __grid_constant__ CombineParams p) {
  const i64 item = i64(blockIdx.x) * COMBINE_WARPS + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= i64(p.batch) * p.seqlen * p.heads) return;
  const int h = int(item % p.heads);
  const i64 bi = item / p.heads;
  const int i = int(bi % p.seqlen), b = int(bi / p.seqlen);
  const float* lp = p.lse_partial + i64(b) * p.lp_batch_stride + i64(i) * p.lp_row_stride + i64(h) * p.lp_head_stride;
  float mx = kNegInf;
  for (int s = lane; s < p.splits; s += 32) mx = fmaxf(mx, lp[s * p.lp_split_stride]);
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, off));
  const float base = mx == kNegInf ? 0.f : mx;
  float total = 0.f;
  for (int s = lane; s < p.splits; s += 32) total += expf(lp[s * p.lp_split_stride] - base);
  for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(~0u, total, off);
  const bool empty = total == 0.f;
  const float lse = empty ? kNegInf : base + logf(total);
  const float* op = p.out_partial + i64(b) * p.op_batch_stride + i64(i) * p.op_row_stride + i64(h) * p.op_head_stride;
  const i64 o_at = i64(b) * p.o_batch_stride + i64(i) * p.o_row_stride + i64(h) * p.o_head_stride;
  for (int c = lane; c < p.head_dim; c += 32) {
    float acc = 0.f;
    if (!empty) {
      for (int s = 0; s < p.splits; ++s) {
        const float l = lp[s * p.lp_split_stride];
        if (l != kNegInf) acc += expf(l - lse) * op[s * p.op_split_stride + c];
      }
    }
    Store::at(p.out, o_at + c, acc);
  }
  if (p.lse && lane == 0) p.lse[i64(b) * p.l_batch_stride + i64(i) * p.l_row_stride + i64(h) * p.l_head_stride] = lse;
}

}  // namespace cuflash

namespace cuflash {
static_assert(sizeof(KvParams) == 384, "params.py KV_PARAMS mirrors KvParams");
static_assert(sizeof(CombineParams) == 168, "params.py COMBINE_PARAMS mirrors CombineParams");
}  // namespace cuflash
