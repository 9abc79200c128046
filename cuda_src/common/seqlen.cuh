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

// Whether Params has seq_end_q / seq_end_k (FwdParams does; the backward's BwdParams does not).
template <class Params, class = void>
struct HasSeqEnds {
  static constexpr bool value = false;
};
template <class Params>
struct HasSeqEnds<Params, decltype(void(&Params::seq_end_q))> {
  static constexpr bool value = true;
};

// Params: FwdParams, or any struct with the same cu_seqlens_* and seqlen_* fields. A packed
// forward reads where each sequence ends from seq_end_q / seq_end_k: cu_seqlens + 1, or, with
// seqused_q / seqused_k, cu_seqlens[b] + seqused[b] (the host computes them), so the used prefix
// costs the kernel nothing: rows past it are not computed (the host zero-fills out and sets lse
// to -inf there), keys past it are not seen, and masks align against the used lengths.
template <class Params>
__device__ __forceinline__ Sequence sequence_of(const Params& p, int batch) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, p.seqlen_q, p.seqlen_k};
  const int q_begin = p.cu_seqlens_q[batch];
  const int k_begin = p.cu_seqlens_k[batch];
  if constexpr (HasSeqEnds<Params>::value) {
    return {q_begin, k_begin, p.seq_end_q[batch] - q_begin, p.seq_end_k[batch] - k_begin};
  } else {
    return {q_begin, k_begin, p.cu_seqlens_q[batch + 1] - q_begin, p.cu_seqlens_k[batch + 1] - k_begin};
  }
}

}  // namespace cuflash
