"""Dropout's counter-based random stream in NumPy, bit for bit the device's
(cuda_src/common/philox.cuh; the design and its reasons: docs/dropout.md).

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011; the generator
of cuRAND, PyTorch and flash-attn) maps a 128-bit counter and a 64-bit key to 128 random bits.
Dropout's keep mask is a pure function of (seed, offset, b, h, i, j): batch entry (or packed
sequence) b, query head h, query row i and key j within the sequence. For a call with ``heads``
query heads:

* key = the 64-bit seed (low word first);
* counter = (the 64-bit ``offset + b * heads + h``, low word first, then ``row_call(i)``,
  ``key_call(j)``), with ``row_call(i) = 8 * (i // 16) + i % 8`` and
  ``key_call(j) = 4 * (j // 16) + (j % 8) // 2``;
* so one call covers the 8 elements ``i + {0, 8}`` x ``j + {0, 1, 8, 9}`` (i % 16 < 8, j even,
  j % 16 < 8): word ``2 * (j % 2) + (i // 8) % 2``, low 16 bits for ``(j // 8) % 2 == 0``, high
  16 bits otherwise;
* the element is kept iff its 16 bits are ``>= keep_threshold(dropout_p)``
  (``round(dropout_p * 65536)``), so the keep probability is ``1 - dropout_p`` within 2^-17.

Nothing depends on the sequence lengths, tiles or layout: a packed batch's sequence b draws the
mask a fixed-length batch draws for entry b, and a block of rows and keys the same bits as the
whole. A call consumes the offsets ``offset .. offset + batch * heads - 1``; the next call that
must draw a fresh mask with the same seed starts at ``offset + increment(batch, heads)``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = ["increment", "keep_mask", "keep_threshold", "key_call", "philox4x32_10", "row_call"]

# Philox4x32's multipliers and Weyl key increments (Random123).
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
KEEP_BITS = 16  # random bits per element


def _mulhilo(a: np.ndarray, multiplier: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    product = a.astype(np.uint64) * multiplier  # < 2^64: exact
    return (product >> np.uint64(32)).astype(np.uint32), product.astype(np.uint32)


def philox4x32_10(counter: npt.ArrayLike, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of ``counter`` (uint32, shape (4, ...): words c0..c3 first) under ``key``
    (k0, k1): uint32 of the counter's shape."""
    c0, c1, c2, c3 = np.asarray(counter, np.uint32)
    k0, k1 = key[0] & _U32, key[1] & _U32
    for round_ in range(_ROUNDS):
        if round_:
            k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint32(k0), lo1, hi0 ^ c3 ^ np.uint32(k1), lo0
    return np.stack([c0, c1, c2, c3])


def keep_threshold(dropout_p: float) -> int:
    """The 16-bit threshold: an element is kept iff its bits are >= it. ``dropout_p * 65536`` is
    exact in binary floating point, so this is round-half-up of the exact product."""
    return math.floor(dropout_p * (1 << KEEP_BITS) + 0.5)


def row_call(i: npt.ArrayLike) -> np.ndarray:
    """The counter word of query rows ``i``: rows i and i + 8 of a 16-row tile share a call."""
    i = np.asarray(i, np.int64)
    return (i >> 4 << 3) | (i & 7)


def key_call(j: npt.ArrayLike) -> np.ndarray:
    """The counter word of keys ``j``: keys j, j + 1, j + 8, j + 9 of a 16-key tile share a call."""
    j = np.asarray(j, np.int64)
    return (j >> 4 << 2) | ((j & 7) >> 1)


def increment(batch: int, heads: int) -> int:
    """How many offsets a call over ``batch`` entries (or packed sequences) of ``heads`` query
    heads consumes."""
    return batch * heads


def _indices(x) -> np.ndarray:
    return np.arange(x, dtype=np.int64) if np.ndim(x) == 0 else np.asarray(x, np.int64)


def keep_mask(seed: int, offset: int, dropout_p: float, heads: int, rows, cols, batches=1) -> np.ndarray:
    """Dropout's keep mask, bool (len(batches), heads, len(rows), len(cols)): True where the
    element survives.

    ``rows``, ``cols``, ``batches``: query rows, keys and batch entries (or packed sequences), each
    an int n (0 .. n - 1) or an array of indices; the positions are within the sequence. ``heads``
    is the call's number of query heads (part of each head's counter)."""
    rows, cols, batches = _indices(rows), _indices(cols), _indices(batches)
    threshold = keep_threshold(dropout_p)
    row_calls, row_of = np.unique(row_call(rows), return_inverse=True)
    key_calls, key_of = np.unique(key_call(cols), return_inverse=True)
    heads_index = np.arange(heads, dtype=np.uint64)
    # The 64-bit low half of each (batch, head)'s counters, wrapping as the device's u64 does.
    stream = (np.uint64(offset & _U64) + batches.astype(np.uint64)[:, None] * np.uint64(heads) + heads_index)
    shape = (batches.size, heads, row_calls.size, key_calls.size)
    counter = np.empty((4, *shape), np.uint32)
    counter[0] = (stream & np.uint64(_U32)).astype(np.uint32)[:, :, None, None]
    counter[1] = (stream >> np.uint64(32)).astype(np.uint32)[:, :, None, None]
    counter[2] = row_calls.astype(np.uint32)[:, None]
    counter[3] = key_calls.astype(np.uint32)[None, :]
    words = philox4x32_10(counter, (seed & _U32, seed >> 32 & _U32))  # (4, batch, heads, row calls, key calls)
    word = 2 * (cols[None, :] & 1) + ((rows[:, None] >> 3) & 1)
    shift = (16 * ((cols >> 3) & 1)).astype(np.uint32)[None, :]
    picked = words[word, :, :, row_of[:, None], key_of[None, :]]  # (rows, cols, batch, heads)
    bits = (picked >> shift[:, :, None, None]) & np.uint32(0xFFFF)
    return (bits >= threshold).transpose(2, 3, 0, 1)
