// The dropout mask of common/philox.cuh in each register layout, written out element by element.
// Test-only (tests/test_dropout_header.py compiles it with cuda_src/ on the include path);
// nothing in the library includes it.
//
// One warp per 16 x 16 tile of a (rows x cols) grid, tile (blockIdx.x, blockIdx.y): each lane
// stores, at the positions its accumulator registers stand for, the keep mask of keep_rows (rows =
// queries), of keep_keys (rows = keys) and, through drop_rows, of a tile of ones. Each output is
// (rows x cols) bytes, row-major by query; the host compares all three with cuflash/_cpu/philox.py.
#include "common/philox.cuh"

namespace cuflash {
namespace dropout_check {

struct Params {
  unsigned long long seed, offset;
  unsigned char* by_rows;
  unsigned char* by_keys;
  unsigned char* dropped;
  int rows, cols, batch, heads, head;
  u32 threshold;
};

__global__ void __launch_bounds__(32) masks(const __grid_constant__ Params p) {
  const int lane = threadIdx.x;
  const int tile_row = blockIdx.x * 16, tile_key = blockIdx.y * 16;
  const DropoutStream d(p.seed, p.offset, p.batch, p.heads, p.head, p.threshold);
  const auto put = [&](unsigned char* out, int row, int key, bool value) {
    if (row < p.rows && key < p.cols) out[static_cast<long long>(row) * p.cols + key] = value;
  };
  bool keep[2][4];
  keep_rows(d, tile_row, tile_key, lane, keep);
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      put(p.by_rows, tile_row + lane / 4 + 8 * (r / 2), tile_key + 8 * t + 2 * (lane % 4) + r % 2, keep[t][r]);
  // Rows = keys: the same tile seen transposed, keys along the accumulator's rows.
  keep_keys(d, tile_key, tile_row, lane, keep);
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      put(p.by_keys, tile_row + 8 * t + 2 * (lane % 4) + r % 2, tile_key + lane / 4 + 8 * (r / 2), keep[t][r]);
  float s[1][2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[0][t][r] = 1.f;
  drop_rows(s, d, tile_row, tile_key, lane);
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      put(p.dropped, tile_row + lane / 4 + 8 * (r / 2), tile_key + 8 * t + 2 * (lane % 4) + r % 2, s[0][t][r] != 0.f);
}

}  // namespace dropout_check
}  // namespace cuflash
