"""head_dim_v != head_dim through the public API: the CPU path computes it (forward, backward,
packed batches, FP8 inputs), the checks name the argument, and GPU inputs pass the same checks and
run the kernel of the wider head dim."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._core import checks, dispatch, interop
from cuflash._cpu import reference

OPTIONS = [dict(), dict(causal=True), dict(window=(4, 2), softcap=5.0)]


def arrays(shapes, dtype=np.float64):
    rng = np.random.default_rng()
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in shapes)


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "causal", "window+softcap"])
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (64, 256), (40, 16)])
def test_forward_and_backward_on_the_host(options, head_dim, head_dim_v):
    q, k, v, dout = arrays([(2, 9, 4, head_dim), (2, 13, 2, head_dim), (2, 13, 2, head_dim_v),
                            (2, 9, 4, head_dim_v)])
    out_given = np.full((2, 9, 4, head_dim_v), np.nan)
    out, lse = cuflash.attention(q, k, v, return_lse=True, out=out_given, **options)
    want_out, want_lse = reference.attention_reference(q, k, v, **options)
    assert out is out_given
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse.astype(np.float32))
    dv_given = np.full(v.shape, np.nan)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, dv=dv_given, **options)
    assert grads[2] is dv_given
    # The host path recomputes P from the float32 lse it is given, as the kernels do; with the
    # float64 lse that recomputation is the reference's backward.
    for got, want in zip(grads, reference.attention_backward_from_lse(dout, q, k, v, out, lse, **options)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    exact = reference.attention_backward_from_lse(dout, q, k, v, want_out, want_lse, **options)
    for got, want in zip(exact, reference.attention_backward_reference(dout, q, k, v, **options)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_low_precision_inputs_keep_their_dtype():
    q, k, v = arrays([(1, 5, 2, 32), (1, 7, 2, 32), (1, 7, 2, 16)], ml_dtypes.bfloat16)
    out = cuflash.attention(q, k, v, causal=True)
    want, _ = reference.attention_reference(q, k, v, causal=True)
    assert out.dtype == q.dtype and out.shape == (1, 5, 2, 16)
    np.testing.assert_array_equal(out, want.astype(q.dtype))


def test_default_scale_is_one_over_sqrt_head_dim():
    q, k, v = arrays([(1, 5, 2, 64), (1, 6, 2, 64), (1, 6, 2, 8)])
    np.testing.assert_allclose(cuflash.attention(q, k, v), cuflash.attention(q, k, v, softmax_scale=1 / math.sqrt(64)),
                               rtol=0, atol=0)


def test_fp8_inputs_on_the_host():
    q, k, v = (x.astype(ml_dtypes.float8_e4m3fn) for x in arrays([(2, 6, 2, 32), (2, 8, 1, 32), (2, 8, 1, 48)]))
    descale_v = np.array([[0.5], [2.0]], np.float32)
    out = cuflash.attention(q, k, v, causal=True, descale_k=0.25, descale_v=descale_v)
    want, _ = reference.attention_reference(reference.dequantize(q, 1.0), reference.dequantize(k, 0.25),
                                            reference.dequantize(v, descale_v), causal=True)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (2, 6, 2, 48)
    np.testing.assert_array_equal(out, want.astype(ml_dtypes.bfloat16))


def test_varlen_forward_and_backward_on_the_host():
    lengths_q, lengths_k = (5, 0, 9), (7, 3, 2)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q, k, v, dout = arrays([(14, 4, 24), (12, 2, 24), (12, 2, 8), (14, 4, 8)])
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    want_out, want_lse = reference.attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse.astype(np.float32))
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    for got, want in zip(grads, reference.attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k,
                                                                              causal=True)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "head_dim_v, words",
    [(0, "v: head_dim must be a positive multiple of 8"), (12, "v: head_dim must be a positive multiple of 8"),
     (264, "v: head_dim must be .* at most 256, got 264")],
)
def test_bad_head_dim_v(head_dim_v, words):
    q, k, v = arrays([(1, 4, 2, 64), (1, 4, 2, 64), (1, 4, 2, head_dim_v)], np.float32)
    with pytest.raises(ValueError, match=words):
        cuflash.attention(q, k, v)
    with pytest.raises(ValueError, match=words):
        cuflash.attention_varlen(q[0], k[0], v[0], np.array([0, 4], np.int32), np.array([0, 4], np.int32))


def test_v_must_match_k_but_for_head_dim():
    q, k, v = arrays([(1, 4, 2, 64), (1, 4, 2, 64), (1, 5, 2, 32)], np.float32)
    with pytest.raises(ValueError, match="v: shape .* must equal k's .* but for head_dim"):
        cuflash.attention(q, k, v)


def test_out_dout_and_dv_take_head_dim_v():
    q, k, v = arrays([(1, 6, 2, 32), (1, 6, 2, 32), (1, 6, 2, 16)], np.float32)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 6, 2, 16\)"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, np.float32))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout: expected shape \(1, 6, 2, 16\)"):
        cuflash.attention_backward(np.ones_like(q), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"dv: expected shape \(1, 6, 2, 16\)"):
        cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, dv=np.empty(k.shape, np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(6, 2, 16\)"):
        cuflash.attention_varlen(q[0], k[0], v[0], np.array([0, 6], np.int32), np.array([0, 6], np.int32),
                                 out=np.empty(q[0].shape, np.float32))


def _device_tensor(shape):
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return interop.DeviceTensor(None, 1 << 20, shape, strides, "bfloat16", 2, 0)


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "varlen"])
def test_gpu_inputs_pass_the_checks_and_pick_the_wider_kernel(packed):
    shapes = [(1, 64, 4, 192), (1, 64, 4, 192), (1, 64, 4, 128)]
    if packed:
        q, k, v = (checks.as_batch_of_one(_device_tensor(shape[1:])) for shape in shapes)
    else:
        q, k, v = (_device_tensor(shape) for shape in shapes)
    checks.check_qkv(q, k, v, on_device=True)
    assert dispatch.kernel_head_dim(q, v) == dispatch.kernel_head_dim(v, q) == 192
    with pytest.raises(ValueError, match="v: head_dim must be a positive multiple of 8 and at most 256, got 260"):
        checks.check_qkv(q, k, _device_tensor((1, 64, 4, 260)), on_device=True)
