"""head_dim_v != head_dim on the GPU (DeepSeek's q/k 192 with v 128, and other pairs): forward and
backward of both kernel families against the float64 reference with docs/measuring.md's rule,
into NaN-filled outputs; masks, softcap, GQA, packed batches, deterministic mode, FP8 inputs and
the torch entry points."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

# (head_dim, head_dim_v): DeepSeek's prefill pair and one its sm90 backward kernel serves with
# columns to spare, v narrower or wider by a bucket or more, and neither a whole bucket.
PAIRS = [(192, 128), (160, 96), (128, 64), (64, 128), (256, 64), (40, 72)]
SEQLENS = [(17, 17), (113, 1023), (1023, 113), (257, 1)]
GROUPS = {"mha": (4, 4), "gqa": (4, 2)}


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def _inputs(rng, pair, seqlens, group="gqa", dtype_name="bfloat16", batch=2):
    from tests.gpu_reference import random_bshd

    (head_dim, head_dim_v), (seqlen_q, seqlen_k), (heads, heads_kv) = pair, seqlens, GROUPS[group]
    return (random_bshd((batch, seqlen_q, heads, head_dim), dtype_name, rng),
            random_bshd((batch, seqlen_k, heads_kv, head_dim), dtype_name, rng),
            random_bshd((batch, seqlen_k, heads_kv, head_dim_v), dtype_name, rng))


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_forward_and_backward_match_reference(pair, causal, seqlens, group, rng):
    from tests.gpu_reference import check_backward, check_forward

    dtype_name = "float16" if causal else "bfloat16"
    q, k, v = _inputs(rng, pair, seqlens, group, dtype_name)
    check_forward(q, k, v, causal, dtype_name)
    check_backward(q, k, v, causal, dtype_name, rng)


@pytest.mark.parametrize("options", [dict(window=(100, 20)), dict(causal=True, window=(64, -1)),
                                     dict(softcap=20.0), dict(causal=True, softcap=5.0, scale=0.07)],
                         ids=["window", "causal-window", "softcap", "causal-softcap-scale"])
@pytest.mark.parametrize("pair", [(192, 128), (64, 128)], ids=lambda p: f"{p[0]}-{p[1]}")
def test_masks_and_softcap(pair, options, rng):
    from tests.gpu_reference import check_backward, check_forward

    options = {"causal": False} | options
    causal = options.pop("causal")
    q, k, v = _inputs(rng, pair, (300, 517))
    check_forward(q, k, v, causal, "bfloat16", **options)
    check_backward(q, k, v, causal, "bfloat16", rng, **options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.usefixtures("causal_dq_order")
def test_deterministic_within_the_rule_and_bitwise_repeated(causal, rng):
    import cupy as cp

    import cuflash
    from tests.gpu_reference import check_backward, random_bshd

    q, k, v = _inputs(rng, (192, 128), (700, 700))
    check_backward(q, k, v, causal, "bfloat16", rng, deterministic=True)
    dout = random_bshd((*q.shape[:3], v.shape[3]), "bfloat16", rng)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for _ in range(4):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_batches(causal, rng):
    from tests.test_varlen_gpu import _check_varlen

    lengths_q, lengths_k = [300, 0, 17, 1000, 5], [310, 4, 0, 1000, 5]
    out, lse = _check_varlen(lengths_q, lengths_k, rng, head_dim=192, head_dim_v=128, causal=causal)
    assert out.shape == (sum(lengths_q), 4, 128)


@pytest.mark.parametrize("pair", [(192, 128), (64, 128)], ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_forward(pair, causal, rng):
    from tests.test_fp8_gpu import check, inputs, run

    q, k, v = inputs(rng, 2, 300, 517, 4, 2, pair[0], head_dim_v=pair[1])
    out, lse = run(q, k, v, causal=causal)
    assert out.shape == (2, 300, 4, pair[1])
    check(out, lse, q, k, v, "bfloat16", causal=causal)


def test_torch_autograd_and_flash_attn_func(rng):
    """flash_attn_func with torch CUDA tensors: out of v's head dim, gradients of each input's
    shape, both within the rule."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    from cuflash.torch import flash_attn_func
    from tests import gpu_reference as ref

    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    shapes = [(2, 200, 8, 192), (2, 333, 2, 192), (2, 333, 2, 128)]
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True) for s in shapes)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 200, 8, 128)
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    out.backward(dout)
    q64, k64, v64, do64 = (cp.from_dlpack(x.detach().double()) for x in (q, k, v, dout))
    options = {"causal": True, "scale": 1 / math.sqrt(192)}
    exact, _ = ref.attention(q64, k64, v64, **options)
    lowp, _ = ref.attention(q64, k64, v64, lowp="bfloat16", **options)
    ref.check_rule("out", cp.from_dlpack(out.detach().double()), exact, lowp, "bfloat16")
    exact = ref.attention_backward(q64, k64, v64, do64, **options)
    lowp = ref.attention_backward(q64, k64, v64, do64, lowp="bfloat16", **options)
    for name, x, e, lp in zip(("dq", "dk", "dv"), (q, k, v), exact, lowp):
        assert x.grad.shape == x.shape
        ref.check_rule(name, cp.from_dlpack(x.grad.double()), e, lp, "bfloat16")
