"""Dropout on the GPU kernels, against the float64 references with the mask regenerated from
(seed, offset) by cuflash/_cpu/philox.py (docs/measuring.md's rule), once per kernel family
(the window kernels, which dropout runs in both, sm90's d64 forward with two consumers):
forward and backward, GQA, odd lengths, windows with softcap, sinks and ALiBi, varlen with empty
sequences, the keep rate, bitwise repetition per seed and the device (seed, offset) pair."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._cpu import philox
from cuflash._cpu.reference import (
    attention_backward_reference,
    attention_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
    max_error_bound,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family", "gpu_dropout")]


@pytest.fixture
def gpu_dropout(monkeypatch):
    """The kernels' dropout, behind checks.GPU_DROPOUT until these tests have passed on a GPU."""
    from cuflash._core import checks

    monkeypatch.setattr(checks, "GPU_DROPOUT", True)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _host(seed, shape_q, shape_kv, dtype):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in (shape_q, shape_kv, shape_kv, shape_q))


def _within_rule(got, ref, lowp, atol=1e-5):
    ok, err, bound = max_error_bound(got, ref, lowp, atol=atol)
    assert ok, (err, bound)


def test_fp8_inputs_refuse_dropout():
    import cupy as cp

    q = cp.zeros((1, 64, 2, 64), cp.uint8)
    with pytest.raises(NotImplementedError, match="dropout_p: not taken with FP8 inputs"):
        cuflash.attention(q, q, q, dtype="e4m3", dropout_p=0.1, seed=1)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("seqlen_q, seqlen_k, heads_kv, causal, head_dim", [
    (113, 113, 4, False, 64), (1023, 517, 2, True, 128), (17, 1023, 1, False, 256), (4224, 4224, 4, True, 64),
])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_forward_and_backward_against_the_reference(dtype, seqlen_q, seqlen_k, heads_kv, causal, head_dim, p):
    import cupy as cp

    if seqlen_q * seqlen_k > 2**22 and p == 0.5:
        pytest.skip("one dropout rate at the longest length: the float64 reference is slow")
    host = _host(seqlen_q, (1, seqlen_q, 4, head_dim), (1, seqlen_k, heads_kv, head_dim), dtype)
    q, k, v, dout = (cp.asarray(x) for x in host)
    options = dict(causal=causal, dropout_p=p, seed=2**63 + 5, offset=17)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(*host[:3], **options)
    lowp, _ = attention_reference(*host[:3], dtype=dtype, **options)
    _within_rule(cp.asnumpy(out), ref, lowp)
    np.testing.assert_allclose(cp.asnumpy(lse), ref_lse, rtol=1e-5, atol=1e-5)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    for got, want in zip(grads, attention_backward_reference(host[3], *host[:3], **options)):
        _within_rule(cp.asnumpy(got), want, want.astype(dtype), atol=2e-3)


def test_same_seed_repeats_bitwise_and_a_device_seed_equals_the_integers():
    import cupy as cp

    q, k, v, dout = (cp.asarray(x) for x in _host(3, (2, 300, 4, 128), (2, 300, 4, 128), BF16))

    def run(seed, offset=0):
        out, lse = cuflash.attention(q, k, v, return_lse=True, dropout_p=0.2, seed=seed, offset=offset)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.2, seed=seed, offset=offset,
                                           deterministic=True)
        return [cp.asnumpy(x).view(np.uint16) for x in (out, *grads)]

    first = run(7, 9)
    for a, b in zip(first, run(7, 9)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(first, run(cp.asarray([7, 9], cp.int64))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(first, run(8, 9)):
        assert (a != b).any()


def test_varlen_with_empty_sequences_against_the_reference():
    import cupy as cp

    lengths_q, lengths_k = [17, 0, 129, 300], [23, 4, 0, 257]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    host = _host(5, (cu_q[-1], 4, 64), (cu_k[-1], 2, 64), np.float16)
    q, k, v, dout = (cp.asarray(x) for x in host)
    options = dict(causal=True, dropout_p=0.15, seed=31, offset=2)
    out, lse = cuflash.attention_varlen(q, k, v, cp.asarray(cu_q), cp.asarray(cu_k), return_lse=True, **options)
    ref, ref_lse = attention_varlen_reference(*host[:3], cu_q, cu_k, **options)
    lowp, _ = attention_varlen_reference(*host[:3], cu_q, cu_k, dtype=np.float16, **options)
    _within_rule(cp.asnumpy(out), ref, lowp)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cp.asarray(cu_q), cp.asarray(cu_k), **options)
    for got, want in zip(grads, attention_varlen_backward_reference(host[3], *host[:3], cu_q, cu_k, **options)):
        _within_rule(cp.asnumpy(got), want, want.astype(np.float16), atol=2e-3)


def test_keep_rate_of_the_kernels_mask():
    """v of ones: each output element is the row's kept probability mass over 1 - p; with q = 0
    every probability is 1 / seqlen_k, so the mean output is the keep rate over 1 - p."""
    import cupy as cp

    p, seqlen = 0.1, 2048
    q = cp.zeros((4, seqlen, 8, 64), cp.float16)
    k = cp.asarray(np.random.default_rng(0).standard_normal((4, seqlen, 8, 64)).astype(np.float16))
    ones = cp.ones_like(k)
    out = cuflash.attention(q, k, ones, dropout_p=p, seed=12345)
    rate = float(out[..., 0].astype(cp.float64).mean()) * (1 - p)
    expected = philox.keep_mask(12345, 0, p, 8, seqlen, seqlen, 4).mean()
    n = 4 * 8 * seqlen * seqlen
    assert abs(rate - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3  # + the fp16 rounding of out
    assert abs(rate - expected) <= 1e-3


def test_torch_draws_from_the_cuda_generator_and_a_cuda_graph_draws_per_replay():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch.manual_seed(3)
    first = ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    grads = torch.autograd.grad(first.sum(), (q, k, v))
    torch.manual_seed(3)
    again = ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    assert torch.equal(first, again)
    assert all(torch.isfinite(g).all() for g in grads)
    # Captured: the seed and offset stay on the device, each replay draws its own.
    graph = torch.cuda.CUDAGraph()
    static = q.detach().clone()
    with torch.cuda.graph(graph):
        out = ct.flash_attn_func(static, k.detach(), v.detach(), dropout_p=0.2)
    torch.cuda.manual_seed(4)
    graph.replay()
    a = out.clone()
    torch.cuda.manual_seed(4)
    graph.replay()
    b = out.clone()
    graph.replay()
    assert torch.equal(a, b) and not torch.equal(a, out)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window, softcap, bias", [((32, 5), 0.0, False), ((-1, -1), 30.0, False),
                                                   ((-1, 0), 0.0, True)])
def test_windows_softcap_sinks_and_alibi_with_dropout(head_dim, window, softcap, bias):
    """Dropout with the window kernel's other run-time switches: a window, a softcap, sinks and
    ALiBi (the lse includes the sink)."""
    import cupy as cp

    host = _host(head_dim, (2, 201, 4, head_dim), (2, 177, 2, head_dim), BF16)
    q, k, v, dout = (cp.asarray(x) for x in host)
    options = dict(window=window, softcap=softcap, dropout_p=0.3, seed=99, offset=5)
    extra = {}
    if bias:
        rng = np.random.default_rng(1)
        extra = dict(sinks=rng.standard_normal(4).astype(np.float32),
                     alibi_slopes=rng.uniform(0.01, 0.2, (2, 4)).astype(np.float32))
    device_extra = {name: cp.asarray(x) for name, x in extra.items()}
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options, **device_extra)
    ref, ref_lse = attention_reference(*host[:3], **options, **extra)
    lowp, _ = attention_reference(*host[:3], dtype=BF16, **options, **extra)
    _within_rule(cp.asnumpy(out), ref, lowp)
    np.testing.assert_allclose(cp.asnumpy(lse), ref_lse, rtol=1e-5, atol=1e-5)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options, **device_extra)
    wanted = attention_backward_reference(host[3], *host[:3], **options, **extra)
    for got, want in zip(grads[:3], wanted[:3]):  # dsinks: tests/test_sinks_alibi_gpu.py
        _within_rule(cp.asnumpy(got), want, want.astype(BF16), atol=2e-3)
