"""cuflash.torch with attention sinks and ALiBi on CPU tensors: forward and autograd (sinks
differentiable) against the float64 references under the DESIGN.md rule, gradcheck in float64,
flash-attn's names (alibi_slopes; sinks or FlashAttention-4's learnable_sink), the ops' fakes,
and torch.compile(fullgraph=True)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash._cpu import reference

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")
ct = pytest.importorskip("cuflash.torch")

ATOL = 1e-5


def random_tensor(rng, shape, dtype, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype).requires_grad_()


def float64(t) -> np.ndarray:
    return t.detach().double().numpy()


def naive_attention(q, k, v, sinks, slopes, causal, scale):
    """The same-dtype baseline, with autograd: S = q k^T * scale rounded to the inputs' dtype, the
    ALiBi bias, the sink as one more score column (gpt-oss's formula), softmax in float32, P
    rounded, P v."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    sq, sk = q.shape[1], k.shape[1]
    scores = (torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale).to(q.dtype).float()
    distance = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None]).abs()
    scores = scores - slopes.view(-1, q.shape[2], 1, 1) * distance
    allowed = torch.from_numpy(reference.allowed_keys(sq, sk, causal=causal))
    scores = scores.masked_fill(~allowed, -math.inf)
    column = sinks.float().view(1, -1, 1, 1).expand(q.shape[0], -1, sq, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :sk]
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(q.dtype), v)


def half_ulp_of_largest(ref: np.ndarray, dtype) -> float:
    """Half a unit in the last place, in ``dtype``, of the largest exact value: the rounding of the
    returned tensor, which no implementation avoids and which the same-dtype baseline's own error
    can miss over few elements."""
    largest = float(np.abs(ref).max(initial=0.0))
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(largest)) / 2 if largest > 0 else 0.0


def assert_rule(name, got, ref, lowp, atol=ATOL):
    atol += half_ulp_of_largest(ref, got.dtype)
    ok, err, bound = reference.max_error_bound(float64(got), ref, float64(lowp), atol=atol)
    assert ok, f"{name}: max error {err:.3e} over the bound {bound:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens, heads, batch_slopes", [((17, 113), (4, 4), False), ((113, 17), (4, 2), True),
                                                          ((1, 64), (6, 1), False)])
def test_attention_with_sinks_and_alibi_forward_and_backward(dtype, causal, seqlens, heads, batch_slopes):
    rng = np.random.default_rng()
    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, heads
    q = random_tensor(rng, (2, seqlen_q, heads_q, 64), dtype)
    k, v = (random_tensor(rng, (2, seqlen_k, heads_kv, 64), dtype) for _ in range(2))
    sinks = random_tensor(rng, (heads_q,), dtype, scale=2.0)
    slopes = torch.from_numpy(rng.uniform(0.01, 0.5, (2, heads_q) if batch_slopes else heads_q).astype(np.float32))
    dout = torch.from_numpy(rng.standard_normal(q.shape)).to(dtype)

    out = ct.attention(q, k, v, causal=causal, sinks=sinks, alibi_slopes=slopes)
    out.backward(dout)
    assert out.dtype == q.grad.dtype == sinks.grad.dtype == dtype

    inputs = [float64(x) for x in (q, k, v)]
    options = dict(causal=causal, sinks=float64(sinks), alibi_slopes=slopes.numpy())
    ref_out, ref_lse = reference.attention_reference(*inputs, **options)
    ref_grads = reference.attention_backward_reference(float64(dout), *inputs, **options)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    lowp_out = naive_attention(*leaves, slopes, causal, 1 / 8)
    lowp_out.backward(dout)
    assert_rule("out", out, ref_out, lowp_out)
    for name, got, ref, lowp in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads, leaves):
        assert_rule(name, got, ref, lowp.grad)
    if dtype == torch.float32:
        assert_rule("dsinks", sinks.grad, ref_grads[3], leaves[3].grad, atol=1e-3)
    else:
        # In 16 bits dsinks sums exp(sink - lse) * rowsum(dout * out) over every row of a head, from
        # the out the forward returned (rounded to its dtype), as the kernels do: the same-dtype
        # baseline, which sums over its own rounding, does not bound that. The formula over the
        # returned out, accumulated in float32 and rounded once to the sinks' dtype, does.
        expected = reference.sinks_gradient(float64(dout), float64(out), ref_lse, float64(sinks))
        np.testing.assert_allclose(float64(sinks.grad), expected, rtol=1e-5,
                                   atol=half_ulp_of_largest(expected, dtype))


def test_gradcheck_in_float64():
    rng = np.random.default_rng(3)
    q = random_tensor(rng, (2, 5, 4, 8), torch.float64)
    k, v = (random_tensor(rng, (2, 7, 2, 8), torch.float64) for _ in range(2))
    sinks = random_tensor(rng, (4,), torch.float64)
    slopes = torch.from_numpy(rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32))
    assert torch.autograd.gradcheck(
        lambda *x: ct.attention(*x[:3], causal=True, window=(3, -1), softcap=4.0, sinks=x[3], alibi_slopes=slopes),
        (q, k, v, sinks))


def test_flash_attn_func_takes_alibi_and_either_name_of_the_sinks():
    rng = np.random.default_rng(5)
    q, k, v = (random_tensor(rng, (1, 31, 2, 64), torch.float16) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    slopes = torch.tensor([0.25, 0.125])
    expected = ct.attention(q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes)
    assert torch.equal(ct.flash_attn_func(q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes), expected)
    assert torch.equal(ct.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks, alibi_slopes=slopes), expected)
    with pytest.raises(TypeError, match="sinks, learnable_sink"):
        ct.flash_attn_func(q, k, v, sinks=sinks, learnable_sink=sinks)
    with pytest.raises(TypeError, match="^sinks: expected a torch.Tensor"):
        ct.flash_attn_func(q, k, v, sinks=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="alibi_slopes: expected shape"):
        ct.flash_attn_func(q, k, v, alibi_slopes=torch.zeros(3))


def test_flash_attn_varlen_func_with_sinks_and_alibi():
    rng = np.random.default_rng(7)
    lengths_q, lengths_k = [5, 0, 33, 4], [40, 7, 33, 0]
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lengths_q, lengths_k))
    q = random_tensor(rng, (sum(lengths_q), 4, 64), torch.float32)
    k, v = (random_tensor(rng, (sum(lengths_k), 2, 64), torch.float32) for _ in range(2))
    sinks = random_tensor(rng, (4,), torch.float32)
    slopes = torch.from_numpy(rng.uniform(0.01, 0.5, (4, 4)).astype(np.float32))
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()

    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                    learnable_sink=sinks, alibi_slopes=slopes)
    out.backward(dout)
    inputs = [float64(x) for x in (q, k, v)] + [cu_q.numpy(), cu_k.numpy()]
    options = dict(causal=True, sinks=float64(sinks), alibi_slopes=slopes.numpy())
    ref_out, _ = reference.attention_varlen_reference(*inputs, **options)
    ref_grads = reference.attention_varlen_backward_reference(float64(dout), *inputs, **options)
    np.testing.assert_allclose(float64(out), ref_out, atol=1e-5)
    for got, ref in zip((q.grad, k.grad, v.grad, sinks.grad), ref_grads):
        np.testing.assert_allclose(float64(got), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 40, sinks=sinks, seqused_q=cu_q[1:] - cu_q[:-1])


def test_fake_outputs_match_the_cpu_ops():
    """The new ops' fake implementations (what torch.compile traces) give the real outputs' shapes,
    dtypes and strides, with sinks and without."""
    q, k, v = torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 32)
    sinks, slopes = torch.randn(2), torch.rand(2)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for s, a in ((sinks, slopes), (None, slopes), (sinks, None)):
        options = (True, 0.125, -1, -1, 0.0, False)
        out, lse = ct._biased_forward(q, k, v, s, a, *options)
        torch.library.opcheck(ct._biased_forward, (q, k, v, s, a, *options))
        torch.library.opcheck(ct._biased_backward, (torch.randn(out.shape), q, k, v, out, lse, s, a, *options))
        packed = (q[0], k[0], v[0])
        out, lse = ct._varlen_biased_forward(*packed, cu, cu, s, a, 5, 5, *options)
        torch.library.opcheck(ct._varlen_biased_forward, (*packed, cu, cu, s, a, 5, 5, *options))
        torch.library.opcheck(ct._varlen_biased_backward,
                              (torch.randn(out.shape), *packed, out, lse, cu, cu, s, a, 5, 5, *options))


# torch.compile's first use imports torch's own modules that call the deprecated torch.jit.script_method.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_fullgraph_matches_eager():
    rng = np.random.default_rng(9)
    q = random_tensor(rng, (1, 9, 2, 16), torch.float32)
    k, v = (random_tensor(rng, (1, 9, 1, 16), torch.float32) for _ in range(2))
    sinks = random_tensor(rng, (2,), torch.float32)
    slopes = torch.tensor([0.5, 0.25])

    def step(q, k, v, sinks):
        return ct.attention(q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes)

    eager = step(q, k, v, sinks)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v, sinks))
    compiled = torch.compile(step, fullgraph=True)(q, k, v, sinks)
    compiled_grads = torch.autograd.grad(compiled.sum(), (q, k, v, sinks))
    assert torch.equal(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


def test_flash_attn_with_kvcache_takes_sinks():
    from cuflash._cpu.reference_kvcache import kvcache_reference
    from kvcache_cases import make_case, reference_args

    r = np.random.default_rng(13)
    args = make_case(r, seqlen_q=2, new=2, page_size=16, lens=[0, 9, 20])
    sinks = r.standard_normal(4)
    ref_out, ref_lse, _, _ = kvcache_reference(**reference_args(args), causal=True, sinks=sinks)
    t = {name: torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
         for name, x in args.items()}
    out, lse = ct.flash_attn_with_kvcache(t.pop("q"), t.pop("k_cache"), t.pop("v_cache"), t.pop("k"), t.pop("v"),
                                          causal=True, return_softmax_lse=True, sinks=torch.from_numpy(sinks), **t)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_lse.astype(np.float32), rtol=1e-6)
    with pytest.raises(NotImplementedError, match="sinks with qv"):
        ct.flash_attn_with_kvcache(torch.zeros(1, 1, 1, 64), torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 512),
                                   qv=torch.zeros(1, 1, 1, 512), sinks=torch.zeros(1))
