// Dropout's random stream: Philox4x32-10 and the keep mask in the kernels' register layouts.
// The mask is a pure function of (seed, offset, batch entry b, query head h, query row i, key j),
// positions within the sequence, so the backward regenerates the forward's mask whatever its
// tiles and orientation, and a CUDA graph replays it as long as seed and offset are read at run
// time. Mirrored bit for bit by cuflash/_cpu/philox.py; the design and its cost: docs/dropout.md.
//   key     = seed (low word first)
//   counter = (offset + b * heads + h as 64 bits, low word first;
//              row_call = 8 (i / 16) + i % 8; key_call = 4 (j / 16) + (j % 8) / 2)
// One call gives the 8 elements rows i + {0, 8} x keys j + {0, 1, 8, 9} of a 16 x 16 tile
// (i % 16 < 8, j even, j % 16 < 8): word 2 (j % 2) + (i / 8) % 2, its low 16 bits for
// (j / 8) % 2 == 0, else its high 16 bits. An element is kept iff its 16 bits are >= threshold
// = round(dropout_p * 65536), a keep probability within 2^-17 of 1 - dropout_p.
#pragma once
#include "common/types.cuh"

namespace cuflash {

// Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011): ten rounds of two
// 32 x 32 -> 64-bit products, the key bumped by the Weyl constants between rounds.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// One (batch entry, query head)'s stream. `heads`: the call's query heads; in a packed batch the
// batch entry is the sequence's index.
struct DropoutStream {
  uint2 key;
  u32 stream_lo, stream_hi;
  u32 threshold;  // kept iff 16 bits >= threshold; 0 keeps everything, 65536 nothing

  __device__ __forceinline__ DropoutStream(unsigned long long seed, unsigned long long offset, int batch, int heads,
                                           int head, u32 keep_threshold)
      : key(make_uint2(static_cast<u32>(seed), static_cast<u32>(seed >> 32))), threshold(keep_threshold) {
    const unsigned long long stream = offset + static_cast<unsigned long long>(batch) * heads + head;
    stream_lo = static_cast<u32>(stream);
    stream_hi = static_cast<u32>(stream >> 32);
  }

  // The call that holds element (row, key): bit 3 of row and of key, and bit 0 of key, pick
  // among its 8 elements.
  __device__ __forceinline__ uint4 words(int row, int key_index) const {
    const u32 row_call = (static_cast<u32>(row) >> 4 << 3) | (row & 7);
    const u32 key_call = (static_cast<u32>(key_index) >> 4 << 2) | ((key_index & 7) >> 1);
    return philox4x32_10(make_uint4(stream_lo, stream_hi, row_call, key_call), key);
  }

  // Whether the 16 bits of `word` in its high half (HIGH) or low half pass.
  template <bool HIGH>
  __device__ __forceinline__ bool keeps(u32 word) const {
    return (HIGH ? word >> 16 : word & 0xFFFFu) >= threshold;
  }
};

// The keep mask of this thread's 8 elements of the 16 x 16 tile at (tile_row, tile_key), both
// multiples of 16, in mma's m16n8 accumulator layout with rows = queries (both forwards, sm80's
// backward): keep[t][r] for register r of n8 tile t, i.e. row tile_row + lane / 4 + 8 (r / 2),
// key tile_key + 8 t + 2 (lane % 4) + r % 2. One Philox call, all of whose bits it uses.
__device__ __forceinline__ void keep_rows(const DropoutStream& d, int tile_row, int tile_key, int lane,
                                          bool (&keep)[2][4]) {
  const uint4 w = d.words(tile_row + lane / 4, tile_key + 2 * (lane % 4));
  // Register r: row half a = r / 2, key parity e = r % 2, so word 2 e + a; tile t: the half.
  keep[0][0] = d.keeps<false>(w.x);
  keep[0][1] = d.keeps<false>(w.z);
  keep[0][2] = d.keeps<false>(w.y);
  keep[0][3] = d.keeps<false>(w.w);
  keep[1][0] = d.keeps<true>(w.x);
  keep[1][1] = d.keeps<true>(w.z);
  keep[1][2] = d.keeps<true>(w.y);
  keep[1][3] = d.keeps<true>(w.w);
}

// The same for the transposed layout, rows = keys (sm90's backward, S^T = K Q^T): the 16 x 16 tile
// of keys tile_key.. and queries tile_query.. (multiples of 16); keep[t][r] for register r of n8
// tile t, i.e. key tile_key + lane / 4 + 8 (r / 2), query tile_query + 8 t + 2 (lane % 4) + r % 2.
// This thread holds half of each of two calls, lane ^ 4 the other halves: each lane computes one
// call and the two swap the halves they do not keep (two shuffles of 32 bits). Every lane of the
// warp must call it together.
__device__ __forceinline__ void keep_keys(const DropoutStream& d, int tile_key, int tile_query, int lane,
                                          bool (&keep)[2][4]) {
  // This lane's key parity (bit 0 of (key % 8)) picks both its call's query parity and which
  // words of each call it keeps: words 2 e, 2 e + 1 (query halves a = 0, 1).
  const bool odd = (lane >> 2) & 1;
  const uint4 w = d.words(tile_query + 2 * (lane % 4) + odd, tile_key + lane / 4);
  const u32 mine0 = odd ? w.z : w.x, mine1 = odd ? w.w : w.y;
  const u32 got0 = __shfl_xor_sync(0xFFFFFFFFu, odd ? w.x : w.z, 4);
  const u32 got1 = __shfl_xor_sync(0xFFFFFFFFu, odd ? w.y : w.w, 4);
  // Words of the call of the even query (r % 2 == 0) and of the odd one, for query half a = t.
  const u32 even0 = odd ? got0 : mine0, even1 = odd ? got1 : mine1;
  const u32 odd0 = odd ? mine0 : got0, odd1 = odd ? mine1 : got1;
  // Register r: key half b = r / 2 picks the 16 bits.
  keep[0][0] = d.keeps<false>(even0);
  keep[0][1] = d.keeps<false>(odd0);
  keep[0][2] = d.keeps<true>(even0);
  keep[0][3] = d.keeps<true>(odd0);
  keep[1][0] = d.keeps<false>(even1);
  keep[1][1] = d.keeps<false>(odd1);
  keep[1][2] = d.keeps<true>(even1);
  keep[1][3] = d.keeps<true>(odd1);
}

// keep_rows' or keep_keys' flags as bit 4 t + r of a word: the masks of a thread's whole row of
// 16 x 16 tiles (up to 32 keys or queries) held in one register, where a flag each would take 8
// per tile across the code between the mask's draw and its last use.
__device__ __forceinline__ u32 keep_bits(const bool (&keep)[2][4]) {
  u32 bits = 0;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) bits |= static_cast<u32>(keep[t][r]) << (4 * t + r);
  return bits;
}

// The attention kernels' dropout, read from their params (FwdParams, BwdParams: common/params.cuh):
// on where dropout_scale (1 / (1 - p)) is nonzero.
template <class Params>
__device__ __forceinline__ bool dropout_on(const Params& p) {
  return p.dropout_scale != 0.f;
}

// The stream of (batch, head) for a call of `heads` query heads: its seed and offset from the
// device pair dropout_rng where given (read at run time, so that a CUDA graph's replays draw
// their own), else from the params.
template <class Params>
__device__ __forceinline__ DropoutStream dropout_stream(const Params& p, int batch, int heads, int head) {
  const unsigned long long* rng = p.dropout_rng;
  return DropoutStream(rng != nullptr ? rng[0] : p.dropout_seed, rng != nullptr ? rng[1] : p.dropout_offset, batch,
                       heads, head, p.dropout_threshold);
}

// The forward's dropout: P's dropped elements set to 0 in an accumulator of MT 16-row tiles by NT
// 8-key tiles (rows = queries) whose first row is first_row and first key first_key (multiples of
// 16). After the online softmax has taken P's row sums (the LSE is of the undropped P); the
// 1 / (1 - dropout_p) goes onto O once, in the epilogue.
template <int MT, int NT>
__device__ __forceinline__ void drop_rows(float (&s)[MT][NT][4], const DropoutStream& d, int first_row, int first_key,
                                          int lane) {
  static_assert(NT % 2 == 0, "whole 16-key tiles");
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int pair = 0; pair < NT / 2; ++pair) {
      bool keep[2][4];
      keep_rows(d, first_row + 16 * mt, first_key + 16 * pair, lane, keep);
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (!keep[t][r]) s[mt][2 * pair + t][r] = 0.f;
    }
}

}  // namespace cuflash
