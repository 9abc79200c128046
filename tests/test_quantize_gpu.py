"""quantize_fp8 on GPU arrays: the kernel's e4m3 bytes and descales equal the NumPy path's bit for
bit on the same input (every granularity, with and without rotation, GQA head groups, odd
lengths, strided input, each input dtype), and FP8 attention arguments checked on GPU arrays."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def outlier_input(shape, dtype_name: str, rng):
    """Normal values with 0.1% outliers of size 30, as NumPy (in ``dtype_name``) and as CuPy."""
    import cupy as cp

    values = rng.standard_normal(shape) + 30.0 * (rng.random(shape) < 1e-3) * rng.choice([-1, 1], shape)
    host = values.astype(DTYPES[dtype_name])
    bits = {2: np.uint16, 4: np.uint32}[host.itemsize]
    return host, cp.asarray(host.view(bits)).view(host.dtype)


def assert_same_bits(device_result, host_result):
    (xq, descale), (host_xq, host_descale) = device_result, host_result
    assert xq.dtype == np.uint8 and xq.shape == host_xq.shape
    np.testing.assert_array_equal(xq.get(), host_xq.view(np.uint8))
    np.testing.assert_array_equal(descale.get().view(np.uint32), host_descale.view(np.uint32))


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("shape", [(2, 257, 4, 64), (1, 33, 3, 80), (3, 5, 2, 256), (1, 130, 2, 96)])
def test_gpu_bytes_equal_the_numpy_path(dtype_name, granularity, rotate, shape):
    rng = np.random.default_rng()
    host, device = outlier_input(shape, dtype_name, rng)
    seed = int(rng.integers(2**31))
    options = {"block_size": 64, "rotate": rotate, "seed": seed}
    assert_same_bits(cuflash.quantize_fp8(device, granularity, **options),
                     cuflash.quantize_fp8(host, granularity, **options))


@pytest.mark.parametrize("granularity", ["head", "block"])
def test_gpu_head_groups_and_strided_input(granularity):
    rng = np.random.default_rng()
    host, device = outlier_input((2, 77, 8, 128), "bfloat16", rng)
    host, device = host[:, :, ::2], device[:, :, ::2]  # every other head: strided, not contiguous
    options = {"block_size": 32, "heads_kv": 2, "rotate": True, "seed": 7}
    result = cuflash.quantize_fp8(device, granularity, **options)
    assert result[1].shape[:2] == (2, 2)
    assert_same_bits(result, cuflash.quantize_fp8(np.ascontiguousarray(host), granularity, **options))


@pytest.mark.parametrize("rotate", [False, True])
def test_gpu_negative_seed_is_named(rotate):
    import cupy as cp

    with pytest.raises(ValueError, match="seed: must be >= 0, got -1"):
        cuflash.quantize_fp8(cp.ones((1, 4, 2, 64), cp.float16), rotate=rotate, seed=-1)


def test_gpu_empty_sequence_gives_descale_one():
    import cupy as cp

    xq, descale = cuflash.quantize_fp8(cp.zeros((2, 0, 3, 64), cp.float16), "head")
    assert xq.shape == (2, 0, 3, 64)
    np.testing.assert_array_equal(descale.get(), np.ones((2, 3), np.float32))


def test_torch_tensors_give_torch_float8():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    host = rng.standard_normal((2, 40, 4, 64)).astype(np.float32)
    xq, descale = cuflash.quantize_fp8(torch.from_numpy(host).cuda(), "head", rotate=True, seed=3)
    assert xq.dtype == torch.float8_e4m3fn and descale.dtype == torch.float32 and xq.is_cuda
    host_xq, host_descale = cuflash.quantize_fp8(host, "head", rotate=True, seed=3)
    np.testing.assert_array_equal(xq.view(torch.uint8).cpu().numpy(), host_xq.view(np.uint8))
    np.testing.assert_array_equal(descale.cpu().numpy(), host_descale)


# FP8 attention arguments on GPU arrays.

def fp8_bytes(shape, rng):
    import cupy as cp

    return cp.asarray((rng.standard_normal(shape)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("name, make, error, words", [
    ("descale_q", lambda cp: np.ones((2, 2), np.float32), TypeError, "descale_q: must be on the same side as q"),
    ("descale_k", lambda cp: cp.ones((2, 2), cp.float64), TypeError, "descale_k: expected float32"),
    ("descale_v", lambda cp: cp.ones((2, 4), cp.float32), ValueError,
     r"descale_v: expected shape \(batch, heads_kv\) = \(2, 2\)"),
    ("descale_q", lambda cp: 0.0, ValueError, "descale_q: must be finite and positive"),
    ("out_dtype", lambda cp: "float32", TypeError, "out_dtype: expected bfloat16 or float16"),
])
def test_bad_fp8_options_on_gpu_arrays(name, make, error, words):
    import cupy as cp

    rng = np.random.default_rng()
    q, k, v = fp8_bytes((2, 16, 4, 64), rng), fp8_bytes((2, 16, 2, 64), rng), fp8_bytes((2, 16, 2, 64), rng)
    with pytest.raises(error, match=words):
        cuflash.attention(q, k, v, dtype="e4m3", **{name: make(cp)})
