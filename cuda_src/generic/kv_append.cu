// kv_append (common/kv_cache.cuh): the new keys and values written into the cache in place at
// cache_seqlens (through the page table when paged), the keys rotated first; and q rotated into a
// scratch copy (an e4m3 q widened there instead, without rotary). One CTA per (token, sequence); elementwise, it moves a few KB per call. An e4m3
// cache gets the new tokens quantized: x / descale in float32, saturated to +-448, rounded to
// nearest even.
//
// generic/: kernels that use no family's instructions (elementwise work and reductions), built for
// the sm80 target and run as they are on every GPU, beside either family's kernels.
#include "common/e4m3.cuh"
#include "common/kv_cache.cuh"
#include "common/types.cuh"

namespace cuflash {

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

// grid (max(seqlen_new, seqlen_q) tokens, batch); with cu_seqlens_k_new seqlen_new is the packed
// total, a bound on any sequence's count. Half-split pairs past rotary_dim are not pairs
// of the table: rotate_row copies dimensions 2j, 2j+1 there, which for j >= rotary_dim / 2 lie past
// rotary_dim in both styles.
template <class T, class C>
__global__ void kv_append(const __grid_constant__ KvParams p) {
  typedef KvStore<T, C> Store;
  typedef typename Store::S S;
  const int t = blockIdx.x, b = blockIdx.y;
  const int cached = kv_cached(p, b);
  const int rotary_start = p.rotary_dim ? kv_rotary_start(p, b) : 0;
  if (t < kv_seqlen_new(p, b)) {
    const int pos = cached + t;
    const i64 new_row = kv_new_first_row(p, b) + t;
    const bool packed = kv_new_packed(p);
    for (int h = 0; h < p.heads_kv; ++h) {
      const u16* kn = static_cast<const u16*>(p.k_new) + (packed ? 0 : i64(b) * p.kn_batch_stride) +
                      new_row * p.kn_row_stride + i64(h) * p.kn_head_stride;
      const u16* vn = static_cast<const u16*>(p.v_new) + (packed ? 0 : i64(b) * p.vn_batch_stride) +
                      new_row * p.vn_row_stride + i64(h) * p.vn_head_stride;
      i64 k_off, v_off;
      kv_rows(p, b, pos, h, k_off, v_off);
      S* kc = static_cast<S*>(p.k_cache) + k_off;
      S* vc = static_cast<S*>(p.v_cache) + v_off;
      const float dk = kv_descale(p.descale_k, p.descale_k_scalar, p, b, h);
      const float dv = kv_descale(p.descale_v, p.descale_v_scalar, p, b, h);
      if (p.rotary_dim) {
        rotate_row<T, Store>(p, kn, kc, rotary_start + t, dk);
      } else {
        for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) Store::at(kc, c, load_elem<T>(kn, c), dk);
      }
      for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) Store::at(vc, c, load_elem<T>(vn, c), dv);
    }
  }
  if (p.q_e4m3 && t < kv_seqlen_q(p, b)) {
    // An e4m3 q widened exactly to T (bf16) into the scratch the attention reads; its descale
    // joins descale_k's on the scores (kv_decode).
    const i64 row = kv_first_row(p, b) + t;
    for (int h = 0; h < p.heads; ++h) {
      const u8* src = static_cast<const u8*>(p.q) + (p.cu_seqlens_q ? 0 : i64(b) * p.q_batch_stride) +
                      (p.cu_seqlens_q ? row : i64(t)) * p.q_row_stride + i64(h) * p.q_head_stride;
      u16* dst = static_cast<u16*>(p.q_rot) + (row * p.heads + h) * p.head_dim;
      for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) dst[c] = u16(widen_e4m3_pair<T>(src[c], 0x1404u));
    }
  } else if (p.q_rot && t < kv_seqlen_q(p, b)) {
    const int pos = rotary_start + (p.rotary_per_row ? t : 0);
    const i64 row = kv_first_row(p, b) + t;
    for (int h = 0; h < p.heads; ++h) {
      const u16* src = static_cast<const u16*>(p.q) + (p.cu_seqlens_q ? 0 : i64(b) * p.q_batch_stride) +
                       (p.cu_seqlens_q ? row : i64(t)) * p.q_row_stride + i64(h) * p.q_head_stride;
      u16* dst = static_cast<u16*>(p.q_rot) + (row * p.heads + h) * p.head_dim;
      rotate_row<T, KvStore<T, T>>(p, src, dst, pos, 1.f);
    }
  }
}

}  // namespace cuflash
