"""Dropout through cuflash's entry points on NumPy inputs (the CPU path): against the float64
references with the mask regenerated from (seed, offset) and the DESIGN.md error rule, the mask
shared by the forward, the backward and a packed batch, reproducibility per seed, the argument
checks, and what GPU calls hand the kernels (on CuPy-like stand-ins, no GPU needed)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._cpu import philox
from cuflash._cpu.reference import (
    attention_backward_reference,
    attention_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
    max_error_bound,
)
from cuflash._core import checks, dispatch
from cuflash._core.params import BWD_PARAMS, DROPOUT_WORDS, FWD_PARAMS
from tests import test_launch_plans
from tests.test_launch_plans import FakeCupyArray
from tests.host_entries import call_entry, random_qkv

gpu = test_launch_plans.gpu  # the stub device's fixture

BF16 = np.dtype(ml_dtypes.bfloat16)


def _inputs(seed, shape_q, shape_kv, dtype, head_dim_v=None):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, shape_q, shape_kv, dtype, head_dim_v)
    dout = rng.standard_normal((*shape_q[:-1], head_dim_v or shape_kv[-1])).astype(dtype)
    return q, k, v, dout


def _within_rule(got, ref, lowp, atol=1e-5):
    ok, err, bound = max_error_bound(got, ref, lowp, atol=atol)
    assert ok, (err, bound)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("seqlen_q, seqlen_k, heads_kv, causal, window, softcap", [
    (17, 17, 4, False, (-1, -1), 0.0),
    (1, 113, 1, True, (-1, -1), 0.0),
    (113, 67, 2, True, (-1, -1), 0.0),  # rows of no key: out 0, lse -inf
    (67, 113, 2, False, (16, 3), 30.0),
])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_forward_and_backward_against_the_reference(dtype, seqlen_q, seqlen_k, heads_kv, causal, window, softcap, p):
    q, k, v, dout = _inputs(seqlen_q + seqlen_k, (2, seqlen_q, 4, 64), (2, seqlen_k, heads_kv, 64), dtype)
    options = dict(causal=causal, window=window, softcap=softcap, dropout_p=p, seed=2**63 + 12345, offset=99)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, **options)
    lowp, _ = attention_reference(q, k, v, dtype=dtype, **options)
    assert out.dtype == dtype and lse.dtype == np.float32
    _within_rule(out, ref, lowp)
    # The lse is the undropped softmax's.
    plain_lse = attention_reference(q, k, v, causal=causal, window=window, softcap=softcap)[1]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ref_lse, plain_lse)

    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    ref_grads = attention_backward_reference(dout, q, k, v, **options)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        _within_rule(got, want, want.astype(dtype), atol=2e-3)


def test_float64_matches_the_reference_given_the_streams_mask():
    """Exact in float64, with the mask passed explicitly as philox draws it: the entry points'
    mask is the stream's, forward and backward alike; another seed's mask is not."""
    q, k, v, dout = _inputs(3, (2, 37, 4, 32), (2, 29, 2, 32), np.float64)
    seed, offset, p = 77, 5, 0.3
    mask = philox.keep_mask(seed, offset, p, 4, 37, 29, 2)
    options = dict(causal=True, dropout_p=p)
    out, lse = cuflash.attention(q, k, v, return_lse=True, seed=seed, offset=offset, **options)
    ref, ref_lse = attention_reference(q, k, v, dropout_mask=mask, **options)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)  # lse is float32
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, seed=seed, offset=offset, **options)
    ref_grads = attention_backward_reference(dout, q, k, v, dropout_mask=mask, **options)
    for got, want in zip(grads, ref_grads):  # P recomputed from the float32 lse
        np.testing.assert_allclose(got, want, atol=1e-6)
    other = attention_reference(q, k, v, dropout_mask=philox.keep_mask(seed + 1, offset, p, 4, 37, 29, 2),
                                **options)[0]
    assert np.abs(other - ref).max() > 1e-2
    # The backward of another seed is not the forward's gradient.
    wrong = cuflash.attention_backward(dout, q, k, v, out, lse, seed=seed + 1, offset=offset, **options)
    assert np.abs(wrong[2] - ref_grads[2]).max() > 1e-2


def test_dropout_zero_is_no_dropout_and_p_scales_the_kept_probabilities():
    q, k, v, _ = _inputs(5, (1, 33, 2, 16), (1, 33, 2, 16), np.float64)
    plain = cuflash.attention(q, k, v)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, dropout_p=0.0, seed=3, offset=4), plain)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, dropout_p=0.0), plain)
    # v of ones: each output element is the sum of the row's kept probabilities / (1 - p), 1 on average.
    ones = np.ones_like(v)
    out = cuflash.attention(q, k, ones, dropout_p=0.25, seed=8)
    p_full, _ = attention_reference(q, k, ones, dropout_p=0.25, dropout_mask=np.ones((1, 2, 33, 33), bool))
    np.testing.assert_allclose(p_full, 1 / 0.75)
    assert (out <= 1 / 0.75 + 1e-12).all() and abs(out.mean() - 1) < 0.15


def test_same_seed_repeats_and_other_seeds_or_offsets_differ():
    q, k, v, dout = _inputs(7, (2, 40, 4, 32), (2, 40, 4, 32), np.float32)

    def run(seed, offset):
        out, lse = cuflash.attention(q, k, v, return_lse=True, dropout_p=0.2, seed=seed, offset=offset)
        return (out, *cuflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.2, seed=seed, offset=offset))

    first = run(123, 0)
    for a, b in zip(first, run(123, 0)):
        np.testing.assert_array_equal(a, b)
    for other in (run(124, 0), run(123, philox.increment(2, 4))):
        for a, b in zip(first, other):
            assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_varlen_with_empty_sequences_against_the_reference(dtype):
    lengths_q, lengths_k = [17, 0, 5, 33], [23, 4, 0, 40]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q, k, v, dout = _inputs(11, (cu_q[-1], 4, 64), (cu_k[-1], 2, 64), dtype)
    options = dict(causal=True, dropout_p=0.15, seed=31, offset=2)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    lowp, _ = attention_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, **options)
    _within_rule(out, ref, lowp)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    ref_grads = attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k, **options)
    for got, want in zip(grads, ref_grads):
        _within_rule(got, want, want.astype(dtype), atol=2e-3)


def test_a_packed_sequence_draws_the_mask_of_its_batch_entry():
    """Packed and fixed-length forms of one batch give the same dropped outputs and gradients: the
    mask of sequence b is that of batch entry b, positions within the sequence."""
    q, k, v, dout = _inputs(13, (3, 21, 4, 16), (3, 21, 2, 16), np.float64)
    options = dict(causal=True, dropout_p=0.4, seed=5, offset=9)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v, dout)]
    cu = np.arange(0, 64, 21, dtype=np.int32)
    out_p, lse_p = cuflash.attention_varlen(*packed[:3], cu, cu, return_lse=True, **options)
    np.testing.assert_allclose(out_p, out.reshape(-1, 4, 16), atol=1e-12)
    grads_p = cuflash.attention_varlen_backward(packed[3], *packed[:3], out_p, lse_p, cu, cu, **options)
    for got, want in zip(grads_p, grads):  # the fixed-length backward reads the float32 lse
        np.testing.assert_allclose(got, want.reshape(got.shape), atol=1e-6)


def test_dropout_with_sinks_and_alibi():
    q, k, v, dout = _inputs(17, (1, 30, 4, 32), (1, 30, 2, 32), np.float64)
    sinks = np.array([-1.0, 0.0, 1.0, 2.0])
    slopes = np.linspace(0.1, 0.4, 4).astype(np.float32)
    options = dict(causal=True, sinks=sinks, alibi_slopes=slopes, dropout_p=0.2, seed=3)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, **options)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)  # lse is float32
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    for got, want in zip(grads, attention_backward_reference(dout, q, k, v, **options)):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("entry", ["forward", "backward", "varlen", "varlen_backward"])
@pytest.mark.parametrize("options, error, words", [
    (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p: expected a probability in \[0, 1\)"),
    (dict(dropout_p=-0.1, seed=1), ValueError, "dropout_p: expected a probability"),
    (dict(dropout_p=float("nan"), seed=1), ValueError, "dropout_p: expected a probability"),
    (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p: expected a real number"),
    (dict(dropout_p=True, seed=1), TypeError, "dropout_p: expected a real number"),
    (dict(dropout_p=0.1), ValueError, "seed: dropout_p > 0 needs a seed"),
    (dict(dropout_p=0.1, seed=1.5), TypeError, "seed: expected an integer, got float"),
    (dict(dropout_p=0.1, seed="7"), TypeError, "seed: expected an integer, got str"),
    (dict(dropout_p=0.1, seed=True), TypeError, "seed: expected an integer, got bool"),
    (dict(dropout_p=0.1, seed=-1), ValueError, r"seed: expected an integer in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, seed=2**64), ValueError, "seed: expected an integer in"),
    (dict(dropout_p=0.1, seed=1, offset=-1), ValueError, "offset: expected an integer in"),
    (dict(dropout_p=0.1, seed=1, offset=2.0), TypeError, "offset: expected an integer"),
    (dict(dropout_p=0.0, seed=0.5), TypeError, "seed: expected an integer"),
])
def test_bad_dropout_arguments_name_the_argument(entry, options, error, words):
    q, k, v, _ = _inputs(19, (2, 9, 4, 64), (2, 11, 2, 64), np.float32)
    with pytest.raises(error, match=words):
        call_entry(entry, q, k, v, **options)


def test_numpy_integers_are_seeds():
    q, k, v, _ = _inputs(23, (1, 9, 2, 16), (1, 9, 2, 16), np.float64)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, dropout_p=0.5, seed=np.uint64(2**64 - 1)),
                                  cuflash.attention(q, k, v, dropout_p=0.5, seed=2**64 - 1))


def _fake_qkv(packed=False):
    lead = (24,) if packed else (2, 12)
    return (FakeCupyArray((*lead, 4, 64), ptr=1 << 30), FakeCupyArray((*lead, 2, 64), ptr=2 << 30),
            FakeCupyArray((*lead, 2, 64), ptr=3 << 30))


def _dropout_fields(params) -> tuple:
    return tuple(params[name].item() for name in ("dropout_threshold", "dropout_scale", *DROPOUT_WORDS))


def test_gpu_calls_pack_the_dropout_into_the_kernels_params(gpu, monkeypatch):
    """The plan holds the threshold and 1 / (1 - p) (keyed by p); each launch writes the seed and
    offset, or the device pair's pointer; dropout runs the window kernel; p = 0 is no dropout.
    Behind checks.GPU_DROPOUT, turned on here."""
    monkeypatch.setattr(checks, "GPU_DROPOUT", True)
    windows = []
    make_mask = dispatch.make_mask
    monkeypatch.setattr(dispatch, "make_mask", lambda *args: windows.append(make_mask(*args)) or windows[-1])
    q, k, v = _fake_qkv()
    scale = float(np.float32(1 / 0.9))
    cuflash.attention(q, k, v, dropout_p=0.1, seed=2**64 - 1, offset=7)
    assert _dropout_fields(np.frombuffer(gpu.launches[-1][1], FWD_PARAMS)[0]) == (
        philox.keep_threshold(0.1), scale, 0, 2**64 - 1, 7)
    assert windows[-1].kind == "window" and windows[-1].dropout
    cuflash.attention(q, k, v, dropout_p=0.1, seed=_fake_int64((2,)))
    assert _dropout_fields(np.frombuffer(gpu.launches[-1][1], FWD_PARAMS)[0]) == (
        philox.keep_threshold(0.1), scale, 9 << 30, 0, 0)
    assert gpu.builds == ["build_forward"]  # one plan: the seeds are the launch's
    cuflash.attention(q, k, v, dropout_p=0.0, seed=3)
    assert _dropout_fields(np.frombuffer(gpu.launches[-1][1], FWD_PARAMS)[0]) == (0, 0.0, 0, 0, 0)
    assert windows[-1].kind == "none" and gpu.builds == ["build_forward"] * 2

    out, dout = FakeCupyArray((2, 12, 4, 64), ptr=4 << 30), FakeCupyArray((2, 12, 4, 64), ptr=5 << 30)
    lse = FakeCupyArray((2, 4, 12), "float32", ptr=6 << 30)
    gpu.reset()
    cuflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.5, seed=11, offset=2)
    # The preprocess and the main kernel share BwdParams.
    assert _dropout_fields(np.frombuffer(gpu.launches[1][1], BWD_PARAMS)[0]) == (
        philox.keep_threshold(0.5), 2.0, 0, 11, 2)

    q, k, v = _fake_qkv(packed=True)
    cu_q, cu_k = FakeCupyArray((3,), "int32", ptr=7 << 30), FakeCupyArray((3,), "int32", ptr=8 << 30)
    cuflash.attention_varlen(q, k, v, cu_q, cu_k, 12, 12, validate=False, dropout_p=0.25, seed=_fake_int64((2,)))
    assert _dropout_fields(np.frombuffer(gpu.launches[-1][1], FWD_PARAMS)[0]) == (
        philox.keep_threshold(0.25), float(np.float32(1 / 0.75)), 9 << 30, 0, 0)
    out, dout = FakeCupyArray((24, 4, 64), ptr=4 << 30), FakeCupyArray((24, 4, 64), ptr=5 << 30)
    lse = FakeCupyArray((4, 24), "float32", ptr=6 << 30)
    gpu.reset()
    cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 12, 12, validate=False, dropout_p=0.25,
                                      seed=5, offset=1)
    assert _dropout_fields(np.frombuffer(gpu.launches[1][1], BWD_PARAMS)[0]) == (
        philox.keep_threshold(0.25), float(np.float32(1 / 0.75)), 0, 5, 1)


def test_sm90_d64_dropout_takes_the_two_consumer_forward():
    for softcap in (False, True):
        choice = dispatch.forward_kernel("sm90", 64, "window", "float16", softcap, dropout=True)
        assert choice == dispatch.forward_kernel("sm90", 64, "window", "float16", softcap, alibi=True)
        assert choice.tile.block_m == 128  # two consumer warpgroups of 64 rows
        assert choice in dispatch.all_kernels("sm90")
    with pytest.raises(ValueError, match="dropout: dropout runs the 16-bit window kernel"):
        dispatch.forward_kernel("sm90", 64, "causal", "float16", dropout=True)


def test_sm90_dropout_with_softcap_takes_sm80s_backward(monkeypatch):
    from cuflash._core import interop

    monkeypatch.setattr(dispatch, "multiprocessors", lambda device: 132)
    q = interop.DeviceTensor(None, 1 << 20, (2, 128, 4, 64), (32768, 256, 64, 1), "float16", 2, 0)
    for softcap, dropout, family in ((30.0, True, "sm80"), (0.0, True, "sm90"), (30.0, False, "sm90")):
        mask = dispatch.make_mask(False, (-1, -1), softcap, 128, 128, dropout=dropout)
        assert dispatch.backward_launch("sm90", q, q, q, q, mask, 2, 128, False, 0).main.family == family


def test_gpu_dropout_is_refused_until_turned_on():
    with pytest.raises(NotImplementedError, match="dropout_p: not yet taken by the GPU kernels"):
        checks.check_dropout(0.1, 3, 0, "cupy", FakeCupyArray((1, 8, 2, 64)))
    assert checks.check_dropout(0.0, 3, 0, "cupy", FakeCupyArray((1, 8, 2, 64))) is None


def test_fp8_gpu_inputs_refuse_dropout(monkeypatch):
    from cuflash._core import plan

    monkeypatch.setattr(checks, "GPU_DROPOUT", True)

    monkeypatch.setattr(plan, "run", lambda *args, **kwargs: pytest.fail("a plan ran"))
    q = FakeCupyArray((2, 12, 4, 64), "uint8", ptr=1 << 30)
    with pytest.raises(NotImplementedError, match="dropout_p: not taken with FP8 inputs"):
        cuflash.attention(q, q, q, dtype="e4m3", dropout_p=0.1, seed=1)


def test_gpu_dropout_arguments_are_checked():
    with pytest.raises(ValueError, match="dropout_p: expected a probability"):
        cuflash.attention(*_fake_qkv(), dropout_p=1.5, seed=1)
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        cuflash.attention(*_fake_qkv(), dropout_p=0.5)
    with pytest.raises(ValueError, match=r"k: heads_kv \(3\) must divide"):  # the call's other checks come first
        cuflash.attention(FakeCupyArray((2, 12, 4, 64), ptr=1 << 30), FakeCupyArray((2, 12, 3, 64), ptr=2 << 30),
                          FakeCupyArray((2, 12, 3, 64), ptr=3 << 30), dropout_p=0.5, seed=1)


def _fake_int64(shape, device=0):
    """A CuPy-like int64 array (FakeCupyArray knows no int64)."""
    x = FakeCupyArray(shape, "int32", ptr=9 << 30, device=device)
    x.dtype, x.itemsize = np.dtype(np.int64), 8
    x.strides = tuple(2 * s for s in x.strides)
    return x


def test_a_gpu_seed_must_be_a_device_array_of_seed_and_offset(monkeypatch):
    from cuflash._core import plan

    monkeypatch.setattr(plan, "run", lambda *args, **kwargs: pytest.fail("a plan ran"))
    seed = _fake_int64((2,))
    strided = _fake_int64((2,))
    strided.strides = (16,)
    for bad, error, words in ((FakeCupyArray((2,), "int32", ptr=9 << 30), ValueError, "seed: a device array holds"),
                              (strided, ValueError, "seed: a device array holds"),
                              (_fake_int64((3,)), ValueError, "seed: a device array holds"),
                              (_fake_int64((2,), device=1), ValueError, "seed: on device 1"),
                              (np.zeros(2, np.int64), TypeError, "seed: expected an integer, or an int64 array")):
        with pytest.raises(error, match=words):
            cuflash.attention(*_fake_qkv(), dropout_p=0.1, seed=bad)
    with pytest.raises(ValueError, match="offset: a device seed array holds the offset"):
        cuflash.attention(*_fake_qkv(), dropout_p=0.1, seed=seed, offset=3)
    # NumPy inputs take integers only.
    q, k, v, _ = _inputs(29, (1, 9, 2, 16), (1, 9, 2, 16), np.float32)
    with pytest.raises(TypeError, match="seed: expected an integer"):
        cuflash.attention(q, k, v, dropout_p=0.1, seed=np.zeros(2, np.int64))
