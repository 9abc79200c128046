// Run-time arguments of the sm90 backward kernel: tensor maps of Q and dO (boxes of 64 query rows)
// and of K and V (boxes of 128 key rows), then the sm80 BwdParams for everything else, so both
// families read one set of fields. Mirrored by BWD_PARAMS_SM90 in cuflash/_core/params.py.
#pragma once
#include "common/params.cuh"
#include "sm90/tma.cuh"

namespace cuflash {
namespace sm90 {

struct BwdParamsSm90 {
  // 4-D maps over the BSHD tensors as in FwdParamsSm90: (head_dim, heads, rows, batch),
  // 128-byte swizzle, boxes of one 64-column panel of one head.
  TensorMap q;
  TensorMap k;
  TensorMap v;
  TensorMap dout;
  BwdParams base;
};
static_assert(sizeof(BwdParamsSm90) == 960 && alignof(BwdParamsSm90) == 64, "cuflash/_core/params.py packs 960 bytes");

}  // namespace sm90
}  // namespace cuflash
