// Run-time arguments of the sm90 forward kernel: the three tensor maps TMA loads Q, K and V
// through, then the sm80 kernel's arguments for everything else (FwdParams: output and LSE
// pointers and strides, packed-batch offsets, lengths, mask and softmax constants; FwdParamsFp8
// for e4m3 inputs, with the descales), so both families read one set of fields, then the tile
// counts of the persistent grid. Mirrored by FWD_PARAMS_SM90 and FWD_PARAMS_SM90_FP8 in
// cuflash/_core/params.py (cuflash.tma.param_dtype lays the 64-byte-aligned maps out).
#pragma once
#include "common/params.cuh"
#include "sm90/tma.cuh"

namespace cuflash {
namespace sm90 {

template <class Base>
struct FwdParamsSm90Of {
  // 4-D maps over the BSHD tensors, innermost first: (head_dim, heads, rows, batch), box (64, 1,
  // rows per tile, 1): one 64-column panel of one head's tile per copy, 128-byte swizzle for
  // 16-bit elements, 64-byte for e4m3 (one swizzle row per panel row either way).
  // A packed batch is one batch of all its rows; sequences start at their cu_seqlens row.
  TensorMap q;
  TensorMap k;
  TensorMap v;
  Base base;
  // The persistent grid's tiles (flash_fwd.cu, tile_coord): tiles = m_blocks * heads * batches.
  int m_blocks;
  int heads;
  int batches;
  int tiles;
};
typedef FwdParamsSm90Of<FwdParams> FwdParamsSm90;
static_assert(sizeof(FwdParamsSm90) == 704 && alignof(FwdParamsSm90) == 64, "cuflash/_core/params.py packs 704 bytes");
static_assert(sizeof(FwdParamsSm90Of<FwdParamsFp8>) == 768, "cuflash/_core/params.py packs 768 bytes");

// The kernel argument of a forward whose inputs are Input (common/params.cuh, FwdArgs).
template <class Input>
using FwdArgsSm90 = FwdParamsSm90Of<typename FwdArgs<Input>::type>;

}  // namespace sm90
}  // namespace cuflash
