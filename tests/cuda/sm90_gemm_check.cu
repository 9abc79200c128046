// Smoke test of the sm90 building blocks (cuda_src/sm90/): C = A * B^T on one CTA, with the
// operands streamed by TMA through a 2-stage shared-memory ring guarded by mbarriers and
// multiplied by wgmma. Test-only (tests/test_sm90_blocks.py compiles it with cuda_src/ on the
// include path); nothing in the library includes it.
//
// A is 64 x K and B is N x K, both K-major 16-bit (or, B_MN_MAJOR, B is K x N row-major: the
// layout V has in O += P V; A_MN_MAJOR, A is K x 64 row-major too: dS in the backward's
// dQ = dS K); C is 64 x N fp32, row-major. Warpgroup 0 is
// the producer (one thread issues the copies), warpgroup 1 the consumer (all 128 threads run the
// wgmma). Every stage also goes back out through a TMA store into `a_copy`, so the test sees
// the swizzled load and store round-trip bit for bit.
#include "common/smem.cuh"
#include "common/types.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace cuflash {
namespace sm90_check {

using sm90::TensorMap;
using sm90::u64;

// Mirrored by the NumPy dtype built with cuflash.tma.param_dtype in the test.
struct GemmCheckParams {
  TensorMap a;       // A: 2-D (K, 64) or, HIGH_RANK, 3-D (K, 64, batches): box (64, 64[, 1]);
                     // A_MN_MAJOR: 2-D (64, K), box (64, 64)
  TensorMap b;       // B: 2-D (K, N) or, HIGH_RANK, 4-D BSHD-like (K, heads, N, batches): box (64[, 1], N[, 1]);
                     // B_MN_MAJOR: 2-D (N, K), box (64, 64): one 64-column panel of 64 K rows
  TensorMap a_copy;  // where each A stage is stored back: the layout of `a`
  float* c;          // 64 x N fp32, row-major
  int* status;       // 0, or the code of the first wait that timed out (see wait_or_flag)
  int k_blocks;      // K / 64
  int a_batch;       // HIGH_RANK: the A slice (outermost coordinate)
  int b_batch;       // HIGH_RANK: the B slice's batch and head coordinates
  int b_head;
};
// The field offsets are checked by the CPU test against the NumPy layout (NVRTC 13.0 has no
// __builtin_offsetof in constant expressions).
static_assert(sizeof(GemmCheckParams) == 448 && alignof(GemmCheckParams) == 64, "the test packs 448 bytes");

constexpr int kM = 64;        // rows of A and C: one wgmma M
constexpr int kBlockK = 64;   // K per stage: one 128-byte swizzled row of 16-bit elements
constexpr int kStages = 2;
constexpr int kThreads = 256;

// A wait that gives up after about a second (2^31 cycles at under 2 GHz) instead of hanging the
// test: it records `code` in *status and returns false. The library's mbarrier_wait loops for ever.
__device__ __forceinline__ bool wait_or_flag(u64* bar, u32 parity, int* status, int code) {
  const long long start = clock64();
  while (!sm90::mbarrier_try_wait(bar, parity)) {
    if (clock64() - start > (1ll << 31)) {
      atomicCAS(status, 0, code);
      return false;
    }
  }
  return true;
}

// N: 64 or 128. A_IN_REGISTERS: A fragments loaded from the swizzled tile into registers
// (the rs form, as P * V will run) instead of read by descriptor. HIGH_RANK: 3-D and 4-D maps
// instead of 2-D. SETMAXNREG: producer and consumer move registers as a warp-specialised kernel
// does. B_MN_MAJOR (with A_IN_REGISTERS, 2-D maps): B stored N-contiguous in N / 64 panels of 64 K
// rows, read through smem_desc_sw128_mn with imm-trans-b, as the sm90 forward reads V. A_MN_MAJOR
// (with B_MN_MAJOR, the ss form, N = 64): A stored M-contiguous as 64 K rows of 64 M values, read
// through smem_desc_sw128_mn with imm-trans-a, as the sm90 backward reads dS. Elem: bf16 or f16.
template <int N, bool A_IN_REGISTERS, bool HIGH_RANK, bool SETMAXNREG, bool B_MN_MAJOR, bool A_MN_MAJOR, class Elem>
__global__ void __launch_bounds__(kThreads, 1) gemm_check(const __grid_constant__ GemmCheckParams p) {
  constexpr u32 A_BYTES = kM * kBlockK * 2;
  constexpr u32 B_BYTES = N * kBlockK * 2;
  constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
  constexpr u32 B_PANEL = kBlockK * 128;  // B_MN_MAJOR: 64 K rows of one 64-column panel
  static_assert(A_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "tiles stay 1024-byte aligned");
  static_assert(!B_MN_MAJOR || !HIGH_RANK, "MN-major B: 2-D maps");
  static_assert(!A_MN_MAJOR || (B_MN_MAJOR && !A_IN_REGISTERS && N == 64), "MN-major A: ss form with MN-major B");

  __shared__ u64 full[kStages];   // TMA bytes of a stage have landed (1 arrival + transactions)
  __shared__ u64 empty[kStages];  // the consumers are done with a stage (128 arrivals)
  // 128-byte-swizzled tiles start on 1024-byte boundaries (the swizzle period): TMA and wgmma
  // both swizzle on absolute address bits, and the descriptors' base offset is 0. The dynamic
  // window's alignment is not promised, so round up; the host adds 1 KiB of slack.
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(&full[s], 1);
      sm90::mbarrier_init(&empty[s], 128);
    }
    sm90::mbarrier_init_fence();
  }
  // Publishes the initialised barriers to every thread before anyone arrives or waits.
  __syncthreads();

  if (threadIdx.x < 128) {
    // Producer warpgroup.
    if constexpr (SETMAXNREG) sm90::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      sm90::prefetch_tensor_map(&p.a);
      sm90::prefetch_tensor_map(&p.b);
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        const int s = kb % kStages;
        const int use = kb / kStages;  // earlier uses of this stage
        // Before refilling a stage, wait for the consumers' release of its previous use
        // (completion number use - 1 of empty[s], parity (use - 1) & 1).
        if (use > 0 && !wait_or_flag(&empty[s], (use - 1) & 1, p.status, 100 + kb)) break;
        unsigned char* const sa = smem + s * STAGE_BYTES;
        unsigned char* const sb = sa + A_BYTES;
        // Announce the stage's bytes, then issue its two copies: the phase completes when this
        // arrival and all STAGE_BYTES have landed, in whichever order.
        sm90::mbarrier_arrive_expect_tx(&full[s], STAGE_BYTES);
        if constexpr (HIGH_RANK) {
          sm90::tma_load(sa, &p.a, &full[s], kb * kBlockK, 0, p.a_batch);
          sm90::tma_load(sb, &p.b, &full[s], kb * kBlockK, p.b_head, 0, p.b_batch);
        } else if constexpr (B_MN_MAJOR) {
          if constexpr (A_MN_MAJOR)
            sm90::tma_load(sa, &p.a, &full[s], 0, kb * kBlockK);
          else
            sm90::tma_load(sa, &p.a, &full[s], kb * kBlockK, 0);
#pragma unroll
          for (int panel = 0; panel < N / 64; ++panel)
            sm90::tma_load(sb + panel * B_PANEL, &p.b, &full[s], 64 * panel, kb * kBlockK);
        } else {
          sm90::tma_load(sa, &p.a, &full[s], kb * kBlockK, 0);
          sm90::tma_load(sb, &p.b, &full[s], kb * kBlockK, 0);
        }
      }
    }
  } else {
    // Consumer warpgroup: warps 4-7, a warpgroup-aligned start as wgmma requires.
    if constexpr (SETMAXNREG) sm90::setmaxnreg_inc<232>();
    const int t = threadIdx.x - 128;
    const int warp = t / 32;
    const int lane = t % 32;
    if (t == 0) sm90::prefetch_tensor_map(&p.a_copy);

    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;

    bool ok = true;
    for (int kb = 0; kb < p.k_blocks && ok; ++kb) {
      const int s = kb % kStages;
      const int use = kb / kStages;
      ok = wait_or_flag(&full[s], use & 1, p.status, 200 + kb);
      __syncwarp();  // reconverge after the spin: the wgmma below are .aligned
      if (!ok) break;
      unsigned char* const sa = smem + s * STAGE_BYTES;
      unsigned char* const sb = sa + A_BYTES;

      if (t == 0) {
        // The stage was written by TMA (async proxy) and is read by the TMA store (async proxy):
        // the full-barrier wait above is all the ordering it needs.
        if constexpr (HIGH_RANK)
          sm90::tma_store(&p.a_copy, sa, kb * kBlockK, 0, p.a_batch);
        else if constexpr (A_MN_MAJOR)
          sm90::tma_store(&p.a_copy, sa, 0, kb * kBlockK);
        else
          sm90::tma_store(&p.a_copy, sa, kb * kBlockK, 0);
        sm90::tma_store_commit();
      }
      __syncwarp();

      const u64 desc_a = sm90::smem_desc_sw128(sa);
      const u64 desc_b = sm90::smem_desc_sw128(sb);
      if constexpr (A_IN_REGISTERS) {
        // Fragments of the four k16 slices of this stage, read from the swizzled tile: logical
        // 16-byte chunk c of row r is at byte r * 128 + (c ^ (r % 8)) * 16 (rows r and r + 8
        // share r % 8). Slice k, register j: row 16 warp + lane / 4 (+ 8 for j odd), chunk
        // 2k (+ 1 for j >= 2), bytes 4 (lane % 4) of it.
        u32 a[4][4];
        const int row = warp * 16 + lane / 4;
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int r = row + (j % 2) * 8;
            const int chunk = 2 * k + j / 2;
            a[k][j] = *reinterpret_cast<const u32*>(sa + r * 128 + ((chunk ^ (r % 8)) * 16) + (lane % 4) * 4);
          }
        sm90::fence_registers(acc);
        sm90::wgmma_fence();  // the A registers were just written by ordinary loads
        if constexpr (B_MN_MAJOR) {
          // A k16 step of an MN-major B is 16 K rows: 2048 bytes on from the panel's start.
          const u64 desc_b_mn = sm90::smem_desc_sw128_mn(sb, B_PANEL);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            sm90::wgmma_rs<N, Elem, true>(acc, a[k], sm90::desc_advance(desc_b_mn, 2048 * k), kb > 0 || k > 0);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k)
            sm90::wgmma_rs<N, Elem>(acc, a[k], sm90::desc_advance(desc_b, 32 * k), kb > 0 || k > 0);
        }
        sm90::wgmma_commit();
        sm90::fence_registers(acc);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc);
      } else {
        sm90::fence_registers(acc);
        sm90::wgmma_fence();  // the accumulators were zeroed by ordinary moves
        if constexpr (A_MN_MAJOR) {
          // Both operands MN-major: a k16 step is 16 K rows, 2048 bytes, of either tile.
          const u64 desc_a_mn = sm90::smem_desc_sw128_mn(sa, A_BYTES);
          const u64 desc_b_mn = sm90::smem_desc_sw128_mn(sb, B_PANEL);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            sm90::wgmma_ss_t<N, Elem, true, true>(acc, sm90::desc_advance(desc_a_mn, 2048 * k),
                                                   sm90::desc_advance(desc_b_mn, 2048 * k), kb > 0 || k > 0);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k)
            sm90::wgmma_ss<N, Elem>(acc, sm90::desc_advance(desc_a, 32 * k), sm90::desc_advance(desc_b, 32 * k),
                                    kb > 0 || k > 0);
        }
        sm90::wgmma_commit();
        sm90::fence_registers(acc);
        sm90::wgmma_wait<0>();  // the tensor cores have read the stage
        sm90::fence_registers(acc);
      }
      // The TMA store must have read the stage before it is handed back for refilling.
      if (t == 0) sm90::tma_store_wait_read<0>();
      sm90::mbarrier_arrive(&empty[s]);
    }
    if (t == 0) sm90::tma_store_wait<0>();  // a_copy written before the kernel ends

    // C from the accumulator layout (wgmma.cuh): rows 16 warp + lane / 4 (+ 8), columns
    // 8 i + 2 (lane % 4) (+ 1).
    const int row = warp * 16 + lane / 4;
    const int col = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      *reinterpret_cast<float2*>(p.c + row * N + 8 * i + col) = make_float2(acc[4 * i], acc[4 * i + 1]);
      *reinterpret_cast<float2*>(p.c + (row + 8) * N + 8 * i + col) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
    }
  }
}

}  // namespace sm90_check
}  // namespace cuflash
