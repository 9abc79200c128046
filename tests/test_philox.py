"""Dropout's random stream on the CPU (cuflash/_cpu/philox.py): Philox4x32-10's published known
answers, the mask formula of docs/dropout.md element by element, its independence from lengths,
blocks and packing, and the keep rate within binomial error of the stated dropout_p."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash._cpu import philox


@pytest.mark.parametrize("counter, key, expected", [
    # Random123's kat_vectors for philox4x32_10.
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_known_answers(counter, key, expected):
    got = philox.philox4x32_10(np.array(counter, np.uint32), key)
    assert got.dtype == np.uint32 and tuple(int(w) for w in got) == expected
    # Vectorised: the same answer in every position of an array of counters.
    many = philox.philox4x32_10(np.broadcast_to(np.array(counter, np.uint32)[:, None, None], (4, 2, 3)), key)
    assert (many == np.array(expected, np.uint32)[:, None, None]).all()


def _element(seed, offset, p, heads, b, h, i, j) -> bool:
    """docs/dropout.md's formula for one element, in Python integers."""
    stream = (offset + b * heads + h) % 2**64
    counter = [stream & 0xFFFFFFFF, stream >> 32, 8 * (i // 16) + i % 8, 4 * (j // 16) + (j % 8) // 2]
    words = philox.philox4x32_10(np.array(counter, np.uint32), (seed & 0xFFFFFFFF, seed >> 32))
    word = int(words[2 * (j % 2) + (i // 8) % 2])
    bits = word >> 16 if (j // 8) % 2 else word & 0xFFFF
    return bits >= round(p * 65536)


@pytest.mark.parametrize("seed, offset", [(0, 0), (2**64 - 1, 2**64 - 3), (0x123456789ABCDEF, 2**32 - 1)])
def test_the_mask_is_the_documented_formula(seed, offset):
    p, heads = 0.37, 3
    mask = philox.keep_mask(seed, offset, p, heads, 41, 37, 2)
    rng = np.random.default_rng(seed % 1000)
    for b, h, i, j in zip(rng.integers(0, 2, 60), rng.integers(0, heads, 60), rng.integers(0, 41, 60),
                          rng.integers(0, 37, 60)):
        assert mask[b, h, i, j] == _element(seed, offset, p, heads, int(b), int(h), int(i), int(j))


def test_one_call_covers_rows_i_and_i_plus_8_by_keys_j_j_plus_1_j_plus_8_j_plus_9():
    assert list(philox.row_call([0, 7, 8, 15, 16, 24])) == [0, 7, 0, 7, 8, 8]
    assert list(philox.key_call([0, 1, 8, 9, 2, 16, 25])) == [0, 0, 0, 0, 1, 4, 4]


def test_the_mask_depends_on_position_alone():
    full = philox.keep_mask(11, 5, 0.5, 4, 64, 80, 3)
    # Shorter sequences: the same elements.
    np.testing.assert_array_equal(philox.keep_mask(11, 5, 0.5, 4, 17, 23, 3), full[:, :, :17, :23])
    # A block of rows and keys (the blockwise CPU path's tiles).
    rows, cols = np.arange(13, 45), np.arange(7, 71)
    np.testing.assert_array_equal(philox.keep_mask(11, 5, 0.5, 4, rows, cols, 3), full[:, :, 13:45, 7:71])
    # A packed sequence b draws the mask of batch entry b.
    np.testing.assert_array_equal(philox.keep_mask(11, 5, 0.5, 4, 30, 50, [2]), full[2:3, :, :30, :50])


def test_offsets_address_streams_of_batch_entries_and_heads():
    base = philox.keep_mask(3, 100, 0.5, 4, 32, 32, 2)
    # offset + 1 is the next head's stream; offset + increment a fresh one for every (b, h).
    np.testing.assert_array_equal(philox.keep_mask(3, 101, 0.5, 4, 32, 32, 1)[0, :3], base[0, 1:])
    fresh = philox.keep_mask(3, 100 + philox.increment(2, 4), 0.5, 4, 32, 32, 2)
    assert 0.4 < (fresh != base).mean() < 0.6


@pytest.mark.parametrize("p", [0.0, 1e-3, 0.1, 0.5, 0.9, 0.999])
def test_keep_rate_within_binomial_error(p):
    mask = philox.keep_mask(2024, 7, p, 8, 512, 1024, 1)
    n = mask.size
    rate = mask.mean()
    sigma = math.sqrt(p * (1 - p) / n)
    # 16 bits: the keep probability is 1 - p within 2^-17, far below 5 sigma here.
    assert abs(rate - (1 - p)) <= 5 * sigma + 2**-17, (rate, 1 - p, sigma)


def test_threshold_and_its_extremes():
    assert philox.keep_threshold(0.0) == 0 and philox.keep_threshold(0.1) == 6554
    assert philox.keep_threshold(0.5) == 32768 and philox.keep_threshold(1 - 2**-18) == 65536
    assert philox.keep_mask(1, 0, 0.0, 2, 20, 20, 2).all()
    assert not philox.keep_mask(1, 0, 1 - 2**-18, 2, 20, 20, 2).any()


def test_seeds_and_offsets_change_the_mask():
    a = philox.keep_mask(1, 0, 0.5, 2, 64, 64, 2)
    np.testing.assert_array_equal(a, philox.keep_mask(1, 0, 0.5, 2, 64, 64, 2))
    for other in (philox.keep_mask(2, 0, 0.5, 2, 64, 64, 2), philox.keep_mask(2**32 + 1, 0, 0.5, 2, 64, 64, 2),
                  philox.keep_mask(1, 2**32 * 4, 0.5, 2, 64, 64, 2)):
        assert 0.45 < (other != a).mean() < 0.55
