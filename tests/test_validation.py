"""Bad input gets a TypeError/ValueError naming the argument, before anything is launched.

The NumPy path shares the validation with the device path; device-only rules are checked on
DeviceTensor records (no GPU needed) and, on a GPU machine, through real CuPy arrays.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._core import checks, dispatch, interop
from cuflash._cpu import numpy_path


def qkv(shape_q=(2, 16, 4, 64), shape_kv=(2, 24, 2, 64), dtype=np.float32):
    rng = np.random.default_rng()
    return (rng.standard_normal(shape_q).astype(dtype),
            rng.standard_normal(shape_kv).astype(dtype),
            rng.standard_normal(shape_kv).astype(dtype))


@pytest.mark.parametrize(
    "mutate, error, words",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q: expected 4 dims"),
        (lambda q, k, v: (q, k[..., None], v), ValueError, "k: expected 4 dims"),
        (lambda q, k, v: (q, k, v[:1]), ValueError, "batch"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "v: shape"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "k: head_dim"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "heads_kv"),
        (lambda q, k, v: (q[..., :60], k[..., :60], v[..., :60]), ValueError, "multiple of 8"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "seqlen_q"),
        (lambda q, k, v: (q[..., ::2], k[..., ::2], v[..., ::2]), ValueError, "contiguous"),
        (lambda q, k, v: (q, k.astype(np.float16), v), TypeError, "k: dtype float16 does not match"),
        (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, "q: dtype int32"),
        (lambda q, k, v: ([1.0], k, v), TypeError, "q: expected a CuPy array"),
    ],
)
def test_bad_qkv(mutate, error, words):
    with pytest.raises(error, match=words):
        cuflash.attention(*mutate(*qkv()))


def test_head_dim_above_256():
    with pytest.raises(ValueError, match="at most 256"):
        cuflash.attention(*qkv((1, 4, 1, 264), (1, 4, 1, 264)))


def test_head_dim_zero():
    with pytest.raises(ValueError, match="q: head_dim must be a positive multiple of 8"):
        cuflash.attention(*qkv((1, 4, 1, 0), (1, 4, 1, 0)))


@pytest.mark.parametrize("causal", ["false", "yes", None, 2, 0.5, [True]])
def test_causal_must_be_a_bool(causal):
    # Read by its truth value, causal="false" would silently run the causal mask.
    with pytest.raises(TypeError, match="causal: expected a bool"):
        cuflash.attention(*qkv(), causal=causal)


def test_causal_takes_numpy_bools_and_0_1():
    q, k, v = qkv()
    expected = cuflash.attention(q, k, v, causal=True)
    for causal in (np.bool_(True), 1):
        assert np.array_equal(cuflash.attention(q, k, v, causal=causal), expected)
    assert np.array_equal(cuflash.attention(q, k, v, causal=np.False_), cuflash.attention(q, k, v))


@pytest.mark.parametrize("scale, error", [(0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                          (math.nan, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_bad_softmax_scale(scale, error):
    with pytest.raises(error, match="softmax_scale"):
        cuflash.attention(*qkv(), softmax_scale=scale)


def test_bad_out():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out: expected shape"):
        cuflash.attention(q, k, v, out=np.empty((2, 16, 4, 32), np.float32))
    with pytest.raises(TypeError, match="out: expected dtype"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, np.float64))


def read_only(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x.flags.writeable = False
    return x


def _fixed_length_calls():
    q, k, v = qkv()
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    backward = dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)
    yield "out", lambda out: cuflash.attention(q, k, v, out=out), out
    q8, k8, v8 = (x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v))
    fp8_out = cuflash.attention(q8, k8, v8)
    yield "out", lambda out: cuflash.attention(q8, k8, v8, out=out), fp8_out
    for name, like in zip(("dq", "dk", "dv"), (q, k, v)):
        yield name, lambda x, name=name: cuflash.attention_backward(**backward, **{name: x}), like


def _packed_calls():
    rng = np.random.default_rng(3)
    cu = np.array([0, 5, 12], np.int32)
    q, k, v = (rng.standard_normal((12, 2, 16)).astype(np.float32) for _ in range(3))
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, return_lse=True)
    backward = (np.ones_like(out), q, k, v, out, lse, cu, cu)
    yield "out", lambda out: cuflash.attention_varlen(q, k, v, cu, cu, out=out), out
    for name, like in zip(("dq", "dk", "dv"), (q, k, v)):
        yield name, lambda x, name=name: cuflash.attention_varlen_backward(*backward, **{name: x}), like


@pytest.mark.parametrize("name, call, like", [*_fixed_length_calls(), *_packed_calls()])
def test_read_only_outputs_are_refused(name, call, like, monkeypatch):
    """Every output argument (out; dq, dk, dv of the backward passes), FP8's out included: a NumPy
    array that is not writable is a ValueError naming it, raised before anything is computed."""
    def computed(*args, **kwargs):
        raise AssertionError("the CPU path ran before the checks refused the output")

    for entry in ("attention", "attention_backward", "attention_varlen", "attention_varlen_backward"):
        monkeypatch.setattr(numpy_path, entry, computed)
    with pytest.raises(ValueError, match=f"{name}: is read-only"):
        call(read_only(np.empty_like(like)))


class _FakeDeviceTensor:
    """Anything exporting __dlpack__ counts as a device tensor."""

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be touched")


def test_cpu_and_gpu_mixed():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k: is on the GPU, but q is on the CPU"):
        cuflash.attention(q, _FakeDeviceTensor(), v)


def test_cpu_torch_tensor_rejected_with_advice():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"q: a CPU torch tensor"):
        cuflash.attention(torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 64))


def _tensor(shape, dtype="float16", device=0, ptr=1 << 20, strides=None):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return interop.DeviceTensor(None, ptr, shape, strides, dtype, 2 if dtype != "float32" else 4, device)


def test_device_float32_suggests_cast():
    t = _tensor((1, 8, 2, 64), "float32")
    with pytest.raises(TypeError, match="q: dtype float32.*cast to float16 or bfloat16"):
        checks.check_qkv(t, t, t, on_device=True)


def test_device_mismatch():
    q = _tensor((1, 8, 2, 64))
    with pytest.raises(ValueError, match="k: on device 1, but q is on device 0"):
        checks.check_qkv(q, _tensor((1, 8, 2, 64), device=1), q, on_device=True)


def test_device_batch_above_grid_limit():
    q = _tensor((70000, 8, 2, 64))
    with pytest.raises(ValueError, match="at most 65535"):
        checks.check_qkv(q, q, q, on_device=True)


def test_device_seqlen_above_grid_limit():
    q = _tensor((1, 65535 * 128 + 1, 1, 8))
    with pytest.raises(ValueError, match="seqlen_q must be at most"):
        checks.check_qkv(q, _tensor((1, 8, 1, 8)), _tensor((1, 8, 1, 8)), on_device=True)


def test_misaligned_out_is_refused():
    q = _tensor((1, 8, 2, 64))
    with pytest.raises(ValueError, match="out: data pointer"):
        checks.check_out("out", _tensor((1, 8, 2, 64), ptr=(1 << 20) + 2), q.shape, q, on_device=True)


def test_alignment_rule():
    assert _tensor((1, 8, 2, 64)).aligned_16
    assert not _tensor((1, 8, 2, 64), ptr=(1 << 20) + 2).aligned_16
    assert not _tensor((1, 8, 2, 64), strides=(8 * 2 * 68, 2 * 68, 68, 1)).aligned_16  # 136-byte heads


def test_dispatch_families(monkeypatch):
    monkeypatch.delenv("CUFLASH_FAMILY", raising=False)
    assert dispatch.select_family((8, 0)) == "sm80"
    assert dispatch.select_family((8, 9)) == "sm80"
    assert dispatch.select_family((9, 0)) == "sm90"
    assert dispatch.select_family((12, 0)) == "sm80"
    with pytest.raises(RuntimeError, match="8.0 or newer"):
        dispatch.select_family((7, 5))
    monkeypatch.setenv("CUFLASH_FAMILY", "sm80")
    assert dispatch.select_family((9, 0)) == "sm80"
    monkeypatch.setenv("CUFLASH_FAMILY", "sm90")
    assert dispatch.select_family((9, 0)) == "sm90"
    with pytest.raises(ValueError, match="9.x"):
        dispatch.select_family((8, 0))
    monkeypatch.setenv("CUFLASH_FAMILY", "fast")
    with pytest.raises(ValueError, match="CUFLASH_FAMILY"):
        dispatch.select_family((9, 0))


@pytest.mark.parametrize("head_dim, bucket", [(8, 64), (32, 64), (64, 64), (72, 96), (96, 96),
                                              (104, 128), (160, 192), (200, 256), (256, 256)])
def test_head_dim_buckets(head_dim, bucket):
    assert dispatch.head_dim_bucket(head_dim) == bucket
    choice = dispatch.forward_kernel("sm80", head_dim, "causal", "bfloat16")
    assert choice.name_expression.startswith(f"cuflash::flash_fwd_sm80<{bucket}, ")
    assert choice.smem_bytes <= 227 * 1024


@pytest.mark.gpu
def test_device_errors_with_real_arrays():
    import cupy as cp

    q = cp.zeros((1, 8, 2, 64), cp.float32)
    with pytest.raises(TypeError, match="cast to float16 or bfloat16"):
        cuflash.attention(q, q, q)
    h = q.astype(cp.float16)
    with pytest.raises(TypeError, match="k: is on the CPU"):
        cuflash.attention(h, np.zeros((1, 8, 2, 64), np.float16), h)
    with pytest.raises(ValueError, match="out: expected shape"):
        cuflash.attention(h, h, h, out=cp.empty((1, 8, 2, 32), cp.float16))


def _forward_for_backward(dtype=np.float32):
    q, k, v = qkv(dtype=dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = np.random.default_rng().standard_normal(q.shape).astype(dtype)
    return dout, q, k, v, out, lse


def test_backward_host_path_recomputes_from_the_given_lse():
    from cuflash._cpu.reference import attention_backward_from_lse

    dout, q, k, v, out, lse = _forward_for_backward(np.float64)
    dk_given = np.full(k.shape, np.nan)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dk=dk_given)
    expected = attention_backward_from_lse(dout, q, k, v, out, lse, causal=True)
    assert dk is dk_given
    for got, want in zip((dq, dk, dv), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "mutate, error, words",
    [
        (lambda a: a | {"dout": a["dout"][:, :3]}, ValueError, "dout: expected shape"),
        (lambda a: a | {"dout": a["dout"].astype(np.float64)}, TypeError, "dout: expected dtype"),
        (lambda a: a | {"out": a["out"][..., :32]}, ValueError, "out: expected shape"),
        (lambda a: a | {"lse": a["lse"].astype(np.float64)}, TypeError, "lse: expected float32"),
        (lambda a: a | {"lse": a["lse"][:, :2]}, ValueError, "lse: expected shape"),
        (lambda a: a | {"lse": np.asfortranarray(a["lse"])}, ValueError, "lse: must be contiguous"),
        (lambda a: a | {"dq": np.empty((2, 16, 4, 32), np.float32)}, ValueError, "dq: expected shape"),
        (lambda a: a | {"dk": np.empty((2, 24, 2, 64), np.float64)}, TypeError, "dk: expected dtype"),
        (lambda a: a | {"dv": np.empty((2, 16, 4, 64), np.float32)}, ValueError, "dv: expected shape"),
    ],
)
def test_backward_bad_inputs(mutate, error, words):
    dout, q, k, v, out, lse = _forward_for_backward()
    args = mutate({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    grads = {name: args.pop(name) for name in ("dq", "dk", "dv") if name in args}
    with pytest.raises(error, match=words):
        cuflash.attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"],
                                   causal=True, **grads)


@pytest.mark.parametrize("flags, name", [({"causal": "no"}, "causal"), ({"deterministic": "yes"}, "deterministic"),
                                         ({"deterministic": None}, "deterministic")])
def test_backward_flags_must_be_bools(flags, name):
    dout, q, k, v, out, lse = _forward_for_backward()
    with pytest.raises(TypeError, match=f"{name}: expected a bool"):
        cuflash.attention_backward(dout, q, k, v, out, lse, **flags)


def test_backward_deterministic_host_path():
    dout, q, k, v, out, lse = _forward_for_backward(np.float64)
    default = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    ordered = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(default, ordered):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("head_dim, rows", [(8, 32), (64, 32), (72, 16), (96, 16), (128, 16), (136, 8), (256, 8)])
def test_backward_helper_rows_per_block(head_dim, rows):
    # One thread per 8 columns, a power of two of at least 8 per row, 256 per block.
    assert dispatch.helper_rows_per_block(head_dim) == rows


def test_backward_kernel_choices():
    preprocess, main, convert = dispatch.backward_kernels("sm80", 128, "causal", "bfloat16")
    # causal, window, softcap, deterministic walk, OWN_V_DIM (false: v has q's head dim)
    assert main.name_expression == ("cuflash::flash_bwd_sm80<128, 64, 128, 8, 1, 164864, true, false, false, false, "
                                    "false, cuflash::bf16>")
    assert main.smem_bytes == ((2 * 128 + 4 * 64) * 128 + 2 * 64 * 128) * 2 + 4 * 64 * 4
    ordered = dispatch.backward_kernels("sm80", 100, "none", "float16", dq_order="walk")[1]
    assert ordered.name_expression == ("cuflash::flash_bwd_sm80<128, 64, 128, 8, 1, 164864, false, false, false, true, "
                                       "false, cuflash::f16>")
    capped = dispatch.backward_kernels("sm80", 64, "causal", "bfloat16", softcap=True)[1]
    assert capped.name_expression == ("cuflash::flash_bwd_sm80<64, 64, 128, 8, 2, 99328, false, true, true, false, "
                                      "false, cuflash::bf16>")
    own = dispatch.backward_kernels("sm80", 192, "none", "bfloat16", head_dim_v=128)[1]
    assert own.name_expression.endswith("false, false, false, false, true, cuflash::bf16>")
    for bucket in dispatch.HEAD_DIM_BUCKETS:
        assert dispatch.backward_kernels("sm80", bucket, "none", "float16")[1].smem_bytes <= 227 * 1024
    assert preprocess.smem_bytes == convert.smem_bytes == 0
