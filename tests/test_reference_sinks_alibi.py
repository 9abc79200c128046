"""CPU tests of the float64 references with attention sinks and ALiBi: the sink as gpt-oss's extra
score column, flash-attn's ALiBi bias, the blockwise loop against the naive reference, and the
gradients (dsinks included) against central differences."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash._cpu.reference import (
    allowed_keys,
    attention_backward_from_lse,
    attention_backward_reference,
    attention_blockwise,
    attention_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
    sinks_gradient,
)
from tests.finite_differences import finite_difference_gradients

pytestmark = pytest.mark.filterwarnings("error")


def _inputs(seed, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim_v or head_dim))
    sinks = rng.standard_normal(heads) * 2
    slopes = rng.uniform(0.01, 0.5, heads)
    return q, k, v, sinks, slopes


def _concatenated_column(q, k, v, sinks, slopes, causal, window, softcap, scale):
    """gpt-oss's formula, written independently: the scores with flash-attn's ALiBi bias, masked,
    then one more column holding the sink, softmaxed together; the sink's column weighs a zero
    value row. Returns out and the lse over the keys and the sink."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    allowed = allowed_keys(sq, sk, causal=causal, window=window)
    out = np.zeros((b, sq, hq, v.shape[3]))
    lse = np.zeros((b, hq, sq))
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            s = q[bi, :, h] @ k[bi, :, kv].T * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
            s = s - slopes[h] * np.abs(i + sk - sq - j)
            s = np.where(allowed, s, -np.inf)
            s = np.concatenate([s, np.full((sq, 1), sinks[h])], axis=1)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            out[bi, :, h] = (p / total)[:, :sk] @ v[bi, :, kv]
            lse[bi, h] = (m + np.log(total))[:, 0]
    return out, lse


CASES = [
    # batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, window, softcap
    (1, 17, 17, 4, 4, 16, False, (-1, -1), 0.0),
    (2, 33, 65, 4, 2, 8, True, (-1, -1), 0.0),
    (1, 40, 23, 6, 2, 16, True, (-1, -1), 5.0),  # rows of no key: causal with seqlen_q > seqlen_k
    (2, 50, 50, 2, 1, 8, False, (7, 3), 0.0),
    (1, 1, 113, 4, 1, 16, False, (-1, -1), 3.0),
]


@pytest.mark.parametrize("case", CASES)
def test_the_sink_is_an_extra_score_column(case):
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v, sinks, slopes = _inputs(1, b, sq, sk, hq, hkv, d)
    scale = 0.3
    expected, expected_lse = _concatenated_column(q, k, v, sinks, slopes, causal, window, softcap, scale)
    options = dict(causal=causal, window=window, softcap=softcap, softmax_scale=scale, sinks=sinks,
                   alibi_slopes=slopes)
    out, lse = attention_reference(q, k, v, **options)
    np.testing.assert_allclose(out, expected, atol=1e-12)
    np.testing.assert_allclose(lse, expected_lse, atol=1e-12)
    out_blockwise, lse_blockwise = attention_blockwise(q, k, v, block_m=16, block_n=8, **options)
    np.testing.assert_allclose(out_blockwise, expected, atol=1e-12)
    np.testing.assert_allclose(lse_blockwise, expected_lse, atol=1e-12)


def test_a_row_of_no_key_gives_zero_and_the_sink():
    q, k, v, sinks, _ = _inputs(2, 1, 12, 5, 3, 3, 8)
    out, lse = attention_reference(q, k, v, causal=True, sinks=sinks)
    masked_rows = np.arange(12) + 5 - 12 < 0
    assert masked_rows.sum() == 7
    assert np.all(out[0, masked_rows] == 0)
    np.testing.assert_array_equal(lse[0][:, masked_rows], np.broadcast_to(sinks[:, None], (3, 7)))
    out_blockwise, lse_blockwise = attention_blockwise(q, k, v, causal=True, sinks=sinks, block_m=4, block_n=4)
    assert np.all(out_blockwise[0, masked_rows] == 0)
    np.testing.assert_allclose(lse_blockwise[0][:, masked_rows], np.broadcast_to(sinks[:, None], (3, 7)))


def test_sinks_of_minus_infinity_are_no_sinks_and_large_sinks_take_all_weight():
    q, k, v, _, _ = _inputs(3, 2, 19, 31, 4, 2, 8)
    plain, plain_lse = attention_reference(q, k, v, causal=True)
    out, lse = attention_reference(q, k, v, causal=True, sinks=np.full(4, -np.inf))
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    out, lse = attention_blockwise(q, k, v, causal=True, sinks=np.full(4, 1e4))
    assert np.abs(out).max() == 0
    np.testing.assert_allclose(lse, 1e4)


def test_a_sink_on_the_wrong_head_changes_the_result():
    q, k, v, _, _ = _inputs(4, 1, 16, 16, 4, 4, 8)
    sinks = np.array([0.5, 1.5, 2.5, 3.5])
    out, _ = attention_reference(q, k, v, sinks=sinks)
    swapped, _ = attention_reference(q, k, v, sinks=sinks[::-1].copy())
    for h in range(4):
        assert np.abs(out[..., h, :] - swapped[..., h, :]).max() > 1e-3


def test_alibi_with_slopes_per_batch_entry():
    q, k, v, _, _ = _inputs(5, 3, 21, 29, 4, 2, 8)
    slopes = np.random.default_rng(6).uniform(0.0, 1.0, (3, 4))
    out, lse = attention_reference(q, k, v, causal=True, alibi_slopes=slopes)
    for bi in range(3):
        expected, expected_lse = attention_reference(q[bi:bi + 1], k[bi:bi + 1], v[bi:bi + 1], causal=True,
                                                     alibi_slopes=slopes[bi])
        np.testing.assert_array_equal(out[bi:bi + 1], expected)
        np.testing.assert_array_equal(lse[bi:bi + 1], expected_lse)
    blockwise, _ = attention_blockwise(q, k, v, causal=True, alibi_slopes=slopes, block_m=8, block_n=8)
    np.testing.assert_allclose(blockwise, out, atol=1e-12)


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 4.0),
                                                     (False, (3, 2), 0.0)])
def test_gradients_against_central_differences(causal, window, softcap):
    q, k, v, sinks, slopes = _inputs(7, 1, 6, 9, 2, 1, 4)
    dout = np.random.default_rng(8).standard_normal(q.shape)
    options = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)

    def loss(q, k, v, sinks):
        return float((attention_reference(q, k, v, sinks=sinks, **options)[0] * dout).sum())

    numeric = finite_difference_gradients(loss, [q, k, v, sinks])
    analytic = attention_backward_reference(dout, q, k, v, sinks=sinks, **options)
    assert len(analytic) == 4
    for got, expected in zip(analytic, numeric):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-6)


def test_the_kernels_backward_from_an_lse_with_the_sink():
    """What the kernels compute: P = exp(S - lse) with the lse including the sink, D from out,
    dsinks from the lse; equal to the backward that knows the sink."""
    q, k, v, sinks, slopes = _inputs(9, 2, 23, 37, 4, 2, 8, head_dim_v=12)
    dout = np.random.default_rng(10).standard_normal(q.shape[:3] + (12,))
    options = dict(causal=True, window=(11, -1), softcap=0.0, alibi_slopes=slopes)
    out, lse = attention_reference(q, k, v, sinks=sinks, **options)
    dq, dk, dv, dsinks = attention_backward_reference(dout, q, k, v, sinks=sinks, **options)
    from_lse = attention_backward_from_lse(dout, q, k, v, out, lse, **options)
    for got, expected in zip(from_lse, (dq, dk, dv)):
        np.testing.assert_allclose(got, expected, atol=1e-12)
    np.testing.assert_allclose(sinks_gradient(dout, out, lse, sinks), dsinks, atol=1e-12)
    assert np.all(dsinks != 0)


def test_varlen_with_sinks_and_alibi_per_sequence():
    rng = np.random.default_rng(11)
    lengths_q, lengths_k = [5, 0, 17, 3], [9, 4, 17, 0]
    cu_q, cu_k = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    heads, heads_kv, d = 4, 2, 8
    q = rng.standard_normal((cu_q[-1], heads, d))
    k = rng.standard_normal((cu_k[-1], heads_kv, d))
    v = rng.standard_normal((cu_k[-1], heads_kv, d))
    dout = rng.standard_normal(q.shape)
    sinks, slopes = rng.standard_normal(heads), rng.uniform(0.0, 0.5, (4, heads))
    options = dict(causal=True, sinks=sinks, alibi_slopes=slopes)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    dq, dk, dv, dsinks = attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k, **options)
    expected_dsinks = np.zeros(heads)
    for i in (0, 2, 3):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        o, l = attention_reference(q[None, rows], k[None, keys], v[None, keys], causal=True, sinks=sinks,
                                   alibi_slopes=slopes[i])
        np.testing.assert_array_equal(out[rows], o[0])
        np.testing.assert_array_equal(lse[:, rows], l[0])
        *_, ds = attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                              causal=True, sinks=sinks, alibi_slopes=slopes[i])
        expected_dsinks += ds
    np.testing.assert_array_equal(lse[:, cu_q[3]:], np.broadcast_to(sinks[:, None], (heads, 3)))
    np.testing.assert_allclose(dsinks, expected_dsinks, atol=1e-12)
    # The packed form of sinks_gradient over the whole batch: the sequence of no keys adds nothing.
    np.testing.assert_allclose(sinks_gradient(dout[None], out[None], lse[None], sinks), dsinks, atol=1e-12)
