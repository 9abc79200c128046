"""attention_varlen and attention_varlen_backward on the GPU: packed batches against the float64
reference of each sequence with docs/measuring.md's rule (out, lse, dq, dk, dv), the edge
cases (empty sequences, a total length of 0, rows left with no key), and the torch entry points."""

from __future__ import annotations

import numpy as np
import pytest

# The checks run the forward (and the backward on its output) once per kernel family the device has
# (conftest.family).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype_name, rng, head_dim_v=None):
    """Fresh packed q, k, v (v of ``head_dim_v``, default head_dim) and device int32 cu_seqlens for
    these sequence lengths."""
    import cupy as cp

    from tests.gpu_reference import random_bshd

    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (lengths_q, lengths_k))
    q = random_bshd((1, int(cu_q[-1]), heads, head_dim), dtype_name, rng)[0]
    k, v = (random_bshd((1, int(cu_k[-1]), heads_kv, dim), dtype_name, rng)[0]
            for dim in (head_dim, head_dim_v or head_dim))
    return q, k, v, cp.asarray(cu_q), cp.asarray(cu_k)


def _check_varlen(lengths_q, lengths_k, rng, heads=4, heads_kv=2, head_dim=128, dtype_name="bfloat16",
                  softmax_scale=None, head_dim_v=None, **options):
    """attention_varlen into a NaN-filled ``out`` from a poisoned pool, then
    attention_varlen_backward into NaN-filled gradients, against the per-sequence float64
    reference; ``options`` go to both (causal, window, softcap, max_seqlen_*, validate)."""
    import math

    import cupy as cp

    import cuflash
    from tests import gpu_reference as ref

    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype_name, rng, head_dim_v)
    ref.poison_pool()
    out = cp.full((*q.shape[:2], v.shape[2]), cp.nan, dtype=q.dtype)
    result, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale, return_lse=True,
                                           out=out, **options)
    assert result is out and lse.shape == (heads, q.shape[0])
    semantics = {"causal": False} | {name: options[name] for name in ("causal", "window", "softcap") if name in options}
    scale = softmax_scale or 1 / math.sqrt(head_dim)
    host_q, host_k = cu_q.get().tolist(), cu_k.get().tolist()
    q64, k64, v64 = (ref.as_float64(x) for x in (q, k, v))
    exact = ref.attention_varlen(q64, k64, v64, host_q, host_k, scale=scale, **semantics)
    lowp = ref.attention_varlen(q64, k64, v64, host_q, host_k, scale=scale, lowp=dtype_name, **semantics)
    ref.check_rule("out", out, exact[0], lowp[0], dtype_name)
    ref.check_rule("lse", lse, exact[1], lowp[1], dtype_name)

    dout = ref.random_bshd((1, *out.shape), dtype_name, rng)[0]
    ref.poison_pool()
    grads = [cp.full(x.shape, cp.nan, dtype=x.dtype) for x in (q, k, v)]
    result = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, softmax_scale=softmax_scale,
                                               dq=grads[0], dk=grads[1], dv=grads[2], **options)
    assert all(r is g for r, g in zip(result, grads))
    do64 = ref.as_float64(dout)
    exact = ref.attention_varlen_backward(q64, k64, v64, do64, host_q, host_k, scale=scale, **semantics)
    lowp = ref.attention_varlen_backward(q64, k64, v64, do64, host_q, host_k, scale=scale, lowp=dtype_name,
                                         **semantics)
    for name, got, e, lp in zip(("dq", "dk", "dv"), grads, exact, lowp):
        ref.check_rule(name, got, e, lp, dtype_name)
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_length_mix(causal, rng):
    lengths = rng.integers(1, 600, size=7)
    _check_varlen(lengths, lengths, rng, causal=causal)


def test_different_q_and_k_lengths_gqa_window(rng):
    _check_varlen(rng.integers(1, 400, size=6), rng.integers(1, 400, size=6), rng, heads=6, heads_kv=2,
                  head_dim=64, dtype_name="float16", window=(32, 8))


def test_zero_length_sequences(rng):
    """Empty q, empty k (rows that see nothing: 0 and -inf) and both empty, inside the batch."""
    import cupy as cp

    lengths_q, lengths_k = [5, 0, 130, 7, 0, 64], [0, 9, 130, 300, 0, 1]
    out, lse = _check_varlen(lengths_q, lengths_k, rng, causal=True)
    assert bool(cp.all(out[:5].view(cp.uint16) == 0)) and bool(cp.all(cp.isneginf(lse[:, :5])))


def test_max_seqlen_one(rng):
    _check_varlen([1] * 37, [1] * 37, rng, causal=True, max_seqlen_q=1, max_seqlen_k=1)


def test_fewer_tokens_than_sequences(rng):
    _check_varlen([0, 0, 1, 0, 2, 0, 0, 0], [1, 0, 1, 2, 0, 0, 3, 0], rng, head_dim=64, dtype_name="float16")


@pytest.mark.parametrize("options", [{"causal": True}, {"causal": True, "window": (256, -1), "softcap": 30.0}],
                         ids=["causal", "window-softcap"])
def test_one_long_and_many_short(options, rng):
    lengths = [3000] + list(rng.integers(1, 40, size=60))
    _check_varlen(lengths, lengths, rng, **options)


@pytest.mark.parametrize("head_dim, dtype_name", [(32, "float16"), (96, "bfloat16"), (192, "float16"),
                                                  (256, "bfloat16")])
def test_head_dim_buckets(head_dim, dtype_name, rng):
    lengths_q, lengths_k = rng.integers(1, 300, size=5), rng.integers(1, 300, size=5)
    _check_varlen(lengths_q, lengths_k, rng, head_dim=head_dim, dtype_name=dtype_name, causal=bool(head_dim % 64))


def test_given_max_seqlen_without_validation(rng):
    lengths = [17, 250, 3, 129]
    _check_varlen(lengths, lengths, rng, max_seqlen_q=250, max_seqlen_k=250, validate=False, softcap=4.0,
                  softmax_scale=0.3)


def test_strided_cu_seqlens_rejected(rng):
    import cupy as cp

    import cuflash

    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 2, 2, 64, "float16", rng)
    spread = cp.zeros(6, cp.int32)
    spread[::2] = cu_q
    with pytest.raises(ValueError, match="cu_seqlens_q: must be contiguous"):
        cuflash.attention_varlen(q, k, v, spread[::2], cu_k)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(ValueError, match="cu_seqlens_k: must be contiguous"):
        cuflash.attention_varlen_backward(q, q, k, v, out, lse, cu_q, spread[::2])


def test_torch_flash_attn_varlen_func():
    """flash-attn's signature, torch in and out, forward and autograd backward."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    from cuflash.torch import flash_attn_varlen_func
    from tests import gpu_reference as ref

    gen = torch.Generator(device="cuda").manual_seed(5)
    cu = torch.tensor([0, 100, 100, 357, 360], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(360, 4, 64, device="cuda", dtype=torch.float16, generator=gen, requires_grad=True)
               for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True, window_size=(50, -1))
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    host = cu.tolist()
    q64, k64, v64 = (cp.from_dlpack(x.detach().double()) for x in (q, k, v))
    options = {"causal": True, "window": (50, -1), "scale": 0.125}
    expected, _ = ref.attention_varlen(q64, k64, v64, host, host, **options)
    lowp, _ = ref.attention_varlen(q64, k64, v64, host, host, lowp="float16", **options)
    ref.check_rule("out", cp.from_dlpack(out.detach().double()), expected, lowp, "float16")
    dout = torch.randn(out.shape, device="cuda", dtype=torch.float16, generator=gen)
    out.backward(dout)
    do64 = cp.from_dlpack(dout.double())
    exact = ref.attention_varlen_backward(q64, k64, v64, do64, host, host, **options)
    lowp = ref.attention_varlen_backward(q64, k64, v64, do64, host, host, lowp="float16", **options)
    for name, x, e, lp in zip(("dq", "dk", "dv"), (q, k, v), exact, lowp):
        ref.check_rule(name, cp.from_dlpack(x.grad.double()), e, lp, "float16")


@pytest.mark.usefixtures("causal_dq_order")
def test_deterministic_backward_repeats_bitwise(rng):
    """deterministic=True over a packed batch (GQA, causal): within the rule (checked through
    _check_varlen's default mode on the same lengths) and bitwise equal over 10 runs."""
    import cupy as cp

    import cuflash

    lengths = [700, 0, 33, 1200, 5]
    out, lse = _check_varlen(lengths, lengths, rng, causal=True)
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 4, 2, 128, "bfloat16", rng)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    dout = cp.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    first = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, deterministic=True)
    default = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    for a, b in zip(first, default):  # the same sums in another order: equal to within rounding
        assert float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max()) < 0.05
    for _ in range(9):
        again = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True,
                                                  deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), name


@pytest.mark.parametrize("lengths_q, lengths_k", [((0, 0, 0), (7, 3, 2)), ((5, 0, 9), (0, 0, 0))])
def test_total_length_zero(lengths_q, lengths_k, rng, monkeypatch):
    """All sequences empty on one side: no kernel of cuflash's launches; out (given, NaN-filled)
    becomes zeros, lse -inf, and the gradients given NaN-filled become zeros."""
    import cupy as cp

    import cuflash
    from cuflash._core import kernels

    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 64, "float16", rng)
    monkeypatch.setattr(kernels, "launch", lambda *args: pytest.fail("a kernel was launched"))
    out = cp.full(q.shape, cp.nan, dtype=q.dtype)
    result, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, out=out)
    assert result is out and lse.shape == (4, q.shape[0]) and lse.dtype == cp.float32
    assert not bool(cp.isnan(out.astype(cp.float32)).any() or out.astype(cp.float32).any())
    assert bool(cp.all(lse == -cp.inf))
    grads = tuple(cp.full(x.shape, cp.nan, dtype=q.dtype) for x in (q, k, v))
    dq, dk, dv = cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, dq=grads[0], dk=grads[1],
                                                   dv=grads[2])
    for given, got in zip(grads, (dq, dk, dv)):
        assert got is given and not bool(cp.isnan(got.astype(cp.float32)).any() or got.astype(cp.float32).any())
    dq, dk, dv = cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not any(bool(g.astype(cp.float32).any()) for g in (dq, dk, dv))


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 5))])
@pytest.mark.parametrize("which", ["both", "q", "k"])
def test_seqused(causal, window, which, rng):
    """seqused_q / seqused_k: each sequence's used prefix against the float64 reference of those
    prefixes; the rows past seqused_q are 0 with lse -inf (out starts NaN-filled)."""
    import cupy as cp

    import cuflash
    from cuflash._cpu.reference import attention_varlen_reference, max_error_bound

    lengths_q, lengths_k = [130, 0, 1, 300, 64], [200, 17, 0, 300, 1]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, 128, "bfloat16", rng)
    used_q = np.array([65, 0, 1, 0, 64], np.int32) if which != "k" else None
    used_k = np.array([200, 3, 0, 129, 0], np.int32) if which != "q" else None
    device_used = [None if u is None else cp.asarray(u) for u in (used_q, used_k)]
    out = cp.full(q.shape, cp.nan, dtype=q.dtype)
    result, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True,
                                           out=out, seqused_q=device_used[0], seqused_k=device_used[1])
    host = [cp.asnumpy(x) for x in (q, k, v)]
    args = (*host, cu_q.get(), cu_k.get(), used_q, used_k)
    exact_out, exact_lse = attention_varlen_reference(*args, causal=causal, window=window)
    lowp_out, _ = attention_varlen_reference(*args, causal=causal, window=window, dtype=host[0].dtype)
    got = cp.asnumpy(out)
    ok, err, bound = max_error_bound(got, exact_out, lowp_out, atol=1e-3)
    assert ok, f"out: max error {err:.3e} over {bound:.3e}"
    got_lse = cp.asnumpy(lse)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(exact_lse))
    finite = np.isfinite(exact_lse)
    np.testing.assert_allclose(got_lse[finite], exact_lse[finite], rtol=1e-2, atol=1e-2)
    if used_q is not None:
        cu = cu_q.get()
        for b, n in enumerate(used_q):
            assert (got[cu[b] + n:cu[b + 1]].astype(np.float32) == 0).all()


def test_seqused_torch():
    torch = pytest.importorskip("torch")
    from cuflash._cpu.reference import attention_varlen_reference
    from cuflash.torch import flash_attn_varlen_func

    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 350], dtype=torch.int32)
    q = torch.randn(10, 8, 64, generator=g).bfloat16()
    k, v = (torch.randn(350, 2, 64, generator=g).bfloat16() for _ in range(2))
    used_q, used_k = torch.tensor([1, 6], dtype=torch.int32), torch.tensor([99, 200], dtype=torch.int32)
    out = flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), 6, 250, causal=True,
                                 seqused_q=used_q.cuda(), seqused_k=used_k.cuda())
    ref, _ = attention_varlen_reference(q.float().numpy(), k.float().numpy(), v.float().numpy(), cu_q.numpy(),
                                        cu_k.numpy(), used_q.numpy(), used_k.numpy(), causal=True)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 5))])
@pytest.mark.parametrize("deterministic", [False, True])
def test_seqused_backward(causal, window, deterministic, rng):
    """attention_varlen_backward with seqused_q / seqused_k (FlashAttention-3 trains with them):
    into NaN-filled gradients, the used rows and keys of each sequence against the float64
    backward of its used prefixes alone, 0 past them (a used length past the sequence counting as
    all of it, as in the forward)."""
    import math

    import cupy as cp

    import cuflash
    from tests import gpu_reference as ref

    lengths_q, lengths_k = [130, 0, 1, 300, 64, 9], [200, 17, 0, 300, 1, 40]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, 128, "bfloat16", rng)
    used_q = np.array([65, 0, 1, 0, 64, 100], np.int32)
    used_k = np.array([200, 3, 0, 129, 0, 33], np.int32)
    options = dict(causal=causal, window=window)
    # validate=False: a used length past its sequence is refused by the checks of the values.
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, seqused_q=cp.asarray(used_q),
                                        seqused_k=cp.asarray(used_k), validate=False, **options)
    dout = ref.random_bshd((1, *out.shape), "bfloat16", rng)[0]
    grads = [cp.full(x.shape, cp.nan, dtype=x.dtype) for x in (q, k, v)]
    ref.poison_pool()
    cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, dq=grads[0], dk=grads[1], dv=grads[2],
                                      seqused_q=cp.asarray(used_q), seqused_k=cp.asarray(used_k),
                                      deterministic=deterministic, validate=False, **options)
    q64, k64, v64, do64 = (ref.as_float64(x) for x in (q, k, v, dout))
    exact = [cp.zeros(x.shape) for x in (q, k, v)]
    lowp = [cp.zeros(x.shape) for x in (q, k, v)]
    host_q, host_k = cu_q.get(), cu_k.get()
    for b in range(len(lengths_q)):
        nq, nk = min(used_q[b], lengths_q[b]), min(used_k[b], lengths_k[b])
        rows, keys = slice(host_q[b], host_q[b] + nq), slice(host_k[b], host_k[b] + nk)
        if nq and nk:
            for target, precision in ((exact, {}), (lowp, {"lowp": "bfloat16"})):
                g = ref.attention_backward(q64[None, rows], k64[None, keys], v64[None, keys], do64[None, rows],
                                           scale=1 / math.sqrt(128), **options, **precision)
                target[0][rows], target[1][keys], target[2][keys] = g[0][0], g[1][0], g[2][0]
    for name, got, e, lp in zip(("dq", "dk", "dv"), grads, exact, lowp):
        ref.check_rule(name, got, e, lp, "bfloat16")
