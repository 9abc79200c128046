"""Attention sinks and ALiBi in the GPU kernels (both families' forward and backward, varlen, the
KV cache's decode, split-KV and chunked prefill, the FP8 forward) against the float64 reference
(tests/gpu_reference.py) with docs/measuring.md's rule, on the GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def sinks_for(heads: int, rng, dtype: str = "float32"):
    """Per-head sinks that differ: a spread around 0, one head without a sink (-inf), one far
    above any row's scores (its rows' weight nearly all on the sink)."""
    import cupy as cp

    values = rng.standard_normal(heads) * 2.0
    values[0] = -np.inf
    if heads > 2:
        values[2] = 12.0
    sinks = cp.asarray(values.astype(np.float32))
    if dtype == "float32":
        return sinks
    if dtype == "float16":
        return sinks.astype(cp.float16)
    import ml_dtypes

    bits = sinks.view(cp.uint32)  # to nearest even, as random_bshd rounds bfloat16
    rounded = (bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16
    return rounded.astype(cp.uint16).view(np.dtype(ml_dtypes.bfloat16))


def slopes_for(heads: int, batch: int | None = None, rng=None):
    """ALiBi's geometric slopes 2^(-8 (h + 1) / heads), per head, or per (batch, head) scaled
    apart so a slope applied to the wrong batch entry fails."""
    import cupy as cp

    base = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
    if batch is None:
        return cp.asarray(base.astype(np.float32))
    return cp.asarray((base[None, :] * (1.0 + np.arange(batch))[:, None]).astype(np.float32))


def _float64(x):
    from tests.gpu_reference import as_float64

    return as_float64(x) if x.dtype.name in ("float16", "bfloat16") else x.astype("float64")


def check_forward(q, k, v, dtype_name, *, sinks=None, alibi=None, **options):
    """cuflash.attention with sinks / slopes into a NaN-filled out against the float64 reference."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import attention, check_rule, poison_pool

    poison_pool()
    out = cp.full((*q.shape[:3], v.shape[3]), cp.nan, dtype=q.dtype)
    result, lse = cuflash.attention(q, k, v, return_lse=True, out=out, sinks=sinks, alibi_slopes=alibi, **options)
    assert result is out
    scale = options.pop("softmax_scale", None) or 1 / math.sqrt(q.shape[3])
    options.setdefault("causal", False)
    q64, k64, v64 = (_float64(x) for x in (q, k, v))
    bias = {"sinks": None if sinks is None else _float64(sinks), "alibi": alibi}
    out_ref, lse_ref = attention(q64, k64, v64, scale=scale, **options, **bias)
    out_lowp, lse_lowp = attention(q64, k64, v64, scale=scale, lowp=dtype_name, **options, **bias)
    check_rule("out", out, out_ref, out_lowp, dtype_name)
    check_rule("lse", lse, lse_ref, lse_lowp, dtype_name)
    return out, lse


# (dtype, head_dim, seqlen_q, seqlen_k, heads, heads_kv, options)
FORWARD = [
    ("bfloat16", 64, 1023, 1023, 8, 2, {"causal": True}),                      # gpt-oss's head dim, GQA
    ("float16", 64, 777, 777, 8, 8, {"causal": True, "window": (128, 0)}),      # its sliding window
    ("bfloat16", 128, 1023, 1023, 4, 4, {}),
    ("float16", 128, 1500, 700, 4, 2, {"causal": True}),                        # rows with no key: lse = sink
    ("bfloat16", 256, 333, 333, 4, 1, {"window": (64, 16)}),
    ("bfloat16", 192, 257, 511, 4, 4, {"softcap": 5.0, "softmax_scale": 1.0}),
    ("float16", 96, 17, 4224, 4, 4, {}),
    ("bfloat16", 64, 1, 1, 4, 4, {}),
]


def _forward_id(case) -> str:
    dtype_name, head_dim, seqlen_q, seqlen_k, heads, heads_kv, options = case
    return f"{dtype_name[0]}{head_dim}-{seqlen_q}x{seqlen_k}-h{heads}.{heads_kv}-" + "-".join(
        f"{key}{value}" for key, value in options.items())


def _inputs(case, rng, batch=2):
    from tests.gpu_reference import random_bshd

    dtype_name, head_dim, seqlen_q, seqlen_k, heads, heads_kv, _ = case
    q = random_bshd((batch, seqlen_q, heads, head_dim), dtype_name, rng)
    k, v = (random_bshd((batch, seqlen_k, heads_kv, head_dim), dtype_name, rng) for _ in range(2))
    return q, k, v


def test_gpu_reference_agrees_with_the_cpu_reference(rng):
    # The two float64 references are separate code: one small case, every feature at once.
    import cupy as cp

    from cuflash._cpu import reference
    from tests.gpu_reference import attention, attention_backward

    q, k, v, dout = (rng.standard_normal(shape) for shape in ((2, 9, 4, 16), (2, 13, 2, 16), (2, 13, 2, 16),
                                                              (2, 9, 4, 16)))
    sinks, slopes = np.array([0.5, -np.inf, 3.0, -1.0]), rng.random((2, 4))
    options = {"causal": True, "window": (5, 0), "softcap": 2.0}
    out, lse = reference.attention_reference(q, k, v, sinks=sinks, alibi_slopes=slopes, **options)
    got_out, got_lse = attention(*(cp.asarray(x) for x in (q, k, v)), scale=0.25, sinks=sinks, alibi=slopes,
                                 **options)
    np.testing.assert_allclose(cp.asnumpy(got_out), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cp.asnumpy(got_lse), lse, rtol=1e-12, atol=1e-12)
    grads = reference.attention_backward_reference(dout, q, k, v, sinks=sinks, alibi_slopes=slopes, **options)
    got = attention_backward(*(cp.asarray(x) for x in (q, k, v, dout)), scale=0.25, sinks=sinks, alibi=slopes,
                             **options)
    for name, g, want in zip(("dq", "dk", "dv", "dsinks"), got, grads):
        np.testing.assert_allclose(cp.asnumpy(g), want, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.usefixtures("family")
@pytest.mark.parametrize("case", FORWARD, ids=_forward_id)
def test_forward_with_sinks(case, rng):
    check_forward(*_inputs(case, rng), case[0], sinks=sinks_for(case[4], rng), **dict(case[6]))


@pytest.mark.usefixtures("family")
@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch"])
@pytest.mark.parametrize("case", FORWARD, ids=_forward_id)
def test_forward_with_alibi(case, per_batch, rng):
    alibi = slopes_for(case[4], 2 if per_batch else None)
    check_forward(*_inputs(case, rng), case[0], alibi=alibi, **dict(case[6]))


@pytest.mark.usefixtures("family")
@pytest.mark.parametrize("sink_dtype", ["float32", "bfloat16", "float16"])
def test_forward_with_sinks_and_alibi_together(sink_dtype, rng):
    case = ("bfloat16", 64, 700, 900, 8, 2, {"causal": True, "window": (200, 0)})
    check_forward(*_inputs(case, rng), "bfloat16", sinks=sinks_for(8, rng, sink_dtype), alibi=slopes_for(8, 2),
                  **dict(case[6]))


def test_a_sink_on_the_wrong_head_fails(rng):
    # The rule must see which head a sink went to: against a reference whose sinks are rolled by
    # one head, the kernel's output fails it.
    import cupy as cp

    import cuflash
    from tests.gpu_reference import attention, check_rule

    case = ("bfloat16", 64, 257, 257, 4, 4, {})
    q, k, v = _inputs(case, rng)
    sinks = cp.asarray(np.array([-1.0, 0.0, 3.0, 1.0], np.float32))
    out = cuflash.attention(q, k, v, sinks=sinks)
    q64, k64, v64 = (_float64(x) for x in (q, k, v))
    rolled = {"causal": False, "scale": 1 / 8, "sinks": cp.roll(sinks, 1).astype(cp.float64)}
    with pytest.raises(AssertionError, match="out: max error"):
        check_rule("out", out, attention(q64, k64, v64, **rolled)[0],
                   attention(q64, k64, v64, lowp="bfloat16", **rolled)[0], "bfloat16")


def _backward(q, k, v, dtype_name, rng, *, sinks=None, alibi=None, deterministic=False, **options):
    """cuflash.attention_backward into NaN-filled gradients against the float64 reference; dsinks
    against the float64 formula over the returned out and lse."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import attention_backward, check_rule, poison_pool, random_bshd

    dout = random_bshd((*q.shape[:3], v.shape[3]), dtype_name, rng)
    out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=sinks, alibi_slopes=alibi, **options)
    poison_pool()
    dq, dk, dv = (cp.full(x.shape, cp.nan, dtype=x.dtype) for x in (q, k, v))
    result = cuflash.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, sinks=sinks,
                                        alibi_slopes=alibi, deterministic=deterministic, **options)
    assert result[0] is dq and result[1] is dk and result[2] is dv
    assert len(result) == (4 if sinks is not None else 3)
    scale = options.pop("softmax_scale", None) or 1 / math.sqrt(q.shape[3])
    options.setdefault("causal", False)
    q64, k64, v64, do64 = (_float64(x) for x in (q, k, v, dout))
    bias = {"sinks": None if sinks is None else _float64(sinks), "alibi": alibi}
    exact = attention_backward(q64, k64, v64, do64, scale=scale, **options, **bias)
    lowp = attention_backward(q64, k64, v64, do64, scale=scale, lowp=dtype_name, **options, **bias)
    for name, got, e, lp in zip(("dq", "dk", "dv"), result[:3], exact, lowp):
        check_rule(name, got, e, lp, dtype_name)
    if sinks is not None:
        dsinks = result[3]
        assert dsinks.dtype == cp.float32 and dsinks.shape == (q.shape[2],)
        # Against the formula over this call's own out and lse, in float64: the float32 sums of
        # rows' products is all that may differ.
        delta = (_float64(dout) * _float64(out)).sum(axis=-1).transpose(0, 2, 1)  # (b, h, s)
        lse64 = lse.astype(cp.float64)
        weight = cp.where(cp.isneginf(lse64), 0.0, cp.exp(_float64(sinks)[None, :, None] - lse64))
        want = -(weight * delta).sum(axis=(0, 2))
        scale_of = float(cp.abs(weight * delta).sum(axis=(0, 2)).max()) + 1e-30
        assert float(cp.abs(dsinks.astype(cp.float64) - want).max()) <= 1e-5 * scale_of
        # And against the exact float64 gradient, within what 16-bit out and dout move it.
        check_rule("dsinks", dsinks, exact[3], lowp[3], dtype_name)
    return result


BACKWARD = [
    ("bfloat16", 64, 1023, 1023, 8, 2, {"causal": True}),
    ("float16", 64, 777, 777, 8, 8, {"causal": True, "window": (128, 0)}),
    ("bfloat16", 128, 513, 1023, 4, 4, {}),
    ("float16", 128, 900, 300, 4, 2, {"causal": True}),                         # rows with no key
    ("bfloat16", 192, 257, 257, 4, 4, {"softcap": 5.0, "softmax_scale": 1.0}),
    ("bfloat16", 256, 129, 333, 2, 1, {"window": (64, 16)}),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", BACKWARD, ids=_forward_id)
def test_backward_with_sinks(case, deterministic, rng):
    _backward(*_inputs(case, rng), case[0], rng, sinks=sinks_for(case[4], rng), deterministic=deterministic,
              **dict(case[6]))


@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch"])
@pytest.mark.parametrize("case", BACKWARD, ids=_forward_id)
def test_backward_with_alibi(case, per_batch, rng):
    _backward(*_inputs(case, rng), case[0], rng, alibi=slopes_for(case[4], 2 if per_batch else None),
              **dict(case[6]))


def test_deterministic_dsinks_repeat_bitwise(rng):
    import cupy as cp

    import cuflash

    case = ("bfloat16", 64, 1023, 1023, 8, 2, {"causal": True})
    q, k, v = _inputs(case, rng)
    sinks = sinks_for(8, rng)
    dout = cp.asarray(q)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks, deterministic=True)
    for _ in range(3):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks, deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all())


def test_varlen_with_sinks_and_alibi_and_an_empty_sequence(rng):
    import cupy as cp

    import cuflash
    from tests.gpu_reference import check_rule, poison_pool, random_bshd

    lengths_q, lengths_k = [300, 0, 129, 777], [500, 40, 0, 777]
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lengths_q)]), np.concatenate([[0], np.cumsum(lengths_k)])
    heads, heads_kv, d = 8, 2, 64
    q = random_bshd((cu_q[-1], heads, d), "bfloat16", rng)
    k, v = (random_bshd((cu_k[-1], heads_kv, d), "bfloat16", rng) for _ in range(2))
    sinks, slopes = sinks_for(heads, rng), slopes_for(heads, len(lengths_q))
    options = {"causal": True}
    poison_pool()
    out, lse = cuflash.attention_varlen(q, k, v, cp.asarray(cu_q, cp.int32), cp.asarray(cu_k, cp.int32),
                                        max(lengths_q), max(lengths_k), return_lse=True, sinks=sinks,
                                        alibi_slopes=slopes, **options)
    scale = 1 / math.sqrt(d)
    q64, k64, v64 = (_float64(x) for x in (q, k, v))
    want_out, want_lse, lowp_out, lowp_lse = _varlen_reference(q64, k64, v64, cu_q, cu_k, scale, sinks, slopes,
                                                               options)
    check_rule("out", out, want_out, lowp_out, "bfloat16")
    check_rule("lse", lse, want_lse, lowp_lse, "bfloat16")
    # A sequence with queries but no keys: out 0, lse the sinks.
    rows = slice(cu_q[2], cu_q[3])
    assert bool((out[rows] == 0).all())
    assert bool(cp.allclose(lse[:, rows], cp.broadcast_to(sinks[:, None], lse[:, rows].shape)))

    dout = random_bshd(out.shape, "bfloat16", rng)
    dq, dk, dv, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cp.asarray(cu_q, cp.int32),
                                                           cp.asarray(cu_k, cp.int32), max(lengths_q),
                                                           max(lengths_k), sinks=sinks, alibi_slopes=slopes,
                                                           **options)
    exact, lowp = (_varlen_backward_reference(q64, k64, v64, _float64(dout), cu_q, cu_k, scale, sinks, slopes,
                                              options, lowp) for lowp in (None, "bfloat16"))
    for name, got, e, lp in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, dsinks), exact, lowp):
        check_rule(name, got, e, lp, "bfloat16")


def _varlen_reference(q, k, v, cu_q, cu_k, scale, sinks, slopes, options):
    """Packed float64 (out, lse) exact and with 16-bit rounding, sequence by sequence."""
    import cupy as cp

    from tests.gpu_reference import attention

    results = []
    for lowp in (None, "bfloat16"):
        out = cp.zeros(q.shape[:2] + (v.shape[2],))
        lse = cp.full((q.shape[1], q.shape[0]), -cp.inf)
        for i in range(len(cu_q) - 1):
            rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            if rows.stop == rows.start:
                continue
            if keys.stop == keys.start:  # no key: out 0, lse the sink
                lse[:, rows] = _float64(sinks)[:, None]
                continue
            o, l = attention(q[None, rows], k[None, keys], v[None, keys], scale=scale, lowp=lowp,
                             sinks=_float64(sinks), alibi=slopes[i], **options)
            out[rows], lse[:, rows] = o[0], l[0]
        results += [out, lse]
    return results


def _varlen_backward_reference(q, k, v, dout, cu_q, cu_k, scale, sinks, slopes, options, lowp):
    import cupy as cp

    from tests.gpu_reference import attention_backward

    dq, dk, dv = cp.zeros(q.shape), cp.zeros(k.shape), cp.zeros(v.shape)
    dsinks = cp.zeros(q.shape[1])
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            g = attention_backward(q[None, rows], k[None, keys], v[None, keys], dout[None, rows], scale=scale,
                                   lowp=lowp, sinks=_float64(sinks), alibi=slopes[i], **options)
            dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
            dsinks += g[3]
    return dq, dk, dv, dsinks


@pytest.mark.parametrize("head_dim", [64, 192])  # d192: sm90 devices run sm80's e4m3 kernel for ALiBi
def test_fp8_forward_with_sinks_and_alibi(family, head_dim, rng):
    # The FP8 rule of tests/test_fp8_gpu.py with the reference taking the same sinks and slopes.
    import cupy as cp
    import ml_dtypes

    import cuflash
    from tests.gpu_reference import attention, check_rule, poison_pool
    from tests.test_fp8_gpu import FP8, dequantize, inputs

    q, k, v = inputs(rng, 2, 700, 900, 8, 2, head_dim)
    sinks, slopes = sinks_for(8, rng), slopes_for(8, 2)
    for bias in ({"sinks": sinks}, {"alibi_slopes": slopes}, {"sinks": sinks, "alibi_slopes": slopes}):
        poison_pool()
        out = cp.full((2, 700, 8, head_dim), cp.nan, dtype=np.dtype(ml_dtypes.bfloat16))
        cuflash.attention(q[0], k[0], v[0], descale_q=q[1], descale_k=k[1], descale_v=v[1], dtype="e4m3", out=out,
                          causal=True, **bias)
        lse = cuflash.attention(q[0], k[0], v[0], descale_q=q[1], descale_k=k[1], descale_v=v[1], dtype="e4m3",
                                causal=True, return_lse=True, **bias)[1]
        q64, k64, v64 = (dequantize(*x) for x in (q, k, v))
        options = {"causal": True, "scale": 1 / math.sqrt(head_dim), "sinks": bias.get("sinks"),
                   "alibi": bias.get("alibi_slopes")}
        out_ref, lse_ref = attention(q64, k64, v64, **options)
        out_lowp, lse_lowp = attention(q64, k64, v64, lowp="bfloat16", p_lowp=FP8, **options)
        check_rule("out", out, out_ref, out_lowp, "bfloat16")
        check_rule("lse", lse, lse_ref, lse_lowp, "bfloat16")


KV_CASES = [  # (seqlen_q, cached, new, num_splits, page_size, alibi per batch)
    (1, 700, 1, 1, 0, False),      # decode, one split
    (1, 3000, 1, 8, 16, True),     # decode split 8 ways over a paged cache: the sink enters at the merge
    (4, 555, 4, 0, 64, False),     # a few rows, splits chosen by the heuristic
    (300, 700, 300, 1, 0, True),   # chunked prefill: the forward kernel over the cache
]


@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: f"q{c[0]}-c{c[1]}-n{c[2]}-s{c[3]}-p{c[4]}")
@pytest.mark.parametrize("what", ["sinks", "alibi", "both"])
def test_kvcache_with_sinks_and_alibi(case, what, rng):
    import cupy as cp

    import cuflash
    from tests.gpu_reference import attention, check_rule, random_bshd

    seqlen_q, cached, new, num_splits, page_size, per_batch = case
    batch, heads, heads_kv, d = 3, 8, 2, 64
    capacity = cached + new + 64
    seqlens = np.array([cached, cached // 3, cached - 7])
    k_all, v_all = (random_bshd((batch, capacity, heads_kv, d), "bfloat16", rng) for _ in range(2))
    q = random_bshd((batch, seqlen_q, heads, d), "bfloat16", rng)
    k_new, v_new = (random_bshd((batch, new, heads_kv, d), "bfloat16", rng) for _ in range(2))
    sinks = sinks_for(heads, rng) if what in ("sinks", "both") else None
    slopes = slopes_for(heads, batch if per_batch else None) if what in ("alibi", "both") else None
    args = {}
    if page_size:
        pages = capacity // page_size + 1
        order = cp.asarray(rng.permutation(batch * pages).astype(np.int32)).reshape(batch, pages)
        k_cache = cp.zeros((batch * pages, page_size, heads_kv, d), k_all.dtype)
        v_cache = cp.zeros_like(k_cache)
        for b in range(batch):
            for p in range(pages):
                rows = slice(p * page_size, min((p + 1) * page_size, capacity))
                n = rows.stop - rows.start
                if n > 0:
                    k_cache[int(order[b, p]), :n] = k_all[b, rows]
                    v_cache[int(order[b, p]), :n] = v_all[b, rows]
        args["page_table"] = order
    else:
        k_cache, v_cache = k_all.copy(), v_all.copy()
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                              cache_seqlens=cp.asarray(seqlens.astype(np.int32)), causal=True,
                                              num_splits=num_splits, return_lse=True, sinks=sinks,
                                              alibi_slopes=slopes, **args)
    for b in range(batch):
        keys = int(seqlens[b]) + new
        k_seq = cp.concatenate([k_all[b, :seqlens[b]], k_new[b]])[None]
        v_seq = cp.concatenate([v_all[b, :seqlens[b]], v_new[b]])[None]
        options = {"causal": True, "scale": 1 / math.sqrt(d), "sinks": None if sinks is None else _float64(sinks),
                   "alibi": None if slopes is None else (slopes[b] if per_batch else slopes)}
        q64, k64, v64 = (_float64(x) for x in (q[b:b + 1], k_seq, v_seq))
        assert keys == k64.shape[1]
        out_ref, lse_ref = attention(q64, k64, v64, **options)
        out_lowp, lse_lowp = attention(q64, k64, v64, lowp="bfloat16", **options)
        check_rule(f"out[{b}]", out[b:b + 1], out_ref, out_lowp, "bfloat16")
        check_rule(f"lse[{b}]", lse[b:b + 1], lse_ref, lse_lowp, "bfloat16")


def test_split_counts_agree_with_sinks(rng):
    # Decoding with sinks split 1..many ways: each within the rule, and all close to each other.
    import cupy as cp

    import cuflash
    from tests.gpu_reference import random_bshd

    batch, heads, heads_kv, d, cached = 2, 8, 1, 64, 4000
    q = random_bshd((batch, 1, heads, d), "float16", rng)
    k_cache, v_cache = (random_bshd((batch, cached, heads_kv, d), "float16", rng) for _ in range(2))
    sinks = sinks_for(heads, rng)
    results = [cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cached, num_splits=splits,
                                              return_lse=True, sinks=sinks) for splits in (1, 2, 5, 16, 63)]
    first_out, first_lse = results[0]
    for out, lse in results[1:]:
        assert float(cp.abs(_float64(out) - _float64(first_out)).max()) < 2e-3
        assert float(cp.abs(lse - first_lse).max()) < 1e-4


def test_torch_sinks_are_differentiable_on_cuda():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    torch.manual_seed(0)
    q = torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(8, device="cuda", dtype=torch.float32, requires_grad=True)
    out = ct.attention(q, k, v, causal=True, sinks=sinks)
    out.float().square().sum().backward()
    # The eager gpt-oss formula (the sink as a concatenated score column) in float64.
    q64, k64, v64, s64 = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    kr, vr = (x.repeat_interleave(4, dim=2) for x in (k64, v64))
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, kr) / 8.0
    mask = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    column = s64.view(1, 8, 1, 1).expand(2, 8, 300, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    want = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    want.square().sum().backward()
    assert torch.allclose(out.double(), want, atol=3e-2)
    assert torch.allclose(sinks.grad.double(), s64.grad, rtol=2e-2, atol=2e-2)
    assert torch.allclose(q.grad.double(), q64.grad, rtol=5e-2, atol=5e-2)
