// Run-time arguments of the forward kernels, passed by value as one struct. The host mirrors
// this layout with an aligned NumPy structured dtype (cuflash/params.py); keep the two in step.
#pragma once
#include "common/types.cuh"

namespace cuflash {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // (batch, heads, seqlen_q), contiguous
  // Strides in elements; the head_dim stride is 1.
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 k_batch_stride, k_row_stride, k_head_stride;
  i64 v_batch_stride, v_row_stride, v_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  int heads;
  int kv_group;  // heads / heads_kv: query heads that share one K/V head
  int seqlen_q;
  int seqlen_k;
  int head_dim;  // the real head_dim; the kernel's template bucket may be larger
  float scale_log2;  // softmax_scale * log2(e): scores go straight to the exp2 domain
};
static_assert(sizeof(FwdParams) == 160, "cuflash/params.py packs 160 bytes");

}  // namespace cuflash
