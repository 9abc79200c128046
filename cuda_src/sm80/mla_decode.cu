// MLA decoding with mma.sync (common/mla_decode.cuh), the sm80 family's on every GPU: warp w of a
// warpgroup multiplies rows 16 w .. 16 w + 15, its A fragments (Q, P) and B fragments (K; V
// transposed) read by ldmatrix from the swizzled tiles. Steps of 32 keys (dispatch.MLA_KEYS) keep
// two stages, Q and P within an A100's 163 KB of shared memory.
#include "common/mla_decode.cuh"

namespace cuflash {

struct MlaMmaSync {
  template <int R>
  static __device__ __forceinline__ void drain(float (&)[R]) {}
  static __device__ __forceinline__ void publish() {}

  // mma.sync is synchronous: nothing to issue ahead of the copies.
  template <class T, int D, int KEYS>
  static __device__ __forceinline__ void scores_issue(float (&)[KEYS / 4], const unsigned char*,
                                                      const unsigned char*) {}

  // s = Q K^T for this warp's 16 rows and the warpgroup's KEYS / 2 keys (rows of k).
  template <class T, int D, int KEYS>
  static __device__ __forceinline__ void scores_finish(float (&s)[KEYS / 4], const unsigned char* q,
                                                       const unsigned char* k, int warp, int lane) {
    static_assert(KEYS % 32 == 0, "ldmatrix.x4 reads B 16 keys at a time");
#pragma unroll
    for (int i = 0; i < KEYS / 4; ++i) s[i] = 0.f;
    const u32 q_base = smem_addr(q), k_base = smem_addr(k);
    const int a_row = 16 * warp + lane % 16, b_row = lane % 8 + 8 * (lane / 16);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 a[4];
      ldmatrix_x4(a, q_base + mla_chunk(a_row, 2 * kk + lane / 16, kMlaRows * 128));
#pragma unroll
      for (int np = 0; np < KEYS / 32; ++np) {
        u32 b[4];
        ldmatrix_x4(b, k_base + mla_chunk(b_row + 16 * np, 2 * kk + (lane / 8) % 2, KEYS * 128));
        T::mma(*reinterpret_cast<float(*)[4]>(s + 8 * np), a, b[0], b[1]);
        T::mma(*reinterpret_cast<float(*)[4]>(s + 8 * np + 4), a, b[2], b[3]);
      }
    }
  }

  // o += P V for this warp's 16 rows and the warpgroup's DV / 2 columns of v (keys x columns).
  template <class T, int DV, int KEYS>
  static __device__ __forceinline__ void pv(float (&o)[DV / 4], const unsigned char* p, const unsigned char* v,
                                            int warp, int lane) {
    const u32 p_base = smem_addr(p), v_base = smem_addr(v);
    const int a_row = 16 * warp + lane % 16, b_row = lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      u32 a[4];
      ldmatrix_x4(a, p_base + mla_chunk(a_row, 2 * kk + lane / 16, 0));
#pragma unroll
      for (int np = 0; np < DV / 32; ++np) {
        u32 b[4];
        ldmatrix_x4_trans(b, v_base + mla_chunk(16 * kk + b_row, 2 * np + lane / 16, KEYS * 128));
        T::mma(*reinterpret_cast<float(*)[4]>(o + 8 * np), a, b[0], b[1]);
        T::mma(*reinterpret_cast<float(*)[4]>(o + 8 * np + 4), a, b[2], b[3]);
      }
    }
  }
};

// T: q's type; C: the cache's (T, or e4m3 with descale_kv). ROWS, KEYS, WARPS: the host's tile
// (dispatch.mla_kernel); SMEM_BYTES: the dynamic shared memory it launches with
// (dispatch.mla_smem_bytes), checked against MlaSmem.
template <class T, class C, int D, int DV, int ROWS, int KEYS, int WARPS, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1) mla_decode_sm80(const __grid_constant__ MlaParams p) {
  static_assert(ROWS == kMlaRows && WARPS * 32 == kMlaThreads, "the body's tile (common/mla_decode.cuh)");
  static_assert(SMEM_BYTES == MlaSmem<D, KEYS>::BYTES, "the host's shared memory differs from MlaSmem");
  extern __shared__ __align__(128) unsigned char smem[];
  mla_decode_body<T, C, MlaMmaSync, D, DV, KEYS>(p, smem);
}

}  // namespace cuflash
