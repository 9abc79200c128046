// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): shared-memory descriptors, the
// asynchronous mma instructions with fp32 accumulators, their fences, and setmaxnreg.
//
// A warpgroup is 4 consecutive warps whose first warp index is a multiple of 4; all 128 threads
// execute every wgmma instruction here together (".sync.aligned": converged, same operands for
// the descriptors). wgmma.mma_async D = A * B^T (+ D) with M = 64, K = 16 per instruction, N
// chosen by the instruction; A and B are K-major (A row m and B row n each hold consecutive k),
// which is Q * K^T with both tiles stored row-major as loaded from BSHD tensors.
//
// Accumulator layout (fp32, N / 2 registers per thread), the mma.sync m16n8 C layout repeated:
// thread t of the warpgroup (warp w = t / 32, lane l = t % 32) holds, for i < N / 8,
//   d[4i + 0], d[4i + 1] = D[16w + l/4    ][8i + 2(l%4) + {0, 1}]
//   d[4i + 2], d[4i + 3] = D[16w + l/4 + 8][8i + 2(l%4) + {0, 1}]
// A from registers (the rs form) uses the same pattern for its 64 x 16 tile, two 16-bit values
// per register: a[0] = A[16w + l/4][2(l%4) + {0,1}], a[1] = the same + 8 rows, a[2] = a[0]'s
// row at k + 8, a[3] = + 8 rows and k + 8. So accumulator registers 8j..8j+7 of an m64nN result,
// packed in pairs, are the A registers of its k-slice j: how P = softmax(S) feeds P * V.
// e4m3 instructions take K = 32 and four 8-bit values per A register: a[0] = A[16w + l/4][4(l%4)
// + {0..3}], a[1] the same + 8 rows, a[2] a[0]'s row at k + 16, a[3] + 8 rows and k + 16
// (sm90/tiles.cuh, pack_a, says how P meets that layout).
#pragma once
#include "common/smem.cuh"
#include "common/types.cuh"
#include "sm90/mbarrier.cuh"

namespace cuflash {
namespace sm90 {

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format" of wgmma), 64 bits:
//   bits  0-13  start address >> 4 (shared addresses are 18 bits and 16-byte aligned here)
//   bits 16-29  leading-dimension byte offset (LBO) >> 4
//   bits 32-45  stride-dimension byte offset (SBO) >> 4
//   bits 49-51  matrix base offset
//   bits 62-63  layout type: 0 no swizzle, 1 128-byte swizzle, 2 64-byte, 3 32-byte
// The one layout used here, for both operands: K-major rows of 64 16-bit elements (128 bytes),
// rows consecutive, swizzled as TMA's CU_TENSOR_MAP_SWIZZLE_128B stores a box whose inner
// dimension is 128 bytes: 16-byte chunk c of row r sits at chunk c ^ (r % 8), in a tile that
// starts on a 1024-byte boundary. The operand's core matrices are 8 rows x 16 bytes; then
//   SBO = 1024 bytes: from one group of 8 rows (M or N) to the next, 8 rows x 128 bytes;
//   LBO: the step between core matrices along K. One instruction's K extent (16 elements,
//        32 bytes) lies inside one swizzled 128-byte row, where the swizzle mode fixes that
//        step, so the hardware ignores the field for swizzled K-major operands; it is set to 1
//        (16 bytes), the value CUTLASS's make_gmma_desc writes for this case;
//   base offset 0: the tile is 1024-byte aligned (the period of the 128-byte swizzle), so the
//        pattern's phase follows from the address bits alone;
//   layout type 1.
__device__ __forceinline__ u64 smem_desc_sw128(const void* tile) {
  constexpr u64 kLbo = 16 >> 4;
  constexpr u64 kSbo = 1024 >> 4;
  constexpr u64 kSwizzle128 = 1;
  return static_cast<u64>((smem_addr(tile) & 0x3FFFF) >> 4) | (kLbo << 16) | (kSbo << 32) | (kSwizzle128 << 62);
}

// The same for e4m3 tiles (the FP8 forward): K-major rows of 64 one-byte elements (64 bytes), as
// TMA's CU_TENSOR_MAP_SWIZZLE_64B stores a box whose inner dimension is 64 bytes: 16-byte chunk c
// of row r at chunk c ^ ((r / 2) % 4), a period of 8 rows (512 bytes). Core matrices are again 8
// rows x 16 bytes, so SBO = 512 bytes (8 rows x 64 bytes), LBO is ignored as above (1), the layout
// type is 2, and tiles start on a 512-byte boundary (the kernels keep 1024). One k32 step of e4m3
// is 32 bytes, two per row: desc_advance moves by 32 bytes as for the 128-byte rows.
__device__ __forceinline__ u64 smem_desc_sw64(const void* tile) {
  constexpr u64 kLbo = 16 >> 4;
  constexpr u64 kSbo = 512 >> 4;
  constexpr u64 kSwizzle64 = 2;
  return static_cast<u64>((smem_addr(tile) & 0x3FFFF) >> 4) | (kLbo << 16) | (kSbo << 32) | (kSwizzle64 << 62);
}

// The descriptor of the same tile `bytes` further along K. K-major (smem_desc_sw128): within one
// 128-byte row, bytes < 128 and a multiple of 16 (a k16 step of 16-bit elements is 32 bytes). The
// hardware applies the swizzle to the full computed address (address bits 4-6 XOR bits 7-9), so
// row r of a start address moved by 32 k bytes is read from tile + 128 r + ((2k + j) ^ (r % 8)) * 16
// for its chunks j = 0, 1: where TMA put logical chunk 2k + j. MN-major (smem_desc_sw128_mn): a
// k16 step is 16 rows of 128 bytes, 2048 bytes, two whole swizzle periods, so the pattern's phase
// is unchanged. The move stays below the 14-bit field's carry because start addresses are below
// 256 KiB.
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// Descriptor of an MN-major B operand: the tile is stored with N contiguous, as V (keys x head_dim,
// row-major as TMA loads it from BSHD) is for O += P V, whose K is the keys. TMA's 128-byte swizzle
// cuts such a tile into panels of 64 N-columns, each `panel_bytes` long: row k of a panel (128
// bytes, 64 N-values) at 128 k, 16-byte chunk c at chunk c ^ (k % 8), as for K-major tiles. In the
// MN-major canonical layout (PTX "shared memory matrix layout", CUTLASS's
// ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) in 16-byte units) the two offsets swap roles:
//   LBO = panel_bytes: from one 64-wide group of N to the next (only read when N > 64);
//   SBO = 1024 bytes: from one group of 8 K-rows to the next (8 rows x 128 bytes);
// and the instruction must say the operand is transposed (imm-trans-b = 1, wgmma_rs<..., true>).
__device__ __forceinline__ u64 smem_desc_sw128_mn(const void* tile, u32 panel_bytes) {
  constexpr u64 kSbo = 1024 >> 4;
  constexpr u64 kSwizzle128 = 1;
  return static_cast<u64>((smem_addr(tile) & 0x3FFFF) >> 4) | (static_cast<u64>(panel_bytes >> 4) << 16) |
         (kSbo << 32) | (kSwizzle128 << 62);
}

// Orders this warpgroup's register accesses before the wgmma.mma_async that follow: required
// before the first mma of a batch whenever the accumulators or A registers were written by other
// instructions (zeroing, rescaling, packing P), and harmless otherwise.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Closes the batch of mma_async issued since the last commit into one wgmma group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are pending; only then may their accumulators (and their
// A registers and shared operands) be read or reused.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across the asynchronous
// region: from its point of view a wgmma asm statement reads and writes d at issue, but the
// hardware writes d until wgmma_wait. Call on the accumulators around issue and after the wait.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for register A operands (k-slices of 4 registers): the hardware reads them until the
// wgmma_wait, so a fence there keeps them live, and unchanged, up to that point.
template <int K>
__device__ __forceinline__ void fence_registers(u32 (&a)[K][4]) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[k][j])::"memory");
}

// setmaxnreg: moves registers between warpgroups of a warp-specialised kernel (a producer that
// needs few gives them to consumers that need many). All warps of the warpgroup execute it; it
// takes effect only in a kernel with a register cap at entry (__launch_bounds__(threads, 1)),
// and the count is a multiple of 8 in [24, 256]: dec must not exceed, inc not go below, the
// current count.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg: multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg: multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

namespace detail {

template <class Elem>
struct WgmmaElem;
template <>
struct WgmmaElem<bf16> {
  static constexpr bool kBf16 = true;
};
template <>
struct WgmmaElem<f16> {
  static constexpr bool kBf16 = false;
};

// Instruction text. The scale-d operand is a predicate: false makes D = A * B^T, ignoring the
// old accumulators (the first k-step of a tile), true accumulates. imm-scale-a/b = 1 (no
// negation); the ss form has imm-trans-a/b = 0: both operands K-major. The rs form has no trans-a
// (registers are always in the layout above) and takes imm-trans-b as an "n" operand: 0 for a
// K-major B, 1 for an MN-major one (smem_desc_sw128_mn).
#define CUFLASH_WGMMA_SS(SHAPE, TYPE, D, DESC_A, DESC_B, SCALE_D)                                         \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE_D ", 0;\n"                                                  \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " D ", %" DESC_A ", %" DESC_B ", p, 1, 1, 0, 0;\n}\n"
// The ss form with imm-trans-a and imm-trans-b as "n" operands, for MN-major operands
// (smem_desc_sw128_mn) on either side: dQ = dS K in the backward reads dS and K as stored.
#define CUFLASH_WGMMA_SS_T(SHAPE, TYPE, D, DESC_A, DESC_B, SCALE_D, TRANS_A, TRANS_B)                     \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE_D ", 0;\n"                                                  \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " D ", %" DESC_A ", %" DESC_B ", p, 1, 1, %" TRANS_A \
  ", %" TRANS_B ";\n}\n"
#define CUFLASH_WGMMA_RS(SHAPE, TYPE, D, A, DESC_B, SCALE_D, TRANS_B)                                     \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE_D ", 0;\n"                                                  \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " D ", " A ", %" DESC_B ", p, 1, 1, %" TRANS_B ";\n}\n"

// e4m3 operands: K = 32 per instruction, and no transpose operands (8-bit wgmma reads both
// operands K-major only); imm-scale-a/b = 1.
#define CUFLASH_WGMMA_SS_E4M3(SHAPE, D, DESC_A, DESC_B, SCALE_D)                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE_D ", 0;\n"                                                  \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32.e4m3.e4m3 " D ", %" DESC_A ", %" DESC_B ", p, 1, 1;\n}\n"
#define CUFLASH_WGMMA_RS_E4M3(SHAPE, D, A, DESC_B, SCALE_D)                                               \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE_D ", 0;\n"                                                  \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32.e4m3.e4m3 " D ", " A ", %" DESC_B ", p, 1, 1;\n}\n"

#define CUFLASH_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define CUFLASH_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CUFLASH_D32                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "  \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUFLASH_D40                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define CUFLASH_D48                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "  \
  "%40, %41, %42, %43, %44, %45, %46, %47}"
#define CUFLASH_D64                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "  \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "  \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
  "%62, %63}"
#define CUFLASH_D88                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "  \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "  \
  "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
  "%80, %81, %82, %83, %84, %85, %86, %87}"
#define CUFLASH_D96                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "  \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "  \
  "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define CUFLASH_D128                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "  \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "  \
  "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "  \
  "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "  \
  "%120, %121, %122, %123, %124, %125, %126, %127}"
#define CUFLASH_ACC8(d, i)                                                                               \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),            \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define CUFLASH_ACC8_ALL(d) CUFLASH_ACC8(d, 0)
#define CUFLASH_ACC16(d) CUFLASH_ACC8(d, 0), CUFLASH_ACC8(d, 8)
#define CUFLASH_ACC32(d) CUFLASH_ACC8(d, 0), CUFLASH_ACC8(d, 8), CUFLASH_ACC8(d, 16), CUFLASH_ACC8(d, 24)
#define CUFLASH_ACC40(d) CUFLASH_ACC32(d), CUFLASH_ACC8(d, 32)
#define CUFLASH_ACC48(d) CUFLASH_ACC32(d), CUFLASH_ACC8(d, 32), CUFLASH_ACC8(d, 40)
#define CUFLASH_ACC64(d) CUFLASH_ACC32(d), CUFLASH_ACC8(d, 32), CUFLASH_ACC8(d, 40), CUFLASH_ACC8(d, 48), CUFLASH_ACC8(d, 56)
#define CUFLASH_ACC32_AT(d, i) CUFLASH_ACC8(d, i), CUFLASH_ACC8(d, i + 8), CUFLASH_ACC8(d, i + 16), CUFLASH_ACC8(d, i + 24)
#define CUFLASH_ACC88(d) CUFLASH_ACC64(d), CUFLASH_ACC8(d, 64), CUFLASH_ACC8(d, 72), CUFLASH_ACC8(d, 80)
#define CUFLASH_ACC96(d) CUFLASH_ACC64(d), CUFLASH_ACC32_AT(d, 64)
#define CUFLASH_ACC128(d) CUFLASH_ACC64(d), CUFLASH_ACC32_AT(d, 64), CUFLASH_ACC32_AT(d, 96)

// An instruction shape's two members: ss (both operands by descriptor) and rs (A from
// registers), each one asm per element type. REGS = N / 2 accumulators take operands %0 ..
// %REGS-1 (D, ACC); the operands after them are numbered by the caller.
#define CUFLASH_WGMMA_SS_MEMBER(REGS, SHAPE, D, ACC, DESC_A, DESC_B, SCALE_D)                            \
  template <class Elem>                                                                                 \
  static __device__ __forceinline__ void ss(float (&d)[REGS], u64 desc_a, u64 desc_b, u32 scale_d) {     \
    if constexpr (WgmmaElem<Elem>::kBf16)                                                               \
      asm volatile(CUFLASH_WGMMA_SS(SHAPE, "bf16", D, DESC_A, DESC_B, SCALE_D)                          \
                   : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                  \
    else                                                                                                \
      asm volatile(CUFLASH_WGMMA_SS(SHAPE, "f16", D, DESC_A, DESC_B, SCALE_D)                           \
                   : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                  \
  }
#define CUFLASH_WGMMA_RS_MEMBER(REGS, SHAPE, D, ACC, A, DESC_B, SCALE_D, TRANS)                          \
  template <class Elem, bool TRANS_B>                                                                   \
  static __device__ __forceinline__ void rs(float (&d)[REGS], const u32 (&a)[4], u64 desc_b, u32 scale_d) { \
    if constexpr (WgmmaElem<Elem>::kBf16)                                                               \
      asm volatile(CUFLASH_WGMMA_RS(SHAPE, "bf16", D, A, DESC_B, SCALE_D, TRANS)                        \
                   : ACC(d)                                                                             \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d),             \
                     "n"(TRANS_B ? 1 : 0));                                                            \
    else                                                                                                \
      asm volatile(CUFLASH_WGMMA_RS(SHAPE, "f16", D, A, DESC_B, SCALE_D, TRANS)                         \
                   : ACC(d)                                                                             \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d),             \
                     "n"(TRANS_B ? 1 : 0));                                                            \
  }

// The ss form with either operand MN-major (imm-trans-a and imm-trans-b as "n" operands).
#define CUFLASH_WGMMA_SS_T_MEMBER(REGS, SHAPE, D, ACC, DESC_A, DESC_B, SCALE_D, TRANS_A, TRANS_B)        \
  template <class Elem, bool TA, bool TB>                                                               \
  static __device__ __forceinline__ void ss_t(float (&d)[REGS], u64 desc_a, u64 desc_b, u32 scale_d) {   \
    if constexpr (WgmmaElem<Elem>::kBf16)                                                               \
      asm volatile(CUFLASH_WGMMA_SS_T(SHAPE, "bf16", D, DESC_A, DESC_B, SCALE_D, TRANS_A, TRANS_B)       \
                   : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA ? 1 : 0), "n"(TB ? 1 : 0)); \
    else                                                                                                \
      asm volatile(CUFLASH_WGMMA_SS_T(SHAPE, "f16", D, DESC_A, DESC_B, SCALE_D, TRANS_A, TRANS_B)        \
                   : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA ? 1 : 0), "n"(TB ? 1 : 0)); \
  }

// The e4m3 members of a shape (both forms): Q K^T of the FP8 forward (ss, N = the key block) and
// its P V (rs, N = the head dim).
#define CUFLASH_WGMMA_E4M3_MEMBERS(REGS, SHAPE, D, ACC, A, SS_DESC_A, SS_DESC_B, SS_SCALE_D, RS_DESC_B,       \
                                   RS_SCALE_D)                                                            \
  static __device__ __forceinline__ void ss_e4m3(float (&d)[REGS], u64 desc_a, u64 desc_b, u32 scale_d) {  \
    asm volatile(CUFLASH_WGMMA_SS_E4M3(SHAPE, D, SS_DESC_A, SS_DESC_B, SS_SCALE_D)                        \
                 : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                      \
  }                                                                                                       \
  static __device__ __forceinline__ void rs_e4m3(float (&d)[REGS], const u32 (&a)[4], u64 desc_b,         \
                                                 u32 scale_d) {                                           \
    asm volatile(CUFLASH_WGMMA_RS_E4M3(SHAPE, D, A, RS_DESC_B, RS_SCALE_D)                                \
                 : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));       \
  }

template <int N>
struct Wgmma;

// N = 16 and 32 serve MLA decoding's transposed products at <= 32 query rows, whose N is the rows
// (mla_decode.cu: S^T = K Q^T, O^T = V^T P^T with V^T read MN-major). N = 32 also serves the
// backward's S^T and dP^T at head dims above 128, where each consumer warpgroup takes half of a
// 64-query block (flash_bwd.cu), and MLA decoding's scores, half of a 64-key step per warpgroup.
template <>
struct Wgmma<16> {
  CUFLASH_WGMMA_SS_MEMBER(8, "m64n16k16", CUFLASH_D8, CUFLASH_ACC8_ALL, "8", "9", "10")
  CUFLASH_WGMMA_SS_T_MEMBER(8, "m64n16k16", CUFLASH_D8, CUFLASH_ACC8_ALL, "8", "9", "10", "11", "12")
};

template <>
struct Wgmma<32> {
  CUFLASH_WGMMA_SS_MEMBER(16, "m64n32k16", CUFLASH_D16, CUFLASH_ACC16, "16", "17", "18")
  CUFLASH_WGMMA_SS_T_MEMBER(16, "m64n32k16", CUFLASH_D16, CUFLASH_ACC16, "16", "17", "18", "19", "20")
};

template <>
struct Wgmma<64> {
  CUFLASH_WGMMA_SS_MEMBER(32, "m64n64k16", CUFLASH_D32, CUFLASH_ACC32, "32", "33", "34")
  CUFLASH_WGMMA_RS_MEMBER(32, "m64n64k16", CUFLASH_D32, CUFLASH_ACC32, "{%32, %33, %34, %35}", "36", "37", "38")
  CUFLASH_WGMMA_SS_T_MEMBER(32, "m64n64k16", CUFLASH_D32, CUFLASH_ACC32, "32", "33", "34", "35", "36")
  CUFLASH_WGMMA_E4M3_MEMBERS(32, "m64n64k32", CUFLASH_D32, CUFLASH_ACC32, "{%32, %33, %34, %35}", "32", "33", "34",
                             "36", "37")
};

template <>
struct Wgmma<128> {
  CUFLASH_WGMMA_SS_MEMBER(64, "m64n128k16", CUFLASH_D64, CUFLASH_ACC64, "64", "65", "66")
  CUFLASH_WGMMA_RS_MEMBER(64, "m64n128k16", CUFLASH_D64, CUFLASH_ACC64, "{%64, %65, %66, %67}", "68", "69", "70")
  CUFLASH_WGMMA_SS_T_MEMBER(64, "m64n128k16", CUFLASH_D64, CUFLASH_ACC64, "64", "65", "66", "67", "68")
  CUFLASH_WGMMA_E4M3_MEMBERS(64, "m64n128k32", CUFLASH_D64, CUFLASH_ACC64, "{%64, %65, %66, %67}", "64", "65", "66",
                             "68", "69")
};

// N = 80, 96 and 176 serve only Q K^T, whose N is the key block: the wide key blocks of unmasked
// calls at d256, d192 and d128 (dispatch.SM90_WIDE_TILES), so they have only the shared-memory
// form.
template <>
struct Wgmma<80> {
  CUFLASH_WGMMA_SS_MEMBER(40, "m64n80k16", CUFLASH_D40, CUFLASH_ACC40, "40", "41", "42")
};

template <>
struct Wgmma<96> {
  CUFLASH_WGMMA_SS_MEMBER(48, "m64n96k16", CUFLASH_D48, CUFLASH_ACC48, "48", "49", "50")
};

template <>
struct Wgmma<176> {
  CUFLASH_WGMMA_SS_MEMBER(88, "m64n176k16", CUFLASH_D88, CUFLASH_ACC88, "88", "89", "90")
};

// In 16 bits, N = 192 and 256 serve only P V, whose N is the head dim (Q K^T's N is the key block,
// 64 to 176), so they have only the register-A form; e4m3 Q K^T takes 192-key blocks too.
template <>
struct Wgmma<192> {
  CUFLASH_WGMMA_RS_MEMBER(96, "m64n192k16", CUFLASH_D96, CUFLASH_ACC96, "{%96, %97, %98, %99}", "100", "101", "102")
  CUFLASH_WGMMA_E4M3_MEMBERS(96, "m64n192k32", CUFLASH_D96, CUFLASH_ACC96, "{%96, %97, %98, %99}", "96", "97", "98",
                             "100", "101")
};

template <>
struct Wgmma<256> {
  CUFLASH_WGMMA_RS_MEMBER(128, "m64n256k16", CUFLASH_D128, CUFLASH_ACC128, "{%128, %129, %130, %131}", "132", "133",
                          "134")
  CUFLASH_WGMMA_SS_T_MEMBER(128, "m64n256k16", CUFLASH_D128, CUFLASH_ACC128, "128", "129", "130", "131", "132")
  CUFLASH_WGMMA_E4M3_MEMBERS(128, "m64n256k32", CUFLASH_D128, CUFLASH_ACC128, "{%128, %129, %130, %131}", "128",
                             "129", "130", "132", "133")
};

#undef CUFLASH_WGMMA_SS_MEMBER
#undef CUFLASH_WGMMA_RS_MEMBER
#undef CUFLASH_WGMMA_SS_T_MEMBER
#undef CUFLASH_WGMMA_E4M3_MEMBERS
#undef CUFLASH_WGMMA_SS_E4M3
#undef CUFLASH_WGMMA_RS_E4M3
#undef CUFLASH_WGMMA_SS
#undef CUFLASH_WGMMA_SS_T
#undef CUFLASH_WGMMA_RS
#undef CUFLASH_D16
#undef CUFLASH_D32
#undef CUFLASH_D40
#undef CUFLASH_D48
#undef CUFLASH_D64
#undef CUFLASH_D88
#undef CUFLASH_D96
#undef CUFLASH_D128
#undef CUFLASH_ACC8
#undef CUFLASH_ACC16
#undef CUFLASH_ACC32
#undef CUFLASH_ACC40
#undef CUFLASH_ACC48
#undef CUFLASH_ACC64
#undef CUFLASH_ACC32_AT
#undef CUFLASH_ACC88
#undef CUFLASH_ACC96
#undef CUFLASH_ACC128

}  // namespace detail

// d (+)= A * B^T for a 64 x 16 slice of A and an N x 16 slice of B, both read from shared memory
// through descriptors (smem_desc_sw128, desc_advance); `accumulate` false overwrites d. Issue
// between wgmma_fence and wgmma_commit; d is valid after the matching wgmma_wait.
template <int N, class Elem>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, bool accumulate) {
  if constexpr (InputStorage<Elem>::fp8)
    detail::Wgmma<N>::ss_e4m3(d, desc_a, desc_b, accumulate ? 1u : 0u);
  else
    detail::Wgmma<N>::template ss<Elem>(d, desc_a, desc_b, accumulate ? 1u : 0u);
}

// d = A * B^T over whole tiles: both operands K-major in PANELS panels of 64 columns (one swizzle
// row each: 128 bytes for 16-bit Elem, 4 k16 steps; 64 bytes for e4m3, 2 k32 steps; a_panel and
// b_panel bytes apart), the first step overwriting d. Issues only: the caller fences, commits and
// waits.
template <int N, class Elem, int PANELS>
__device__ __forceinline__ void wgmma_ss_panels(float (&d)[N / 2], u64 desc_a, u32 a_panel, u64 desc_b, u32 b_panel) {
  constexpr int kSteps = InputStorage<Elem>::fp8 ? 2 : 4;  // 32-byte k-steps per 64-column row
#pragma unroll
  for (int panel = 0; panel < PANELS; ++panel)
#pragma unroll
    for (int k = 0; k < kSteps; ++k)
      wgmma_ss<N, Elem>(d, desc_advance(desc_a, panel * a_panel + 32 * k), desc_advance(desc_b, panel * b_panel + 32 * k),
                        panel > 0 || k > 0);
}

// The ss form with either operand MN-major (smem_desc_sw128_mn's descriptor, the instruction's
// transpose flag set): TRANS_A for an A stored M-contiguous, TRANS_B for a B stored N-contiguous.
// N = 64, 128 or 256 (MLA decoding's P V, sm90/mla_decode.cu).
template <int N, class Elem, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void wgmma_ss_t(float (&d)[N / 2], u64 desc_a, u64 desc_b, bool accumulate) {
  detail::Wgmma<N>::template ss_t<Elem, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate ? 1u : 0u);
}

// The same with A's 64 x 16 slice in registers (layout at the top of this file); the registers
// must keep their values until the wgmma_wait that covers this instruction. B_MN_MAJOR: B's
// descriptor is smem_desc_sw128_mn's (a 16 x N slice stored N-contiguous) instead of K-major.
// e4m3 (no MN-major B): a 64 x 32 slice of A, four bytes per register (sm90/tiles.cuh, pack_a).
template <int N, class Elem, bool B_MN_MAJOR = false>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b, bool accumulate) {
  if constexpr (InputStorage<Elem>::fp8) {
    static_assert(!B_MN_MAJOR, "e4m3 wgmma reads B K-major only");
    detail::Wgmma<N>::rs_e4m3(d, a, desc_b, accumulate ? 1u : 0u);
  } else {
    detail::Wgmma<N>::template rs<Elem, B_MN_MAJOR>(d, a, desc_b, accumulate ? 1u : 0u);
  }
}

}  // namespace sm90
}  // namespace cuflash
