"""Sliding windows and softcap in the forward and backward kernels against the float64
reference with docs/measuring.md's rule, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


# (dtype, head_dim, seqlen_q, seqlen_k, heads, heads_kv, causal, window)
WINDOWS = [
    ("bfloat16", 128, 1023, 1023, 4, 4, False, (100, -1)),   # left only
    ("float16", 64, 1023, 1023, 4, 2, False, (-1, 77)),      # right only, GQA
    ("bfloat16", 96, 1023, 1023, 4, 1, False, (130, 45)),    # both sides, MQA
    ("float16", 192, 700, 1500, 4, 4, False, (64, 64)),      # seqlen_q < seqlen_k
    ("bfloat16", 256, 1500, 700, 4, 2, False, (33, 0)),      # seqlen_q > seqlen_k: rows with no key
    ("bfloat16", 128, 1023, 1023, 4, 4, True, (200, -1)),    # causal with a left window
    ("float16", 128, 113, 1023, 4, 4, True, (17, 5)),        # causal overrides right
    ("bfloat16", 64, 300, 100, 2, 2, True, (10, -1)),        # causal, the first 200 rows see nothing
    ("bfloat16", 128, 257, 257, 2, 2, False, (0, 0)),        # the diagonal alone
    ("float16", 128, 17, 17, 2, 2, False, (-1, 0)),          # the causal mask, run as causal
    ("bfloat16", 128, 1, 4224, 2, 2, False, (100, -1)),      # one query
    ("bfloat16", 128, 4224, 4224, 2, 2, True, (512, -1)),    # long: most key blocks skipped
    ("bfloat16", 128, 4224, 4224, 2, 1, False, (1000, 1000)),
    # Tiles taller than a key block (sm90: 192 rows over 128 keys at d64, 128 over 64 at d256):
    # the band's edges cross a tile's consumer warpgroups in different key blocks.
    ("float16", 64, 4224, 4224, 2, 2, True, (300, -1)),
    ("bfloat16", 256, 1100, 1100, 2, 2, False, (200, 70)),
    ("float16", 256, 129, 129, 2, 2, False, (5000, 5000)),   # wider than the sequence: plain kernel
]


def _window_id(case) -> str:
    dtype_name, head_dim, seqlen_q, seqlen_k, heads, heads_kv, causal, window = case
    return (f"{dtype_name[0]}{head_dim}-{seqlen_q}x{seqlen_k}-h{heads}.{heads_kv}-{'causal' if causal else 'full'}-"
            f"w{window[0]}.{window[1]}")


def _window_inputs(case, rng):
    """Fresh q, k, v for a WINDOWS case."""
    from tests.gpu_reference import random_bshd

    dtype_name, head_dim, seqlen_q, seqlen_k, heads, heads_kv, _, _ = case
    q = random_bshd((2, seqlen_q, heads, head_dim), dtype_name, rng)
    k, v = (random_bshd((2, seqlen_k, heads_kv, head_dim), dtype_name, rng) for _ in range(2))
    return q, k, v


@pytest.mark.usefixtures("family")  # forward: once per kernel family (conftest.family)
@pytest.mark.parametrize("case", WINDOWS, ids=_window_id)
def test_window_matches_reference(case, rng):
    from tests.gpu_reference import check_forward

    dtype_name, causal, window = case[0], case[6], case[7]
    check_forward(*_window_inputs(case, rng), causal, dtype_name, window=window)


# (dtype, head_dim, seqlen_q, seqlen_k, causal, window, softcap, softmax_scale); scale 1 makes
# the scores large enough for the cap to bend them.
SOFTCAPS = [
    ("bfloat16", 128, 1023, 1023, False, (-1, -1), 5.0, 1.0),
    ("float16", 128, 1023, 1023, True, (-1, -1), 5.0, 1.0),
    ("bfloat16", 64, 1500, 700, True, (-1, -1), 30.0, None),   # rows with no key
    ("float16", 96, 113, 1023, False, (64, 16), 2.0, 0.5),
    ("bfloat16", 192, 777, 777, True, (128, -1), 50.0, None),  # Gemma 2's local layers
    ("float16", 256, 333, 333, False, (-1, -1), 1.0, None),
    ("bfloat16", 64, 17, 4224, False, (-1, -1), 0.5, 1.0),
]


def _softcap_id(case) -> str:
    dtype_name, head_dim, seqlen_q, seqlen_k, causal, window, softcap, _ = case
    return (f"{dtype_name[0]}{head_dim}-{seqlen_q}x{seqlen_k}-{'causal' if causal else 'full'}-"
            f"w{window[0]}.{window[1]}-cap{softcap}")


def _softcap_inputs(case, rng):
    """Fresh q (4 heads), k and v (2 heads) for a SOFTCAPS case."""
    from tests.gpu_reference import random_bshd

    dtype_name, head_dim, seqlen_q, seqlen_k = case[:4]
    q = random_bshd((2, seqlen_q, 4, head_dim), dtype_name, rng)
    k, v = (random_bshd((2, seqlen_k, 2, head_dim), dtype_name, rng) for _ in range(2))
    return q, k, v


@pytest.mark.usefixtures("family")  # forward: once per kernel family (conftest.family)
@pytest.mark.parametrize("case", SOFTCAPS, ids=_softcap_id)
def test_softcap_matches_reference(case, rng):
    from tests.gpu_reference import check_forward

    dtype_name, _, _, _, causal, window, softcap, scale = case
    check_forward(*_softcap_inputs(case, rng), causal, dtype_name, scale=scale, window=window, softcap=softcap)


@pytest.mark.usefixtures("family")  # forward: once per kernel family (conftest.family)
def test_window_rows_without_keys_give_zero_and_minus_inf(rng):
    """window (-1, 2) with seqlen_q 300 > seqlen_k 100: query i sees keys up to i - 198, so rows
    0..197 see none."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import random_bshd

    q = random_bshd((1, 300, 2, 64), "bfloat16", rng)
    k, v = (random_bshd((1, 100, 2, 64), "bfloat16", rng) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, window=(-1, 2), softcap=10.0, return_lse=True)
    assert bool(cp.all(out[:, :198].view(cp.uint16) == 0))
    assert bool(cp.all(cp.isneginf(lse[:, :, :198])))
    assert bool(cp.all(cp.isfinite(lse[:, :, 198:])))


@pytest.mark.usefixtures("family")  # each family runs its own backward
@pytest.mark.parametrize("case", WINDOWS, ids=_window_id)
def test_window_backward_matches_reference(case, rng):
    from tests.gpu_reference import check_backward

    dtype_name, causal, window = case[0], case[6], case[7]
    check_backward(*_window_inputs(case, rng), causal, dtype_name, rng, window=window)


@pytest.mark.usefixtures("family")  # each family runs its own backward
@pytest.mark.parametrize("case", SOFTCAPS, ids=_softcap_id)
def test_softcap_backward_matches_reference(case, rng):
    from tests.gpu_reference import check_backward

    dtype_name, _, _, _, causal, window, softcap, scale = case
    check_backward(*_softcap_inputs(case, rng), causal, dtype_name, rng, scale=scale, window=window,
                   softcap=softcap)


@pytest.mark.usefixtures("family")  # sm90 takes turns, sm80 walks
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_deterministic_window_repeats_bitwise(softcap, rng):
    """deterministic=True with a window, with and without a softcap (GQA): within the rule, and
    bitwise equal over 10 runs."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import check_backward, random_bshd

    options = {"causal": True, "window": (300, -1), "softcap": softcap}
    q = random_bshd((2, 1100, 4, 128), "bfloat16", rng)
    k, v = (random_bshd((2, 1100, 2, 128), "bfloat16", rng) for _ in range(2))
    check_backward(q, k, v, options["causal"], "bfloat16", rng, window=options["window"],
                   softcap=options["softcap"], deterministic=True)
    dout = random_bshd(q.shape, "bfloat16", rng)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for _ in range(9):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), name


@pytest.mark.usefixtures("family")
def test_window_backward_rows_without_keys_give_zero_gradients(rng):
    """Rows 0..197 see no key (window (-1, 2), seqlen_q 300 > seqlen_k 100): their dq is 0, and no
    NaN reaches dk or dv from their lse = -inf."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import random_bshd

    q, dout = (random_bshd((1, 300, 2, 64), "bfloat16", rng) for _ in range(2))
    k, v = (random_bshd((1, 100, 2, 64), "bfloat16", rng) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, window=(-1, 2), softcap=10.0, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, window=(-1, 2), softcap=10.0)
    assert bool(cp.all(dq[:, :198].view(cp.uint16) == 0))
    for g in (dq, dk, dv):
        assert not bool(cp.isnan(g.astype(cp.float32)).any())


def test_flash_attn_func_window_and_softcap():
    """flash-attn's entry point with window_size and softcap, forward and autograd backward."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    from cuflash.torch import flash_attn_func
    from tests import gpu_reference as ref

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True, window_size=(64, 64), softcap=5.0)
    q64, k64, v64 = (cp.from_dlpack(x.detach().double()) for x in (q, k, v))
    options = {"causal": True, "window": (64, 64), "softcap": 5.0, "scale": 128 ** -0.5}
    expected, _ = ref.attention(q64, k64, v64, **options)
    lowp, _ = ref.attention(q64, k64, v64, lowp="bfloat16", **options)
    ref.check_rule("out", cp.from_dlpack(out.detach().double()), expected, lowp, "bfloat16")
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    out.backward(dout)
    do64 = cp.from_dlpack(dout.double())
    exact = ref.attention_backward(q64, k64, v64, do64, **options)
    lowp = ref.attention_backward(q64, k64, v64, do64, lowp="bfloat16", **options)
    for name, x, e, lp in zip(("dq", "dk", "dv"), (q, k, v), exact, lowp):
        ref.check_rule(name, cp.from_dlpack(x.grad.double()), e, lp, "bfloat16")
