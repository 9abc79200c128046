"""The forward's host side without a GPU: window normalisation against the reference semantics,
kernel choice per mask and softcap, and the grid and FwdParams a launch gets (kernels.launch
captured), for fixed-length and packed batches. The launch-plan cache: tests/test_launch_plans.py."""

from __future__ import annotations

import contextlib
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash._core import checks, dispatch, interop, kernels, plan
from cuflash._core.params import FWD_PARAMS, FWD_PARAMS_FP8, ArgumentBuffer
from cuflash._cpu.reference import allowed_keys

WINDOW_SIDES = (-1, 0, 1, 3, 6, 7, 8, 20)
FP8 = "float8_e4m3fn"


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 8), (8, 1), (7, 7), (5, 9), (9, 5)])
def test_kernel_window_keeps_the_mask(seqlen_q, seqlen_k):
    """Folding causal in and dropping sides that bound nothing changes no (query, key) pair, also
    when normalised against longer (packed) lengths."""
    for causal, left, right in itertools.product((False, True), WINDOW_SIDES, WINDOW_SIDES):
        expected = allowed_keys(seqlen_q, seqlen_k, causal=causal, window=(left, right))
        for bound_q, bound_k in ((seqlen_q, seqlen_k), (seqlen_q + 5, seqlen_k + 9)):
            window = dispatch.make_mask(causal, (left, right), 0.0, bound_q, bound_k).window
            assert np.array_equal(allowed_keys(seqlen_q, seqlen_k, window=window), expected), (causal, left, right)


def test_kernel_window_picks_the_cheapest_mask():
    def mask(causal, window, seqlen_q, seqlen_k):
        return dispatch.make_mask(causal, window, 0.0, seqlen_q, seqlen_k)

    assert mask(False, (-1, -1), 100, 100).kind == "none"
    assert mask(False, (99, 150), 100, 100).kind == "none"
    assert mask(True, (-1, 5), 100, 100).kind == "causal"
    assert mask(False, (-1, 0), 100, 100).kind == "causal"
    assert mask(True, (10**12, -1), 100, 100).kind == "causal"  # fits int32
    assert mask(True, (1, 0), 1, 100).window == (1, -1)  # one query sees the last key: no right bound
    assert mask(True, (98, -1), 100, 100).kind == "window"


def test_forward_kernel_flags():
    name = lambda mask, softcap: dispatch.forward_kernel("sm80", 128, mask, "bfloat16", softcap).name_expression  # noqa: E731
    assert name("none", False).endswith("false, false, false, cuflash::bf16>")
    assert name("causal", False).endswith("true, false, false, cuflash::bf16>")
    assert name("window", False).endswith("false, true, false, cuflash::bf16>")
    # Softcap serves every mask from the run-time window bounds.
    assert name("none", True) == name("causal", True) == name("window", True)
    assert name("none", True).endswith("false, true, true, cuflash::bf16>")
    assert dispatch.forward_kernel("sm80", 128, "causal", "bfloat16").blocks_slowest
    assert not dispatch.forward_kernel("sm80", 128, "causal", "bfloat16", True).blocks_slowest
    with pytest.raises(ValueError, match="mask"):
        dispatch.forward_kernel("sm80", 128, "local", "bfloat16")
    forward = [c for c in dispatch.all_kernels("sm80") if c.source == "sm80/flash_fwd.cu"]
    # Four mask kernels per bucket and 16-bit dtype, as many per bucket and output dtype of FP8 inputs, and
    # of the 16-bit kernels that read a KV cache.
    assert len(forward) == len(dispatch.HEAD_DIM_BUCKETS) * len(dispatch.ELEMENT_TYPES) * 4 * 3


def _tensor(shape, dtype="bfloat16", ptr=1 << 20, strides=None):
    strides = strides or tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    itemsize = {"float32": 4, "int32": 4, "float8_e4m3fn": 1}.get(dtype, 2)
    return interop.DeviceTensor(None, ptr, tuple(shape), strides, dtype, itemsize, 0)


@pytest.fixture
def launches(monkeypatch):
    """kernels.launch replaced by a recorder of (kernel, FwdParams, or FwdParamsFp8 for FP8
    inputs); new arrays are fake DeviceTensors."""
    calls = []
    monkeypatch.setattr(dispatch, "device_target", lambda device: ("sm80", (9, 0)))
    monkeypatch.setattr(plan, "PLANS", plan.PlanCache())
    monkeypatch.setattr(kernels, "get_function",
                        lambda choice, arch, device: SimpleNamespace(ptr=hash(choice.name_expression)))
    def record(kernel, stream, argument):
        struct = ArgumentBuffer.struct_bytes(argument)
        calls.append((kernel, np.frombuffer(struct, FWD_PARAMS_FP8 if len(struct) == FWD_PARAMS_FP8.itemsize
                                            else FWD_PARAMS)[0]))

    monkeypatch.setattr(kernels, "launch", record)
    monkeypatch.setattr(interop, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(interop, "stream_handle", lambda framework, device: 0)
    monkeypatch.setattr(interop, "allocate", lambda framework, like, shape, dtype=None:
                        (_tensor(shape, dtype or like.dtype, ptr=2 << 20), 2 << 20))
    return calls


def test_fixed_length_launch(launches):
    q, k = _tensor((2, 300, 8, 128)), _tensor((2, 1000, 2, 128), ptr=3 << 20)
    lse = _tensor((2, 8, 300), "float32", ptr=4 << 20)
    built = plan.build_forward(q, k, k, q, lse, 0.1, dispatch.make_mask(True, (256, -1), 30.0, 300, 1000), 2, 300)
    kernels.launch(built.kernel, 0, built.argument.fill(q.ptr, k.ptr, k.ptr, q.ptr, lse.ptr, 0, 0, 0, 0, 0, 0))
    (kernel, params), = launches
    choice = dispatch.forward_kernel("sm80", 128, "window", "bfloat16", True)
    assert kernel.function == hash(choice.name_expression) and kernel.grid == (3, 8, 2)
    assert (params["q"], params["k"], params["o"], params["lse"]) == (1 << 20, 3 << 20, 1 << 20, 4 << 20)
    assert (params["window_left"], params["window_right"]) == (256, 0)
    assert params["cu_seqlens_q"] == 0 and params["seqlen_k"] == 1000 and params["kv_group"] == 4
    assert (params["lse_batch_stride"], params["lse_head_stride"]) == (8 * 300, 300)
    # The softmax sees tanh(s * 0.1 / 30) * 30: scale_log2 carries the cap, the tanh the scale.
    assert params["scale_log2"] == pytest.approx(30 * math.log2(math.e))
    assert params["softcap_tanh_scale"] == pytest.approx(0.1 / 30)


def test_packed_launch(launches):
    q, k = _tensor((700, 8, 64)), _tensor((900, 8, 64), ptr=3 << 20)
    cu_q, cu_k = _tensor((4,), "int32", ptr=5 << 20), _tensor((4,), "int32", ptr=6 << 20)
    views = (checks.as_batch_of_one(t) for t in (q, k, k, q))
    mask = dispatch.make_mask(True, (-1, -1), 0.0, 700, 900)
    built = plan.build_forward(*views, _tensor((8, 700), "float32"), 0.125, mask, 3, 500, (cu_q, cu_k))
    out, lse = built.launch("cupy", (q, k, k), (None,), (None,), True, (cu_q, cu_k))
    (kernel, params), = launches
    assert lse.shape == (8, 700) and out.shape == q.shape
    assert kernel.grid == (8, 3, 4)  # causal: heads, batch, ceil(500 / 128) query blocks
    assert (params["cu_seqlens_q"], params["cu_seqlens_k"]) == (5 << 20, 6 << 20)
    assert (params["seq_end_q"], params["seq_end_k"]) == ((5 << 20) + 4, (6 << 20) + 4)  # cu_seqlens[1:]
    assert params["q_batch_stride"] == params["k_batch_stride"] == params["o_batch_stride"] == 0
    assert (params["lse_batch_stride"], params["lse_head_stride"]) == (0, 700)
    assert params["scale_log2"] == pytest.approx(0.125 * math.log2(math.e))


def test_fp8_launch_fills_the_descale_pointers(launches):
    """FP8 inputs on an sm80 device: sm80's kernel, FwdParamsFp8 with the descale arrays' pointers
    filled per call and the scalar folded into the scale (sm90's: tests/test_sm90_forward.py)."""
    q, k = _tensor((2, 300, 8, 64), FP8), _tensor((2, 500, 2, 64), FP8, ptr=3 << 20)
    descale_q, descale_v = _tensor((2, 2), "float32", ptr=5 << 20), _tensor((2, 2), "float32", ptr=6 << 20)
    mask = dispatch.make_mask(True, (-1, -1), 0.0, 300, 500)
    built = plan.build_forward(q, k, k, interop.contiguous(q.shape, q, "float16"),
                               _tensor((2, 8, 300), "float32"), 0.125, mask, 2, 300,
                               descales=(descale_q, 0.5, descale_v))
    out, lse = built.launch("cupy", (q, k, k, descale_q, 0.5, descale_v), (None,), (None,), False)
    (kernel, struct), = launches
    assert out.dtype == "float16" and lse is None
    assert kernel.function == hash(dispatch.forward_kernel("sm80", 64, "causal", FP8, out_dtype="float16")
                                   .name_expression)
    assert (struct["q"], struct["k"], struct["o"]) == (1 << 20, 3 << 20, 2 << 20)
    assert (struct["descale_q"], struct["descale_k"], struct["descale_v"]) == (5 << 20, 0, 6 << 20)
    assert struct["scale_log2"] == pytest.approx(0.125 * 0.5 * math.log2(math.e))


@pytest.mark.parametrize("window, softcap, packed, unequal", [
    ((-1, -1), 0.0, False, False),   # no mask
    ((-1, 0), 0.0, False, True),     # causal: a tile's keys grow with its rows
    ((1024, 0), 0.0, False, False),  # narrow bands: the same key blocks but near the ends
    ((256, 256), 0.0, False, False),
    ((0, 0), 0.0, False, False),
    ((1024, 1024), 0.0, False, True),  # wider bands: the persistent grid measured even or slower
    ((4096, 0), 0.0, False, True),
    ((1024, -1), 0.0, False, True),  # one-sided windows
    ((-1, 64), 0.0, False, True),
    ((1024, 0), 30.0, False, True),  # softcap kernels keep one CTA per tile
    ((1024, 0), 0.0, True, True),    # a packed batch's sequences differ
    ((-1, -1), 0.0, True, True),
])
def test_sm90_forward_grid_policy(window, softcap, packed, unequal, monkeypatch):
    """Which sm90 forward grids run persistent (one CTA per SM) over 16k keys: 2048 tiles."""
    monkeypatch.setattr(dispatch, "multiprocessors", lambda device: 132)
    mask = dispatch.make_mask(False, window, softcap, 16384, 16384)
    assert dispatch.sm90_tiles_unequal(mask, packed) is unequal
    assert dispatch.sm90_ctas(unequal, 16384, 2048, device=0) == (2048 if unequal else 132)
