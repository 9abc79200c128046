"""cuflash.torch with dropout on CPU tensors: the seed and offset drawn from torch's generator
(torch.manual_seed repeats a run, the backward regenerates the forward's mask), forward and
autograd against the float64 references under the DESIGN.md rule, flash-attn's dropout_p, the
ops' fakes, torch.compile(fullgraph=True), and the arguments refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuflash._cpu import reference

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")
ct = pytest.importorskip("cuflash.torch")

from tests.test_torch_sinks_alibi_cpu import assert_rule, float64, random_tensor  # noqa: E402

NUMPY_DTYPES = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32}


def drawn_seed_offset(generator_seed: int, q) -> tuple[int, int]:
    """The (seed, offset) a dropout call draws first after ``torch.manual_seed(generator_seed)``."""
    torch.manual_seed(generator_seed)
    seed, offset = ct._dropout_rng(q).tolist()
    return seed % 2**64, offset % 2**64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens, heads", [((17, 113), (4, 4)), ((113, 17), (4, 2)), ((1, 64), (6, 1))])
def test_flash_attn_func_forward_and_backward_against_the_reference(dtype, causal, seqlens, heads):
    rng = np.random.default_rng(sum(seqlens) + heads[1])
    (sq, sk), (hq, hkv) = seqlens, heads
    q = random_tensor(rng, (2, sq, hq, 64), dtype)
    k, v = (random_tensor(rng, (2, sk, hkv, 64), dtype) for _ in range(2))
    dout = random_tensor(rng, (2, sq, hq, 64), dtype).detach()
    seed, offset = drawn_seed_offset(7, q)
    torch.manual_seed(7)
    out = ct.flash_attn_func(q, k, v, dropout_p=0.17, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    options = dict(causal=causal, dropout_p=0.17, seed=seed, offset=offset)
    qn, kn, vn, don = (float64(t) for t in (q, k, v, dout))
    ref, _ = reference.attention_reference(qn, kn, vn, **options)
    lowp, _ = reference.attention_reference(qn, kn, vn, dtype=NUMPY_DTYPES[dtype], **options)
    assert_rule("out", out, ref, torch.from_numpy(lowp.astype(np.float64)))
    ref_grads = reference.attention_backward_reference(don, qn, kn, vn, **options)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        lowp_grad = torch.from_numpy(want.astype(NUMPY_DTYPES[dtype]).astype(np.float64))
        assert_rule(name, got, want, lowp_grad, atol=2e-3)


def test_manual_seed_repeats_and_each_call_draws_afresh():
    rng = np.random.default_rng(3)
    q, k, v = (random_tensor(rng, (2, 33, 4, 32), torch.float32) for _ in range(3))

    def run():
        out = ct.flash_attn_func(q, k, v, dropout_p=0.3)
        return (out, *torch.autograd.grad(out.sum(), (q, k, v)))

    torch.manual_seed(11)
    first, second = run(), run()
    torch.manual_seed(11)
    again = run()
    for a, b, c in zip(first, again, second):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_varlen_against_the_reference_with_the_sequence_masks():
    rng = np.random.default_rng(5)
    lengths_q, lengths_k = [17, 0, 33], [23, 4, 40]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    q = random_tensor(rng, (int(cu_q[-1]), 4, 64), torch.float64)
    k, v = (random_tensor(rng, (int(cu_k[-1]), 2, 64), torch.float64) for _ in range(2))
    dout = torch.from_numpy(rng.standard_normal(q.shape))
    seed, offset = drawn_seed_offset(13, q)
    torch.manual_seed(13)
    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 40, dropout_p=0.25, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    options = dict(causal=True, dropout_p=0.25, seed=seed, offset=offset)
    ref, _ = reference.attention_varlen_reference(*(float64(t) for t in (q, k, v)), cu_q.numpy(), cu_k.numpy(),
                                                  **options)
    np.testing.assert_allclose(float64(out), ref, atol=1e-12)
    ref_grads = reference.attention_varlen_backward_reference(dout.numpy(), *(float64(t) for t in (q, k, v)),
                                                              cu_q.numpy(), cu_k.numpy(), **options)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(float64(got), want, atol=1e-6)  # P recomputed from the float32 lse


def test_gradcheck_in_float64():
    """The backward is the gradient of the forward with its mask held: the same seed and offset for
    every evaluation (the generator reseeded before each)."""
    rng = np.random.default_rng(17)
    q = random_tensor(rng, (1, 7, 2, 8), torch.float64)
    k, v = (random_tensor(rng, (1, 9, 1, 8), torch.float64) for _ in range(2))
    sinks = random_tensor(rng, (2,), torch.float64)

    def fixed_mask(q, k, v, sinks):
        torch.manual_seed(5)
        return ct.attention(q, k, v, causal=True, sinks=sinks, dropout_p=0.3)

    assert torch.autograd.gradcheck(fixed_mask, (q, k, v, sinks), atol=1e-5, rtol=1e-4)


def test_fake_outputs_match_the_cpu_ops():
    q, k, v = torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 32)
    sinks, slopes = torch.randn(2), torch.rand(2)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    rng = ct._dropout_rng(q)
    for s, a in ((sinks, slopes), (None, None)):
        options = (True, 0.125, -1, -1, 0.0, False, 0.2)
        out, lse = ct._dropout_forward(q, k, v, s, a, rng, *options)
        torch.library.opcheck(ct._dropout_forward, (q, k, v, s, a, rng, *options))
        torch.library.opcheck(ct._dropout_backward, (torch.randn(out.shape), q, k, v, out, lse, s, a, rng, *options))
        packed = (q[0], k[0], v[0])
        out, lse = ct._varlen_dropout_forward(*packed, cu, cu, s, a, rng, 5, 5, *options)
        torch.library.opcheck(ct._varlen_dropout_forward, (*packed, cu, cu, s, a, rng, 5, 5, *options))
        torch.library.opcheck(ct._varlen_dropout_backward,
                              (torch.randn(out.shape), *packed, out, lse, cu, cu, s, a, rng, 5, 5, *options))


# torch.compile's first use imports torch's own modules that call the deprecated torch.jit.script_method.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_fullgraph_draws_in_the_graph_and_matches_eager_random_ops():
    import torch._inductor.config as inductor_config

    rng = np.random.default_rng(9)
    q = random_tensor(rng, (1, 9, 2, 16), torch.float32)
    k, v = (random_tensor(rng, (1, 9, 1, 16), torch.float32) for _ in range(2))

    def step(q, k, v):
        return ct.attention(q, k, v, causal=True, dropout_p=0.3)

    torch.manual_seed(1)
    eager = step(q, k, v)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
    # Inductor's own random numbers differ from eager's; with its fallback the graph draws as
    # eager does, so the compiled forward and backward meet eager's bit for bit.
    with inductor_config.patch(fallback_random=True):
        compiled_step = torch.compile(step, fullgraph=True)
        torch.manual_seed(1)
        compiled = compiled_step(q, k, v)
        compiled_grads = torch.autograd.grad(compiled.sum(), (q, k, v))
        # The draw is part of the graph: the next call drops other elements.
        assert not torch.equal(compiled_step(q, k, v), compiled)
    assert torch.equal(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dropout_p, error, words", [
    (1.0, ValueError, r"dropout_p: expected a probability in \[0, 1\)"),
    (-0.5, ValueError, "dropout_p: expected a probability"),
    ("0.1", TypeError, "dropout_p: expected a real number"),
    (None, TypeError, "dropout_p: expected a real number"),
])
def test_bad_dropout_p_names_it(dropout_p, error, words):
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(error, match=words):
        ct.flash_attn_func(q, k, v, dropout_p=dropout_p)
    with pytest.raises(error, match=words):
        ct.attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8, dropout_p=dropout_p)


def test_dropout_refused_with_fp8_and_with_seqused():
    q = torch.randn(1, 8, 2, 16).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="dropout_p is not taken with FP8 inputs"):
        ct.flash_attn_func(q, q, q, dropout_p=0.1)
    x = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="dropout_p is not taken with seqused_q"):
        ct.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, dropout_p=0.1, seqused_q=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        ct.flash_attn_func(x[None], x[None], x[None], dropout_p=0.1, return_attn_probs=True)
