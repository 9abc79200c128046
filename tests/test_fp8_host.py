"""FP8 (e4m3) on the host: the NumPy path of attention and attention_varlen against the float64
reference on the dequantized inputs, the FP8 baseline of the reference, quantize_fp8's NumPy path
(and its kernel compiled for sm_80 and sm_90a), and bad FP8 input refused before any launch."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._core import dispatch, kernels
from cuflash import quantize
from cuflash._cpu import reference

E4M3 = ml_dtypes.float8_e4m3fn


def fp8(shape, rng, spread=2.0):
    """Fresh random e4m3 values (normal, times ``spread``) and nothing else."""
    return (rng.standard_normal(shape) * spread).astype(E4M3)


def descales(shape, rng):
    """Per-(batch, heads_kv) descales that differ from head to head."""
    return rng.uniform(0.05, 2.0, shape).astype(np.float32)


def exact(q, k, v, dq, dk, dv, cu_seqlens=None, **options):
    """The float64 reference of an FP8 call on its dequantized inputs."""
    cu_q, cu_k = cu_seqlens or (None, None)
    deq = (reference.dequantize(q, dq, cu_q), reference.dequantize(k, dk, cu_k), reference.dequantize(v, dv, cu_k))
    if cu_seqlens:
        return reference.attention_varlen_reference(*deq, cu_q, cu_k, **options)
    return reference.attention_reference(*deq, **options)


def assert_rounded_from(out, ref, dtype):
    """``out`` is ``ref`` rounded to ``dtype`` (the NumPy path computes in float64, then casts)."""
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float64), ref.astype(dtype).astype(np.float64))


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (False, (5, 3), 0.0), (True, (-1, -1), 20.0)])
@pytest.mark.parametrize("shape_q, shape_kv", [((2, 17, 4, 64), (2, 29, 2, 64)), ((1, 33, 3, 80), (1, 9, 1, 80))])
def test_numpy_fp8_forward_is_the_reference_on_dequantized_inputs(causal, window, softcap, shape_q, shape_kv):
    rng = np.random.default_rng()
    q, k, v = fp8(shape_q, rng), fp8(shape_kv, rng), fp8(shape_kv, rng)
    dq, dk, dv = (descales(shape_kv[:1] + shape_kv[2:3], rng) for _ in range(3))
    options = {"causal": causal, "window": window, "softcap": softcap}
    out, lse = cuflash.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, return_lse=True, **options)
    ref, ref_lse = exact(q, k, v, dq, dk, dv, **options)
    assert_rounded_from(out, ref, ml_dtypes.bfloat16)
    np.testing.assert_allclose(lse, ref_lse.astype(np.float32), rtol=1e-6)


def test_a_descale_applied_to_the_wrong_head_fails():
    rng = np.random.default_rng()
    q, k, v = fp8((1, 24, 4, 64), rng), fp8((1, 24, 2, 64), rng), fp8((1, 24, 2, 64), rng)
    dq, dk, dv = (np.array([[0.25, 1.5]], np.float32) * rng.uniform(0.9, 1.1) for _ in range(3))
    out = cuflash.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv).astype(np.float64)
    right = exact(q, k, v, dq, dk, dv)[0]
    swapped = exact(q, k, v, dq, dk, dv[:, ::-1])[0]
    bound = reference.max_error_bound(out, right, right.astype(ml_dtypes.bfloat16))[2]
    assert reference.max_error_bound(out, right, right.astype(ml_dtypes.bfloat16))[0]
    assert np.abs(out - swapped).max() > 10 * bound


def test_scalar_and_default_descales_and_float16_out():
    rng = np.random.default_rng()
    q, k, v = (fp8((2, 9, 2, 32), rng) for _ in range(3))
    out = cuflash.attention(q, k, v, descale_q=0.5, descale_k=np.float32(2.0), out_dtype=np.float16)
    assert_rounded_from(out, exact(q, k, v, 0.5, 2.0, 1.0)[0], np.float16)
    assert cuflash.attention(q, k, v).dtype == np.dtype(ml_dtypes.bfloat16)
    assert cuflash.attention(q, k, v, out_dtype="float16").dtype == np.float16


def test_uint8_bytes_declared_e4m3_equal_float8_arrays():
    rng = np.random.default_rng()
    q, k, v = (fp8((1, 12, 2, 64), rng) for _ in range(3))
    dk = descales((1, 2), rng)
    expected = cuflash.attention(q, k, v, causal=True, descale_k=dk)
    got = cuflash.attention(*(x.view(np.uint8) for x in (q, k, v)), causal=True, descale_k=dk, dtype="e4m3")
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_out_is_written_in_out_dtype():
    rng = np.random.default_rng()
    q, k, v = (fp8((1, 8, 2, 64), rng) for _ in range(3))
    out = np.full(q.shape, np.nan, np.float16)
    assert cuflash.attention(q, k, v, out=out, out_dtype="float16") is out
    assert_rounded_from(out, exact(q, k, v, 1.0, 1.0, 1.0)[0], np.float16)


def test_varlen_fp8_per_sequence_descales_with_empty_sequences():
    rng = np.random.default_rng()
    lengths_q, lengths_k = [5, 0, 7, 3], [4, 6, 0, 9]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q, k, v = fp8((cu_q[-1], 4, 64), rng), fp8((cu_k[-1], 2, 64), rng), fp8((cu_k[-1], 2, 64), rng)
    dq, dk, dv = (descales((4, 2), rng) for _ in range(3))
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, descale_q=dq,
                                        descale_k=dk, descale_v=dv)
    ref, ref_lse = exact(q, k, v, dq, dk, dv, (cu_q, cu_k), causal=True)
    assert_rounded_from(out, ref, ml_dtypes.bfloat16)
    np.testing.assert_allclose(lse, ref_lse.astype(np.float32), rtol=1e-6)
    swapped = exact(q, k, v, dq, dk, dv[::-1], (cu_q, cu_k), causal=True)[0]
    assert np.abs(out.astype(np.float64) - swapped).max() > 1e-2


def test_varlen_uint8_bytes_declared_e4m3_into_out():
    rng = np.random.default_rng()
    cu = np.array([0, 3, 11], np.int32)
    q, k, v = (fp8((11, 2, 32), rng) for _ in range(3))
    dv = descales((2, 2), rng)
    out = np.full(q.shape, np.nan, np.float16)
    result = cuflash.attention_varlen(*(x.view(np.uint8) for x in (q, k, v)), cu, cu, dtype="e4m3", descale_v=dv,
                                      out_dtype="float16", out=out)
    assert result is out
    assert_rounded_from(out, exact(q, k, v, 1.0, 1.0, dv, (cu, cu))[0], np.float16)


def test_fp8_baseline_rounds_p_to_e4m3():
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 6, 1, 16)) for _ in range(3))
    out = reference.attention_reference(q, k, v, p_dtype=E4M3)[0][0, :, 0]
    s = q[0, :, 0] @ k[0, :, 0].T / 4.0
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out, p.astype(E4M3).astype(np.float64) @ v[0, :, 0], rtol=1e-12)
    exact_out = reference.attention_reference(q, k, v)[0][0, :, 0]
    assert np.abs(out - exact_out).max() > 1e-3


def test_dequantize_maps_query_heads_to_their_kv_head():
    x = np.ones((2, 3, 4, 8), E4M3)
    descale = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    per_head = reference.dequantize(x, descale)[:, 0, :, 0]
    np.testing.assert_array_equal(per_head, [[1, 1, 2, 2], [3, 3, 4, 4]])


# Bad input.

def fp8_qkv(shape_q=(2, 16, 4, 64), shape_kv=(2, 24, 2, 64)):
    rng = np.random.default_rng()
    return fp8(shape_q, rng), fp8(shape_kv, rng), fp8(shape_kv, rng)


@pytest.mark.parametrize("options, error, words", [
    ({"descale_q": np.ones((2, 4), np.float32)}, ValueError, r"descale_q: expected shape \(batch, heads_kv\)"),
    ({"descale_k": np.ones((2, 2), np.float64)}, TypeError, "descale_k: expected float32"),
    ({"descale_v": np.ones((2, 4), np.float32)[:, ::2]}, ValueError, "descale_v: must be contiguous"),
    ({"descale_v": np.array([[1, 0]] * 2, np.float32)}, ValueError, "descale_v: every entry must be finite"),
    ({"descale_q": np.array([[1, np.nan]] * 2, np.float32)}, ValueError, "descale_q: every entry must be finite"),
    ({"descale_q": math.nan}, ValueError, "descale_q: must be finite and positive"),
    ({"descale_k": math.inf}, ValueError, "descale_k: must be finite and positive"),
    ({"descale_k": 0.0}, ValueError, "descale_k: must be finite and positive"),
    ({"descale_v": -1}, ValueError, "descale_v: must be finite and positive"),
    ({"descale_v": "1"}, TypeError, "descale_v: expected a CuPy array"),
    ({"out_dtype": "float32"}, TypeError, "out_dtype: expected bfloat16 or float16"),
    ({"out_dtype": np.float8_e4m3fn if hasattr(np, "float8_e4m3fn") else E4M3}, TypeError, "out_dtype"),
    ({"dtype": "e5m2"}, ValueError, "dtype: expected None or 'e4m3'"),
])
def test_bad_fp8_options(options, error, words):
    with pytest.raises(error, match=words):
        cuflash.attention(*fp8_qkv(), **options)


def test_bad_out_dtype_for_fp8():
    q, k, v = fp8_qkv()
    with pytest.raises(TypeError, match=r"out: expected dtype bfloat16 \(out_dtype\), got float8_e4m3fn"):
        cuflash.attention(q, k, v, out=np.empty_like(q))
    with pytest.raises(TypeError, match=r"out: expected dtype float16 \(out_dtype\), got bfloat16"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, ml_dtypes.bfloat16), out_dtype="float16")


@pytest.mark.parametrize("name, words", [("q", "k: dtype float8_e4m3fn does not match q's bfloat16"),
                                         ("k", "k: dtype bfloat16 does not match q's float8_e4m3fn"),
                                         ("v", "v: dtype bfloat16 does not match q's float8_e4m3fn")])
def test_mixed_fp8_and_16_bit_inputs(name, words):
    arrays = dict(zip("qkv", fp8_qkv()))
    arrays[name] = arrays[name].astype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=words):
        cuflash.attention(*arrays.values())


def test_e5m2_is_refused_with_the_supported_format_named():
    q, k, v = (x.astype(ml_dtypes.float8_e5m2) for x in fp8_qkv())
    with pytest.raises(TypeError, match=r"q: dtype float8_e5m2 is not supported .*only e4m3"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("options", [{"descale_q": 1.0}, {"descale_v": np.ones((2, 2), np.float32)},
                                     {"out_dtype": "bfloat16"}])
def test_fp8_options_with_16_bit_inputs_are_refused(options):
    q, k, v = (x.astype(np.float16) for x in fp8_qkv())
    with pytest.raises(ValueError, match=f"{next(iter(options))}: only FP8"):
        cuflash.attention(q, k, v, **options)


def test_declared_e4m3_needs_bytes():
    q, k, v = (x.astype(np.float16) for x in fp8_qkv())
    with pytest.raises(TypeError, match="q: dtype='e4m3' reads uint8"):
        cuflash.attention(q, k, v, dtype="e4m3")


def test_varlen_descale_has_one_row_per_sequence():
    q, k, v = (x[0] for x in fp8_qkv((1, 10, 4, 64), (1, 10, 2, 64)))
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match=r"descale_k: expected shape \(batch, heads_kv\) = \(2, 2\)"):
        cuflash.attention_varlen(q, k, v, cu, cu, descale_k=np.ones((1, 2), np.float32))


def test_fp8_backward_is_refused():
    q, k, v = fp8_qkv()
    out = np.zeros(q.shape, ml_dtypes.bfloat16)
    lse = np.zeros((2, 4, 16), np.float32)
    with pytest.raises(TypeError, match="q: dtype float8_e4m3fn .*forward path only"):
        cuflash.attention_backward(out, q, k, v, out, lse)


# quantize_fp8 (NumPy path).

def e4m3_round_like_the_kernel(values: np.ndarray) -> np.ndarray:
    """common/e4m3.cuh's to_e4m3 in NumPy integer arithmetic (for |v| <= 448)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.int64)
    sign = (bits >> 24) & 0x80
    magnitude = np.abs(values.astype(np.float32))
    subnormal = sign | np.rint(magnitude * np.float32(512)).astype(np.int64)
    kept = bits & 0x7FFFFFFF
    kept = (kept + 0x7FFFF + ((kept >> 20) & 1)) >> 20
    normal = sign | np.minimum(kept - (120 << 3), 0x7E)
    return np.where(magnitude < np.float32(2.0**-6), subnormal, normal).astype(np.uint8)


def test_the_kernels_e4m3_rounding_is_ml_dtypes():
    rng = np.random.default_rng()
    representable = np.sort(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32))
    representable = representable[np.isfinite(representable)]
    ties = (representable[:-1] + representable[1:]) / 2  # exact in float32
    values = np.concatenate([representable, ties, np.nextafter(ties, np.float32(-np.inf)),
                             np.nextafter(ties, np.float32(np.inf)),
                             rng.uniform(-448, 448, 100_000).astype(np.float32),
                             rng.uniform(-2.0**-5, 2.0**-5, 100_000).astype(np.float32)])
    values = values[np.abs(values) <= 448].astype(np.float32)
    np.testing.assert_array_equal(e4m3_round_like_the_kernel(values), values.astype(E4M3).view(np.uint8))


@pytest.mark.parametrize("granularity", quantize.GRANULARITIES)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64])
def test_quantize_round_trip_and_descale_layout(granularity, dtype):
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 37, 4, 64)) * rng.uniform(0.1, 10, (1, 1, 4, 1))).astype(dtype)
    xq, descale = cuflash.quantize_fp8(x, granularity, block_size=16)
    assert xq.dtype == np.dtype(E4M3) and xq.shape == x.shape and descale.dtype == np.float32
    x32 = x.astype(np.float32).astype(np.float64)
    if granularity == "block":
        assert descale.shape == (2, 4, 3)
        per_element = np.repeat(descale.transpose(0, 2, 1), 16, axis=1)[:, :37, :, None]
        amax = np.stack([np.abs(x32[:, i * 16:(i + 1) * 16]).max(axis=(1, 3)) for i in range(3)], axis=-1)
    else:
        assert descale.shape == (2, 4)
        per_element = descale[:, None, :, None]
        amax = np.abs(x32).max(axis=(1, 3)) if granularity == "head" else np.full((2, 4), np.abs(x32).max())
    np.testing.assert_array_equal(descale, (amax.astype(np.float32) / np.float32(448)).reshape(descale.shape))
    assert np.abs(xq.astype(np.float64)).max() == 448
    dequantized = xq.astype(np.float64) * per_element
    np.testing.assert_allclose(dequantized, x32, rtol=2.0**-4, atol=per_element.max() * 2.0**-9)


def test_quantize_head_groups_of_a_gqa_query():
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 20, 6, 64), (2, 31, 2, 64), (2, 31, 2, 64)))
    (qq, dq), (kq, dk), (vq, dv) = (cuflash.quantize_fp8(x, "head", heads_kv=2) for x in (q, k, v))
    assert dq.shape == dk.shape == dv.shape == (2, 2)
    np.testing.assert_array_equal(dq, (np.abs(q.astype(np.float32)).reshape(2, 20, 2, 3, 64).max(axis=(1, 3, 4))
                                       / np.float32(448)))
    out = cuflash.attention(qq, kq, vq, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    assert_rounded_from(out, exact(qq, kq, vq, dq, dk, dv, causal=True)[0], ml_dtypes.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 96, 80, 256])
def test_rotation_is_orthogonal_and_keeps_q_k_transposed(head_dim):
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    rotation = quantize._rotated(np.eye(head_dim, dtype=np.float32), seed).astype(np.float64)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(head_dim), atol=1e-6)
    q, k = rng.standard_normal((2, 9, head_dim)).astype(np.float32)
    scores = quantize._rotated(q, seed).astype(np.float64) @ quantize._rotated(k, seed).astype(np.float64).T
    np.testing.assert_allclose(scores, q.astype(np.float64) @ k.astype(np.float64).T, atol=1e-4)
    other = quantize._rotated(np.eye(head_dim, dtype=np.float32), seed + 1)
    assert not np.array_equal(other, rotation.astype(np.float32))


def test_rotated_quantization_gives_the_same_attention():
    """q and k rotated with one seed: the error against the exact attention is that of plain
    quantization (a rotation that changed q kᵀ would be off by the scores' own size)."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 32, 2, 64)) for _ in range(3))
    seed = int(rng.integers(2**31))
    vq, dv = cuflash.quantize_fp8(v, "head")
    ref = reference.attention_reference(q, k, v)[0]
    errors = []
    for rotate in (False, True):
        (qq, dq), (kq, dk) = (cuflash.quantize_fp8(x, "head", rotate=rotate, seed=seed) for x in (q, k))
        out = cuflash.attention(qq, kq, vq, descale_q=dq, descale_k=dk, descale_v=dv).astype(np.float64)
        errors.append(np.sqrt(np.mean((out - ref) ** 2)))
    assert errors[1] < 2 * errors[0]


def test_a_group_of_zeros_gets_descale_one():
    x = np.zeros((1, 5, 2, 16), np.float32)
    x[:, :, 1] = 3.0
    xq, descale = cuflash.quantize_fp8(x, "head")
    np.testing.assert_array_equal(descale, [[1.0, np.float32(3.0) / np.float32(448)]])
    assert not xq[:, :, 0].astype(np.float32).any()


@pytest.mark.parametrize("x_shape, options, error, words", [
    ((2, 8, 2), {}, ValueError, "x: expected 4 dims"),
    ((1, 8, 2, 264), {}, ValueError, "x: head_dim must be between 1 and 256"),
    ((1, 8, 2, 64), {"granularity": "row"}, ValueError, "granularity: expected one of tensor, head, block"),
    ((1, 8, 2, 64), {"block_size": 0}, ValueError, "block_size: must be at least 1"),
    ((1, 8, 2, 64), {"block_size": 1.5}, TypeError, "block_size: expected an int"),
    ((1, 8, 4, 64), {"heads_kv": 3}, ValueError, r"heads_kv: must divide x's heads \(4\)"),
    ((1, 8, 2, 64), {"rotate": "yes"}, TypeError, "rotate: expected a bool"),
    ((1, 8, 2, 64), {"seed": None}, TypeError, "seed: expected an int"),
    ((1, 8, 2, 64), {"seed": -1}, ValueError, "seed: must be >= 0, got -1"),
    ((1, 8, 2, 64), {"seed": -1, "rotate": True}, ValueError, "seed: must be >= 0, got -1"),
])
def test_bad_quantize_input(x_shape, options, error, words):
    with pytest.raises(error, match=words):
        cuflash.quantize_fp8(np.ones(x_shape, np.float32), **options)


@pytest.mark.filterwarnings("error")  # nothing of NumPy's may leak out: a RuntimeWarning fails
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("granularity", quantize.GRANULARITIES)
@pytest.mark.parametrize("bad, dtype, words", [
    (np.nan, np.float32, "x: holds NaN or infinity"),
    (-np.inf, np.float16, "x: holds NaN or infinity"),
    (np.inf, ml_dtypes.bfloat16, "x: holds NaN or infinity"),
    (1e300, np.float64, "x: holds values beyond float32's range"),
])
def test_quantize_refuses_values_that_are_not_finite(bad, dtype, words, granularity, rotate):
    x = np.random.default_rng(5).standard_normal((2, 8, 2, 64)).astype(dtype)
    x[1, 3, 0, 7] = bad
    with pytest.raises(ValueError, match=words):
        cuflash.quantize_fp8(x, granularity, block_size=4, rotate=rotate)


@pytest.mark.filterwarnings("error")
def test_quantize_of_finite_values_that_a_rotation_overflows():
    x = np.full((1, 2, 1, 64), 3e38, np.float32)
    cuflash.quantize_fp8(x)  # the values themselves are fine
    with pytest.raises(ValueError, match="beyond float32's range .* once cast and rotated"):
        cuflash.quantize_fp8(x, rotate=True)


def test_quantize_refuses_integer_input():
    with pytest.raises(TypeError, match="x: dtype int32 is not supported"):
        cuflash.quantize_fp8(np.ones((1, 4, 1, 8), np.int32))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_quantize_kernel_compiles_without_spills(arch):
    for dtype in ("float16", "bfloat16", "float32"):
        resources = kernels.compile_kernel(dispatch.quantize_kernel(dtype), arch).resources()
        assert resources["registers"] > 0 and resources["spill_stores"] == 0 and resources["stack_frame"] == 0
