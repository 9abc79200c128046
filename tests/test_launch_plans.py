"""The launch-plan cache (plan.PLANS) without a GPU: CuPy-like stand-in arrays, the kernels and
allocations stubbed, every launch recorded as (kernel, grid, block, shared memory, argument
bytes). A cache hit must launch exactly what a fresh computation launches, so a key that missed a
field that shapes a kernel or its arguments would show up here as a difference."""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

import cuflash
from cuflash import quantize
from cuflash._core import checks, dispatch, interop, kernels, plan
from cuflash._core.params import FWD_PARAMS, FWD_POINTERS, ArgumentBuffer, pack_fwd_params

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float32": np.dtype(np.float32), "int32": np.dtype(np.int32), "uint8": np.dtype(np.uint8)}


class FakeCupyArray:
    """What interop reads of a CuPy array: shape, byte strides, dtype, itemsize, data.ptr/device_id."""

    __module__ = "cupy._fake"  # interop.framework_of tells CuPy by the module

    def __init__(self, shape, dtype="float16", ptr=1 << 30, strides=None, device=0):
        self.shape, self.dtype = tuple(shape), DTYPES[dtype]
        self.itemsize = self.dtype.itemsize
        strides = strides or tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))
        self.strides = tuple(s * self.itemsize for s in strides)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)

    def copy(self):  # interop.realign
        return FakeCupyArray(self.shape, self.dtype.name, ptr=7 << 30)


@pytest.fixture
def gpu(monkeypatch):
    """A stub device: records launches and memsets, hands out pointers from a counter (reset by
    ``reset()`` so that two runs of one call see the same pointers), counts plan builds."""
    state = SimpleNamespace(launches=[], memsets=[], next_ptr=[5 << 30], builds=[])

    def take(nbytes):
        ptr = state.next_ptr[0]
        state.next_ptr[0] += -(-nbytes // 512) * 512
        return ptr

    def reset():
        state.launches.clear()
        state.memsets.clear()
        state.next_ptr[0] = 5 << 30

    def counted(build):
        def wrapper(*args, **kwargs):
            state.builds.append(build.__name__)
            return build(*args, **kwargs)
        return wrapper

    state.reset = reset
    monkeypatch.setattr(plan, "PLANS", plan.PlanCache())
    monkeypatch.setattr(dispatch, "device_target", lambda device: ("sm80", (9, 0)))
    monkeypatch.setattr(dispatch, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(plan, "build_forward", counted(plan.build_forward))
    monkeypatch.setattr(plan, "build_backward", counted(plan.build_backward))
    monkeypatch.setattr(kernels, "get_function",
                        lambda choice, arch, device: SimpleNamespace(ptr=hash((choice.name_expression, arch, device))))
    monkeypatch.setattr(kernels, "launch", lambda kernel, stream, argument: state.launches.append(
        (kernel, ArgumentBuffer.struct_bytes(argument))))
    monkeypatch.setattr(interop, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(interop, "stream_handle", lambda framework, device: 7)
    monkeypatch.setattr(interop, "allocate", lambda framework, like, shape, dtype=None: (
        lambda ptr: (FakeCupyArray(shape, dtype or like.dtype, ptr=ptr), ptr))(take(4 * math.prod(shape))))
    monkeypatch.setattr(interop, "scratch", lambda framework, like, nbytes: (None, take(nbytes)))
    monkeypatch.setattr(interop, "upload", lambda framework, like, host: (None, take(host.nbytes)))
    monkeypatch.setattr(interop, "zero", lambda ptr, nbytes, stream: state.memsets.append((ptr, nbytes)))
    return state


def _run(gpu, call):
    gpu.reset()
    call()
    return list(gpu.launches), list(gpu.memsets)


def _assert_transparent(gpu, calls):
    """Each call launches the same with the cache warm (earlier calls cached) as computed afresh."""
    for call in calls:
        cached = _run(gpu, call)
        warm, plan.PLANS = plan.PLANS, plan.PlanCache()
        fresh = _run(gpu, call)
        plan.PLANS = warm
        assert cached == fresh
        assert cached[0], "nothing launched"


def _strided(shape, dtype, layout, ptr):
    """BSHD ``shape`` as contiguous, with padded rows, or as a view of a BHSD array."""
    b, s, h, d = shape
    strides = {"contiguous": None, "padded": (s * h * (d + 64), h * (d + 64), d + 64, 1),
               "bhsd": (h * s * d, d, s * d, 1)}[layout]
    return FakeCupyArray(shape, dtype, ptr=ptr, strides=strides)


def _forward_calls(seed=0, count=120):
    """Random forward calls over a small pool of layouts and options, with repeats."""
    rng = random.Random(seed)
    pool = []
    for _ in range(count):
        dtype = rng.choice(["float16", "bfloat16"])
        head_dim = rng.choice([64, 128])
        heads_kv = rng.choice([1, 2, 4])
        q = _strided((2, rng.choice([33, 130]), 4, head_dim), dtype, rng.choice(["contiguous", "padded", "bhsd"]),
                     (1 << 30) + rng.choice([0, 0, 0, 4096, 2]))
        k, v = (_strided((2, rng.choice([50]), heads_kv, head_dim), dtype, rng.choice(["contiguous", "padded"]),
                         (2 << 30) + i * (1 << 28)) for i in range(2))
        options = dict(causal=rng.choice([False, True]), softmax_scale=rng.choice([None, 0.2, 1]),
                       window=rng.choice([(-1, -1), (8, 0), (3, 5), (100, -1)]), softcap=rng.choice([0.0, 30.0]),
                       return_lse=rng.choice([False, True]))
        if rng.random() < 0.3:
            options["out"] = _strided(q.shape, dtype, rng.choice(["contiguous", "padded"]), 3 << 30)
        pool.append((q, k, v, options))
    return [lambda q=q, k=k, v=v, o=o: cuflash.attention(q, k, v, **o) for q, k, v, o in
            (rng.choice(pool) for _ in range(3 * count))]


def test_forward_cache_is_transparent(gpu):
    _assert_transparent(gpu, _forward_calls())
    assert 0 < len(plan.PLANS) < 120


def _backward_call(rng):
    dtype = rng.choice(["float16", "bfloat16"])
    heads_kv = rng.choice([1, 2, 4])
    seqlen_q = rng.choice([33, 130])
    q = _strided((2, seqlen_q, 4, 64), dtype, rng.choice(["contiguous", "padded", "bhsd"]), 1 << 30)
    k, v = (_strided((2, 50, heads_kv, 64), dtype, rng.choice(["contiguous", "padded"]), (2 << 30) + i * (1 << 28))
            for i in range(2))
    out, dout = (_strided(q.shape, dtype, rng.choice(["contiguous", "bhsd"]), (3 << 30) + i * (1 << 28))
                 for i in range(2))
    lse = FakeCupyArray((2, 4, seqlen_q), "float32", ptr=4 << 30)
    options = dict(causal=rng.choice([False, True]), softmax_scale=rng.choice([None, 0.2]),
                   window=rng.choice([(-1, -1), (8, 0)]), softcap=rng.choice([0.0, 30.0]),
                   deterministic=rng.choice([False, True]))
    if rng.random() < 0.3:
        options["dk"] = _strided(k.shape, dtype, "padded", 6 << 30)
    return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **options)


def test_backward_cache_is_transparent(gpu):
    rng = random.Random(1)
    pool = [_backward_call(rng) for _ in range(60)]
    _assert_transparent(gpu, [rng.choice(pool) for _ in range(180)])


def test_varlen_cache_is_transparent(gpu):
    calls = []
    for dtype, heads_kv, causal, max_q, dq_given in itertools.product(["float16", "bfloat16"], [1, 2], [False, True],
                                                                      [40, 100], [False, True]):
        q, out, dout = (FakeCupyArray((120, 2, 64), dtype, ptr=(1 + i) << 30) for i in range(3))
        k = FakeCupyArray((90, heads_kv, 64), dtype, ptr=5 << 30)
        lse = FakeCupyArray((2, 120), "float32", ptr=6 << 30)
        cu_q, cu_k = (FakeCupyArray((4,), "int32", ptr=(8 + i) << 30) for i in range(2))
        grads = {"dq": FakeCupyArray((120, 2, 64), dtype, ptr=10 << 30)} if dq_given else {}
        calls.append(lambda q=q, k=k, cu_q=cu_q, cu_k=cu_k, c=causal, m=max_q: cuflash.attention_varlen(
            q, k, k, cu_q, cu_k, m, 60, causal=c, validate=False))
        calls.append(lambda q=q, k=k, out=out, dout=dout, lse=lse, cu_q=cu_q, cu_k=cu_k, c=causal, m=max_q, g=grads:
                     cuflash.attention_varlen_backward(dout, q, k, k, out, lse, cu_q, cu_k, m, 60, causal=c,
                                                       validate=False, **g))
    _assert_transparent(gpu, calls + calls[::-1])


def test_quantize_cache_is_transparent(gpu):
    calls = []
    for layout, dtype, granularity, rotate, seed in itertools.product(["contiguous", "padded", "bhsd"],
                                                                      ["float16", "float32"], quantize.GRANULARITIES,
                                                                      [False, True], [0, 1]):
        x = _strided((2, 33, 4, 64), dtype, layout, 1 << 30)
        calls.append(lambda x=x, g=granularity, r=rotate, s=seed: cuflash.quantize_fp8(
            x, g, block_size=16, rotate=r, seed=s, heads_kv=2))
    _assert_transparent(gpu, calls + calls[::-1])


def test_hit_skips_the_build_and_writes_the_new_pointers(gpu):
    q = FakeCupyArray((1, 64, 2, 64))
    cuflash.attention(q, q, q)
    assert gpu.builds == ["build_forward"] and len(plan.PLANS) == 1
    moved = FakeCupyArray((1, 64, 2, 64), ptr=9 << 30)
    launches, _ = _run(gpu, lambda: cuflash.attention(moved, moved, moved))
    assert gpu.builds == ["build_forward"]  # no second build
    params = np.frombuffer(launches[0][1], FWD_PARAMS)[0]
    assert params["q"] == params["k"] == params["v"] == 9 << 30 and params["o"] == 5 << 30 and params["lse"] == 0


def test_unreturned_lse_is_not_allocated(gpu, monkeypatch):
    """Without return_lse the kernel gets a null lse (it skips those stores) and nothing is
    allocated for it; with it, the array returned."""
    asked = []
    monkeypatch.setattr(interop, "scratch", lambda framework, like, nbytes: asked.append(nbytes) or (None, 9 << 30))
    q = FakeCupyArray((2, 64, 3, 64))
    cuflash.attention(q, q, q)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    assert asked == [] and lse.shape == (2, 3, 64)
    unreturned, returned = (np.frombuffer(argument, FWD_PARAMS)[0]["lse"] for _, argument in gpu.launches)
    assert unreturned == 0 and returned == lse.data.ptr


def test_layouts_and_options_key_separate_plans(gpu):
    """One field changed at a time: each a plan of its own, launching what it would uncached."""
    q = FakeCupyArray((1, 64, 2, 64))
    padded = _strided((1, 64, 2, 64), "float16", "padded", 1 << 30)
    variants = [
        lambda: cuflash.attention(q, q, q),
        lambda: cuflash.attention(padded, q, q),  # strides, of each input
        lambda: cuflash.attention(q, padded, q),
        lambda: cuflash.attention(q, q, padded),
        lambda: cuflash.attention(*[FakeCupyArray((1, 64, 1, 64))] * 3),  # shape
        lambda: cuflash.attention(*[FakeCupyArray((1, 64, 2, 64), "bfloat16")] * 3),  # dtype
        lambda: cuflash.attention(*[FakeCupyArray((1, 64, 2, 64), device=1)] * 3),  # device
        lambda: cuflash.attention(q, q, q, causal=True),
        lambda: cuflash.attention(q, q, q, softmax_scale=0.5),
        lambda: cuflash.attention(q, q, q, window=(4, 4)),
        lambda: cuflash.attention(q, q, q, softcap=5.0),
        lambda: cuflash.attention(q, q, q, out=_strided((1, 64, 2, 64), "float16", "padded", 2 << 30)),
    ]
    seen = set()
    for variant in variants:
        launches, _ = _run(gpu, variant)
        kernel, argument = launches[0]
        seen.add((kernel.function, kernel.grid, argument[8 * len(FWD_POINTERS):]))  # all but the pointers
    assert len(seen) == len(variants) == len(plan.PLANS)
    _assert_transparent(gpu, variants + variants[::-1])


def test_bad_input_after_a_cached_call_still_raises(gpu):
    q = FakeCupyArray((1, 64, 2, 64))
    cuflash.attention(q, q, q, softmax_scale=1, window=(1, 0))
    cuflash.attention_backward(q, q, q, q, q, FakeCupyArray((1, 2, 64), "float32"), softmax_scale=1, window=(1, 0))
    lse = FakeCupyArray((1, 2, 64), "float32")
    with pytest.raises(TypeError, match="softmax_scale"):
        cuflash.attention(q, q, q, softmax_scale=True, window=(1, 0))  # True == 1, same hash
    with pytest.raises(TypeError, match="window: expected integers"):
        cuflash.attention(q, q, q, softmax_scale=1, window=(True, 0))
    with pytest.raises(TypeError, match="softmax_scale"):
        cuflash.attention_backward(q, q, q, q, q, lse, softmax_scale=True, window=(1, 0))
    with pytest.raises(TypeError, match="window: expected integers"):
        cuflash.attention_backward(q, q, q, q, q, lse, softmax_scale=1, window=(True, 0))
    with pytest.raises(TypeError, match="softcap"):
        cuflash.attention_backward(q, q, q, q, q, lse, softmax_scale=1, window=(1, 0), softcap=False)
    cuflash.attention(q, q, q, out=FakeCupyArray((1, 64, 2, 64), ptr=2 << 30))
    with pytest.raises(ValueError, match="out: data pointer"):
        cuflash.attention(q, q, q, out=FakeCupyArray((1, 64, 2, 64), ptr=(2 << 30) + 8))
    with pytest.raises(ValueError, match="dq: data pointer"):
        cuflash.attention_backward(q, q, q, q, q, lse, softmax_scale=1, window=(1, 0),
                                   dq=FakeCupyArray((1, 64, 2, 64), ptr=(2 << 30) + 8))


def test_signatures_name_the_plan_of_their_checked_key(gpu, monkeypatch):
    """Two spellings of one call (the default scale, and the same scale given) are two signatures
    of one plan key: one plan is built, and each signature, once checked, skips the checks."""
    checked = []
    check = checks.check_forward
    monkeypatch.setattr(checks, "check_forward", lambda *args: checked.append(args) or check(*args))
    q = FakeCupyArray((1, 64, 2, 64))
    for _ in range(3):
        cuflash.attention(q, q, q)
        cuflash.attention(q, q, q, softmax_scale=64 ** -0.5)
    assert gpu.builds == ["build_forward"] and len(plan.PLANS) == 1 and len(checked) == 2


def test_misaligned_inputs_are_copied_and_checked_every_call(gpu, monkeypatch):
    """A tensor whose pointer or strides are not 16-byte aligned is copied; the plan is the copy's
    (contiguous like q: the first call's plan), and no signature is recorded for the call, whose
    own tensors the plan cannot launch on."""
    checked = []
    check = checks.check_forward
    monkeypatch.setattr(checks, "check_forward", lambda *args: checked.append(args) or check(*args))
    q = FakeCupyArray((1, 64, 2, 64))
    cuflash.attention(q, q, q)
    misaligned = [FakeCupyArray((1, 64, 2, 64), ptr=(1 << 30) + 2),
                  FakeCupyArray((1, 64, 2, 64), strides=(64 * 2 * 68, 2 * 68, 68, 1))]  # rows of 136 bytes
    for x in misaligned * 2:
        launches, _ = _run(gpu, lambda: cuflash.attention(x, q, q))
        assert np.frombuffer(launches[0][1], FWD_PARAMS)[0]["q"] == 7 << 30  # the realigned copy
    assert gpu.builds == ["build_forward"] and len(plan.PLANS) == 1 and len(checked) == 5


def test_a_new_device_plan_rebuilds(gpu, monkeypatch):
    q = FakeCupyArray((1, 64, 2, 64))
    cuflash.attention(q, q, q)
    monkeypatch.setattr(dispatch, "device_target", lambda device: ("sm80", (8, 0)))  # e.g. after cache_clear()
    launches, _ = _run(gpu, lambda: cuflash.attention(q, q, q))
    assert gpu.builds == ["build_forward"] * 2
    name = dispatch.forward_kernel("sm80", 64, "none", "float16").name_expression
    assert launches[0][0].function == hash((name, "sm_80", 0))  # the kernel compiled for the new arch
    assert plan.PLANS.items()[0][1].target == ("sm80", (8, 0))


def test_cache_is_bounded(gpu, monkeypatch):
    monkeypatch.setattr(plan.PLANS, "max_size", 4)
    for seqlen in range(1, 11):
        cuflash.attention(*[FakeCupyArray((1, seqlen, 1, 64))] * 3)
    assert len(plan.PLANS) == 4
    keys = [key for key, _ in plan.PLANS.items()]
    assert all(key[1][0] == (1, seqlen, 1, 64) for key, seqlen in zip(keys, range(7, 11)))


def test_backward_scratch_layout(gpu):
    """One scratch allocation: dq_accum (and GQA's dk/dv accumulators unless deterministic) zeroed
    by one memset, delta after them, each on a 512-byte boundary."""
    q = FakeCupyArray((2, 100, 4, 64))
    k = FakeCupyArray((2, 80, 2, 64))
    lse = FakeCupyArray((2, 4, 100), "float32")
    plans = {}
    for deterministic in (False, True):
        cuflash.attention_backward(q, q, k, k, q, lse, deterministic=deterministic)
        plans[deterministic] = plan.PLANS.items()[-1][1]
    dq_bytes = 4 * 2 * 4 * 100 * 64  # splits 1, (batch, heads, rows, bucket)
    atomic = plans[False]
    assert atomic.offsets[1] == 0 and atomic.offsets[2] == dq_bytes
    kv_bytes = 4 * 2 * 80 * 2 * 64
    assert atomic.offsets[3] == dq_bytes + kv_bytes and atomic.zeroed_bytes == atomic.offsets[0] == dq_bytes + 2 * kv_bytes
    ordered = plans[True]
    assert ordered.zeroed_bytes == ordered.offsets[2]  # dq_accum only
    assert atomic.offsets[4] is None and ordered.offsets[4] is None  # sm80 walks: no turn counters
    assert all(offset % 512 == 0 for built in plans.values() for offset in built.offsets if offset is not None)


def test_argument_buffer_matches_numpy_packing():
    def record(shape, ptr, dtype="bfloat16"):
        return interop.DeviceTensor(None, ptr, shape, tuple(math.prod(shape[i + 1:]) for i in range(len(shape))),
                                    dtype, 4 if dtype == "float32" else 2, 0)

    q, k = record((2, 30, 8, 128), 1 << 20), record((2, 40, 2, 128), 2 << 20)
    lse = record((2, 8, 30), 3 << 20, "float32")
    packed = pack_fwd_params(q, k, k, q, lse, 0.1, (5, 0), 3.0)
    buffer = ArgumentBuffer(packed, FWD_POINTERS)
    first = buffer.fill(11 << 20, 12 << 20, 13 << 20, 14 << 20, 15 << 20, 0, 0, 0, 0, 0, 0)
    second = buffer.fill(q.ptr, k.ptr, k.ptr, q.ptr, lse.ptr, 0, 0, 0, 0, 0, 0)
    assert ArgumentBuffer.struct_bytes(second) == packed.tobytes()
    repacked = pack_fwd_params(q._replace(ptr=11 << 20), k._replace(ptr=12 << 20), k._replace(ptr=13 << 20),
                               q._replace(ptr=14 << 20), lse._replace(ptr=15 << 20), 0.1, (5, 0), 3.0)
    assert ArgumentBuffer.struct_bytes(first) == repacked.tobytes()  # the first fill is its own copy
    # cuLaunchKernel's kernelParams: slot 0 holds the address of the struct right after it.
    import ctypes
    assert first[0] == ctypes.addressof(first) + 8 and second[0] == ctypes.addressof(second) + 8


def test_backward_fields_key_separate_plans(gpu):
    """The backward, one field changed at a time, as for the forward."""
    q = FakeCupyArray((1, 64, 2, 64))
    k = FakeCupyArray((1, 64, 1, 64))
    padded = _strided((1, 64, 2, 64), "float16", "padded", 1 << 30)
    lse = FakeCupyArray((1, 2, 64), "float32")
    variants = [lambda: cuflash.attention_backward(q, q, q, q, q, lse)]
    for name in ("dout", "q", "k", "v", "out", "dq", "dk", "dv"):
        args = {"dout": q, "q": q, "k": q, "v": q, "out": q, "lse": lse, name: padded}
        variants.append(lambda args=args: cuflash.attention_backward(**args))
    variants += [
        lambda: cuflash.attention_backward(q, q, k, k, q, lse),  # GQA
        lambda: cuflash.attention_backward(q, q, k, k, q, lse, deterministic=True),
        lambda: cuflash.attention_backward(q, q, q, q, q, lse, deterministic=True),
        lambda: cuflash.attention_backward(q, q, q, q, q, lse, causal=True),
        lambda: cuflash.attention_backward(q, q, q, q, q, lse, softmax_scale=0.5),
        lambda: cuflash.attention_backward(q, q, q, q, q, lse, window=(4, 4)),
        lambda: cuflash.attention_backward(q, q, q, q, q, lse, softcap=5.0),
    ]
    for variant in variants:
        variant()
    assert len(plan.PLANS) == len(variants)
    _assert_transparent(gpu, variants + variants[::-1])


def test_total_length_zero_fills_and_launches_nothing(gpu, monkeypatch):
    """A packed batch whose keys are all empty: out filled with 0 and lse with -inf, the
    gradients with 0, by the framework's fill; nothing launched, nothing planned."""
    filled = []
    monkeypatch.setattr(FakeCupyArray, "fill", lambda self, value: filled.append((self.shape, value)), raising=False)
    q, empty, cu = FakeCupyArray((50, 2, 64)), FakeCupyArray((0, 2, 64)), FakeCupyArray((3,), "int32")
    out, lse = cuflash.attention_varlen(q, empty, empty, cu, cu, 30, 0, return_lse=True, validate=False)
    assert filled == [((50, 2, 64), 0.0), ((2, 50), -math.inf)] and (out.shape, lse.shape) == ((50, 2, 64), (2, 50))
    filled.clear()
    dq, dk, dv = cuflash.attention_varlen_backward(out, q, empty, empty, out, lse, cu, cu, 30, 0, validate=False)
    assert filled == [((50, 2, 64), 0.0), ((0, 2, 64), 0.0), ((0, 2, 64), 0.0)]
    assert not gpu.launches and not gpu.memsets and not gpu.builds and len(plan.PLANS) == 0
