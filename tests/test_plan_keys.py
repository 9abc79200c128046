"""Plan keys without a GPU: for every operation, a checked call (a checks record) and calls that
differ from it in one field the plan reads each get a key of their own, while calls that differ
only in pointers, or in the values behind them, share the key. Each record's fields are all named
here, as varied or as the launch's alone, so that a field added to a record fails this test until
its plan_key says what becomes of it. That a cache hit launches what a fresh plan launches:
tests/test_launch_plans.py and tests/test_kvcache_plan.py."""

from __future__ import annotations

import math

import numpy as np

from cuflash._core import checks, interop


def tensor(shape, dtype="float16", ptr=1 << 20, strides=None, device=0) -> interop.DeviceTensor:
    strides = strides or tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    itemsize = {"float32": 4, "int32": 4, "float8_e4m3fn": 1}.get(dtype, 2)
    return interop.DeviceTensor(None, ptr, tuple(shape), strides, dtype, itemsize, device)


def relayouts(t: interop.DeviceTensor) -> list[interop.DeviceTensor]:
    """``t`` with one part of its layout changed at a time: shape, strides, dtype, device."""
    other_dtype = {"float16": "bfloat16", "int32": "float32"}.get(t.dtype, "float16")
    return [t._replace(shape=(*t.shape[:-1], t.shape[-1] + 8)),
            t._replace(strides=(*t.strides[:-2], t.strides[-2] + 64, 1) if t.ndim > 1 else (2,)),
            t._replace(dtype=other_dtype), t._replace(device=t.device + 1)]


def moved(x):
    """``x`` with every DeviceTensor in it at another 16-byte-aligned address, and NumPy arrays
    (host copies of values) holding other values."""
    if isinstance(x, interop.DeviceTensor):
        return x._replace(ptr=x.ptr + (64 << 20))
    if isinstance(x, np.ndarray):
        return x + 1
    if isinstance(x, dict):
        return {name: moved(value) for name, value in x.items()}
    if isinstance(x, tuple):  # the records, Lengths and Fp8 among them
        return type(x)(*map(moved, x)) if hasattr(x, "_fields") else tuple(map(moved, x))
    return x


def assert_keyed(base, variants: dict[str, list], launch_only: tuple[str, ...] = ()) -> None:
    """Each variant (``base`` with one field replaced) keys a plan of its own; ``base`` with its
    pointers moved keys base's. Every field of the record is a key of ``variants`` or named in
    ``launch_only``."""
    assert set(base._fields) == set(variants) | set(launch_only), "a field neither keyed nor the launch's"
    key = base.plan_key()
    hash(key)
    for field, values in variants.items():
        assert values, field
        for value in values:
            assert base._replace(**{field: value}).plan_key() != key, (field, value)
    assert moved(base).plan_key() == key


def lengths(batch=3, max_seqlen_q=40, max_seqlen_k=60) -> checks.Lengths:
    host = np.array([0, 10, 30, 60][:batch + 1])
    cu = tensor((batch + 1,), "int32", ptr=9 << 20)
    return checks.Lengths(host, host, cu, cu._replace(ptr=10 << 20), batch, max_seqlen_q, max_seqlen_k, host, host,
                          tensor((batch,), "int32", ptr=11 << 20), tensor((batch,), "int32", ptr=12 << 20))


FP8 = checks.Fp8("bfloat16", 0.5, tensor((2, 2), "float32", ptr=13 << 20), 1.0)
FP8_VARIANTS = [FP8._replace(out_dtype="float16"), FP8._replace(descale_q=0.25), FP8._replace(descale_v=0.5),
                FP8._replace(descale_q=tensor((2, 2), "float32", ptr=13 << 20)),
                *(FP8._replace(descale_k=t) for t in relayouts(FP8.descale_k))]


def options(base) -> dict[str, list]:
    """Other values of the options every attention record holds: ALiBi slopes' presence and batch
    stride among them (the sinks are a pointer only, the launch's), and in the forward's and the
    backward's, dropout's probability (its seed and offset are the launch's)."""
    varied = {"scale": [base.scale * 2], "causal": [not base.causal], "window": [(4, 0), (-1, 4)], "softcap": [30.0],
              "alibi": [0, 8] if base.alibi is None else [None, base.alibi + 8]}
    if "dropout" in base._fields:
        varied["dropout"] = [0.1, 0.5] if base.dropout == 0.0 else [0.0, base.dropout / 2]
    return varied


def test_fp8_options():
    key = FP8.plan_key()
    assert all(variant.plan_key() != key for variant in FP8_VARIANTS)
    assert moved(FP8).plan_key() == key


def test_forward():
    q, k = tensor((2, 64, 4, 64)), tensor((2, 80, 2, 64), ptr=2 << 20)
    v, out = k._replace(ptr=3 << 20), q._replace(ptr=4 << 20)
    base = checks.ForwardCall(q, k, v, None, 0.125, False, (-1, -1), 0.0, None)
    variants = {"q": relayouts(q), "k": relayouts(k), "v": relayouts(v), "out": [out, *relayouts(out)],
                "fp8": [FP8], "lengths": [lengths()], **options(base)}
    assert_keyed(base, variants)
    assert_keyed(base._replace(out=out, fp8=FP8),
                 variants | {"out": [None, *relayouts(out)], "fp8": [None, *FP8_VARIANTS]})
    assert_keyed(base._replace(dropout=0.1), variants | options(base._replace(dropout=0.1)))


def test_varlen_forward():
    q, k = tensor((120, 4, 64)), tensor((90, 2, 64), ptr=2 << 20)
    v = k._replace(ptr=3 << 20)
    base = checks.ForwardCall(q, k, v, None, 0.125, True, (-1, -1), 0.0, None, lengths())
    # The longest key sequence is the forward's to check, not to plan: its grid covers the queries.
    assert base._replace(lengths=lengths(max_seqlen_k=90)).plan_key() == base.plan_key()
    assert_keyed(base, {"q": relayouts(q), "k": relayouts(k), "v": relayouts(v), "out": [q._replace(ptr=4 << 20)],
                        "fp8": [FP8], "lengths": [None, lengths(batch=2), lengths(max_seqlen_q=41)],
                        **options(base)})


def test_backward():
    q, k = tensor((2, 64, 4, 64)), tensor((2, 80, 2, 64), ptr=2 << 20)
    lse = tensor((2, 4, 64), "float32", ptr=5 << 20)
    inputs = {"q": q, "k": k, "v": k._replace(ptr=3 << 20), "out": q._replace(ptr=4 << 20),
              "dout": q._replace(ptr=6 << 20), "lse": lse}
    grads = {"dq": q._replace(ptr=7 << 20), "dk": k._replace(ptr=8 << 20), "dv": k._replace(ptr=9 << 20)}
    base = checks.BackwardCall(**inputs, dq=None, dk=None, dv=None, scale=0.125, causal=False, window=(-1, -1),
                               softcap=0.0, deterministic=False)
    variants = ({name: relayouts(t) for name, t in inputs.items()}
                | {name: [t, *relayouts(t)] for name, t in grads.items()}
                | {"deterministic": [True], "lengths": [lengths()], **options(base)})
    assert_keyed(base, variants)


def test_varlen_backward():
    q, k = tensor((120, 4, 64)), tensor((90, 2, 64), ptr=2 << 20)
    lse = tensor((4, 120), "float32", ptr=5 << 20)
    base = checks.BackwardCall(q, k, k, q, q, lse, None, None, None, 0.125, True, (-1, -1), 0.0, True, lengths())
    assert_keyed(base, {"q": relayouts(q), "k": relayouts(k), "v": relayouts(k), "out": relayouts(q),
                        "dout": relayouts(q), "lse": relayouts(lse), "dq": [q], "dk": [k], "dv": [k],
                        "deterministic": [False],
                        "lengths": [None, lengths(batch=2), lengths(max_seqlen_q=41), lengths(max_seqlen_k=61)],
                        **options(base)})


def kv_call() -> checks.KvCall:
    """A paged decoding step with an append and rotary embedding: batch 2, 8 heads over 2 kv heads."""
    q, new = tensor((2, 1, 8, 64)), tensor((2, 1, 2, 64), ptr=2 << 20)
    tensors = {"q": q, "k_cache": tensor((16, 16, 2, 64), ptr=3 << 20), "v_cache": tensor((16, 16, 2, 64), ptr=4 << 20),
               "k": new, "v": new._replace(ptr=5 << 20), "cache_seqlens": tensor((2,), "int32", ptr=6 << 20),
               "page_table": tensor((2, 8), "int32", ptr=7 << 20), "rotary_cos": tensor((128, 16), ptr=8 << 20),
               "rotary_sin": tensor((128, 16), ptr=9 << 20)}
    host = {"cache_seqlens": np.array([5, 9]), "page_table": np.arange(16).reshape(2, 8)}
    return checks.KvCall("cupy", tensors, host, 2, 1, 8, 2, 64, 16, 128, 1, False, tensors["cache_seqlens"], 0.125,
                         True, (-1, -1), 0.0, 32, False, True, 0, None, None, False)


def test_kvcache():
    base = kv_call()
    t = base.tensors
    arrays = [{**t, name: x} for name in t for x in relayouts(t[name])]
    arrays += [{name: x for name, x in t.items() if name != dropped} for dropped in ("k", "v", "rotary_cos")]
    # An array given in one call and another of the same layout in the other (the names are keyed).
    arrays += [{**t, name: tensor((2,), "int32", ptr=10 << 20)} for name in ("cache_batch_idx", "cache_leftpad")]
    arrays.append({**t, "cu_seqlens_q": tensor((3,), "int32", ptr=10 << 20)})
    # q's pointer: 16-byte aligned or not (dispatch.kvcache_prefill).
    arrays.append({**t, "q": t["q"]._replace(ptr=t["q"].ptr + 2)})
    descale = tensor((2, 2), "float32", ptr=11 << 20)
    variants = {"tensors": arrays, "batch": [3], "max_seqlen_q": [2], "heads": [16], "heads_kv": [1], "head_dim": [128],
                "page_size": [32], "capacity": [256], "seqlen_new": [0], "varlen": [True], "cache_seqlens": [None, 5],
                "rotary_dim": [64], "rotary_interleaved": [True], "rotary_per_row": [False], "num_splits": [1, 3],
                "descale_k": [1.0, descale], "descale_v": [0.5, descale], "descale_q": [0.5, descale],
                **options(base)}
    assert_keyed(base, variants, launch_only=("framework", "host", "return_lse"))
    assert base._replace(framework="torch", return_lse=True).plan_key() == base.plan_key()
    scalars = base._replace(cache_seqlens=5, descale_k=0.5, descale_v=descale)
    assert_keyed(scalars, variants | {"cache_seqlens": [6, t["cache_seqlens"]], "descale_k": [0.25, descale],
                                      "descale_v": [1.0, *relayouts(descale)]},
                 launch_only=("framework", "host", "return_lse"))


def test_combine():
    o, l = tensor((4, 2, 3, 8, 64), "float32"), tensor((4, 2, 3, 8), "float32", ptr=2 << 20)
    base = checks.CombineCall("cupy", o, l, "float32", False)
    assert_keyed(base, {"out_partial": relayouts(o), "lse_partial": relayouts(l), "out_dtype": ["bfloat16"]},
                 launch_only=("framework", "return_lse"))


def test_mla():
    t = {"q": tensor((2, 1, 16, 576)), "kv_cache": tensor((32, 64, 1, 576), ptr=2 << 20),
         "page_table": tensor((2, 16), "int32", ptr=3 << 20), "cache_seqlens": tensor((2,), "int32", ptr=4 << 20)}
    rope = {"q_rope": tensor((2, 1, 16, 64), ptr=5 << 20), "kv_rope_cache": tensor((32, 64, 1, 64), ptr=6 << 20)}
    base = checks.MlaCall("cupy", t, 2, 1, 16, 576, 512, 64, 1024, 0.04, True, 0, None, False)
    descale = tensor((2, 1), "float32", ptr=7 << 20)
    arrays = [{**t, name: x} for name in t for x in relayouts(t[name])] + [t | rope]
    variants = {"tensors": arrays, "batch": [3], "seqlen_q": [2], "heads": [128], "head_dim": [512],
                "head_dim_v": [448], "page_size": [16], "capacity": [512], "scale": [0.05], "causal": [False],
                "num_splits": [4], "descale_kv": [1.0, descale]}
    assert_keyed(base, variants, launch_only=("framework", "return_lse"))
    split = base._replace(tensors=t | rope, descale_kv=descale)
    rope_arrays = [{**t, **rope, name: x} for name in rope for x in relayouts(rope[name])]
    assert_keyed(split, variants | {"tensors": [t, *rope_arrays], "descale_kv": [None, 2.0, *relayouts(descale)]},
                 launch_only=("framework", "return_lse"))


def test_quantize():
    x = tensor((2, 33, 4, 64))
    base = checks.QuantizeCall(x, "head", 1, 128, True, 3)
    assert_keyed(base, {"x": relayouts(x), "granularity": ["tensor", "block"], "group_heads": [2],
                        "block_size": [64], "rotate": [False], "seed": [4]})
    unrotated = base._replace(rotate=False)
    assert unrotated._replace(seed=4).plan_key() == unrotated.plan_key()  # the signs are not read
