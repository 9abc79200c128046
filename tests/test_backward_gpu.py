"""Backward kernels against float64 reference gradients with docs/measuring.md's rule, on the GPU; the
PyTorch autograd / torch.compile / flash-attn entry points."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

HEAD_DIMS = [32, 64, 96, 128, 192, 256]
SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (113, 1023), (1023, 113), (257, 1)]
GROUPS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def _check_gradients(q, k, v, causal, dtype_name, rng):
    from tests.gpu_reference import check_backward

    check_backward(q, k, v, causal, dtype_name, rng)


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.usefixtures("family")  # each family runs its own backward
def test_backward_matches_reference(dtype_name, head_dim, causal, seqlens, group, rng):
    from tests.gpu_reference import random_bshd

    heads, heads_kv = GROUPS[group]
    seqlen_q, seqlen_k = seqlens
    q = random_bshd((2, seqlen_q, heads, head_dim), dtype_name, rng)
    k = random_bshd((2, seqlen_k, heads_kv, head_dim), dtype_name, rng)
    v = random_bshd((2, seqlen_k, heads_kv, head_dim), dtype_name, rng)
    _check_gradients(q, k, v, causal, dtype_name, rng)


@pytest.mark.usefixtures("family")
def test_backward_strided_inputs(rng):
    from tests.gpu_reference import random_bshd

    qkv = random_bshd((2, 300, 3, 4, 128), "bfloat16", rng)
    _check_gradients(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], True, "bfloat16", rng)


def test_backward_bad_inputs():
    import cupy as cp

    import cuflash

    q = cp.zeros((1, 8, 2, 64), cp.float16)
    lse = cp.zeros((1, 2, 8), cp.float32)
    with pytest.raises(ValueError, match="dout: expected shape"):
        cuflash.attention_backward(q[:, :4], q, q, q, q, lse)
    with pytest.raises(TypeError, match="lse: expected float32"):
        cuflash.attention_backward(q, q, q, q, q, lse.astype(cp.float16))
    with pytest.raises(ValueError, match="lse: expected shape"):
        cuflash.attention_backward(q, q, q, q, q, lse[:, :1])
    with pytest.raises(ValueError, match="dk: expected shape"):
        cuflash.attention_backward(q, q, q, q, q, lse, dk=cp.empty((1, 8, 1, 64), cp.float16))


@pytest.mark.parametrize("group", ["mha", "gqa"])
@pytest.mark.parametrize("seqlens", [(1023, 1023), (113, 1023), (1023, 113), (257, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.usefixtures("family", "causal_dq_order")
def test_deterministic_matches_reference_and_repeats_bitwise(head_dim, causal, seqlens, group, rng):
    import cupy as cp

    import cuflash
    from tests import gpu_reference as ref

    heads, heads_kv = GROUPS[group]
    q = ref.random_bshd((2, seqlens[0], heads, head_dim), "bfloat16", rng)
    k, v = (ref.random_bshd((2, seqlens[1], heads_kv, head_dim), "bfloat16", rng) for _ in range(2))
    dout = ref.random_bshd(q.shape, "bfloat16", rng)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    scale = 1 / math.sqrt(head_dim)
    q64, k64, v64, do64 = (ref.as_float64(x) for x in (q, k, v, dout))
    exact = ref.attention_backward(q64, k64, v64, do64, causal=causal, scale=scale)
    lowp = ref.attention_backward(q64, k64, v64, do64, causal=causal, scale=scale, lowp="bfloat16")
    for name, got, e, lp in zip(("dq", "dk", "dv"), first, exact, lowp):
        ref.check_rule(name, got, e, lp, "bfloat16")
    for _ in range(9):
        again = [cp.full_like(x, cp.nan) for x in first]
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                   dq=again[0], dk=again[1], dv=again[2])
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), name


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_long_sequence(head_dim, causal, deterministic, rng):
    """16k keys in float16: a dQ reduction whose error grows with the number of key blocks (as a
    fixed-point quantum does: docs/kernels.md, determinism)
    shows here, where dq itself is small, and not at the sweep's lengths."""
    from tests import gpu_reference as ref

    q, k, v = (ref.random_bshd((1, 16384, 2, head_dim), "float16", rng) for _ in range(3))
    ref.check_backward(q, k, v, causal, "float16", rng, deterministic=deterministic)


def test_deterministic_heads_in_groups(rng):
    """sm90's deterministic mode without a causal mask interleaves the key blocks of as many heads
    as fill one wave (here 132 SMs // 33 key blocks = 4 of 6 heads, so a second group of 2, GQA):
    within the rule and bitwise equal over 3 runs."""
    import cupy as cp

    import cuflash
    from tests import gpu_reference as ref

    q = ref.random_bshd((1, 4224, 6, 64), "float16", rng)
    k, v = (ref.random_bshd((1, 4224, 3, 64), "float16", rng) for _ in range(2))
    ref.check_backward(q, k, v, False, "float16", rng, deterministic=True)
    dout = ref.random_bshd(q.shape, "float16", rng)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True)
    for _ in range(2):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), name


@pytest.mark.parametrize("causal", [False, True])
def test_torch_training_step_matches_sdpa(causal):
    torch = pytest.importorskip("torch")
    import cuflash.torch as cft

    gen = torch.Generator(device="cuda").manual_seed(3)
    shape_q, shape_kv = (2, 333, 8, 128), (2, 333, 2, 128)
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = cft.attention(q, k, v, causal=causal)
    out.backward(dout)
    grads = [x.grad for x in (q, k, v)]

    def sdpa(dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in xs), is_causal=causal, enable_gqa=True).transpose(1, 2)
        o.backward(dout.to(dtype))
        return o, [x.grad for x in xs]

    out64, grads64 = sdpa(torch.float64)
    out16, grads16 = sdpa(torch.bfloat16)
    for name, got, exact, lowp in zip(("out", "dq", "dk", "dv"), [out] + grads, [out64] + grads64,
                                      [out16] + grads16):
        err = (got.double() - exact).abs().max().item()
        bound = 2 * (lowp.double() - exact).abs().max().item() + 1e-3
        assert err <= bound, (name, err, bound)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # inductor: torch.compile's default
def test_torch_compile_fullgraph_forward_and_backward(backend):
    torch = pytest.importorskip("torch")
    import cuflash.torch as cft

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(128, 3 * 128, device="cuda", dtype=torch.bfloat16)

        def forward(self, x):
            q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 64).unbind(2)
            return cft.attention(q, k, v, causal=True).sum()

    block = Block()
    x = torch.randn(2, 100, 128, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    loss = compiled(x)
    loss.backward()
    compiled_grad = block.proj.weight.grad.clone()
    block.proj.weight.grad = None
    block(x).backward()
    # dQ is summed with atomics, so the two runs agree to rounding, not bitwise.
    diff = (compiled_grad.float() - block.proj.weight.grad.float()).abs().max().item()
    assert diff <= 1e-2 * block.proj.weight.grad.float().abs().max().item()


def test_flash_attn_func_deterministic_gradients_repeat_bitwise():
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 700, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 900, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)

    def gradients():
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        flash_attn_func(*xs, causal=True, deterministic=True).backward(dout)
        return [x.grad for x in xs]

    first = gradients()
    for _ in range(3):
        for a, b in zip(first, gradients()):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_flash_attn_func_signature_and_refusals():
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_func

    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    out = flash_attn_func(q, q, q, causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    for kwargs, name in (({"dropout_p": 0.1}, "dropout_p"), ({"return_attn_probs": True}, "return_attn_probs")):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_func(q, q, q, **kwargs)
    # alibi_slopes and sinks (FlashAttention-4's learnable_sink) reach the kernels: each changes
    # the output, and the two names of the sinks give the same one.
    slopes, sinks = torch.full((2,), 0.5, device="cuda"), torch.full((2,), 2.0, device="cuda")
    biased = flash_attn_func(q, q, q, causal=True, alibi_slopes=slopes)
    sunk = flash_attn_func(q, q, q, causal=True, learnable_sink=sinks)
    assert not torch.equal(biased, out) and not torch.equal(sunk, out)
    assert torch.equal(sunk, flash_attn_func(q, q, q, causal=True, sinks=sinks))
