// The backward's first and last launches, the same for both families, around either family's
// main kernel (sm80/flash_bwd.cu, sm90/flash_bwd.cu):
//   flash_bwd_preprocess: delta = rowsum(dO * O), a few lanes per query row;
//   flash_bwd_convert: fp32 accumulators -> the gradients' dtype (dQ, summing the deterministic
//     splits; dK and dV when several query heads share a K/V head).
//
// generic/: kernels that use no family's instructions (elementwise work and reductions), built for
// the sm80 target and run as they are on every GPU, beside either family's kernels.
#include "common/params.cuh"
#include "common/seqlen.cuh"
#include "common/types.cuh"

namespace cuflash {

// Both kernels give each row of a (row, head) head_dim / 8 threads, one 16-byte vector of 16-bit
// elements each, rounded up to a power of two (a row's threads are then aligned lanes of one warp,
// reduced with shuffles) and at least 8, so that one block of THREADS (dispatch.HELPER_THREADS)
// covers THREADS / row_threads rows (dispatch.helper_rows_per_block computes the same for the
// grid). They are bound by memory, and a warp per row would leave 16 or 24 of its 32 lanes idle
// below head_dim 256.
__device__ __forceinline__ int helper_row_threads(int head_dim) {
  const int vectors = (head_dim + 7) / 8;
  return vectors <= 8 ? 8 : 1 << (32 - __clz(vectors - 1));
}

// delta = rowsum(dO * O) per (row, head): the dP correction of the main kernels' dS. O and dO
// have v's head dim.
template <int THREADS, class Elem>
__global__ void __launch_bounds__(THREADS) flash_bwd_preprocess(const __grid_constant__ BwdParams p) {
  const int row_threads = helper_row_threads(p.head_dim_v);
  const int col = (threadIdx.x & (row_threads - 1)) * 8;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const Sequence seq = sequence_of(p, batch);
  const int row = blockIdx.x * (THREADS / row_threads) + threadIdx.x / row_threads;
  // Every lane stays to the shuffles (a full-warp mask); rows past the sequence add zeros.
  const bool inside = row < seq.seqlen_q;
  float sum = 0.f;
  if (inside && col < p.head_dim_v) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const u16*>(p.o) + batch * p.o_batch_stride +
                                                    (seq.q_begin + row) * p.o_row_stride + head * p.o_head_stride + col);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const u16*>(p.dout) + batch * p.do_batch_stride +
                                                    (seq.q_begin + row) * p.do_row_stride + head * p.do_head_stride +
                                                    col);
    const u32 ow[4] = {o.x, o.y, o.z, o.w};
    const u32 dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = Elem::unpack(ow[i]);
      const float2 b = Elem::unpack(dw[i]);
      sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
  }
  for (int offset = row_threads / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (inside && col == 0) p.delta[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_begin + row] = sum;
}

// fp32 accumulators -> the gradient's dtype, times `scale`. Output element (batch, row, head, col)
// is scale times the sum, in index order, of `group` fp32 values at src + batch * src_batch_stride
// + row * src_row_stride + head * src_head_stride + g * group_stride + col (dQ splits, or
// deterministic GQA dK/dV per query head).
template <int THREADS, class Elem>
__global__ void __launch_bounds__(THREADS) flash_bwd_convert(const __grid_constant__ ConvertParams p) {
  const int row_threads = helper_row_threads(p.head_dim);
  const int col = (threadIdx.x & (row_threads - 1)) * 8;
  const int row = blockIdx.x * (THREADS / row_threads) + threadIdx.x / row_threads;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  if (row >= p.seqlen || col >= p.head_dim) return;
  // Eight columns per thread: the sources are the backward's own fp32 buffers, whose strides
  // and summand stride are whole 16-byte vectors (the backward plan allocates them so).
  const float* const src = p.src + batch * p.src_batch_stride + row * p.src_row_stride + head * p.src_head_stride + col;
  float sum[8] = {};
  for (int g = 0; g < p.group; ++g) {
    const float4 lo = *reinterpret_cast<const float4*>(src + g * p.group_stride);
    const float4 hi = *reinterpret_cast<const float4*>(src + g * p.group_stride + 4);
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] += v[i];
  }
  u32 packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) packed[i] = Elem::pack(sum[2 * i] * p.scale, sum[2 * i + 1] * p.scale);
  // The gradients are 16-byte aligned with strides of whole 16-byte vectors (the entry
  // points refuse others): one vector store.
  u16* const dst = static_cast<u16*>(p.dst) + batch * p.dst_batch_stride + row * p.dst_row_stride +
                   head * p.dst_head_stride + col;
  *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

}  // namespace cuflash
