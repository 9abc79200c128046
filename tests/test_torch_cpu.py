"""cuflash.torch on CPU tensors: the custom ops run cuflash's CPU path (as NumPy arrays do), forward
and backward through autograd, checked against the float64 reference with the correctness rule:
``max|got - ref| <= 2 * max|lowp - ref| + atol``, lowp the naive attention computed by torch in
the inputs' dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash._cpu import reference

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")
ct = pytest.importorskip("cuflash.torch")

ATOL = 1e-5
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def random_tensor(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()


def float64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def naive_attention(q, k, v, causal, scale):
    """The same-dtype baseline, with autograd: S = q k^T * scale in float32 rounded to the inputs'
    dtype, softmax in float32, P rounded, P v; GQA heads repeated; flash-attn's bottom-right
    causal mask; rows that see no key give 0."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scores = (torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale).to(q.dtype).float()
    allowed = torch.from_numpy(reference.allowed_keys(q.shape[1], k.shape[1], causal=causal))
    # A finite fill, not -inf, so that a row with no key gives no NaN forward or backward.
    probs = torch.softmax(scores.masked_fill(~allowed, -1e30), dim=-1) * allowed
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(q.dtype), v)


def assert_rule(name, got, ref, lowp):
    ok, err, bound = reference.max_error_bound(float64(got), ref, float64(lowp), atol=ATOL)
    assert ok, f"{name}: max error {err:.3e} over the bound {bound:.3e}"


def lowp_gradients(q, k, v, dout, causal, scale):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = naive_attention(*leaves, causal, scale)
    out.backward(dout)
    return out, [x.grad for x in leaves]


def assert_out_and_gradients_follow_rule(out, q, k, v, dout, causal):
    """out and the gradients autograd left in q, k, v against the float64 reference, under the rule."""
    ref_out, _ = reference.attention_reference(float64(q), float64(k), float64(v), causal=causal)
    ref_grads = reference.attention_backward_reference(float64(dout), float64(q), float64(k), float64(v),
                                                       causal=causal)
    lowp_out, lowp_grads = lowp_gradients(q, k, v, dout, causal, 1 / math.sqrt(q.shape[-1]))
    assert_rule("out", out, ref_out, lowp_out)
    for name, got, ref, lowp in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads, lowp_grads):
        assert_rule(name, got, ref, lowp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens, heads", [((17, 113), (4, 4)), ((113, 17), (4, 2)), ((1, 64), (6, 1))])
def test_attention_forward_and_backward_on_cpu(dtype, causal, seqlens, heads):
    rng = np.random.default_rng()
    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, heads
    q = random_tensor(rng, (2, seqlen_q, heads_q, 64), dtype)
    k, v = (random_tensor(rng, (2, seqlen_k, heads_kv, 64), dtype) for _ in range(2))
    dout = torch.from_numpy(rng.standard_normal(q.shape)).to(dtype)

    out = ct.attention(q, k, v, causal=causal)
    out.backward(dout)
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype

    assert_out_and_gradients_follow_rule(out, q, k, v, dout, causal)


def test_flash_attn_varlen_func_on_cpu():
    rng = np.random.default_rng()
    lengths_q, lengths_k = [5, 0, 33], [40, 7, 33]
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lengths_q, lengths_k))
    q = random_tensor(rng, (sum(lengths_q), 4, 64), torch.bfloat16)
    k, v = (random_tensor(rng, (sum(lengths_k), 2, 64), torch.bfloat16) for _ in range(2))
    dout = torch.from_numpy(rng.standard_normal(q.shape)).to(torch.bfloat16)

    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    out.backward(dout)

    ref_out, _ = reference.attention_varlen_reference(float64(q), float64(k), float64(v), cu_q.numpy(),
                                                      cu_k.numpy(), causal=True)
    ref_grads = reference.attention_varlen_backward_reference(float64(dout), float64(q), float64(k), float64(v),
                                                              cu_q.numpy(), cu_k.numpy(), causal=True)
    lowp_grads = [torch.zeros_like(x) for x in (q, k, v)]
    lowp_out = torch.zeros_like(q)
    for i in range(len(lengths_q)):
        rows, keys = slice(*cu_q[i:i + 2].tolist()), slice(*cu_k[i:i + 2].tolist())
        o, grads = lowp_gradients(q[None, rows], k[None, keys], v[None, keys], dout[None, rows], True, 1 / 8)
        lowp_out[rows] = o[0].detach()
        for lowp, grad, part in zip(lowp_grads, grads, (rows, keys, keys)):
            lowp[part] = grad[0]
    assert_rule("out", out, ref_out, lowp_out)
    for name, got, ref, lowp in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads, lowp_grads):
        assert_rule(name, got, ref, lowp)


def test_flash_attn_func_on_cpu_matches_attention_bitwise():
    rng = np.random.default_rng()
    q, k, v = (random_tensor(rng, (1, 31, 2, 128), torch.float16) for _ in range(3))
    expected = ct.attention(q, k, v, causal=True, window=(8, 0), softcap=5.0)
    got = ct.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=5.0)
    assert torch.equal(got, expected)


def test_cpu_tensors_get_the_same_errors_as_numpy_arrays():
    q = torch.randn(1, 4, 2, 64, dtype=torch.float16)
    k = torch.randn(1, 4, 3, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="heads"):
        ct.attention(q, k, k)
    with pytest.raises(ValueError, match="dropout_p"):
        ct.flash_attn_func(q, q, q, dropout_p=1.5)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        ct.flash_attn_func(q, q, q, return_attn_probs=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dims, heads", [((192, 128), (4, 4)), ((32, 64), (6, 2))])
def test_head_dim_v_forward_and_backward_on_cpu(dtype, causal, head_dims, heads):
    rng = np.random.default_rng()
    (head_dim, head_dim_v), (heads_q, heads_kv) = head_dims, heads
    q = random_tensor(rng, (2, 19, heads_q, head_dim), dtype)
    k = random_tensor(rng, (2, 37, heads_kv, head_dim), dtype)
    v = random_tensor(rng, (2, 37, heads_kv, head_dim_v), dtype)
    dout = torch.from_numpy(rng.standard_normal((2, 19, heads_q, head_dim_v))).to(dtype)

    out = ct.flash_attn_func(q, k, v, causal=causal)
    out.backward(dout)
    assert out.shape == dout.shape and v.grad.shape == v.shape and k.grad.shape == k.shape

    assert_out_and_gradients_follow_rule(out, q, k, v, dout, causal)


def test_head_dim_v_varlen_on_cpu_is_the_reference_cast():
    rng = np.random.default_rng()
    lengths_q, lengths_k = [7, 0, 12], [9, 4, 5]
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lengths_q, lengths_k))
    q = random_tensor(rng, (sum(lengths_q), 4, 48), torch.float32)
    k = random_tensor(rng, (sum(lengths_k), 2, 48), torch.float32)
    v = random_tensor(rng, (sum(lengths_k), 2, 24), torch.float32)
    dout = torch.from_numpy(rng.standard_normal((sum(lengths_q), 4, 24))).float()
    options = dict(causal=True, window=(5, -1), softcap=4.0)

    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                    window_size=(5, -1), softcap=4.0)
    out.backward(dout)

    ref_out, _ = reference.attention_varlen_reference(float64(q), float64(k), float64(v), cu_q.numpy(),
                                                      cu_k.numpy(), **options)
    ref_grads = reference.attention_varlen_backward_reference(float64(dout), float64(q), float64(k), float64(v),
                                                              cu_q.numpy(), cu_k.numpy(), **options)
    np.testing.assert_array_equal(out.detach().numpy(), ref_out.astype(np.float32))
    for got, ref in zip((q.grad, k.grad, v.grad), ref_grads):
        np.testing.assert_array_equal(got.numpy(), ref.astype(np.float32))


def test_head_dim_v_fake_outputs_match_the_cpu_ops():
    """The ops' fake implementations (what torch.compile traces) give the real outputs' shapes and
    strides."""
    q, k = torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)
    v = torch.randn(1, 8, 2, 32)
    out, lse = ct._forward(q, k, v, True, 0.125, -1, -1, 0.0, False)
    torch.library.opcheck(ct._forward, (q, k, v, True, 0.125, -1, -1, 0.0, False))
    torch.library.opcheck(ct._backward, (torch.randn(out.shape), q, k, v, out, lse, True, 0.125, -1, -1, 0.0, False))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    torch.library.opcheck(ct._varlen_forward, (q[0], k[0], v[0], cu, cu, 5, 5, True, 0.125, -1, -1, 0.0, False))


def _wrapper_calls():
    """(argument name, a call of a cuflash.torch wrapper with that argument replaced, whether it
    may be None) for the tensor arguments of every wrapper."""
    q, packed, cu = torch.randn(1, 4, 2, 16), torch.randn(4, 2, 16), torch.tensor([0, 4], dtype=torch.int32)
    cache, partial, lse = torch.zeros(1, 8, 2, 16), torch.zeros(2, 1, 4, 2, 16), torch.zeros(2, 1, 4, 2)
    return [
        ("q", lambda x: ct.attention(x, q, q), False),
        ("v", lambda x: ct.attention(q, q, x), False),
        ("q", lambda x: ct.flash_attn_func(x, q, q), False),
        ("k", lambda x: ct.attention_varlen(packed, x, packed, cu, cu), False),
        ("cu_seqlens_q", lambda x: ct.attention_varlen(packed, packed, packed, x, cu), False),
        ("seqused_k", lambda x: ct.attention_varlen(packed, packed, packed, cu, cu, seqused_k=x), True),
        ("cu_seqlens_k", lambda x: ct.flash_attn_varlen_func(packed, packed, packed, cu, x, 4, 4), False),
        ("q", lambda x: ct.flash_attn_with_kvcache(x, cache, cache), False),
        ("v_cache", lambda x: ct.flash_attn_with_kvcache(q, cache, x), False),
        ("page_table", lambda x: ct.flash_attn_with_kvcache(q, cache, cache, page_table=x), True),
        ("qv", lambda x: ct.flash_attn_with_kvcache(q, cache, cache, qv=x), True),
        ("out_partial", lambda x: ct.flash_attn_combine(x, lse), False),
        ("lse_partial", lambda x: ct.flash_attn_combine(partial, x), False),
        ("out", lambda x: ct.flash_attn_combine(partial, lse, out=x), True),
    ]


@pytest.mark.parametrize("name, call, bad", [(name, call, bad) for name, call, optional in _wrapper_calls()
                                             for bad in ("numpy",) + (() if optional else ("none",))])
def test_wrappers_name_an_argument_that_is_not_a_tensor(name, call, bad):
    """A NumPy array, or None where a tensor is required: a short TypeError naming the argument,
    not the dispatcher's error printing the whole array, nor an AttributeError."""
    value = np.zeros((1, 4, 2, 16), np.float32) if bad == "numpy" else None
    with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor") as error:
        call(value)
    assert "array(" not in str(error.value) and len(str(error.value)) < 200


def e4m3(rng, shape) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.float8_e4m3fn)


def as_numpy(t):
    """A CPU tensor as the NumPy array cuflash's CPU path takes (e4m3 and bf16 through ml_dtypes)."""
    import ml_dtypes

    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def test_fp8_cpu_tensors_take_the_cpu_path():
    """float8_e4m3fn CPU tensors run cuflash's CPU path through flash_attn_func and
    flash_attn_varlen_func, as their NumPy views do, descales as numbers or CPU tensors."""
    import cuflash

    rng = np.random.default_rng(21)
    q, k, v = e4m3(rng, (2, 9, 4, 32)), e4m3(rng, (2, 13, 2, 32)), e4m3(rng, (2, 13, 2, 32))
    descale_k = torch.from_numpy(rng.uniform(0.5, 2.0, (2, 2)).astype(np.float32))
    got = ct.flash_attn_func(q, k, v, causal=True, q_descale=0.5, k_descale=descale_k)
    expected = cuflash.attention(*(as_numpy(x) for x in (q, k, v)), causal=True, descale_q=0.5,
                                 descale_k=descale_k.numpy())
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, 4, 32)
    assert torch.equal(got.view(torch.int16), torch.from_numpy(expected.view(np.int16)))

    cu_q, cu_k = torch.tensor([0, 9, 18], dtype=torch.int32), torch.tensor([0, 13, 26], dtype=torch.int32)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    got = ct.flash_attn_varlen_func(*packed, cu_q, cu_k, 9, 13, k_descale=descale_k)
    expected = cuflash.attention_varlen(*(as_numpy(x) for x in packed), cu_q.numpy(), cu_k.numpy(),
                                        descale_k=descale_k.numpy())
    assert torch.equal(got.view(torch.int16), torch.from_numpy(expected.view(np.int16)))
