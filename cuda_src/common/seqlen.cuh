// Where a batch entry's sequence lives: in a fixed-length batch, batch `b` of every tensor starts
// at b * batch_stride and all sequences share the lengths in the params; in a packed batch
// (cu_seqlens set, batch strides 0) sequence b starts at row cu_seqlens[b] and has its own lengths.
//
// Packed batches are a run-time switch (a null pointer test per CTA), not a template flag: the
// fixed-length path pays one uniform branch and two row offsets of 0 per CTA, where a flag would
// double the forward instantiations, and with them the compile check and first-call compiles.
#pragma once
#include "common/types.cuh"

namespace cuflash {

struct Sequence {
  int q_begin;  // first row of the sequence in q, o and lse
  int k_begin;  // first row in k and v
  int seqlen_q;
  int seqlen_k;
};

// Params: FwdParams, or any struct with the same cu_seqlens_* and seqlen_* fields.
template <class Params>
__device__ __forceinline__ Sequence sequence_of(const Params& p, int batch) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, p.seqlen_q, p.seqlen_k};
  const int q_begin = p.cu_seqlens_q[batch];
  const int k_begin = p.cu_seqlens_k[batch];
  return {q_begin, k_begin, p.cu_seqlens_q[batch + 1] - q_begin, p.cu_seqlens_k[batch + 1] - k_begin};
}

}  // namespace cuflash
