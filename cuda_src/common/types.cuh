// Element types and the tensor-core instruction for each, without CUDA headers: NVRTC compiles
// these sources with no include path beyond cuda_src/, so the 16-bit types are raw bit patterns
// and every conversion is one PTX instruction.
#pragma once

namespace cuflash {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// fp16 inputs, fp32 accumulation.
struct f16 {
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    // cvt packs its first source into the upper half.
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float2 unpack(u32 x) {
    float lo, hi;
    asm("{.reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(x));
    return make_float2(lo, hi);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// bf16 inputs, fp32 accumulation.
struct bf16 {
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  // bf16 is the top half of an fp32: widening is a shift.
  static __device__ __forceinline__ float2 unpack(u32 x) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// e4m3 (float8_e4m3fn) inputs, stored as bytes: widened to fp16 or bf16 before mma.sync on sm80
// (common/fp8.cuh), multiplied as they are by sm90's e4m3 wgmma (sm90/wgmma.cuh).
struct e4m3 {
  // Four floats -> four e4m3 bytes, a in the lowest; rounded to nearest even, saturated to +-448
  // (sm_89 and newer). cvt puts its first source in the upper byte of each pair.
  static __device__ __forceinline__ u32 pack4(float a, float b, float c, float d) {
    u32 r;
    asm("{.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};}"
        : "=r"(r)
        : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
  }
};

typedef unsigned char u8;

// How a kernel's inputs are stored: 16-bit inputs as u16, e4m3 as bytes.
template <class Input>
struct InputStorage {
  typedef u16 type;
  static constexpr bool fp8 = false;
};
template <>
struct InputStorage<e4m3> {
  typedef u8 type;
  static constexpr bool fp8 = true;
};

// One 16-bit element of T, at element index i, as a float and back (rounded to nearest even).
template <class T>
__device__ __forceinline__ float load_elem(const void* p, i64 i) {
  return T::unpack(u32(static_cast<const u16*>(p)[i])).x;
}
template <class T>
__device__ __forceinline__ void store_elem(void* p, i64 i, float x) {
  static_cast<u16*>(p)[i] = u16(T::pack(x, 0.f) & 0xffffu);
}

// Zeroes an fp32 accumulator of MT x NT m16n8 tiles (four values per thread each).
template <int MT, int NT>
__device__ __forceinline__ void clear(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// Multiplies an fp32 accumulator of MT x NT m16n8 tiles by `factor` in place.
template <int MT, int NT>
__device__ __forceinline__ void scale(float (&acc)[MT][NT][4], float factor) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= factor;
}

__device__ __forceinline__ float fast_exp2(float x) {
  // ex2.approx maps -inf to +0, which the online softmax relies on for masked scores.
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Bit pattern of -inf; NVRTC offers no constexpr infinity without headers.
#define kNegInf __int_as_float(0xff800000)

}  // namespace cuflash
