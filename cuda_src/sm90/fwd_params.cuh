// Run-time arguments of the sm90 forward kernel: the three tensor maps TMA loads Q, K and V
// through, then the sm80 FwdParams for everything else (output and LSE pointers and strides,
// packed-batch offsets, lengths, mask and softmax constants), so both families read one set of
// fields, then the tile counts of the persistent grid. Mirrored by FWD_PARAMS_SM90 in cuflash/params.py (cuflash.tma.param_dtype lays the
// 64-byte-aligned maps out).
#pragma once
#include "common/params.cuh"
#include "sm90/tma.cuh"

namespace cuflash {
namespace sm90 {

struct FwdParamsSm90 {
  // 4-D maps over the BSHD tensors, innermost first: (head_dim, heads, rows, batch), 128-byte
  // swizzle, box (64, 1, rows per tile, 1): one 64-column panel of one head's tile per copy.
  // A packed batch is one batch of all its rows; sequences start at their cu_seqlens row.
  TensorMap q;
  TensorMap k;
  TensorMap v;
  FwdParams base;
  // The persistent grid's tiles (flash_fwd.cu, tile_coord): tiles = m_blocks * heads * batches.
  int m_blocks;
  int heads;
  int batches;
  int tiles;
};
static_assert(sizeof(FwdParamsSm90) == 640 && alignof(FwdParamsSm90) == 64, "cuflash/params.py packs 640 bytes");

}  // namespace sm90
}  // namespace cuflash
