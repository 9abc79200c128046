"""CPU tests of cuflash._cpu.reference: the naive reference, the blockwise algorithm, FLOPs, the 2x rule."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash._cpu.reference import (
    attention_blockwise,
    attention_flops,
    attention_reference,
    max_error_bound,
)
from tests.finite_differences import finite_difference_gradients

# Any RuntimeWarning (overflow, invalid value, divide by zero) is a failure.
pytestmark = pytest.mark.filterwarnings("error")


def make_qkv(
    seed: int,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads: int,
    heads_kv: int,
    head_dim: int,
    dtype: np.dtype = np.float64,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fresh random normal q, k, v in BSHD layout (never zeros)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    return tuple(x.astype(dtype) for x in (q, k, v))


def direct_attention(q, k, v, causal, scale):
    """Attention with explicit Python loops and math.exp: independent of the vectorised code."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = np.zeros((b, sq, hq, v.shape[3]))
    lse = np.full((b, hq, sq), -math.inf)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                scores = {
                    j: scale * sum(float(q[bi, i, h, c]) * float(k[bi, j, kh, c]) for c in range(d))
                    for j in keys
                }
                total = sum(math.exp(s) for s in scores.values())
                lse[bi, h, i] = math.log(total)
                for c in range(v.shape[3]):
                    out[bi, i, h, c] = sum(
                        math.exp(scores[j]) / total * float(v[bi, j, kh, c]) for j in keys
                    )
    return out, lse


def masked_rows(seqlen_q: int, seqlen_k: int, causal: bool) -> np.ndarray:
    """Boolean (seqlen_q,): rows with no visible key under bottom-right causal masking."""
    rows = np.arange(seqlen_q)
    return (rows + seqlen_k - seqlen_q < 0) if causal else np.zeros(seqlen_q, bool)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [1, 2])
def test_reference_matches_direct_formula(causal, heads_kv):
    q, k, v = make_qkv(0, batch=1, seqlen_q=3, seqlen_k=5, heads=2, heads_kv=heads_kv, head_dim=4)
    out, lse = attention_reference(q, k, v, causal=causal)
    out_d, lse_d = direct_attention(q, k, v, causal, 1 / math.sqrt(4))
    np.testing.assert_allclose(out, out_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_d, rtol=1e-12, atol=1e-12)
    assert out.dtype == lse.dtype == np.float64
    assert out.shape == (1, 3, 2, 4) and lse.shape == (1, 2, 3)


def test_reference_direct_formula_with_masked_rows():
    q, k, v = make_qkv(1, batch=2, seqlen_q=5, seqlen_k=3, heads=2, heads_kv=1, head_dim=3)
    out, lse = attention_reference(q, k, v, causal=True, softmax_scale=0.7)
    out_d, lse_d = direct_attention(q, k, v, True, 0.7)
    np.testing.assert_allclose(out, out_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_d))
    np.testing.assert_allclose(lse, lse_d, rtol=1e-12, atol=1e-12)


SEQLENS = [(1, 1), (17, 17), (113, 67), (67, 113), (1, 64), (64, 1), (128, 128)]
BLOCKS = [(64, 64), (16, 48), (7, 5)]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("heads,heads_kv", HEADS)
def test_blockwise_matches_reference(causal, seqlen_q, seqlen_k, block_m, block_n, heads, heads_kv):
    seed = hash((causal, seqlen_q, seqlen_k, block_m, block_n, heads, heads_kv)) % 2**32
    q, k, v = make_qkv(seed, 2, seqlen_q, seqlen_k, heads, heads_kv, head_dim=40)
    ref, lse_ref = attention_reference(q, k, v, causal=causal)
    out, lse = attention_blockwise(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert out.shape == ref.shape == (2, seqlen_q, heads, 40)
    assert lse.shape == lse_ref.shape == (2, heads, seqlen_q)
    assert out.dtype == lse.dtype == np.float64
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("head_dim", [8, 40, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_head_dims(head_dim, causal):
    q, k, v = make_qkv(head_dim, 2, 113, 67, 6, 3, head_dim)
    ref, lse_ref = attention_reference(q, k, v, causal=causal)
    out, lse = attention_blockwise(q, k, v, causal=causal, block_m=32, block_n=24)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-10, atol=1e-12)


def test_blockwise_float32():
    q, k, v = make_qkv(7, 2, 97, 131, 4, 2, 64)
    ref, lse_ref = attention_reference(q, k, v, causal=True)
    out, lse = attention_blockwise(q, k, v, causal=True, dtype=np.float32)
    assert out.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_blockwise_long_sequence():
    q, k, v = make_qkv(11, 1, 4224, 4224, 1, 1, 64)
    ref, lse_ref = attention_reference(q, k, v, causal=True)
    out, lse = attention_blockwise(q, k, v, causal=True, block_m=128, block_n=128)
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 67), (64, 1), (5, 3), (9, 0)])
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_fully_masked_rows(seqlen_q, seqlen_k, impl):
    q, k, v = make_qkv(3, 2, seqlen_q, seqlen_k, 4, 2, 16)
    if impl == "reference":
        out, lse = attention_reference(q, k, v, causal=True)
    else:
        out, lse = attention_blockwise(q, k, v, causal=True, block_m=16, block_n=16)
    dead = masked_rows(seqlen_q, seqlen_k, causal=True)
    assert dead.any()
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, dead] == 0).all()
    assert np.isneginf(lse[..., dead]).all()
    assert np.isfinite(lse[..., ~dead]).all()
    assert (np.abs(out[:, ~dead]) > 0).any() or not (~dead).any()


@pytest.mark.parametrize("impl", [attention_reference, attention_blockwise])
def test_softmax_scale_honoured(impl):
    q, k, v = make_qkv(5, 1, 33, 41, 2, 2, 16)
    scale = 0.31
    out, lse = impl(q, k, v, softmax_scale=scale)
    # Scaling q by scale / default_scale with the default scale is the same attention.
    out2, lse2 = impl(q * (scale * 4.0), k, v)
    np.testing.assert_allclose(out, out2, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, lse2, rtol=1e-10, atol=1e-12)
    out3, _ = impl(q, k, v)
    assert np.abs(out - out3).max() > 1e-3


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_baseline(dtype, causal):
    q, k, v = make_qkv(9, 2, 67, 113, 4, 2, 64, dtype=dtype)
    ref, lse_ref = attention_reference(q, k, v, causal=causal)
    lowp, lse_lowp = attention_reference(q, k, v, causal=causal, dtype=dtype)
    assert lowp.dtype == dtype and lse_lowp.dtype == np.float32
    diff = np.abs(lowp.astype(np.float64) - ref).max()
    assert 0 < diff < 1e-2 * np.abs(ref).max()
    np.testing.assert_allclose(lse_lowp, lse_ref, rtol=1e-2)
    # The correctness rule: float64 result passes, a float32 blockwise result passes,
    # a perturbed one fails.
    ok, err, bound = max_error_bound(ref, ref, lowp, atol=1e-5)
    assert ok and err == 0 and bound > 0
    out32, _ = attention_blockwise(q, k, v, causal=causal, dtype=np.float32)
    assert max_error_bound(out32, ref, lowp, atol=1e-5)[0]
    assert not max_error_bound(ref + 3 * diff, ref, lowp, atol=1e-5)[0]


def test_max_error_bound_nan_and_inf():
    ref = np.array([1.0, -np.inf, 2.0])
    ok, err, bound = max_error_bound(np.array([1.0, -np.inf, 2.1]), ref, np.array([1.0, -np.inf, 2.0]))
    assert not ok and err == pytest.approx(0.1) and bound == 0
    ok, err, _ = max_error_bound(np.array([1.0, -np.inf, 2.05]), ref, np.array([1.0, -np.inf, 2.1]))
    assert ok and err == pytest.approx(0.05)
    ok, err, _ = max_error_bound(np.array([np.nan, -np.inf, 2.0]), ref, ref, atol=1.0)
    assert not ok and math.isnan(err)


def test_attention_flops():
    assert attention_flops(1, 1, 1, 1, 1) == 4.0
    assert attention_flops(2, 16, 1024, 1024, 128) == 4.0 * 2 * 16 * 1024 * 1024 * 128
    assert attention_flops(2, 16, 1024, 1024, 128, causal=True) == 2.0 * 2 * 16 * 1024 * 1024 * 128
    fwd = attention_flops(1, 16, 16384, 16384, 128, causal=True)
    assert attention_flops(1, 16, 16384, 16384, 128, causal=True, mode="bwd") == 2.5 * fwd
    assert attention_flops(1, 16, 16384, 16384, 128, causal=True, mode="fwd_bwd") == 3.5 * fwd
    assert attention_flops(3, 5, 7, 11, 13) == 4 * 3 * 5 * 7 * 11 * 13
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 1, 1, 1, 1, mode="backward")


@pytest.mark.parametrize("impl", [attention_reference, attention_blockwise])
def test_bad_inputs(impl):
    q, k, v = make_qkv(0, 1, 8, 8, 4, 3, 16)
    with pytest.raises(ValueError, match="heads_kv"):
        impl(q, k, v)
    q, k, v = make_qkv(0, 1, 8, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="k: expected head_dim"):
        impl(q, k[..., :8], v)
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        impl(q[0], k, v)
    with pytest.raises(ValueError, match="v: expected"):
        impl(q, k, v[:, :4])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", [((1, 5, 2, 8), (1, 7, 2, 8)), ((2, 6, 4, 8), (2, 4, 1, 8))],
                         ids=["mha", "mqa"])
def test_backward_reference_matches_finite_differences(causal, shapes):
    """d/dx sum(out * dout), central differences in float64, for q, k and v."""
    from cuflash._cpu.reference import attention_backward_reference

    rng = np.random.default_rng()
    q = rng.standard_normal(shapes[0])
    k, v = rng.standard_normal(shapes[1]), rng.standard_normal(shapes[1])
    dout = rng.standard_normal(q.shape)
    grads = attention_backward_reference(dout, q, k, v, causal=causal, softmax_scale=0.7)

    def loss(q_, k_, v_):
        out, _ = attention_reference(q_, k_, v_, causal=causal, softmax_scale=0.7)
        return float((out * dout).sum())

    for got, numeric in zip(grads, finite_difference_gradients(loss, [q, k, v])):
        np.testing.assert_allclose(got, numeric, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (3, 0), 0.0),
                                                     (False, (2, 1), 4.0)])
def test_backward_from_lse_equals_the_reference(causal, window, softcap):
    """17 queries against 9 keys: under the windows some rows see no key (lse = -inf)."""
    from cuflash._cpu.reference import attention_backward_from_lse, attention_backward_reference

    rng = np.random.default_rng()
    q = rng.standard_normal((2, 17, 4, 8))
    k, v = rng.standard_normal((2, 9, 2, 8)), rng.standard_normal((2, 9, 2, 8))
    dout = rng.standard_normal(q.shape)
    options = dict(causal=causal, window=window, softcap=softcap, softmax_scale=0.6)
    out, lse = attention_reference(q, k, v, **options)
    got = attention_backward_from_lse(dout, q, k, v, out, lse, **options)
    for got_x, want in zip(got, attention_backward_reference(dout, q, k, v, **options)):
        np.testing.assert_allclose(got_x, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_backward_from_lse_splits_over_key_blocks(softcap):
    """With the whole attention's out and lse, each key block's gradients are its share of the
    whole's: dq sums over the blocks, dk and dv are the blocks' rows."""
    from cuflash._cpu.reference import attention_backward_from_lse, attention_backward_reference

    rng = np.random.default_rng()
    q = rng.standard_normal((1, 13, 2, 8))
    k, v = rng.standard_normal((1, 11, 2, 8)), rng.standard_normal((1, 11, 2, 8))
    dout = rng.standard_normal(q.shape)
    out, lse = attention_reference(q, k, v, softcap=softcap)
    expected = attention_backward_reference(dout, q, k, v, softcap=softcap)
    dq = np.zeros_like(q)
    for keys in (slice(0, 4), slice(4, 11)):
        block = attention_backward_from_lse(dout, q, k[:, keys], v[:, keys], out, lse, softcap=softcap)
        dq += block[0]
        for got, want in zip(block[1:], expected[1:]):
            np.testing.assert_allclose(got, want[:, keys], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dq, expected[0], rtol=1e-10, atol=1e-12)
