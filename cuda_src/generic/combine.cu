// kv_combine: the splits of kv_decode (sm80/kv_decode.cu) or of MLA decoding merged through their
// LSEs; also cuflash.combine's kernel.
//
// generic/: kernels that use no family's instructions (elementwise work and reductions), built for
// the sm80 target and run as they are on every GPU, beside either family's kernels.
#include "common/params.cuh"
#include "common/types.cuh"

namespace cuflash {

struct store_f32 {
  static __device__ __forceinline__ void at(void* p, i64 i, float x) { static_cast<float*>(p)[i] = x; }
};
template <class T>
struct store_16 {
  static __device__ __forceinline__ void at(void* p, i64 i, float x) { store_elem<T>(p, i, x); }
};

// One CTA of WARPS warps (kv_combine's template argument, dispatch.COMBINE_WARPS) per (batch, row,
// head); grid.x covers batch * seqlen * heads. Every warp reads all the splits' lse (a few floats)
// and reduces it itself, then takes a contiguous 1 / WARPS of the splits; each lane owns 4 columns
// of a 128-column chunk, so a warp reads one 512-byte row of out_partial per split, the loads of
// several splits in flight at once. The warps' sums meet in shared memory.
constexpr int COMBINE_COLS = 128;  // columns per chunk: 4 per lane

// Four columns c .. c + 3 of a partial row (zeros past head_dim): one 16-byte load when VEC (the
// rows 16-byte aligned and head_dim a multiple of 4).
template <bool VEC>
__device__ __forceinline__ float4 combine_load4(const float* row, int c, int head_dim) {
  if constexpr (VEC) {
    return *reinterpret_cast<const float4*>(row + c);
  } else {
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = c + j < head_dim ? row[c + j] : 0.f;
    return make_float4(x[0], x[1], x[2], x[3]);
  }
}

// acc += the 4 columns at c of `count` (<= 32) consecutive splits' rows from `first` on, weighted
// by lane j's `weight` for the j-th (0 for a split that saw no key: its row, which may be garbage,
// is left out). The loads of COMBINE_BATCH splits are all issued before any is used, so their
// latencies overlap.
constexpr int COMBINE_BATCH = 8;
template <bool VEC>
__device__ __forceinline__ void combine_splits(float4& acc, const float* first, i64 split_stride, int count,
                                               float weight, int c, int head_dim) {
  for (int j0 = 0; j0 < count; j0 += COMBINE_BATCH) {
    float4 x[COMBINE_BATCH];
#pragma unroll
    for (int u = 0; u < COMBINE_BATCH; ++u) {
      x[u] = j0 + u < count && c < head_dim ? combine_load4<VEC>(first + i64(j0 + u) * split_stride, c, head_dim)
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < COMBINE_BATCH; ++u) {
      const float w = __shfl_sync(~0u, weight, (j0 + u) % 32);
      if (w != 0.f) {
        acc.x += w * x[u].x;
        acc.y += w * x[u].y;
        acc.z += w * x[u].z;
        acc.w += w * x[u].w;
      }
    }
  }
}

template <class Store, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) kv_combine(const __grid_constant__ CombineParams p) {
  static_assert(WARPS * 32 >= COMBINE_COLS, "a thread per column of a chunk adds up the warps' sums");
  __shared__ float4 partial[WARPS][COMBINE_COLS / 4];
  const i64 item = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = int(item % p.heads);
  const i64 bi = item / p.heads;
  const int i = int(bi % p.seqlen), b = int(bi / p.seqlen);
  const float* lp = p.lse_partial + i64(b) * p.lp_batch_stride + i64(i) * p.lp_row_stride + i64(h) * p.lp_head_stride;
  // The head's sink (common/bias.cuh) joins as one more part whose output is 0: it enters the
  // LSE, and so every split's weight, once.
  const float sink = p.sinks != nullptr ? p.sinks[h] : kNegInf;
  float mx = lane == 0 ? sink : kNegInf;
  for (int s = lane; s < p.splits; s += 32) mx = fmaxf(mx, lp[s * p.lp_split_stride]);
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, off));
  const float base = mx == kNegInf ? 0.f : mx;
  float total = lane == 0 ? expf(sink - base) : 0.f;
  for (int s = lane; s < p.splits; s += 32) total += expf(lp[s * p.lp_split_stride] - base);
  for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(~0u, total, off);
  const bool empty = total == 0.f;
  const float lse = empty ? kNegInf : base + logf(total);

  const float* op = p.out_partial + i64(b) * p.op_batch_stride + i64(i) * p.op_row_stride + i64(h) * p.op_head_stride;
  const i64 o_at = i64(b) * p.o_batch_stride + i64(i) * p.o_row_stride + i64(h) * p.o_head_stride;
  // 16-byte loads need every row start 16-byte aligned: the base, the strides and head_dim.
  const bool vec = p.head_dim % 4 == 0 && reinterpret_cast<size_t>(p.out_partial) % 16 == 0 &&
                   (p.op_split_stride | p.op_batch_stride | p.op_row_stride | p.op_head_stride) % 4 == 0;
  const int per_warp = (p.splits + WARPS - 1) / WARPS;
  const int s_lo = warp * per_warp, s_hi = min(p.splits, s_lo + per_warp);
  for (int c0 = 0; c0 < p.head_dim; c0 += COMBINE_COLS) {
    const int c = c0 + 4 * lane;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = s_lo; s0 < s_hi && !empty; s0 += 32) {
      const float l = s0 + lane < s_hi ? lp[(s0 + lane) * p.lp_split_stride] : kNegInf;
      const float weight = l == kNegInf ? 0.f : expf(l - lse);
      const float* first = op + i64(s0) * p.op_split_stride;
      const int count = min(32, s_hi - s0);
      if (vec) {
        combine_splits<true>(acc, first, p.op_split_stride, count, weight, c, p.head_dim);
      } else {
        combine_splits<false>(acc, first, p.op_split_stride, count, weight, c, p.head_dim);
      }
    }
    partial[warp][lane] = acc;
    __syncthreads();  // every warp's sums of this chunk are in place
    const int col = c0 + threadIdx.x;
    if (threadIdx.x < COMBINE_COLS && col < p.head_dim) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += reinterpret_cast<const float*>(partial[w])[threadIdx.x];
      Store::at(p.out, o_at + col, sum);
    }
    __syncthreads();  // the chunk's sums are read before the next chunk overwrites them
  }
  if (p.lse && threadIdx.x == 0) p.lse[i64(b) * p.l_batch_stride + i64(i) * p.l_row_stride + i64(h) * p.l_head_stride] = lse;
}

}  // namespace cuflash
