// MLA decoding on Hopper (common/mla_decode.cuh): the products by wgmma from shared memory. S = Q K^T
// is m64n(KEYS/2) per warpgroup over D / 16 k-steps, Q and K both K-major; O += P V is m64n(DV/2)
// with P K-major and V, the cache rows' first DV columns, read MN-major from the same stage.
#include "common/mla_decode.cuh"
#include "sm90/mbarrier.cuh"
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

constexpr int kMlaKeys = 64;  // dispatch.MLA_KEYS["sm90"]

// T: q's type; C: the cache's (T, or e4m3 with descale_kv). SMEM_BYTES: the dynamic shared memory
// the host launches with (dispatch.mla_smem_bytes), checked against MlaSmem.
template <class T, class C, int D, int DV, int SMEM_BYTES>
__global__ void __launch_bounds__(kMlaThreads, 1) mla_decode_sm90(const __grid_constant__ MlaParams p) {
  static_assert(SMEM_BYTES == MlaSmem<D, kMlaKeys>::BYTES + kSmemAlignSlack,
                "the host's shared memory differs from MlaSmem");
  extern __shared__ unsigned char smem_raw[];
  // wgmma's descriptors take 1024-byte-aligned tiles (sm90/tiles.cuh).
  unsigned char* smem = smem_raw + ((kSmemAlignSlack - smem_addr(smem_raw) % kSmemAlignSlack) % kSmemAlignSlack);
  mla_decode_body<T, C, MlaWgmma, D, DV, kMlaKeys>(p, smem);
}

}  // namespace sm90
}  // namespace cuflash
