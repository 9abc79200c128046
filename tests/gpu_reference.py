"""Float64 reference attention on the GPU (CuPy), for checking kernels at real sizes quickly.

Same semantics as cuflash._cpu.reference.attention_reference (its mask: reference.allowed_keys),
batched over (batch, head) on the device; ``lowp`` rounds S, P and out to float16/bfloat16 as the
same-dtype baseline of the correctness rule does.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np


def round_to(x, dtype_name: str):
    """Round a float32/float64 CuPy array to float16, bfloat16 or float8_e4m3fn (finite values
    up to its 448) and return it as float64."""
    if dtype_name == "float8_e4m3fn":
        # 3 mantissa bits: a quantum of 2^(exponent - 3), and 2^-9 over the subnormals, rounded
        # half to even by rint.
        x = x.astype(cp.float64)
        quantum = cp.ldexp(1.0, cp.maximum(cp.frexp(x)[1] - 4, -9))
        return cp.rint(x / quantum) * quantum
    x32 = x.astype(cp.float32)
    if dtype_name == "float16":
        return x32.astype(cp.float16).astype(cp.float64)
    # bfloat16: round-to-nearest-even on the top 16 bits of the float32 pattern.
    bits = x32.view(cp.uint32)
    rounded = (bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) & cp.uint32(0xFFFF0000)
    return rounded.view(cp.float32).astype(cp.float64)


def as_float64(x):
    """A float64 CuPy copy of a CuPy float16/bfloat16 array (bfloat16 widened bitwise)."""
    if x.dtype.name == "bfloat16":
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return x.astype(cp.float64)


def alibi_bias(slopes, batch: int, heads: int, seqlen_q: int, seqlen_k: int):
    """ALiBi's float64 bias (batch or 1, heads, seqlen_q, seqlen_k): -slope * |i + seqlen_k -
    seqlen_q - j|, for slopes (heads,) or (batch, heads) (any array module's, float32)."""
    slopes = cp.asarray(slopes, dtype=cp.float64).reshape(-1, heads)[:, :, None, None]
    i = cp.arange(seqlen_q)[:, None]
    j = cp.arange(seqlen_k)[None, :]
    return -slopes * cp.abs(i + seqlen_k - seqlen_q - j).astype(cp.float64)


def _softmax(s, sinks):
    """(P, lse, rows without weight) of scores s (b, h, sq, sk), each head's sink (h,) joining its
    rows' denominators as one more column (None: none); a row of no key and no sink gets P 0 and
    lse -inf."""
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = cp.asarray(sinks, dtype=cp.float64).reshape(1, -1, 1, 1)
        m = cp.maximum(m, sink)
    m = cp.where(cp.isneginf(m), 0.0, m)
    p = cp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + cp.exp(sink - m)
    empty = l == 0
    p = p / cp.where(empty, 1.0, l)
    lse = cp.where(empty[..., 0], -cp.inf, m[..., 0] + cp.log(cp.where(empty, 1.0, l)[..., 0]))
    return p, lse


def _scores(q, k, scale, lowp, softcap, alibi, causal, window):
    """The masked scores (b, h, sq, sk) of (b, h, s, d) q and k, and softcap's t (or None)."""
    from cuflash._cpu.reference import allowed_keys

    rnd = (lambda x: round_to(x, lowp)) if lowp else (lambda x: x)
    s = rnd(cp.matmul(q, k.transpose(0, 1, 3, 2)) * scale)
    t = None
    if softcap:
        t = cp.tanh(s / softcap)
        s = rnd(softcap * t)
    sq, sk = q.shape[2], k.shape[2]
    if alibi is not None:
        s = s + alibi_bias(alibi, q.shape[0], q.shape[1], sq, sk)
    if causal or window != (-1, -1):
        s = cp.where(cp.asarray(allowed_keys(sq, sk, causal=causal, window=window)), s, -cp.inf)
    return s, t


def attention(q, k, v, *, causal: bool, scale: float, lowp: str | None = None, window=(-1, -1),
              softcap: float = 0.0, p_lowp: str | None = None, sinks=None, alibi=None):
    """Returns (out, lse) in float64: out (b, sq, h, d), lse (b, h, sq). ``p_lowp``: the dtype P
    is rounded to before P V, default ``lowp`` (float8_e4m3fn: FlashAttention-3's FP8 baseline).
    ``sinks`` (h,) and ``alibi`` slopes ((h,) or (b, h)) as cuflash.attention takes them."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (b, h, s, d)
    group = q.shape[1] // k.shape[1]
    k, v = (cp.repeat(x, group, axis=1) for x in (k, v))
    s, _ = _scores(q, k, scale, lowp, softcap, alibi, causal, window)
    p, lse = _softmax(s, sinks)
    if p_lowp or lowp:
        p = round_to(p, p_lowp or lowp)
    out = cp.matmul(p, v)
    if lowp:
        out = round_to(out, lowp)
    return out.transpose(0, 2, 1, 3), lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Packed (total, h, d) q, k, v and host cu_seqlens: (out (total_q, h, d), lse (h, total_q)) in
    float64, each sequence through :func:`attention`; rows of empty sequences or without keys
    give 0 and -inf."""
    out = cp.zeros(q.shape[:2] + (v.shape[2],))
    lse = cp.full((q.shape[1], q.shape[0]), -cp.inf)
    for i in range(len(cu_seqlens_q) - 1):
        rows, keys = slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]), slice(cu_seqlens_k[i], cu_seqlens_k[i + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            o, l = attention(q[None, rows], k[None, keys], v[None, keys], **options)
            out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


def attention_backward(q, k, v, dout, *, causal: bool, scale: float, lowp: str | None = None, window=(-1, -1),
                       softcap: float = 0.0, sinks=None, alibi=None):
    """(dq, dk, dv) in float64, and dsinks (h,) after them with ``sinks``; ``lowp`` rounds S, P,
    dP, dS and the gradients to float16/bfloat16, as autograd through attention computed in that
    dtype would. Window, softcap, sinks and ALiBi as in :func:`attention`; rows without keys get
    zero gradients."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh, doh = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    kh, vh = (cp.repeat(x, group, axis=1) for x in (kh, vh))
    rnd = (lambda x: round_to(x, lowp)) if lowp else (lambda x: x)
    s, t = _scores(qh, kh, scale, lowp, softcap, alibi, causal, window)
    p, lse = _softmax(s, sinks)
    p = rnd(p)
    dv = cp.matmul(p.transpose(0, 1, 3, 2), doh)
    dp = rnd(cp.matmul(doh, vh.transpose(0, 1, 3, 2)))
    delta = (p * dp).sum(axis=-1, keepdims=True)  # rowsum(dout * out), the sink's column adding 0
    ds = p * (dp - delta)
    if softcap:  # d(softcap * tanh(x / softcap)) / dx
        ds = ds * (1 - t * t)
    ds = rnd(ds)
    dq = cp.matmul(ds, kh) * scale
    dk = cp.matmul(ds.transpose(0, 1, 3, 2), qh) * scale

    def per_kv_head(x):  # sum the query heads of each group
        b, h, s_, d = x.shape
        return x.reshape(b, h // group, group, s_, d).sum(axis=2)

    dq, dk, dv = dq, per_kv_head(dk), per_kv_head(dv)
    grads = tuple(rnd(x).transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    if sinks is None:
        return grads
    sink = cp.asarray(sinks, dtype=cp.float64).reshape(1, -1, 1)
    weight = cp.where(cp.isneginf(lse), 0.0, cp.exp(sink - lse))
    return (*grads, -(weight * delta[..., 0]).sum(axis=(0, 2)))


def attention_varlen_backward(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, **options):
    """Packed (total, h, d) inputs and host cu_seqlens: (dq, dk, dv) packed, in float64, each
    sequence through :func:`attention_backward`; empty sequences get zero gradients."""
    dq, dk, dv = cp.zeros(q.shape), cp.zeros(k.shape), cp.zeros(v.shape)
    for i in range(len(cu_seqlens_q) - 1):
        rows, keys = slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]), slice(cu_seqlens_k[i], cu_seqlens_k[i + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            g = attention_backward(q[None, rows], k[None, keys], v[None, keys], dout[None, rows], **options)
            dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def check_rule(name: str, got, ref, lowp_ref, dtype_name: str) -> None:
    """docs/measuring.md's rule: max|got - ref| <= 2 max|lowp_ref - ref| + atol, with atol the rounding error
    of representing the reference in the low-precision dtype (flash-attn's test rule)."""
    got = as_float64(got) if got.dtype != cp.float32 else got.astype(cp.float64)
    both_inf = cp.isneginf(got) & cp.isneginf(ref)
    assert not bool(cp.isnan(got).any()), f"{name}: NaN in the output"
    assert bool((cp.isneginf(got) == cp.isneginf(ref)).all()), f"{name}: -inf pattern differs"
    err = float(cp.where(both_inf, 0.0, cp.abs(got - ref)).max())
    base = float(cp.where(both_inf, 0.0, cp.abs(lowp_ref - ref)).max())
    finite_ref = cp.where(both_inf, 0.0, ref)
    atol = float(cp.abs(round_to(finite_ref + 0.3, dtype_name) - 0.3 - finite_ref).max())
    bound = 2 * base + atol
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (2 x {base:.3e} + {atol:.3e})"


def poison_pool():
    """Fill soon-to-be-reused pool memory with NaN, so an unwritten output element fails."""
    junk = cp.full(64 << 20, cp.nan, dtype=cp.float32)
    del junk


def check_forward(q, k, v, causal, dtype_name, scale=None, window=(-1, -1), softcap=0.0):
    """cuflash.attention on fixed-length CuPy inputs, into a NaN-filled ``out`` from a poisoned
    pool, against the float64 reference with docs/measuring.md's rule (out and lse)."""
    import cuflash

    poison_pool()
    out = cp.full((*q.shape[:3], v.shape[3]), cp.nan, dtype=q.dtype)
    options = {"causal": causal, "window": window, "softcap": softcap}
    result, lse = cuflash.attention(q, k, v, softmax_scale=scale, return_lse=True, out=out, **options)
    assert result is out
    scale = scale or 1 / math.sqrt(q.shape[3])
    q64, k64, v64 = (as_float64(x) for x in (q, k, v))
    out_ref, lse_ref = attention(q64, k64, v64, scale=scale, **options)
    out_lowp, lse_lowp = attention(q64, k64, v64, scale=scale, lowp=dtype_name, **options)
    check_rule("out", out, out_ref, out_lowp, dtype_name)
    check_rule("lse", lse, lse_ref, lse_lowp, dtype_name)


def check_backward(q, k, v, causal, dtype_name, rng, scale=None, window=(-1, -1), softcap=0.0,
                   deterministic=False):
    """cuflash.attention_backward on fixed-length CuPy inputs (a fresh random dout), into
    NaN-filled gradients, against the float64 reference gradients with docs/measuring.md's rule."""
    import cuflash

    options = {"causal": causal, "window": window, "softcap": softcap}
    dout = random_bshd((*q.shape[:3], v.shape[3]), dtype_name, rng)
    out, lse = cuflash.attention(q, k, v, softmax_scale=scale, return_lse=True, **options)
    poison_pool()
    dq, dk, dv = (cp.full(x.shape, cp.nan, dtype=x.dtype) for x in (q, k, v))
    result = cuflash.attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, deterministic=deterministic,
                                        dq=dq, dk=dk, dv=dv, **options)
    assert result[0] is dq and result[1] is dk and result[2] is dv
    scale = scale or 1 / math.sqrt(q.shape[3])
    q64, k64, v64, do64 = (as_float64(x) for x in (q, k, v, dout))
    exact = attention_backward(q64, k64, v64, do64, scale=scale, **options)
    lowp = attention_backward(q64, k64, v64, do64, scale=scale, lowp=dtype_name, **options)
    for name, got, e, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, lowp):
        check_rule(name, got, e, lp, dtype_name)


def random_bshd(shape, dtype_name: str, rng: np.random.Generator):
    """Fresh standard-normal CuPy array of float16 or bfloat16."""
    from cuflash.bench.attention import random_normal

    return random_normal(shape, dtype_name, seed=int(rng.integers(2**31)))
