// cuflash.quantize_fp8 on the GPU: one CTA per quantization group (the whole tensor, one
// (batch, head group), or one block of rows of a (batch, head group)), in one launch. The CTA reads its group
// twice: once for the absolute maximum, once to scale, saturate and round to e4m3. With a
// rotation, each row of head_dim values is multiplied by random signs and by block-diagonal
// Hadamard matrices (a butterfly in shared memory) before both passes.
//
// Every step is float32 with explicit round-to-nearest intrinsics (no contraction into FMAs), and
// the butterfly runs in the order cuflash/quantize.py's NumPy path runs it, so the GPU's bytes
// and descales equal the NumPy path's bit for bit; a maximum does not depend on its order.
//
// generic/: kernels that use no family's instructions (elementwise work and reductions), built for
// the sm80 target and run as they are on every GPU, beside either family's kernels.
#include "common/e4m3.cuh"
#include "common/params.cuh"
#include "common/types.cuh"

namespace cuflash {

struct load_f16 {
  static __device__ __forceinline__ float at(const void* x, i64 i) {
    return f16::unpack(static_cast<const u16*>(x)[i]).x;
  }
};

struct load_bf16 {
  static __device__ __forceinline__ float at(const void* x, i64 i) {
    return __uint_as_float(u32(static_cast<const u16*>(x)[i]) << 16);
  }
};

struct load_f32 {
  static __device__ __forceinline__ float at(const void* x, i64 i) { return static_cast<const float*>(x)[i]; }
};

// Row `row` of the group (batch_count x row_count x head_count rows from batch0, row0, head0) into
// `values` (this warp's head_dim floats in shared memory), rotated when asked; returns its
// element offset in the contiguous output.
template <class Load>
__device__ __forceinline__ i64 load_row(const QuantizeArgs& a, int row, int batch0, int row0, int head0,
                                        int row_count, int head_count, float* values) {
  const int lane = threadIdx.x & 31;
  const int batch = batch0 + row / (row_count * head_count);
  const int within = row % (row_count * head_count);
  const int seq = row0 + within / head_count;
  const int head = head0 + within % head_count;
  const i64 in = batch * a.x_batch_stride + seq * a.x_row_stride + head * a.x_head_stride;
  __syncwarp();  // every lane is done with the previous row
  for (int c = lane; c < a.head_dim; c += 32) {
    const float x = Load::at(a.x, in + c);
    values[c] = a.rotate_block ? __fmul_rn(x, a.signs[c]) : x;
  }
  __syncwarp();
  if (a.rotate_block) {
    for (int h = 1; h < a.rotate_block; h *= 2) {
      for (int pair = lane; pair < a.head_dim / 2; pair += 32) {
        const int i = (pair / h) * 2 * h + pair % h;
        const float lo = values[i], hi = values[i + h];
        values[i] = __fadd_rn(lo, hi);
        values[i + h] = __fsub_rn(lo, hi);
      }
      __syncwarp();
    }
    for (int c = lane; c < a.head_dim; c += 32) values[c] = __fmul_rn(values[c], a.rotate_norm);
    __syncwarp();
  }
  return ((i64(batch) * a.seqlen + seq) * a.heads + head) * a.head_dim;
}

template <int THREADS, int MAX_HEAD_DIM, class Load>
__global__ void __launch_bounds__(THREADS) quantize_fp8(const __grid_constant__ QuantizeArgs a) {
  constexpr int WARPS = THREADS / 32;
  __shared__ float rows[WARPS][MAX_HEAD_DIM];
  __shared__ float warp_max[WARPS];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int group = blockIdx.x;
  int batch0 = 0, batch_count = a.batch, row0 = 0, row_count = a.seqlen, head0 = 0, head_count = a.heads;
  if (a.granularity > 0) {
    const int head_groups = a.heads / a.group_heads;
    const int head_index = a.granularity == 2 ? group / a.blocks_per_head : group;
    batch0 = head_index / head_groups, batch_count = 1;
    head0 = (head_index % head_groups) * a.group_heads, head_count = a.group_heads;
    if (a.granularity == 2) {
      row0 = (group % a.blocks_per_head) * a.block_size;
      row_count = min(a.block_size, a.seqlen - row0);
    }
  }
  const int rows_in_group = batch_count * row_count * head_count;
  float* const values = rows[warp];

  float amax = 0.f;
  for (int row = warp; row < rows_in_group; row += WARPS) {
    load_row<Load>(a, row, batch0, row0, head0, row_count, head_count, values);
    for (int c = lane; c < a.head_dim; c += 32) amax = fmaxf(amax, fabsf(values[c]));
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (lane == 0) warp_max[warp] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, warp_max[w]);
  // A group of zeros keeps the scale 1 (any descale serves it, and 1 is finite and positive).
  const float scale = amax > 0.f ? __fdiv_rn(E4M3_MAX, amax) : 1.f;
  for (int i = threadIdx.x; i < a.descales_per_group; i += THREADS)
    a.descale[i64(group) * a.descales_per_group + i] = amax > 0.f ? __fdiv_rn(amax, E4M3_MAX) : 1.f;

  for (int row = warp; row < rows_in_group; row += WARPS) {
    const i64 out = load_row<Load>(a, row, batch0, row0, head0, row_count, head_count, values);
    for (int c = lane; c < a.head_dim; c += 32) {
      const float scaled = fminf(fmaxf(__fmul_rn(values[c], scale), -E4M3_MAX), E4M3_MAX);
      a.out[out + c] = to_e4m3(scaled);
    }
  }
}

}  // namespace cuflash
