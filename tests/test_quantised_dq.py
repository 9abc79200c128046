"""The arithmetic behind sm90's deterministic dQ (flash_bwd.cu, QUANTISED_DQ), checked on the CPU
with NumPy's IEEE float32: each key block's term of a dQ row, rounded to a multiple of the row's
quantum (2^-24 of the bound the preprocess computes, dq_quantum_scale), sums to the same bits in
any order, and the bound holds for every partial sum."""

import math

import numpy as np
import pytest


def _terms(rng, rows, keys, head_dim, dout_scale, block=128):
    """Per-key-block dQ terms (float64, unscaled by softmax_scale as the kernel adds them) of
    attention rows, and each row's bound 4 |dO_i|_1 max|V| max|K|."""
    q, k, v = (rng.standard_normal((n, head_dim)) for n in (rows, keys, keys))
    k[3] *= 4.0  # an outlier key loosens the bound for every other row
    dout = rng.standard_normal((rows, head_dim)) * dout_scale
    s = q @ k.T / math.sqrt(head_dim)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dp = dout @ v.T
    delta = (p * dp).sum(axis=1, keepdims=True)
    ds = p * (dp - delta)
    terms = np.stack([ds[:, j:j + block] @ k[j:j + block] for j in range(0, keys, block)])
    bound = 4 * np.abs(dout).sum(axis=1) * np.abs(v).max() * np.abs(k).max()
    return terms, bound


def _quantum_scale(bound):
    """dq_quantum_scale: 2^(24 - e) for bound < 2^e, so that partial sums stay below 2^24 quanta."""
    exponent = np.frexp(bound)[1]
    return np.ldexp(np.float32(1), np.minimum(24 - exponent, 126)).astype(np.float32)


@pytest.mark.parametrize("dout_scale", [2.0**-20, 1.0, 1024.0])
def test_quantised_terms_sum_exactly_in_any_order(dout_scale):
    rng = np.random.default_rng(7)
    terms, bound = _terms(rng, rows=40, keys=1000, head_dim=64, dout_scale=dout_scale)
    # The bound holds for every partial sum, in key order and reversed.
    for ordered in (terms, terms[::-1]):
        assert (np.abs(np.cumsum(ordered, axis=0)) <= bound[None, :, None]).all()
    scale = _quantum_scale(bound)[None, :, None]
    quantised = np.rint(terms.astype(np.float32) * scale) / scale  # what the kernel stages, float32
    assert quantised.dtype == np.float32
    def sums_in_four_orders(values):  # the reductions' order varies between runs
        totals = []
        for seed in range(4):
            total = np.zeros(values.shape[1:], np.float32)
            for index in np.random.default_rng(seed).permutation(len(values)):
                total = total + values[index]
            totals.append(total.view(np.uint32))
        return totals

    plain = sums_in_four_orders(terms.astype(np.float32))
    assert not all(np.array_equal(plain[0], t) for t in plain[1:])  # unquantised: the order shows
    totals = sums_in_four_orders(quantised)
    assert all(np.array_equal(totals[0], t) for t in totals[1:])  # quantised: any order, same bits
    total = totals[0].view(np.float32)
    # Each term is off by at most half a quantum (<= 2^-25 of the bound, up to the float32 rounding
    # of the term itself): far below a 16-bit gradient's rounding.
    error = np.abs(total - terms.sum(axis=0))
    assert (error <= len(terms) * (bound[:, None] * 2.0**-24 + np.abs(terms).max(axis=0) * 2.0**-24)).all()
    assert (error <= np.abs(terms.sum(axis=0)) * 2.0**-11 + bound[:, None] * 2.0**-18).all()
