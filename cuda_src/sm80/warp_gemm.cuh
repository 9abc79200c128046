// The sm80 kernels' warp-level products: acc += A B per warp with mma.sync m16n8k16, A as MT tiles
// of 16 rows, B as NT tiles of 8 columns, k in steps of 16. Each step loads every A tile once and
// B 16 columns (two n8 tiles) at a time with one ldmatrix.x4, so each B fragment feeds 2 * MT
// mma.sync. Products over the same k run fused, operand by operand (warp_gemm's pack), so that
// each ldmatrix has several mma to hide behind.
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

// acc += A B for one warp. a_tiles and b_tiles hold the fragments of the k step in flight, and the
// caller declares them: arrays local to an inlined helper are laid out ahead of the caller's, and
// that reorders ptxas's register assignment (the SASS changes; the instruction count does not).
template <class Elem, int MT, int NT, class A, class B>
struct WarpProduct {
  float (&acc)[MT][NT][4];
  u32 (&a_tiles)[MT][4];
  u32 (&b_tiles)[4];
  A a;
  B b;

  // Functions rather than static data members, which NVRTC would emit as unused globals.
  __device__ static constexpr int m_tiles() { return MT; }
  __device__ static constexpr int n_tiles() { return NT; }
  __device__ __forceinline__ void load_a(int mt, int k) { a.load(a_tiles[mt], mt, k); }
  __device__ __forceinline__ void load_b(int np, int k) { b.load(b_tiles, np, k); }
  // Both n8 tiles of B's 16 columns np.
  __device__ __forceinline__ void mma(int mt, int np) {
    Elem::mma(acc[mt][2 * np], a_tiles[mt], b_tiles[0], b_tiles[1]);
    Elem::mma(acc[mt][2 * np + 1], a_tiles[mt], b_tiles[2], b_tiles[3]);
  }
};

template <class Elem, int MT, int NT, class A, class B>
__device__ __forceinline__ WarpProduct<Elem, MT, NT, A, B> warp_product(float (&acc)[MT][NT][4], u32 (&a_tiles)[MT][4],
                                                                        u32 (&b_tiles)[4], A a, B b) {
  return {acc, a_tiles, b_tiles, a, b};
}

// Runs K_STEPS k steps of one or more products (warp_product temporaries) of the same tile counts,
// fused: per step each product's A tiles (tile by tile, product by product), then per 16 columns of
// B each product's B fragment and its mma.sync.
template <int K_STEPS, class First, class... Rest>
__device__ __forceinline__ void warp_gemm(First&& first, Rest&&... rest) {
  constexpr int MT = First::m_tiles(), NT = First::n_tiles();
  static_assert(((Rest::m_tiles() == MT && Rest::n_tiles() == NT) && ...), "fused products share their tiles");
  static_assert(NT % 2 == 0, "B loads 16 columns at a time");
#pragma unroll
  for (int k = 0; k < K_STEPS; ++k) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      first.load_a(mt, k);
      (rest.load_a(mt, k), ...);
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      first.load_b(np, k);
      (rest.load_b(np, k), ...);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        first.mma(mt, np);
        (rest.mma(mt, np), ...);
      }
    }
  }
}

}  // namespace cuflash
