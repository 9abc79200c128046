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
  MlaCacheLoader<T, C, D, DV, kMlaKeys> loader;
  mla_decode_body<T, C, MlaWgmma, D, DV, kMlaKeys>(p, smem, loader);
}


// A 16-bit cache whose steps of 64 rows each lie in one page (pages of a multiple of 64 rows, or
// one page per sequence) comes by TMA instead: thread 0 issues a step's boxes (64 rows x 64
// columns, 128-byte swizzled as the stages are laid out) on the stage's mbarrier. The SM's copy
// engine streams a step at ~4.2-4.6 TB/s where the threads' 16-byte cp.async reach ~3.7-4.0
// (docs/mla.md), and the threads issue no copies.
struct MlaParamsTma {
  TensorMap kv_cache;  // (pages, page_size, 1, its head dim), boxes of 64 rows x 64 columns
  TensorMap kv_rope;   // the split form's rotary cache; else kv_cache's again
  MlaParams base;
};
static_assert(sizeof(MlaParamsTma) == 512, "params.py MLA_PARAMS_TMA mirrors MlaParamsTma");

template <int D>
struct MlaTmaSmem {
  static constexpr u32 FULL = MlaSmem<D, kMlaKeys>::BYTES;  // an mbarrier per stage: its boxes landed
  static constexpr u32 BYTES = FULL + 2 * 8;                // dispatch.mla_smem_bytes
};

// MlaCacheLoader's interface. Stages are issued and landed in turn, so counts give each stage's
// mbarrier phase.
template <int D, int DV, int KEYS>
struct MlaTmaLoader {
  const MlaParamsTma& maps;
  u64* full;  // [2], one arrival (thread 0's, with the bytes) a phase
  int page = 0;  // of the next issue's rows (thread 0), looked up a step ahead of it
  int issued = 0, landed = 0;

  __device__ __forceinline__ void lookup(const MlaParams& p, int b, int first_key, int kv_len) {
    if (threadIdx.x == 0 && first_key < kv_len) page = p.page_table[i64(b) * p.max_pages + first_key / p.page_size];
  }

  __device__ __forceinline__ void issue(const MlaParams& p, unsigned char* stage, int first_key, int) {
    if (threadIdx.x == 0) {
      u64* bar = &full[issued % 2];
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
    ++issued;
  }

  // Waits for the step's boxes; rows past the sequence's end (a page's rows beyond kv_len hold
  // whatever was written there, possibly NaN) become zeros, as masked keys must be finite: 0 * NaN
  // is not 0. The caller fences and barriers after.
  __device__ __forceinline__ void land(unsigned char* stage, int first_key, int kv_len) {
    mbarrier_wait(&full[landed % 2], (landed / 2) % 2);
    ++landed;
    const int valid = kv_len - first_key;
    if (valid < KEYS) {
      for (int i = threadIdx.x; i < (KEYS - valid) * (D / 8); i += kMlaThreads)
        *reinterpret_cast<uint4*>(stage + mla_chunk(valid + i / (D / 8), i % (D / 8), KEYS * 128)) =
            make_uint4(0, 0, 0, 0);
    }
  }
};

// T: q's and the cache's 16-bit type. SMEM_BYTES: as for mla_decode_sm90, checked against MlaTmaSmem.
template <class T, int D, int DV, int SMEM_BYTES>
__global__ void __launch_bounds__(kMlaThreads, 1) mla_decode_tma_sm90(const __grid_constant__ MlaParamsTma p) {
  static_assert(SMEM_BYTES == MlaTmaSmem<D>::BYTES + kSmemAlignSlack, "the host's shared memory differs from MlaTmaSmem");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((kSmemAlignSlack - smem_addr(smem_raw) % kSmemAlignSlack) % kSmemAlignSlack);
  u64* full = reinterpret_cast<u64*>(smem + MlaTmaSmem<D>::FULL);
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&p.kv_cache);
    prefetch_tensor_map(&p.kv_rope);
    mbarrier_init(&full[0], 1);
    mbarrier_init(&full[1], 1);
    mbarrier_init_fence();
  }
  // Every thread waits on the barriers; they are initialised first.
  __syncthreads();
  MlaTmaLoader<D, DV, kMlaKeys> loader{p, full};
  mla_decode_body<T, T, MlaWgmma, D, DV, kMlaKeys>(p.base, smem, loader);
}

}  // namespace sm90
}  // namespace cuflash
