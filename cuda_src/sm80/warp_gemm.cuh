// The sm80 kernels' warp-level products: acc += A B per warp with mma.sync m16n8k16, A as MT tiles
// of 16 rows, B as NT tiles of 8 columns, k in steps of 16. Each step loads every A tile once and
// B 16 columns (two n8 tiles) at a time with one ldmatrix.x4, so each B fragment feeds 2 * MT
// mma.sync.
#pragma once
#include "common/smem.cuh"
#include "common/types.cuh"

namespace cuflash {

// An operand in a swizzled shared-memory tile, 16 x 16 elements per ldmatrix.x4 at (block mn of
// its M or N side, k step k). K_MAJOR: the tile's rows run along k (P^T, V, dO, Q and K read as
// k x n), read with ldmatrix.trans; otherwise along M or N (Q, dO and dS as A, K and V as B).
// `offset`: bytes added to every address (the buffer of a double-buffered tile).
template <int ROW_ELEMS, bool K_MAJOR>
struct SmemOperand {
  const FragmentAddress<ROW_ELEMS>& fragments;
  u32 offset;
  __device__ __forceinline__ void load(u32 (&r)[4], int mn, int k) const {
    if constexpr (K_MAJOR)
      ldmatrix_x4_trans(r, fragments.at(k * 16, mn * 16) + offset);
    else
      ldmatrix_x4(r, fragments.at(mn * 16, k * 16) + offset);
  }
};

template <bool K_MAJOR, int ROW_ELEMS>
__device__ __forceinline__ SmemOperand<ROW_ELEMS, K_MAJOR> smem_operand(const FragmentAddress<ROW_ELEMS>& fragments,
                                                                        u32 offset = 0) {
  return {fragments, offset};
}

// An fp32 accumulator of m16n8 tiles as the A operand, packed to 16 bits: its tiles 2k and 2k + 1
// are, element for element, the A fragment of k step k (the forward's P in P V never leaves
// registers).
template <class Elem, int MT, int NT>
struct RegisterOperand {
  const float (&acc)[MT][NT][4];
  __device__ __forceinline__ void load(u32 (&r)[4], int mt, int k) const {
    r[0] = Elem::pack(acc[mt][2 * k][0], acc[mt][2 * k][1]);
    r[1] = Elem::pack(acc[mt][2 * k][2], acc[mt][2 * k][3]);
    r[2] = Elem::pack(acc[mt][2 * k + 1][0], acc[mt][2 * k + 1][1]);
    r[3] = Elem::pack(acc[mt][2 * k + 1][2], acc[mt][2 * k + 1][3]);
  }
};

template <class Elem, int MT, int NT>
__device__ __forceinline__ RegisterOperand<Elem, MT, NT> register_operand(const float (&acc)[MT][NT][4]) {
  return {acc};
}

// Both n8 tiles of B's 16 columns np times A tile mt.
template <class Elem, int MT, int NT>
__device__ __forceinline__ void mma_16_columns(float (&acc)[MT][NT][4], const u32 (&a)[4], const u32 (&b)[4], int mt,
                                               int np) {
  Elem::mma(acc[mt][2 * np], a, b[0], b[1]);
  Elem::mma(acc[mt][2 * np + 1], a, b[2], b[3]);
}

// acc += A B over K_STEPS k steps, for one warp: per step the MT A tiles, then per 16 columns of B
// its fragment and 2 * MT mma.sync. a_tiles and b_tiles hold the fragments of the step in flight;
// the caller declares them, and passes everything by reference: arrays local to an inlined helper
// are laid out ahead of the caller's, and a struct holding a reference to the accumulator delays
// its promotion to registers; either reorders ptxas's register assignment (the SASS changes; the
// instruction count does not).
template <int K_STEPS, class Elem, int MT, int NT, class A, class B>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], u32 (&a_tiles)[MT][4], u32 (&b_tiles)[4], const A& a,
                                          const B& b) {
  static_assert(NT % 2 == 0, "B loads 16 columns at a time");
#pragma unroll
  for (int k = 0; k < K_STEPS; ++k) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) a.load(a_tiles[mt], mt, k);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      b.load(b_tiles, np, k);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_16_columns<Elem>(acc, a_tiles[mt], b_tiles, mt, np);
    }
  }
}

// Two products over the same k steps, fused operand by operand (A tile mt of each, then B of each
// and their mma.sync), so that each ldmatrix has twice the mma.sync to hide behind.
template <int K_STEPS, class Elem, int MT, int NT, class A1, class B1, class A2, class B2>
__device__ __forceinline__ void warp_gemm_fused(float (&acc1)[MT][NT][4], u32 (&a1_tiles)[MT][4], u32 (&b1_tiles)[4],
                                                const A1& a1, const B1& b1, float (&acc2)[MT][NT][4],
                                                u32 (&a2_tiles)[MT][4], u32 (&b2_tiles)[4], const A2& a2,
                                                const B2& b2) {
  static_assert(NT % 2 == 0, "B loads 16 columns at a time");
#pragma unroll
  for (int k = 0; k < K_STEPS; ++k) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a1.load(a1_tiles[mt], mt, k);
      a2.load(a2_tiles[mt], mt, k);
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      b1.load(b1_tiles, np, k);
      b2.load(b2_tiles, np, k);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16_columns<Elem>(acc1, a1_tiles[mt], b1_tiles, mt, np);
        mma_16_columns<Elem>(acc2, a2_tiles[mt], b2_tiles, mt, np);
      }
    }
  }
}

}  // namespace cuflash
