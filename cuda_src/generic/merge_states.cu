// merge_states (cuflash.merge_states, vLLM's merge_attn_states): two partial attention results over
// disjoint key sets (a shared prefix and each sequence's suffix: cascade attention) merged through
// their LSEs: lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b - lse)
// out_b. Memory-bound: one warp per (row, head), each lane 8 columns (16 bytes of a 16-bit row) at
// a time, the two LSEs read by every lane (one broadcast transaction each).
//
// generic/: kernels that use no family's instructions (elementwise work and reductions), built for
// the sm80 target and run as they are on every GPU, beside either family's kernels.
#include "common/params.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"

namespace cuflash {

// Eight consecutive elements of a row of T (f16, bf16: one 16-byte vector) as floats, and back.
template <class T>
struct Row8 {
  static __device__ __forceinline__ void load(const void* base, i64 i, float (&x)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const u16*>(base) + i);
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = T::unpack(words[j]);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
  static __device__ __forceinline__ void store(void* base, i64 i, const float (&x)[8]) {
    const uint4 v = make_uint4(T::pack(x[0], x[1]), T::pack(x[2], x[3]), T::pack(x[4], x[5]), T::pack(x[6], x[7]));
    *reinterpret_cast<uint4*>(static_cast<u16*>(base) + i) = v;
  }
};

// float32 rows: two 16-byte vectors.
struct Row8F32 {
  static __device__ __forceinline__ void load(const void* base, i64 i, float (&x)[8]) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 lo = p[0], hi = p[1];
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = v[j];
  }
  static __device__ __forceinline__ void store(void* base, i64 i, const float (&x)[8]) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(x[0], x[1], x[2], x[3]);
    p[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
};

constexpr int MERGE_WARPS = 4;  // dispatch.MERGE_WARPS

template <class Row>
__global__ void __launch_bounds__(MERGE_WARPS * 32) merge_states(const __grid_constant__ MergeParams p) {
  const i64 item = i64(blockIdx.x) * MERGE_WARPS + threadIdx.x / 32;
  if (item >= i64(p.rows) * p.heads) return;
  const int lane = threadIdx.x % 32;
  const int h = int(item % p.heads);
  const i64 r = item / p.heads;
  const i64 outer = r / p.inner_rows, inner = r % p.inner_rows;
  float la = p.lse_a[outer * p.la_outer_stride + inner * p.la_inner_stride + h * p.la_head_stride];
  float lb = p.lse_b[outer * p.lb_outer_stride + inner * p.lb_inner_stride + h * p.lb_head_stride];
  // An LSE of +inf (a sum that overflowed) drops its part, as vLLM's merge does.
  la = la == -kNegInf ? kNegInf : la;
  lb = lb == -kNegInf ? kNegInf : lb;
  const float m = fmaxf(la, lb);
  float wa = 0.f, wb = 0.f, lse = kNegInf;
  if (m != kNegInf) {  // both -inf: no key on either side, out 0
    wa = expf(la - m);
    wb = expf(lb - m);
    const float sum = wa + wb;
    lse = m + logf(sum);
    wa /= sum;
    wb /= sum;
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[outer * p.l_outer_stride + inner * p.l_inner_stride + h * p.l_head_stride] = lse;
  }
  const i64 a = outer * p.oa_outer_stride + inner * p.oa_inner_stride + h * p.oa_head_stride;
  const i64 b = outer * p.ob_outer_stride + inner * p.ob_inner_stride + h * p.ob_head_stride;
  const i64 o = outer * p.o_outer_stride + inner * p.o_inner_stride + h * p.o_head_stride;
  for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
    float x[8] = {}, y[8] = {};
    // A part of weight 0 is not read: its row may hold anything (NaN included) when it saw no key.
    if (wa > 0.f) Row::load(p.out_a, a + c, x);
    if (wb > 0.f) Row::load(p.out_b, b + c, y);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = wa * x[j] + wb * y[j];
    Row::store(p.out, o + c, x);
  }
}

}  // namespace cuflash
