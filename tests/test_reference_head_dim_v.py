"""The reference with v's head dim (head_dim_v) different from q and k's, against an independent
einsum of the softmax and central finite differences, for every mask, softcap, GQA and packed
batches."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash._cpu.reference import (
    allowed_keys,
    attention_backward_reference,
    attention_blockwise,
    attention_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
)
from tests.finite_differences import finite_difference_gradients

pytestmark = pytest.mark.filterwarnings("error")

# (head_dim, head_dim_v): DeepSeek's prefill pair, a wider v, and a small pair for the gradients.
HEAD_DIMS = [(192, 128), (64, 96), (24, 8)]
MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(3, 1)),
    "causal+softcap": dict(causal=True, softcap=2.5),
}


def qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v):
    return (rng.standard_normal((batch, seqlen_q, heads, head_dim)),
            rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)),
            rng.standard_normal((batch, seqlen_k, heads_kv, head_dim_v)))


def einsum_attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """softmax(q kᵀ scale) v over the whole score tensor at once, GQA by repeating k and v."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = np.where(allowed_keys(q.shape[1], k.shape[1], causal=causal, window=window), s, -np.inf)
    seen = np.isfinite(s).any(axis=-1, keepdims=True)
    m = np.where(seen, s.max(axis=-1, keepdims=True, initial=-np.inf), 0)
    w = np.exp(s - m)
    total = np.where(seen, w.sum(axis=-1, keepdims=True), 1)
    out = np.einsum("bhij,bjhd->bihd", w / total, v)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(total), -np.inf)[..., 0]
    return out, lse


@pytest.mark.parametrize("head_dim, head_dim_v", HEAD_DIMS)
@pytest.mark.parametrize("mask", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("heads, heads_kv", [(2, 2), (4, 1)], ids=["mha", "mqa"])
def test_forward_matches_einsum(head_dim, head_dim_v, mask, heads, heads_kv):
    q, k, v = qkv(np.random.default_rng(), 2, 7, 11, heads, heads_kv, head_dim, head_dim_v)
    scale = 1 / math.sqrt(head_dim)
    want_out, want_lse = einsum_attention(q, k, v, scale, **MASKS[mask])
    for impl in (attention_reference, attention_blockwise):
        out, lse = impl(q, k, v, **MASKS[mask])
        assert out.shape == (2, 7, heads, head_dim_v)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_default_scale_follows_head_dim_not_head_dim_v():
    q, k, v = qkv(np.random.default_rng(), 1, 5, 6, 2, 2, 32, 8)
    out, _ = attention_reference(q, k, v)
    np.testing.assert_allclose(out, einsum_attention(q, k, v, 1 / math.sqrt(32))[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_baseline_has_head_dim_v(dtype):
    q, k, v = qkv(np.random.default_rng(), 1, 9, 13, 4, 2, 64, 40)
    exact, _ = attention_reference(q, k, v, causal=True)
    lowp, _ = attention_reference(q, k, v, causal=True, dtype=dtype)
    assert lowp.shape == exact.shape == (1, 9, 4, 40) and lowp.dtype == np.dtype(dtype)
    error = np.abs(lowp.astype(np.float64) - exact).max()
    assert 0 < error < 0.05


@pytest.mark.parametrize("mask", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("head_dim, head_dim_v", [(8, 16), (16, 8)])
def test_backward_matches_finite_differences(mask, head_dim, head_dim_v):
    q, k, v = qkv(np.random.default_rng(), 1, 5, 6, 2, 1, head_dim, head_dim_v)
    dout = np.random.default_rng().standard_normal((1, 5, 2, head_dim_v))
    grads = attention_backward_reference(dout, q, k, v, softmax_scale=0.4, **MASKS[mask])

    def loss(q_, k_, v_):
        return float((einsum_attention(q_, k_, v_, 0.4, **MASKS[mask])[0] * dout).sum())

    for got, want, like in zip(grads, finite_difference_gradients(loss, (q, k, v)), (q, k, v)):
        assert got.shape == like.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_backward_refuses_dout_without_head_dim_v():
    q, k, v = qkv(np.random.default_rng(), 1, 4, 4, 1, 1, 16, 8)
    with pytest.raises(ValueError, match="dout: expected shape"):
        attention_backward_reference(np.ones(q.shape), q, k, v)


def test_varlen_forward_and_backward_with_head_dim_v():
    """Each packed sequence, including empty ones, against the fixed-length reference of itself."""
    rng = np.random.default_rng()
    lengths_q, lengths_k = [5, 0, 3, 4], [6, 2, 0, 9]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 4, 24))
    k = rng.standard_normal((cu_k[-1], 2, 24))
    v = rng.standard_normal((cu_k[-1], 2, 16))
    dout = rng.standard_normal((cu_q[-1], 4, 16))
    options = dict(causal=True, softcap=3.0)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    dq, dk, dv = attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k, **options)
    assert (out.shape, dq.shape, dk.shape, dv.shape) == (dout.shape, q.shape, k.shape, v.shape)
    for i in range(len(lengths_q)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want_out, want_lse = einsum_attention(q[None, rows], k[None, keys], v[None, keys], 1 / math.sqrt(24),
                                              **options)
        np.testing.assert_allclose(out[rows], want_out[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], want_lse[0], rtol=1e-12, atol=1e-12)
        if lengths_q[i] and lengths_k[i]:
            want = attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                                **options)
            for got, w in zip((dq[rows], dk[keys], dv[keys]), want):
                np.testing.assert_array_equal(got, w[0])
        else:
            for got in (dq[rows], dk[keys], dv[keys]):
                assert not got.any()
