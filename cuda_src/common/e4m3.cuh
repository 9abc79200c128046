// e4m3 (float8_e4m3fn) conversions shared by the FP8 forward (fp8.cuh), generic/quantize_fp8.cu and
// the KV cache (generic/kv_append.cu, sm80/kv_decode.cu) and MLA decoding: float32 -> e4m3 bits, and
// packed e4m3 pairs widened exactly to fp16/bf16.
#pragma once
#include "common/types.cuh"

namespace cuflash {

constexpr float E4M3_MAX = 448.f;

// float32 -> e4m3 (float8_e4m3fn) bits, round to nearest even, for |v| <= 448 (the callers
// saturate first). Done in integer arithmetic because sm_80 has no e4m3 conversion instruction.
__device__ __forceinline__ unsigned char to_e4m3(float v) {
  const u32 bits = __float_as_uint(v);
  const u32 sign = (bits >> 24) & 0x80u;
  const float magnitude = fabsf(v);
  if (magnitude < 0.015625f) {  // below 2^-6, the smallest normal: multiples of 2^-9
    return static_cast<unsigned char>(sign | u32(rintf(magnitude * 512.f)));
  }
  // Keep 3 of float32's 23 mantissa bits, rounding to nearest even (a carry bumps the exponent),
  // then rebias the exponent from 127 to 7.
  u32 kept = bits & 0x7fffffffu;
  kept = (kept + 0x7ffffu + ((kept >> 20) & 1u)) >> 20;
  return static_cast<unsigned char>(sign | min(kept - (120u << 3), 0x7eu));
}

// Widening of packed e4m3 pairs. Each byte is moved to the top of a 16-bit lane, its exponent and
// mantissa bits shifted right by kShift into the 16-bit format's fields, and one multiply by
// 2^(16-bit bias - 7) rebiases the exponent: exact, and e4m3's subnormals land on normal values.
// e4m3 has no infinity; its NaN (S.1111.111) would come out as +-480, which no finite e4m3 reaches,
// so that pattern also gets the exponent field all ones.
template <class Elem>
struct E4m3Widening;

template <>
struct E4m3Widening<f16> {
  static constexpr int kShift = 1;
  static constexpr u32 kField = 0x3f803f80u;  // exponent and mantissa of both lanes after the shift
  static constexpr u32 kNanCarry = 0x40004000u;  // the field plus its lowest bit carries here only for NaN
  static constexpr u32 kNanExponent = 0x1fu;     // (carry >> 4) * this: the exponent field all ones
  static __device__ __forceinline__ u32 from_f16(u32 x) { return x; }
  static __device__ __forceinline__ u32 rebias(u32 x) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x5c005c00u));  // 2^8, both lanes
    return r;
  }
};

template <>
struct E4m3Widening<bf16> {
  static constexpr int kShift = 4;
  static constexpr u32 kField = 0x07f007f0u;
  static constexpr u32 kNanCarry = 0x08000800u;
  static constexpr u32 kNanExponent = 0xffu;
  // An f16 pair holding e4m3 values, through float32: each has at most 4 significant bits, so its
  // float32's low 16 bits are zero and the top halves are the exact bf16 values (NaN kept).
  static __device__ __forceinline__ u32 from_f16(u32 x) {
    const float2 v = f16::unpack(x);
    return __byte_perm(__float_as_uint(v.x), __float_as_uint(v.y), 0x7632);
  }
  static __device__ __forceinline__ u32 rebias(u32 x) {
    // bf16x2 has no multiply before sm_90; fma adding -0 keeps the sign of a zero.
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(0x7b807b80u), "r"(0x80008000u));  // 2^120
    return r;
  }
};

// Two e4m3 bytes of `bytes`, chosen by the prmt selector `select` (0x1404: bytes 0 and 1, 0x3424:
// bytes 2 and 3), -> a packed Elem pair, the first byte in the low lane.
template <class Elem>
__device__ __forceinline__ u32 widen_e4m3_pair(u32 bytes, u32 select) {
  typedef E4m3Widening<Elem> W;
  u32 top;  // each byte in the top 8 bits of its 16-bit lane
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(top) : "r"(bytes), "r"(select));
  const u32 field = (top >> W::kShift) & W::kField;
  const u32 nan_exponent = (((field + (W::kField & ~(W::kField << 1))) & W::kNanCarry) >> 4) * W::kNanExponent;
  return W::rebias((top & 0x80008000u) | field) | nan_exponent;
}

// The four e4m3 bytes of `bytes` -> two packed Elem pairs, bytes 0, 1 into `lo` and 2, 3 into
// `hi`, the first byte of each in the low lane. sm_89 and later convert an e4m3 pair to f16 in one
// instruction (exact, NaN kept), a handful fewer than widen_e4m3_pair's integer arithmetic, which
// older GPUs keep.
template <class Elem>
__device__ __forceinline__ void widen_e4m3_word(u32 bytes, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
  u32 f16_lo, f16_hi;
  asm("{.reg .b16 l, h;\n"
      "mov.b32 {l, h}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(f16_lo), "=r"(f16_hi)
      : "r"(bytes));
  lo = E4m3Widening<Elem>::from_f16(f16_lo);
  hi = E4m3Widening<Elem>::from_f16(f16_hi);
#else
  lo = widen_e4m3_pair<Elem>(bytes, 0x1404u);
  hi = widen_e4m3_pair<Elem>(bytes, 0x3424u);
#endif
}

}  // namespace cuflash
