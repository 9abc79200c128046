"""Attention sinks and ALiBi through cuflash's entry points on NumPy inputs (the CPU path), against
the float64 references with the DESIGN.md error rule; their argument checks; and the GPU's refusal
(NotImplementedError, before any launch) on CuPy-like stand-ins, which needs no GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._core import checks, interop
from cuflash._cpu.reference_kvcache import kvcache_reference
from cuflash._cpu.reference import (
    attention_backward_reference,
    attention_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
    max_error_bound,
)
from tests.finite_differences import finite_difference_gradients
from kvcache_cases import make_case, reference_args, same_bytes
from tests.test_launch_plans import FakeCupyArray
from tests.host_entries import call_entry, random_qkv

BF16 = np.dtype(ml_dtypes.bfloat16)


def _inputs(seed, shape_q, shape_kv, dtype, head_dim_v=None):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, shape_q, shape_kv, dtype, head_dim_v)
    heads = shape_q[-2]
    sinks = (rng.standard_normal(heads) * 2).astype(np.float32)
    slopes = rng.uniform(0.01, 0.5, heads).astype(np.float32)
    dout = rng.standard_normal((*shape_q[:-1], head_dim_v or shape_kv[-1])).astype(dtype)
    return q, k, v, sinks, slopes, dout


def _within_rule(got, ref, lowp, atol=1e-5):
    ok, err, bound = max_error_bound(got, ref, lowp, atol=atol)
    assert ok, (err, bound)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, window, softcap", [
    (17, 17, False, (-1, -1), 0.0),
    (1, 113, True, (-1, -1), 0.0),
    (113, 67, True, (-1, -1), 0.0),  # rows of no key: out 0, lse = sink
    (67, 113, False, (16, 3), 30.0),
])
@pytest.mark.parametrize("use_sinks, slopes_shape", [(True, None), (False, "heads"), (True, "batch_heads")])
def test_forward_and_backward_against_the_reference(dtype, seqlen_q, seqlen_k, causal, window, softcap, use_sinks,
                                                    slopes_shape):
    q, k, v, sinks, slopes, dout = _inputs(seqlen_q + seqlen_k, (2, seqlen_q, 4, 64), (2, seqlen_k, 2, 64), dtype)
    sinks = sinks if use_sinks else None
    if slopes_shape == "batch_heads":
        slopes = np.stack([slopes, slopes[::-1]])
    slopes = slopes if slopes_shape else None
    options = dict(causal=causal, window=window, softcap=softcap, sinks=sinks, alibi_slopes=slopes)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, **options)
    lowp, _ = attention_reference(q, k, v, dtype=dtype, **options)
    assert out.dtype == dtype and lse.dtype == np.float32
    _within_rule(out, ref, lowp)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)

    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    ref_grads = attention_backward_reference(dout, q, k, v, **options)
    assert len(grads) == (4 if use_sinks else 3)
    # The 16-bit baseline: the same gradients from the 16-bit forward's out, rounded to the dtype.
    for got, want in zip(grads[:3], ref_grads[:3]):
        assert got.dtype == dtype
        _within_rule(got, want, want.astype(dtype), atol=2e-3)
    if use_sinks:
        assert grads[3].dtype == np.float32 and grads[3].shape == (4,)
        np.testing.assert_allclose(grads[3], ref_grads[3], rtol=2e-2, atol=2e-2)


def test_float64_matches_exactly_and_dsinks_matches_central_differences():
    q, k, v, sinks, slopes, dout = _inputs(3, (1, 9, 2, 8), (1, 13, 1, 8), np.float64)
    sinks = sinks.astype(np.float64)
    options = dict(causal=True, alibi_slopes=slopes)
    out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=sinks, **options)
    ref, ref_lse = attention_reference(q, k, v, sinks=sinks, **options)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks, **options)[3]

    def loss(s):
        return float((attention_reference(q, k, v, sinks=s, **options)[0] * dout).sum())

    (numeric,) = finite_difference_gradients(loss, [sinks])
    np.testing.assert_allclose(dsinks, numeric, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sink", [-np.inf, 30.0])
def test_minus_infinity_and_large_sinks(sink):
    q, k, v, _, _, dout = _inputs(5, (1, 17, 2, 64), (1, 17, 2, 64), np.float32)
    sinks = np.full(2, sink, np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=sinks)
    if np.isneginf(sink):  # no sink: plain attention
        plain, plain_lse = cuflash.attention(q, k, v, return_lse=True)
        np.testing.assert_array_equal(out, plain)
        np.testing.assert_array_equal(lse, plain_lse)
    else:  # the sink takes nearly all the weight, without overflow
        assert np.abs(out).max() < 1e-6 and np.allclose(lse, sink, atol=1e-5)
    dq, dk, dv, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv, dsinks))


def test_a_sink_on_the_wrong_head_fails():
    q, k, v, sinks, _, _ = _inputs(7, (1, 17, 4, 64), (1, 17, 2, 64), np.float64)
    sinks = np.array([-3.0, -1.0, 1.0, 3.0])
    out = cuflash.attention(q, k, v, sinks=sinks)
    ref, _ = attention_reference(q, k, v, sinks=sinks)
    wrong, _ = attention_reference(q, k, v, sinks=sinks[::-1].copy())
    np.testing.assert_allclose(out, ref, atol=1e-12)
    assert np.abs(out - wrong).max() > 1e-3


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_varlen_with_an_empty_sequence(dtype):
    lengths_q, lengths_k = [17, 0, 5, 9], [23, 4, 0, 9]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q, k, v, sinks, slopes, dout = _inputs(11, (cu_q[-1], 4, 64), (cu_k[-1], 2, 64), dtype)
    slopes = np.random.default_rng(0).uniform(0.01, 0.5, (4, 4)).astype(np.float32)
    options = dict(causal=True, sinks=sinks, alibi_slopes=slopes)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    lowp, _ = attention_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, **options)
    _within_rule(out, ref, lowp)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # Sequence 2 has queries and no key: out 0, lse = sink.
    rows = slice(cu_q[2], cu_q[3])
    assert not out[rows].any()
    np.testing.assert_allclose(lse[:, rows], np.broadcast_to(sinks[:, None], (4, 5)))
    dq, dk, dv, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    ref_grads = attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k, **options)
    for got, want in zip((dq, dk, dv), ref_grads[:3]):
        _within_rule(got, want, want.astype(dtype), atol=2e-3)
    np.testing.assert_allclose(dsinks, ref_grads[3], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("entry", ["forward", "backward", "varlen", "varlen_backward"])
@pytest.mark.parametrize("options, error, words", [
    (dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks: expected shape \(4,\)"),
    (dict(sinks=np.zeros((1, 4), np.float32)), ValueError, "sinks: expected shape"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, "sinks: expected dtype"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks: expected a CuPy array"),
    (dict(sinks=np.array([0, np.nan, 0, 0], np.float32)), ValueError, "sinks: every entry"),
    (dict(sinks=np.array([0, np.inf, 0, 0], np.float32)), ValueError, "sinks: every entry"),
    (dict(alibi_slopes=np.zeros(4, np.float64)), TypeError, "alibi_slopes: expected dtype float32"),
    (dict(alibi_slopes=np.zeros(5, np.float32)), ValueError, "alibi_slopes: expected shape"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), ValueError, "alibi_slopes: expected shape"),
    (dict(alibi_slopes=np.array([0, 0, np.inf, 0], np.float32)), ValueError, "alibi_slopes: every entry"),
    (dict(sinks=FakeCupyArray((4,), "float32")), TypeError, "sinks: must be on the same side as q"),
])
def test_bad_sinks_and_slopes_name_the_argument(entry, options, error, words):
    q, k, v, *_ = _inputs(13, (2, 9, 4, 64), (2, 11, 2, 64), np.float32)
    with pytest.raises(error, match=words):
        call_entry(entry, q, k, v, **options)


def _fake_qkv(packed=False):
    lead = (24,) if packed else (2, 12)
    return (FakeCupyArray((*lead, 4, 64), ptr=1 << 30), FakeCupyArray((*lead, 2, 64), ptr=2 << 30),
            FakeCupyArray((*lead, 2, 64), ptr=3 << 30))


class _Launched(Exception):
    """Raised by the stand-in for plan.run: the call got as far as its launch pipeline."""


def _capture_runs(monkeypatch) -> list:
    """plan.run replaced by a recorder of (signature, options) that stops the call there."""
    from cuflash._core import plan

    seen = []

    def record(signature, device, prepare, args, build, framework, tensors, given, given_t, *options):
        seen.append((signature, options))
        raise _Launched

    monkeypatch.setattr(plan, "run", record)
    return seen


@pytest.mark.parametrize("name, value, pointers, stride", [
    ("sinks", ((4,), "float32"), (9 << 30, 0), None),
    ("alibi_slopes", ((2, 4), "float32"), (0, 9 << 30), 4),
    ("alibi_slopes", ((4,), "float32"), (0, 9 << 30), 0)])
def test_gpu_sinks_and_slopes_reach_the_launch(name, value, pointers, stride, monkeypatch):
    # The pointers at the launch; a fixed-length call's signature holds the float32 arrays' layouts
    # (a varlen call has none).
    seen = _capture_runs(monkeypatch)
    option = {name: FakeCupyArray(*value, ptr=9 << 30)}
    batch = 2
    q, k, v = _fake_qkv()
    out, dout = FakeCupyArray((2, 12, 4, 64), ptr=4 << 30), FakeCupyArray((2, 12, 4, 64), ptr=5 << 30)
    lse = FakeCupyArray((2, 4, 12), "float32", ptr=6 << 30)
    packed = _fake_qkv(packed=True)
    cu = FakeCupyArray((batch + 1,), "int32", ptr=7 << 30), FakeCupyArray((batch + 1,), "int32", ptr=8 << 30)
    for call, fixed in ((lambda: cuflash.attention(q, k, v, **option), True),
                        (lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **option), True),
                        (lambda: cuflash.attention_varlen(*packed, *cu, 12, 12, validate=False, **option), False)):
        with pytest.raises(_Launched):
            call()
        signature, options = seen[-1]
        bias = options[-2]  # the last: dropout's words (checks.NO_DROPOUT_WORDS)
        assert bias.pointers == pointers and bias.alibi_stride == stride
        assert (signature is not None and signature[-1] == checks.bias_layouts(bias)) if fixed else signature is None


def test_16bit_sinks_take_the_checked_path(monkeypatch):
    # bfloat16 sinks are copied to float32 on every call: no signature could name the copy.
    seen = _capture_runs(monkeypatch)
    monkeypatch.setattr(interop, "float32_contiguous", lambda t, framework: t._replace(dtype="float32", ptr=8 << 30))
    with pytest.raises(_Launched):
        cuflash.attention(*_fake_qkv(), sinks=FakeCupyArray((4,), "bfloat16", ptr=9 << 30))
    signature, options = seen[-1]
    assert signature is None and options[-2].pointers == (8 << 30, 0)


def test_gpu_sinks_of_a_bad_dtype_or_shape_are_named_first():
    with pytest.raises(TypeError, match="sinks: expected dtype float32 or bfloat16 or float16"):
        cuflash.attention(*_fake_qkv(), sinks=FakeCupyArray((4,), "int32", ptr=9 << 30))
    with pytest.raises(ValueError, match="alibi_slopes: expected shape"):
        cuflash.attention(*_fake_qkv(), alibi_slopes=FakeCupyArray((3,), "float32", ptr=9 << 30))
    with pytest.raises(ValueError, match="sinks: on device 1"):
        cuflash.attention(*_fake_qkv(), sinks=FakeCupyArray((4,), "float32", ptr=9 << 30, device=1))


# attention_with_kvcache: the sink enters each sequence's softmax once.

def test_kvcache_matches_attention_on_gathered_keys():
    """Independently of the KV-cache reference: a contiguous cache with an append is attention over
    the cached prefix and the new tokens, sinks and ALiBi included."""
    r = np.random.default_rng(17)
    args = make_case(r, batch=2, seqlen_q=3, new=3, lens=[5, 9], heads=4, heads_kv=2)
    q, kc, vc, k, v = (np.copy(args[n]) for n in ("q", "k_cache", "v_cache", "k", "v"))
    sinks = np.array([-1.0, 0.5, 2.0, -np.inf])
    slopes = r.uniform(0.01, 0.5, (2, 4)).astype(np.float32)
    out, lse = cuflash.attention_with_kvcache(**args, causal=True, sinks=sinks, alibi_slopes=slopes, return_lse=True)
    for b, n in enumerate([5, 9]):
        keys = np.concatenate([kc[b, :n], k[b]])[None]
        values = np.concatenate([vc[b, :n], v[b]])[None]
        want, want_lse = cuflash.attention(q[b:b + 1], keys, values, causal=True, sinks=sinks,
                                           alibi_slopes=slopes[b:b + 1], return_lse=True)
        np.testing.assert_allclose(out[b:b + 1], want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], want_lse, rtol=1e-6)


@pytest.mark.parametrize("page_size, varlen", [(None, False), (16, False), (8, True)])
def test_kvcache_against_the_reference_with_an_empty_sequence(page_size, varlen):
    r = np.random.default_rng(19)
    args = make_case(r, batch=3, seqlen_q=4, new=0, lens=[0, 11, 30], page_size=page_size, varlen=varlen,
                     counts=[2, 4, 3] if varlen else None, heads=8, heads_kv=2, dtype=np.float16)
    sinks = (r.standard_normal(8) * 2).astype(np.float16)
    slopes = r.uniform(0.01, 0.5, 8).astype(np.float32)
    before = {name: np.copy(x) if isinstance(x, np.ndarray) else x for name, x in args.items()}
    out, lse = cuflash.attention_with_kvcache(**args, causal=True, sinks=sinks, alibi_slopes=slopes, return_lse=True)
    ref, ref_lse, ref_k, ref_v = kvcache_reference(**reference_args(before), causal=True, sinks=sinks,
                                                   alibi_slopes=slopes)
    lowp, _, _, _ = kvcache_reference(**reference_args(before), causal=True, sinks=sinks, alibi_slopes=slopes,
                                      dtype=np.float16)
    _within_rule(out, ref, lowp)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert same_bytes(args["k_cache"], ref_k) and same_bytes(args["v_cache"], ref_v)
    # Sequence 0 caches no key: out 0, lse = sink.
    first = out[:2] if varlen else out[0]
    first_lse = lse[:, :2] if varlen else lse[0]
    assert not first.any()
    np.testing.assert_allclose(first_lse, np.broadcast_to(sinks.astype(np.float32)[:, None], first_lse.shape))


def test_kvcache_bad_sinks_and_gpu_bias_at_the_launch(monkeypatch):
    args = make_case(np.random.default_rng(23), new=0, heads=4, dtype=np.float16)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        cuflash.attention_with_kvcache(**args, sinks=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(4,\) or \(batch, heads\) = \(3, 4\)"):
        cuflash.attention_with_kvcache(**args, alibi_slopes=np.zeros((2, 4), np.float32))
    q = FakeCupyArray((3, 1, 4, 64), ptr=1 << 30)
    cache = FakeCupyArray((3, 40, 2, 64), ptr=2 << 30)
    seen = _capture_runs(monkeypatch)
    with pytest.raises(_Launched):
        cuflash.attention_with_kvcache(q, cache, FakeCupyArray((3, 40, 2, 64), ptr=3 << 30), cache_seqlens=7,
                                       sinks=FakeCupyArray((4,), "float32", ptr=4 << 30))
    signature, options = seen[-1]
    assert signature is None and options[-1].pointers == (4 << 30, 0)
