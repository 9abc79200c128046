"""Sliding windows, softcap and variable-length batches in the NumPy reference (CPU): the mask
against flash-attn's rule written out per element, softcap gradients against finite
differences, the blockwise CPU path against the naive reference, packed batches against their
sequences one by one, and the edge cases (empty sequences, rows left with no key)."""

from __future__ import annotations

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

WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (4, 1), (0, 5), (40, 40)]


def _allowed_by_rule(i, j, seqlen_q, seqlen_k, causal, window):
    left, right = window
    offset = seqlen_k - seqlen_q
    if causal:
        right = 0
    return (right < 0 or j <= i + offset + right) and (left < 0 or j >= i + offset - left)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(9, 9), (5, 12), (12, 5), (1, 7), (7, 1)])
def test_allowed_keys_follow_flash_attn_rule(seqlen_q, seqlen_k, causal, window):
    mask = allowed_keys(seqlen_q, seqlen_k, causal=causal, window=window)
    expected = np.array([[_allowed_by_rule(i, j, seqlen_q, seqlen_k, causal, window) for j in range(seqlen_k)]
                         for i in range(seqlen_q)], dtype=bool).reshape(seqlen_q, seqlen_k)
    np.testing.assert_array_equal(mask, expected)


def _qkv(rng, shape_q, shape_kv):
    return rng.standard_normal(shape_q), rng.standard_normal(shape_kv), rng.standard_normal(shape_kv)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("seqlens", [(37, 37), (23, 61), (61, 23)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_blockwise_matches_reference_with_window_and_softcap(seqlens, softcap, causal, window):
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, (2, seqlens[0], 4, 16), (2, seqlens[1], 2, 16))
    options = dict(causal=causal, window=window, softcap=softcap, softmax_scale=0.9)
    out, lse = attention_blockwise(q, k, v, block_m=8, block_n=16, **options)
    ref_out, ref_lse = attention_reference(q, k, v, **options)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_softcap_changes_scores_as_tanh():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, (1, 6, 1, 8), (1, 6, 1, 8))
    scale, cap = 0.8, 1.5
    _, lse = attention_reference(q, k, v, softmax_scale=scale, softcap=cap)
    s = cap * np.tanh(q[0, :, 0] @ k[0, :, 0].T * scale / cap)
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(s).sum(axis=-1)), rtol=1e-12)


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 1.3), (True, (2, -1), 0.7),
                                                     (False, (1, 1), 2.0), (True, (0, 0), 0.0)])
def test_backward_with_window_and_softcap_matches_finite_differences(causal, window, softcap):
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, (1, 5, 2, 8), (1, 7, 1, 8))
    dout = rng.standard_normal(q.shape)
    options = dict(causal=causal, window=window, softcap=softcap, softmax_scale=0.6)
    grads = attention_backward_reference(dout, q, k, v, **options)

    def loss(q_, k_, v_):
        return float((attention_reference(q_, k_, v_, **options)[0] * dout).sum())

    for got, numeric in zip(grads, finite_difference_gradients(loss, [q, k, v])):
        np.testing.assert_allclose(got, numeric, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", [attention_reference, attention_blockwise])
def test_window_leaving_rows_without_keys(impl):
    """seqlen_q > seqlen_k with a window of one key to the left only: the first rows see nothing."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, (1, 12, 2, 8), (1, 4, 2, 8))
    out, lse = impl(q, k, v, causal=True, window=(1, 0))
    empty = ~allowed_keys(12, 4, causal=True, window=(1, 0)).any(axis=1)
    assert empty[:7].all() and not empty[8:].any()
    assert np.isneginf(lse[:, :, empty]).all() and (out[:, empty] == 0).all()
    assert np.isfinite(out).all()
    grads = attention_backward_reference(rng.standard_normal(q.shape), q, k, v, causal=True, window=(1, 0))
    assert all(np.isfinite(g).all() for g in grads)
    assert (grads[0][:, empty] == 0).all()


def _packed(rng, lengths_q, lengths_k, heads=4, heads_kv=2, head_dim=8):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], heads, head_dim))
    k, v = (rng.standard_normal((cu_k[-1], heads_kv, head_dim)) for _ in range(2))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("lengths", [([5, 0, 9, 1], [7, 3, 0, 1]), ([1], [1]), ([0, 0], [0, 4]),
                                     ([40, 2, 3], [40, 2, 3])], ids=["mixed", "one", "empty", "long-short"])
@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (True, (2, 0), 1.5), (False, (1, 3), 0.0)])
def test_varlen_reference_is_each_sequence_alone(lengths, causal, window, softcap):
    rng = np.random.default_rng(13)
    q, k, v, cu_q, cu_k = _packed(rng, *lengths)
    options = dict(causal=causal, window=window, softcap=softcap)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    dout = rng.standard_normal(q.shape)
    dq, dk, dv = attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k, **options)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # queries with no keys at all
            assert (out[rows] == 0).all() and np.isneginf(lse[:, rows]).all() and (dq[rows] == 0).all()
            continue
        o, l = attention_reference(q[None, rows], k[None, keys], v[None, keys], **options)
        np.testing.assert_array_equal(out[rows], o[0])
        np.testing.assert_array_equal(lse[:, rows], l[0])
        g = attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], **options)
        for got, want in zip((dq[rows], dk[keys], dv[keys]), g):
            np.testing.assert_array_equal(got, want[0])
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))
