"""attention_with_kvcache's launch plan without a GPU: the kernels, grids and KvParams /
CombineParams a call launches with (kernels.launch captured, the device stubbed)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from cuflash._core import checks, dispatch, interop, kernels, plan
from cuflash._core.params import COMBINE_PARAMS, FWD_PARAMS_PAGED, FWD_PARAMS_PAGED_SIZE, KV_PARAMS
from kvcache_cases import make_case


def device_tensor(x, ptr):
    if x is None:
        return None
    if isinstance(x, int):
        return x
    return interop.DeviceTensor(None, ptr, tuple(x.shape), tuple(s // x.itemsize for s in x.strides), x.dtype.name,
                                x.itemsize, 0)


@pytest.fixture
def recorder(monkeypatch):
    launches = []
    monkeypatch.setattr(dispatch, "device_target", lambda device: ("sm80", (8, 0)))
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 108)
    monkeypatch.setattr(kernels, "prepare", lambda choice, arch, device, grid: (choice.name_expression, tuple(grid),
                                                                               choice.smem_bytes))
    monkeypatch.setattr(kernels, "launch", lambda kernel, stream, argument: launches.append((kernel, bytes(argument)[8:])))
    monkeypatch.setattr(interop, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(interop, "stream_handle", lambda framework, device: 0)
    monkeypatch.setattr(interop, "allocate", lambda framework, like, shape, dtype=None: (np.empty(shape), 4096))
    monkeypatch.setattr(interop, "scratch", lambda framework, like, nbytes: (None, 1 << 20))
    return launches


def planned(args, **options):
    if "descale_k" in options:  # an FP8 cache: descales as the GPU path takes them
        dk = options["descale_k"]
        options["descale_k"] = dk if isinstance(dk, float) else device_tensor(dk, 1024 * 13)
    call = checks.check_kvcache(
        {name: args.get(name) for name in checks.KV_ARRAYS if name != "cache_seqlens"},
        args.get("cache_seqlens"), None, args.get("rotary_interleaved", True), options.get("causal", False), None,
        options.get("window", (-1, -1)), 0.0, options.get("num_splits", 0), None, None, True, False)
    if "descale_k" in options:
        call = call._replace(descale_k=options["descale_k"], descale_v=options["descale_v"])
    names = checks.KV_ARRAYS
    tensors = tuple(device_tensor(call.tensors.get(name), 1024 * (i + 1)) for i, name in enumerate(names))
    call = call._replace(tensors={n: t for n, t in zip(names, tensors) if t is not None},
                         cache_seqlens=device_tensor(call.cache_seqlens, 1024 * 6))
    tensors += tuple(d if isinstance(d, interop.DeviceTensor) else None
                     for d in (call.descale_k, call.descale_v, call.descale_q))
    return plan.build_kvcache(call, tensors), (tensors[0], tuple(t.ptr if t is not None else 0 for t in tensors))


def test_paged_split_decode_launches_append_decode_combine(recorder):
    r = np.random.default_rng(0)
    args = make_case(r, batch=2, seqlen_q=2, heads=8, heads_kv=2, head_dim=128, capacity=4096, page_size=16, new=2,
                     dtype=np.float16, rotary="half")
    built, operands = planned(args, causal=True)
    out, lse = built.launch("cupy", operands, (None,), (None,), True)
    (append, a_arg), (decode, d_arg), (combine, c_arg) = recorder
    assert append[0] == "cuflash::kv_append<cuflash::f16, cuflash::f16>" and append[1] == (2, 2, 1)
    # 8 query heads over 2 kv heads, 2 tokens: 8 packed rows, one tile; 4 CTAs would take 73 splits
    # to fill 90% of 108 x 3 slots, but each split keeps 128 of the 4096 positions.
    splits = dispatch.kvcache_splits(0, 2, 2, 1, 4096, 108, 3)
    assert splits == 32 and decode == ("cuflash::kv_decode<cuflash::f16, cuflash::f16, 128, 16, 64, 4, 3, 70144>",
                                       (splits, 2, 2), dispatch.kv_smem_bytes(128))
    p = np.frombuffer(d_arg, KV_PARAMS)[0]
    assert p["num_splits"] == splits and p["page_size"] == 16 and p["max_pages"] == 256 and p["window_right"] == 0
    assert p["rotary_dim"] == 128 and p["rotary_interleaved"] == 0 and p["rotary_per_row"] == 1
    assert p["lse"] == 0 and p["out"] == 4096 and p["q_rot"] == 1 << 20 and p["out_partial"] > p["q_rot"]
    c = np.frombuffer(c_arg, COMBINE_PARAMS)[0]
    assert c["splits"] == splits and c["out"] == 4096 and c["lse"] == 4096 and c["out_partial"] == p["out_partial"]
    assert combine[0] == "cuflash::kv_combine<cuflash::store_16<cuflash::f16>, 4>"
    assert combine[1] == dispatch.kv_combine_grid(2 * 2 * 8)


def test_filled_gpu_decode_runs_unsplit(recorder):
    r = np.random.default_rng(1)
    args = make_case(r, batch=64, seqlen_q=1, heads=32, heads_kv=8, head_dim=64, capacity=64, new=0,
                     dtype=np.float16)
    built, operands = planned(args)
    built.launch("cupy", operands, (None,), (None,), False)
    assert len(recorder) == 1  # no append, no combine
    p = np.frombuffer(recorder[0][1], KV_PARAMS)[0]
    assert p["num_splits"] == 1 and p["lse"] == 0 and p["out_partial"] == 0


def test_chunked_prefill_runs_the_forward_over_the_paged_cache(recorder):
    r = np.random.default_rng(2)
    args = make_case(r, batch=3, seqlen_q=300, heads=8, heads_kv=2, head_dim=128, capacity=1024, page_size=16, new=1,
                     varlen=True, dtype=np.float16, rotary="interleaved")
    built, tensors = planned(args, causal=True)
    out, lse = built.launch("cupy", tensors, (None,), (None,), True)
    # The forward takes the sequences of 128 rows or more, kv_decode (unsplit: no combine) the others.
    (append, _), (decode, d_arg), (forward, f_arg) = recorder
    assert decode[0].startswith("cuflash::kv_decode<") and decode[1][0] == 32  # row tiles of 127 rows x 4 heads
    d = np.frombuffer(d_arg, KV_PARAMS)[0]
    assert d["max_decode_rows"] == 127 and d["num_splits"] == 1 and d["lse"] == 4096
    assert append[0] == "cuflash::kv_append<cuflash::f16, cuflash::f16>"
    expected = dispatch.kvcache_prefill_kernel("float16", 128, dispatch.Mask("causal", -1, 0, 0.0))
    assert forward == (expected.name_expression, (8, 3, 3), expected.smem_bytes)  # causal: (heads, batch, blocks)
    assert built.attention == expected.name_expression and forward[0].endswith("cuflash::f16, true>")
    p = np.frombuffer(f_arg, FWD_PARAMS_PAGED)[0]
    total = args["q"].shape[0]
    assert len(f_arg) == FWD_PARAMS_PAGED_SIZE
    assert p["q"] == 1 << 20 and p["q_batch_stride"] == 0 and p["q_row_stride"] == 8 * 128  # the rotated copy
    assert p["k"] == 2048 and p["v"] == 3072 and p["o"] == 4096 and p["lse"] == 4096
    assert p["cu_seqlens_q"] == 1024 * 10 and p["seq_end_q"] == 1024 * 10 + 4 and p["cu_seqlens_k"] == 0
    assert p["page_table"] == 1024 * 7 and p["cache_seqlens"] == 1024 * 6
    assert p["page_table_stride"] == 64 and p["page_size"] == 16 and p["new_keys"] == 0 and p["min_rows"] == 128
    assert p["cu_seqlens_k_new"] == 1024 * 10  # the packed q's appends: as many as its rows
    assert p["k_batch_stride"] == 16 * 2 * 128 and p["k_row_stride"] == 2 * 128 and p["kv_group"] == 4
    assert p["window_left"] == -1 and p["window_right"] == 0
    assert p["lse_batch_stride"] == 0 and p["lse_head_stride"] == total
    assert out.shape == args["q"].shape and lse.shape == (8, total)


def test_prefill_of_a_contiguous_cache_reads_q_in_place(recorder):
    r = np.random.default_rng(3)
    args = make_case(r, batch=2, seqlen_q=200, heads=4, heads_kv=4, head_dim=64, capacity=512, new=200,
                     dtype=np.float16)
    built, tensors = planned(args, window=(100, 10))
    built.launch("cupy", tensors, (None,), (None,), False)
    (append, _), (forward, f_arg) = recorder
    assert "true, false, cuflash::f16, cuflash::f16, true>" in forward[0]  # the window kernel
    assert forward[1] == (2, 4, 2)  # (blocks, heads, batch)
    p = np.frombuffer(f_arg, FWD_PARAMS_PAGED)[0]
    assert p["q"] == 1024 and tuple(p[f"q_{s}_stride"] for s in ("batch", "row", "head")) == (200 * 4 * 64, 256, 64)
    assert p["page_table"] == 0 and p["k_batch_stride"] == 512 * 4 * 64 and p["new_keys"] == 200
    assert p["page_size"] == 512
    assert p["seqlen_q"] == 200 and p["cu_seqlens_q"] == 0 and p["seq_end_q"] == 0 and p["lse"] == 0
    assert (p["window_left"], p["window_right"]) == (100, 10)
    assert p["lse_batch_stride"] == 4 * 200 and p["lse_head_stride"] == 200


@pytest.mark.parametrize("change, prefill", [
    ({}, True),
    ({"seqlen_q": dispatch.KV_PREFILL_ROWS - 1}, False),  # short chunks: kv_decode with its splits
    ({"leftpad": True}, False),
    ({"batch_idx": True, "page_size": None}, True),
    ({"cache_dtype": "float8_e4m3fn"}, False),
])
def test_prefill_route(recorder, change, prefill):
    import ml_dtypes

    case = dict(batch=2, seqlen_q=dispatch.KV_PREFILL_ROWS, heads=4, heads_kv=2, head_dim=64, capacity=512,
                page_size=64, new=0, dtype=np.float16) | change
    if case.get("cache_dtype") == "float8_e4m3fn":
        case["cache_dtype"] = ml_dtypes.float8_e4m3fn
    args = make_case(np.random.default_rng(4), **case)
    options = {"descale_k": 1.0, "descale_v": 1.0} if "cache_dtype" in change else {}
    built, _ = planned(args, **options)
    assert (built.forward is not None) == prefill and (built.decode is None) == prefill
    assert ("flash_fwd_sm80" in built.attention) == prefill


@pytest.mark.parametrize("num_splits, prefill", [(0, True), (1, True), (2, False)])
def test_explicit_splits_keep_the_decode_kernel(recorder, num_splits, prefill):
    args = make_case(np.random.default_rng(5), batch=1, seqlen_q=256, heads=2, heads_kv=1, capacity=512,
                     page_size=1, new=0, dtype=np.float16)
    built, _ = planned(args, num_splits=num_splits)
    assert (built.forward is not None) == prefill


def test_prefill_takes_cache_batch_idx_as_its_page_table(recorder):
    args = make_case(np.random.default_rng(7), batch=3, seqlen_q=130, heads=2, heads_kv=1, capacity=200,
                     batch_idx=True, new=0, dtype=np.float16)
    built, tensors = planned(args)
    built.launch("cupy", tensors, (None,), (None,), False)
    (forward, f_arg), = recorder
    p = np.frombuffer(f_arg, FWD_PARAMS_PAGED)[0]
    assert p["page_table"] == 1024 * 8 and p["page_table_stride"] == 1 and p["page_size"] == 200
    assert p["k_batch_stride"] == 200 * 64 and p["new_keys"] == 0


def test_prefill_takes_no_unaligned_q(recorder):
    args = make_case(np.random.default_rng(6), batch=1, seqlen_q=256, heads=2, heads_kv=1, capacity=512,
                     page_size=16, new=0, dtype=np.float16)
    call = checks.check_kvcache({name: args.get(name) for name in ("q", "k_cache", "v_cache", "k", "v", "page_table",
                                                                  "cache_batch_idx", "cache_leftpad", "cu_seqlens_q",
                                                                  "rotary_cos", "rotary_sin")},
                                args["cache_seqlens"], None, True, False, None, (-1, -1), 0.0, 0, None, None, False,
                                False)
    q, kc = device_tensor(args["q"], 1024 + 2), device_tensor(args["k_cache"], 2048)
    assert not dispatch.kvcache_prefill(call, q, kc)
    assert dispatch.kvcache_prefill(call, q._replace(ptr=1024), kc)


def test_paged_forward_is_sm80_and_16bit_only():
    with pytest.raises(ValueError, match="paged"):
        dispatch.forward_kernel("sm90", 128, "none", "bfloat16", paged=True)
    with pytest.raises(ValueError, match="paged"):
        dispatch.forward_kernel("sm80", 128, "none", "float8_e4m3fn", out_dtype="bfloat16", paged=True)


def test_explicit_splits_honoured():
    assert dispatch.kvcache_splits(7, 64, 8, 1, 100, 132, 3) == 7
    assert dispatch.kvcache_splits(0, 1, 1, 1, 100, 132, 3) == 1  # too few keys to split


@pytest.mark.parametrize("batch, capacity, splits", [
    (64, 8192, 3),    # 512 CTAs: 1.29 waves of 396 slots; 3 splits make 3.88
    (8, 8192, 6),     # 64 CTAs: 6 splits fill 384 of the 396 slots
    (1, 32768, 45),   # 8 CTAs: 360 of 396
    (1, 1024, 8),     # 128 positions per split at most: the most efficient of 1..8
    (96, 8192, 1),    # 768 CTAs: 1.94 waves, 0.97 efficient unsplit
    (100, 8192, 1),   # 800 CTAs: over two waves, never split
])
def test_auto_splits_fill_the_waves(batch, capacity, splits):
    assert dispatch.kvcache_splits(0, batch, 8, 1, capacity, 132, 3) == splits


def test_kv_and_mla_kernels_listed_last_for_the_compile_check():
    names = [c.name_expression for c in dispatch.all_kernels("sm80")]
    kv = [c.name_expression for c in dispatch.kvcache_all_kernels()]
    mla = [c.name_expression for c in dispatch.mla_all_kernels("sm80")]
    # appends, decodes (16-bit and e4m3 caches), combines, merges, forwards over the cache (three
    # masks and softcap's); then MLA decoding (two q dtypes, each with its own and an e4m3 cache)
    assert names[-len(kv) - len(mla):] == kv + mla and len(kv) == 4 + 4 * 3 + 3 + 3 + 5 * 2 * 4 and len(mla) == 4
    # sm90's MLA kernels come before its (192, 128) backward (both dtypes x the 9 (mask, softcap,
    # dQ order) of the equal dims' list), its TMA-loaded MLA kernels (one per dtype) after it, then
    # their transposed forms for 16 and 32 query rows, then the d64 ALiBi forwards of two consumers
    # (16-bit and e4m3 into either dtype; with softcap they are the narrow kernels listed before).
    sm90 = [c.name_expression for c in dispatch.all_kernels("sm90")]
    tma = [c.name_expression for c in dispatch.mla_tma_kernels()]
    narrow = [c.name_expression for c in dispatch.mla_narrow_kernels()]
    pair = [n for n in sm90 if n.startswith("cuflash::sm90::flash_bwd_sm90<192, 128, ")]
    alibi = [n for n in sm90[-4:] if n.startswith("cuflash::sm90::flash_fwd_sm90<64, 2, ")]
    late = pair + tma + narrow + alibi
    assert len(pair) == 2 * 9 and len(tma) == 2 and len(narrow) == 4 and len(alibi) == 4
    assert sm90[-len(late):] == late
    assert sm90[-len(late) - 4:-len(late)] == [c.name_expression for c in dispatch.mla_all_kernels("sm90")]


def test_fp8_cache_plan_takes_the_descales(recorder):
    import ml_dtypes

    r = np.random.default_rng(2)
    args = make_case(r, batch=3, seqlen_q=1, heads=8, heads_kv=2, head_dim=128, capacity=64, page_size=16, new=1,
                     dtype=ml_dtypes.bfloat16, cache_dtype=ml_dtypes.float8_e4m3fn)
    descale_k = np.full((3, 2), 0.5, np.float32)
    built, operands = planned(args, num_splits=1, descale_k=descale_k, descale_v=2.0)
    built.launch("cupy", operands, (None,), (None,), False)
    (append, a_arg), (decode, d_arg) = recorder
    assert append[0] == "cuflash::kv_append<cuflash::bf16, cuflash::e4m3>"
    assert decode[0] == "cuflash::kv_decode<cuflash::bf16, cuflash::e4m3, 128, 16, 64, 4, 3, 70144>"
    p = np.frombuffer(d_arg, KV_PARAMS)[0]
    assert p["descale_k"] == 1024 * 13 and p["descale_v"] == 0
    assert p["descale_k_scalar"] == 1.0 and p["descale_v_scalar"] == 2.0


class StandInCupyArray:
    """What interop.describe reads of a CuPy array (shape, strides, dtype, data.ptr), and .get()
    for the host copies that validate=True takes."""

    def __init__(self, host: np.ndarray, ptr: int):
        self.host, self.shape, self.strides, self.dtype = host, host.shape, host.strides, host.dtype
        self.data = type("MemoryPointer", (), {"ptr": ptr, "device_id": 0})()

    def get(self) -> np.ndarray:
        return self.host


StandInCupyArray.__module__ = "cupy.stand_in"  # interop.framework_of tells CuPy arrays by their module


def stand_in_call(r, base: int, **options):
    """attention_with_kvcache on stand-in GPU arrays of one decoding step (paged, append), the
    arrays' pointers from ``base``; returns the KvParams of the decode launch."""
    import cuflash

    args = make_case(r, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=64, capacity=64, page_size=16, new=1,
                     dtype=np.float16)
    arrays = {name: StandInCupyArray(x, base + 1024 * i) if isinstance(x, np.ndarray) else x
              for i, (name, x) in enumerate(args.items())}
    cuflash.attention_with_kvcache(**(arrays | options))
    return arrays


@pytest.fixture
def counted_checks(recorder, monkeypatch):
    """The checks' calls, counted; the plan cache emptied before and after."""
    calls = []
    check = checks.check_kvcache
    monkeypatch.setattr(checks, "check_kvcache", lambda *args: calls.append(args) or check(*args))
    plan.PLANS.clear()
    yield calls
    plan.PLANS.clear()


def test_out_given_is_written_and_its_pointer_follows_each_call(counted_checks, recorder):
    r = np.random.default_rng(4)
    outs = [StandInCupyArray(np.zeros((2, 1, 8, 64), np.float16), base) for base in (1 << 28, 1 << 29)]
    for out in outs:
        arrays = stand_in_call(r, 1 << 20, causal=True, out=out)
        p = np.frombuffer(recorder[-1][1], KV_PARAMS)[0]
        assert p["out"] == out.data.ptr and p["q"] == arrays["q"].data.ptr
    assert len(counted_checks) == 1  # the second out served by the signature, its layout the first's
    with pytest.raises(ValueError, match="out: must be contiguous"):
        stand_in_call(r, 1 << 20, out=StandInCupyArray(np.zeros((2, 1, 16, 64), np.float16)[:, :, ::2], 1 << 30))


def test_repeated_decode_call_skips_the_checks_and_takes_the_new_pointers(counted_checks, recorder):
    r = np.random.default_rng(3)
    stand_in_call(r, 1 << 20, causal=True)
    assert len(counted_checks) == 1 and len(recorder) == 2  # append, decode
    arrays = stand_in_call(r, 1 << 24, causal=True)
    assert len(counted_checks) == 1 and len(recorder) == 4  # the cached plan, unchecked
    p = np.frombuffer(recorder[-1][1], KV_PARAMS)[0]
    assert p["q"] == arrays["q"].data.ptr and p["k_cache"] == arrays["k_cache"].data.ptr
    assert p["cache_seqlens"] == arrays["cache_seqlens"].data.ptr and p["page_table"] == arrays["page_table"].data.ptr


@pytest.mark.parametrize("options", [{"validate": True}, {"softmax_scale": np.float32(0.125)}, {"causal": 1},
                                     {"cache_seqlens": np.int32(5)}])
def test_calls_the_key_cannot_hold_are_checked_every_time(counted_checks, recorder, options):
    r = np.random.default_rng(4)
    for base in (1 << 20, 1 << 24):
        stand_in_call(r, base, **options)
    assert len(counted_checks) == 2 and len(recorder) == 4


@pytest.mark.parametrize("options, error", [({"num_splits": -1}, ValueError), ({"num_splits": True}, TypeError),
                                            ({"softcap": -1.0}, ValueError), ({"window": (-2, 0)}, ValueError),
                                            ({"cache_seqlens": 5.0}, TypeError)])
def test_a_bad_option_raises_after_a_good_call_of_the_same_layout(counted_checks, recorder, options, error):
    r = np.random.default_rng(5)
    stand_in_call(r, 1 << 20)
    with pytest.raises(error):
        stand_in_call(r, 1 << 24, **options)
    assert len(recorder) == 2  # nothing launched for the bad call


def test_misaligned_cache_refused_after_an_aligned_call(counted_checks, recorder):
    r = np.random.default_rng(6)
    stand_in_call(r, 1 << 20)
    with pytest.raises(ValueError, match="k_cache: data pointer and strides must be 16-byte aligned"):
        stand_in_call(r, (1 << 24) + 8)


def padded(x: np.ndarray) -> np.ndarray:
    """``x`` as a view with 8 more elements between its rows (other strides, same values)."""
    wide = np.zeros((*x.shape[:-1], x.shape[-1] + 8), x.dtype)
    wide[..., :x.shape[-1]] = x
    return wide[..., :x.shape[-1]]


def kv_variants(r) -> list[dict]:
    """Keyword arguments of decoding calls (NumPy) that differ from the first in one thing each
    that the checks or the kernels read: an array's shape, strides or dtype, or an option
    (return_lse is not one: the plan serves both, its launch takes it)."""
    import ml_dtypes

    base = make_case(r, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=64, capacity=64, page_size=16, new=1,
                     dtype=np.float16, rotary="half")
    fp8 = make_case(r, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=64, capacity=64, page_size=16, new=1,
                    dtype=np.float16, cache_dtype=ml_dtypes.float8_e4m3fn)
    bf16 = {name: x.astype(ml_dtypes.bfloat16) if isinstance(x, np.ndarray) and x.dtype == np.float16 else x
            for name, x in base.items()}
    unrotated = {name: x for name, x in base.items() if not name.startswith("rotary")}
    variants = [base, bf16, unrotated, {**unrotated, "k": None, "v": None},
                make_case(r, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=64, capacity=96, page_size=16,
                          new=1, dtype=np.float16, rotary="half"),
                make_case(r, batch=2, seqlen_q=1, heads=8, heads_kv=1, head_dim=64, capacity=64, page_size=32,
                          new=1, dtype=np.float16, rotary="half"),
                make_case(r, batch=2, seqlen_q=2, heads=8, heads_kv=2, head_dim=128, capacity=64, new=2,
                          dtype=np.float16, rotary="interleaved", leftpad=True, batch_idx=True),
                {**base, "cache_seqlens": 7}, {**base, "cache_seqlens": 9},
                fp8, {**fp8, "descale_k": 0.5}, {**fp8, "descale_k": 0.5, "descale_v": 2.0},
                {**fp8, "descale_k": np.full((2, 2), 0.5, np.float32)}]
    variants += [{**base, name: padded(base[name])} for name in ("q", "k", "v")]
    variants.append({**base, "k_cache": padded(base["k_cache"]), "v_cache": padded(base["v_cache"])})
    variants += [{**base, **option} for option in (
        {"causal": True}, {"window": (4, 0)}, {"window": (4, 2)}, {"softcap": 5.0}, {"softmax_scale": 0.3},
        {"softmax_scale": 1}, {"num_splits": 1}, {"num_splits": 3}, {"rotary_interleaved": True})]
    return variants


def test_every_field_the_kernels_read_keys_its_own_plan(counted_checks, recorder):
    """Each variant (and the same variant on another device) builds its own plan, and launching it
    from a warm cache, unchecked, launches exactly what a fresh plan launches."""
    import cuflash

    def gpu_call(args: dict, device: int) -> None:
        arrays = {}
        for i, (name, x) in enumerate(args.items()):
            if isinstance(x, np.ndarray):
                x = StandInCupyArray(x, (1 << 20) * (i + 1))
                x.data.device_id = device
            arrays[name] = x
        cuflash.attention_with_kvcache(**arrays)

    calls = [(args, device) for args in kv_variants(np.random.default_rng(7)) for device in (0, 1)]
    for args, device in calls:
        gpu_call(args, device)
    assert len(plan.PLANS) == len(counted_checks) == len(calls)
    warm = []
    for args, device in calls:
        recorder.clear()
        gpu_call(args, device)
        warm.append(list(recorder))
    assert len(counted_checks) == len(calls)  # every call a hit, unchecked
    for (args, device), launched in zip(calls, warm):
        plan.PLANS.clear()
        recorder.clear()
        gpu_call(args, device)
        assert recorder == launched


class StandInTorchTensor:
    """What interop reads of a torch tensor: is_cuda, shape, stride(), dtype, get_device(), data_ptr()."""

    __module__ = "torch.stand_in"  # interop.framework_of tells torch by the module and is_cuda
    is_cuda = True

    def __init__(self, shape, ptr: int, is_cuda: bool = True, device: int = 0):
        self.shape, self.dtype, self.is_cuda = shape, "torch.bfloat16", is_cuda
        self._ptr, self._device = ptr, device

    def stride(self):
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def get_device(self):
        return self._device

    def data_ptr(self):
        return self._ptr


def test_layouts_and_pointers_of_one_framework_or_none():
    q, table = np.zeros((2, 1, 4, 64), np.float16), np.zeros((2, 3), np.int32)
    cupy_q, cupy_table = StandInCupyArray(q, 1 << 20), StandInCupyArray(table, 2 << 20)
    torch_q, torch_table = StandInTorchTensor((2, 1, 4, 64), 3 << 20), StandInTorchTensor((2, 3), 4 << 20, device=1)
    for x in (cupy_q, torch_q):
        interop.framework_of(x, "q")
    assert interop.layouts_and_pointers([cupy_q, None, cupy_table]) == (
        "cupy", (((2, 1, 4, 64), q.strides, q.dtype, 0), None, ((2, 3), (12, 4), table.dtype, 0)),
        (1 << 20, 0, 2 << 20))
    assert interop.layouts_and_pointers([torch_q, torch_table, None]) == (
        "torch", (((2, 1, 4, 64), (256, 256, 64, 1), "torch.bfloat16", 0), ((2, 3), (3, 1), "torch.bfloat16", 1), None),
        (3 << 20, 4 << 20, 0))
    cpu_table = StandInTorchTensor((2, 3), 4 << 20, is_cuda=False)
    for mixed in ([cupy_q, torch_table], [torch_q, cupy_table], [torch_q, cpu_table], [cupy_q, table], [cupy_q, 3]):
        assert interop.layouts_and_pointers(mixed) is None
