"""Forward kernels against the float64 reference with the 2x + atol rule, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

# Every test here runs the forward, once per kernel family the device has (conftest.family).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

HEAD_DIMS = [32, 64, 80, 96, 128, 160, 192, 256]
SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (4224, 4224), (113, 1023), (1023, 113),
           (1, 4224), (4224, 17)]
GROUPS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}  # (heads_q, heads_kv)


@pytest.fixture
def rng(request):
    # Fresh inputs per test, reproducible from the test id.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_forward_matches_reference(dtype_name, head_dim, causal, seqlens, group, rng):
    from tests.gpu_reference import check_forward, random_bshd

    heads, heads_kv = GROUPS[group]
    seqlen_q, seqlen_k = seqlens
    batch = 2 if seqlen_q * seqlen_k < 1 << 20 else 1
    q = random_bshd((batch, seqlen_q, heads, head_dim), dtype_name, rng)
    k = random_bshd((batch, seqlen_k, heads_kv, head_dim), dtype_name, rng)
    v = random_bshd((batch, seqlen_k, heads_kv, head_dim), dtype_name, rng)
    check_forward(q, k, v, causal, dtype_name)


@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_without_copy(causal, rng):
    """q/k/v as slices of a packed (b, s, 3, h, d) buffer and of a (b, h, s, d) transpose."""
    from tests.gpu_reference import check_forward, random_bshd

    qkv = random_bshd((2, 300, 3, 4, 128), "bfloat16", rng)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    v = random_bshd((2, 4, 300, 128), "bfloat16", rng).transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous and not v.flags.c_contiguous
    check_forward(q, k, v, causal, "bfloat16")


def test_softmax_scale_is_used(rng):
    from tests.gpu_reference import check_forward, random_bshd

    q, k, v = (random_bshd((1, 200, 2, 64), "float16", rng) for _ in range(3))
    check_forward(q, k, v, True, "float16", scale=0.37)


def test_rows_without_keys_give_zero_and_minus_inf(rng):
    """Causal with seqlen_q > seqlen_k: the first rows see no key (bottom-right alignment)."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import check_forward, random_bshd

    q = random_bshd((1, 300, 2, 64), "bfloat16", rng)
    k, v = (random_bshd((1, 100, 2, 64), "bfloat16", rng) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert bool(cp.all(out[:, :200].view(cp.uint16) == 0))
    assert bool(cp.all(cp.isneginf(lse[:, :, :200])))
    assert bool(cp.all(cp.isfinite(lse[:, :, 200:])))
    check_forward(q, k, v, True, "bfloat16")


@pytest.mark.parametrize("causal", [False, True])
def test_torch_in_torch_out_on_current_stream(causal):
    torch = pytest.importorskip("torch")
    import cuflash

    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 513, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 700, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 700, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 513)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.double().transpose(1, 2) for x in (q, k, v)), is_causal=False, enable_gqa=True,
        attn_mask=None if not causal else torch.ones(513, 700, dtype=torch.bool, device="cuda").tril(700 - 513),
    ).transpose(1, 2)
    lowp = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), enable_gqa=True,
        attn_mask=None if not causal else torch.ones(513, 700, dtype=torch.bool, device="cuda").tril(700 - 513),
    ).transpose(1, 2)
    err = (out.double() - expected).abs().max().item()
    base = (lowp.double() - expected).abs().max().item()
    assert err <= 2 * base + 1e-3, (err, base)


def test_torch_strided_view_is_zero_copy():
    torch = pytest.importorskip("torch")
    import cuflash

    qkv = torch.randn(1, 257, 3, 4, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    out = torch.full_like(q, float("nan"))
    result = cuflash.attention(q, k, v, out=out)
    assert result is out and not torch.isnan(out).any()
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.double().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert (out.double() - expected).abs().max().item() < 2e-3


def test_jax_in_cupy_out():
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import cupy as cp

    import cuflash

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (1, 130, 2, 64), dtype=jax.numpy.float16)
    out = cuflash.attention(q, q, q)
    assert isinstance(out, cp.ndarray) and out.shape == (1, 130, 2, 64)
    from tests import gpu_reference as ref

    q64 = ref.as_float64(cp.from_dlpack(q))
    expected, _ = ref.attention(q64, q64, q64, causal=False, scale=1 / 8)
    lowp, _ = ref.attention(q64, q64, q64, causal=False, scale=1 / 8, lowp="float16")
    ref.check_rule("out", out, expected, lowp, "float16")


def test_misaligned_strides_are_copied_not_wrong(rng):
    """A head_dim-8 view whose row stride (9 heads x 8) is not a multiple of 16 bytes... is fine;
    a pointer offset by one element is not 16-byte aligned and takes the copy path."""
    from tests.gpu_reference import check_forward, random_bshd

    base = random_bshd((1, 100 * 2 * 64 + 8), "float16", rng)[0]
    q = base[8:].reshape(1, 100, 2, 64)  # 16-byte aligned (8 halves)
    shifted = random_bshd((1, 100 * 2 * 64 + 1), "float16", rng)[0][1:].reshape(1, 100, 2, 64)
    assert shifted.data.ptr % 16 != 0
    check_forward(shifted, q, q, False, "float16")
