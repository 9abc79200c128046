// Register and shared-memory tile helpers the sm90 kernels share: the 128-byte swizzle as TMA
// stores it, the wgmma accumulator seen as the common headers' m16n8 layout, accumulators packed
// into register-A operands, the position in an mbarrier-guarded ring, and the alignment of the
// dynamic shared memory.
#pragma once
#include "common/types.cuh"

namespace cuflash {
namespace sm90 {

// TMA's and wgmma's 128-byte swizzle repeats every 1024 bytes, so the kernels' tiles start on a
// 1024-byte boundary. The dynamic shared-memory window's alignment is not promised: the host
// launches with this much slack beyond a kernel's layout, and the kernel rounds its base up (in
// the kernel itself: the same rounding in an inlined helper changes the generated code).
constexpr u32 kSmemAlignSlack = 1024;

// Byte offset of 16-bit element (row, col) in a tile of panels `panel_bytes` apart, 128-byte
// swizzled as TMA stores it: 16-byte chunk c of a row at chunk c ^ (row % 8).
__device__ __forceinline__ u32 swizzled_offset(int row, int col, u32 panel_bytes) {
  return (col / 64) * panel_bytes + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// The same for 64-byte rows (e4m3 tiles, 64B swizzle): 16-byte chunk c of row r at chunk
// c ^ ((r / 2) % 4). Here for 16-bit elements, 32 to a row: the FP8 forward stages O in its Q
// buffer this way.
__device__ __forceinline__ u32 swizzled_offset_64(int row, int col, u32 panel_bytes) {
  return (col / 32) * panel_bytes + row * 64 + ((((col % 32) / 8) ^ ((row / 2) % 4)) * 16) + (col % 8) * 2;
}

// The m64nN accumulator of a warpgroup seen as the m16n8 layout the common headers take (one
// 16-row tile per warp, N / 8 column tiles): the register order is the same (sm90/wgmma.cuh).
template <int NT>
__device__ __forceinline__ float (&flat(float (&x)[1][NT][4]))[NT * 4] {
  return reinterpret_cast<float(&)[NT * 4]>(x);
}

// The first N columns of a wider accumulator, as wgmma's m64nN operand: a thread's registers of
// the leading 8-column tiles come first (sm90/wgmma.cuh).
template <int N, int REGISTERS>
__device__ __forceinline__ float (&leading_columns(float (&x)[REGISTERS]))[N / 2] {
  static_assert(N / 2 <= REGISTERS, "fewer columns than the accumulator holds");
  return reinterpret_cast<float(&)[N / 2]>(x);
}

// Stage and phase of a walk around a ring of STAGES mbarrier-guarded stages: a full barrier of
// stage s completes once per lap, so its waiters wait for parity `phase`.
template <int STAGES>
struct RingPosition {
  int stage = 0;
  u32 phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// An accumulator in 16 bits as register-A operands: registers 8j..8j+7 of an m64nN result, packed
// in pairs, are the A registers of its k-slice j (sm90/wgmma.cuh). The forward's P = softmax(S)
// feeds P V this way, the backward's P^T and dS^T feed dV and dK.
template <class Elem, int NT>
__device__ __forceinline__ void pack_a(const float (&s)[1][NT][4], u32 (&p)[NT / 2][4]) {
#pragma unroll
  for (int j = 0; j < NT / 2; ++j) {
    p[j][0] = Elem::pack(s[0][2 * j][0], s[0][2 * j][1]);
    p[j][1] = Elem::pack(s[0][2 * j][2], s[0][2 * j][3]);
    p[j][2] = Elem::pack(s[0][2 * j + 1][0], s[0][2 * j + 1][1]);
    p[j][3] = Elem::pack(s[0][2 * j + 1][2], s[0][2 * j + 1][3]);
  }
}

// The same in e4m3, the register-A operand of k32 slices (sm90/wgmma.cuh): k-slice j takes
// accumulator tiles 4j..4j+3. A thread holds, of row l/4 (and + 8), the columns 2(l%4) + {0, 1}
// of each 8-column tile, while the operand wants it to hold 4(l%4) + {0..3} and 16 + 4(l%4) +
// {0..3}. Rather than exchange values between threads, each register takes the thread's own four
// values in order (tiles 4j and 4j + 1 for k 0-15, 4j + 2 and 4j + 3 for k 16-31), so logical k
// position L (0..31) of the slice holds column e4m3_key(L) of S. The product P V sums over keys,
// so it is unchanged when V's rows are permuted the same way: the FP8 forward writes V's
// transpose with key e4m3_key(L) at position L (flash_fwd.cu, VTranspose).
template <int NT>
__device__ __forceinline__ void pack_a_e4m3(const float (&s)[1][NT][4], u32 (&p)[NT / 4][4]) {
#pragma unroll
  for (int j = 0; j < NT / 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // row l/4, then row l/4 + 8
      p[j][h] = e4m3::pack4(s[0][4 * j][2 * h], s[0][4 * j][2 * h + 1], s[0][4 * j + 1][2 * h],
                            s[0][4 * j + 1][2 * h + 1]);
      p[j][2 + h] = e4m3::pack4(s[0][4 * j + 2][2 * h], s[0][4 * j + 2][2 * h + 1], s[0][4 * j + 3][2 * h],
                                s[0][4 * j + 3][2 * h + 1]);
    }
  }
}

// The key (0..31, within a k32 slice) whose probability pack_a_e4m3 puts at logical position L:
// thread l%4 = (L % 16) / 4 holds columns 2(l%4), 2(l%4) + 1 of the slice's 8-column tiles, L % 4
// picks among the first two tiles' (of each half of 16), L / 16 the half.
__host__ __device__ constexpr int e4m3_key(int L) {
  return 16 * (L / 16) + 8 * ((L % 4) / 2) + 2 * ((L % 16) / 4) + L % 2;
}

}  // namespace sm90
}  // namespace cuflash
