"""attention_with_kvcache and combine on the GPU against the float64 reference with the
correctness rule (docs/measuring.md): out and lse, and the caches after the call, whose every byte
but the appended rows must be unchanged (the rest is NaN-poisoned, so a stray read shows in out
and a stray write in the bytes). Sweeps: page sizes, GQA ratios, cache lengths 0 / 1 / page
boundary / full, leftpad, batch index, new-token counts, rotary styles, windows, softcap, splits,
packed q, empty sequences, FP8 (e4m3) caches with scalar and per-(batch, kv head) descales; and
chunked prefill, the query chunks that run the forward kernel over the cache (both families'
devices run sm80's, dispatch.kvcache_prefill_kernel)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._core import dispatch, plan
from cuflash._cpu.reference import max_error_bound
from cuflash._cpu.reference_kvcache import combine_reference, kvcache_reference
from kvcache_cases import make_case, reference_args, same_bytes

pytestmark = pytest.mark.gpu
ATOL = 1e-3
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def to_device(value):
    """A NumPy argument on the GPU (e4m3 as its uint8 bytes: CuPy has no float8 dtype)."""
    import cupy as cp

    if not isinstance(value, np.ndarray):
        return value
    return cp.asarray(value.view(np.uint8) if value.dtype == E4M3 else value)


def to_torch(x: np.ndarray):
    """A NumPy argument as a torch CUDA tensor (bf16 and e4m3 through their bits)."""
    import torch

    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    if x.dtype == E4M3:
        return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn).cuda()
    return torch.from_numpy(x).cuda()


def check(args: dict, **options):
    """One call on device copies of ``args`` (NumPy, 16-bit) with ``options``, checked against the
    reference: out and lse by the rule, the caches byte for byte but the appended rows (rotated
    keys within one rounding)."""
    import cupy as cp

    fp8 = args["k_cache"].dtype == E4M3
    options = {"return_lse": True} | ({"dtype": "e4m3"} if fp8 else {}) | options
    device = {name: to_device(value) for name, value in args.items()}
    out, lse = cuflash.attention_with_kvcache(**device, **options)
    ref_options = {name: value for name, value in options.items() if name not in ("num_splits", "return_lse",
                                                                                   "validate", "dtype")}
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**reference_args(args), **ref_options)
    lowp_out = kvcache_reference(**reference_args(args), **ref_options, dtype=args["q"].dtype)[0]
    out_h = cp.asnumpy(out)
    assert np.isfinite(out_h.astype(np.float32)).all(), "out holds NaN: a poisoned cache row was read"
    ok, err, bound = max_error_bound(out_h, ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
    lse_h = cp.asnumpy(lse)
    assert np.array_equal(np.isneginf(lse_h), np.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_h[finite], ref_lse[finite], rtol=1e-2, atol=1e-2)
    for name, ref in (("k_cache", ref_k), ("v_cache", ref_v)):
        got = cp.asnumpy(device[name])
        got = got.view(E4M3) if fp8 else got
        if same_bytes(got, ref):
            continue
        # Rotated keys are rotated in float32 on the GPU, in float64 by the reference: one rounding
        # of the cache's type apart (an e4m3 step is 1/8 relative, 2^-9 among subnormals).
        assert name == "k_cache" and "rotary_cos" in args, f"{name}: bytes outside the append changed"
        before = args[name]
        untouched = same_bytes_mask(before, ref)
        assert np.array_equal(bits(got)[untouched], bits(ref)[untouched]), f"{name}: untouched bytes changed"
        rtol, atol = (0.13, 2.0**-9) if fp8 else (1e-2, 1e-2)
        np.testing.assert_allclose(got[~untouched].astype(np.float32), ref[~untouched].astype(np.float32),
                                   rtol=rtol, atol=atol)
    return out_h


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8 if a.itemsize == 1 else np.uint16)


def same_bytes_mask(a, b):
    return bits(a) == bits(b)


def case(r, **kw):
    return make_case(r, dtype=BF16, **kw)


@pytest.mark.parametrize("page_size", [None, 1, 16, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 16])
def test_page_sizes_and_gqa(page_size, group):
    r = np.random.default_rng(page_size or 0)
    args = case(r, batch=4, heads=2 * group, heads_kv=2, head_dim=128, capacity=300, page_size=page_size, new=1,
                lens=[0, 1, 256 if page_size is None else page_size, 299])
    check(args, causal=True)


@pytest.mark.parametrize("group", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("seqlen_q", [1, 2, 4, 16])
def test_query_tokens_and_groups(group, seqlen_q):
    r = np.random.default_rng(group * 100 + seqlen_q)
    args = case(r, batch=3, seqlen_q=seqlen_q, heads=group * 2, heads_kv=2, head_dim=64, capacity=150,
                page_size=16, new=seqlen_q)
    check(args, causal=True)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 192, 256])
@pytest.mark.parametrize("rotary", [None, "interleaved", "half"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_rotary_and_head_dims(head_dim, rotary, dtype):
    r = np.random.default_rng(head_dim)
    args = make_case(r, batch=2, seqlen_q=3, heads=8, heads_kv=2, head_dim=head_dim, capacity=100, page_size=16,
                     new=3, rotary=rotary, rotary_dim=head_dim // 2 if rotary == "half" else None, dtype=dtype)
    check(args, causal=True)
    args = make_case(r, batch=2, seqlen_q=3, heads=8, heads_kv=2, head_dim=head_dim, capacity=100, new=3,
                     rotary=rotary, dtype=dtype)
    check(args)  # not causal: q rotated at cache_seqlens


@pytest.mark.parametrize("new", [0, 1, 5, 16])
@pytest.mark.parametrize("leftpad, batch_idx", [(False, False), (True, False), (False, True), (True, True)])
def test_append_leftpad_batch_idx(new, leftpad, batch_idx):
    r = np.random.default_rng(new)
    args = case(r, batch=4, seqlen_q=max(new, 1), heads=4, heads_kv=1, capacity=64, new=new, leftpad=leftpad,
                batch_idx=batch_idx, rotary="interleaved" if new else None)
    check(args, causal=True)


@pytest.mark.parametrize("window, softcap", [((-1, -1), 30.0), ((16, 0), 0.0), ((5, 2), 0.0), ((0, -1), 5.0),
                                             ((40, 40), 0.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows_and_softcap(window, softcap, causal):
    r = np.random.default_rng(sum(window) + 2)
    args = case(r, batch=3, seqlen_q=4, heads=8, heads_kv=2, capacity=200, page_size=64, new=4, leftpad=True)
    check(args, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 7, 64, 300])
def test_splits_equal_unsplit(num_splits):
    r = np.random.default_rng(num_splits)
    args = case(r, batch=2, seqlen_q=2, heads=16, heads_kv=2, head_dim=128, capacity=1000, page_size=16, new=2)
    check(args, causal=True, num_splits=num_splits)
    check(args | dict(q=args["q"][:1], k=args["k"][:1], v=args["v"][:1], page_table=args["page_table"][:1],
                      cache_seqlens=args["cache_seqlens"][:1] + 0), num_splits=num_splits)


@pytest.mark.parametrize("new", [0, 1])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_packed_q(new, num_splits):
    r = np.random.default_rng(new + 10 * num_splits)
    args = case(r, batch=5, seqlen_q=7, varlen=True, heads=6, heads_kv=2, capacity=90, page_size=16, new=new,
                leftpad=True, rotary="half" if new else None)
    check(args, causal=True, num_splits=num_splits, validate=True)


def test_empty_sequences():
    r = np.random.default_rng(5)
    args = case(r, batch=3, new=0, lens=[0, 6, 6], page_size=4, capacity=8)
    args["cache_leftpad"] = np.array([0, 6, 2], np.int32)
    out = check(args, num_splits=3)
    assert (out[:2] == 0).all()


def test_int_cache_seqlens_and_validate():
    r = np.random.default_rng(6)
    args = case(r, batch=2, seqlen_q=2, new=2, lens=[9, 9], capacity=20)
    args["cache_seqlens"] = 9
    check(args, causal=True, validate=True)


# Chunked prefill: sequences of at least this many query rows run the forward over the cache.
CHUNK = dispatch.KV_PREFILL_ROWS


def checked_plan(args: dict, **options):
    """check(args, **options), and the plan that ran it."""
    plan.PLANS.clear()
    check(args, **options)
    (_, ran), = plan.PLANS.items()
    return ran


@pytest.mark.parametrize("page_size", [None, 1, 16, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_chunked_prefill_page_sizes_and_gqa(page_size, group):
    r = np.random.default_rng(page_size or 0)
    # Odd chunks, one of 0 rows, each appended after a random cached prefix (0 and full included).
    args = case(r, batch=4, varlen=True, counts=[CHUNK + 45, 0, 1, 2 * CHUNK + 3], heads=2 * group, heads_kv=2,
                head_dim=128, capacity=600, page_size=page_size, new=1)
    ran = checked_plan(args, causal=True)
    # A mixed batch: the forward takes the long chunks, kv_decode (unsplit) the one-row sequence.
    assert "flash_fwd_sm80" in ran.attention and ran.forward is not None and ran.decode is not None
    assert ran.combine is None


@pytest.mark.usefixtures("family")  # sm80's forward on either family's device
def test_chunked_prefill_is_what_runs():
    r = np.random.default_rng(11)
    args = case(r, batch=2, seqlen_q=CHUNK, heads=4, heads_kv=1, capacity=400, page_size=16, new=CHUNK)
    forward = dispatch.kvcache_prefill_kernel("bfloat16", 64, dispatch.Mask("causal", -1, 0, 0.0))
    assert checked_plan(args, causal=True).attention == forward.name_expression
    shorter = {name: args[name][:, :CHUNK - 1] for name in ("q", "k", "v")}
    assert "kv_decode" in checked_plan(args | shorter, causal=True).attention


@pytest.mark.parametrize("window, softcap", [((-1, -1), 30.0), ((100, 0), 0.0), ((5, 2), 0.0), ((0, -1), 5.0),
                                             ((300, 40), 0.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_prefill_windows_and_softcap(window, softcap, causal):
    r = np.random.default_rng(sum(window) + 3)
    args = case(r, batch=3, seqlen_q=CHUNK + 7, heads=8, heads_kv=2, capacity=450, page_size=64, new=CHUNK + 7)
    check(args, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("head_dim, dtype", [(64, BF16), (80, np.dtype(np.float16)), (128, np.dtype(np.float16)),
                                             (256, BF16)])
@pytest.mark.parametrize("rotary", [None, "interleaved", "half"])
def test_chunked_prefill_rotary_and_head_dims(head_dim, dtype, rotary):
    r = np.random.default_rng(head_dim + 1)
    args = make_case(r, batch=2, varlen=True, counts=[CHUNK + 1, CHUNK + 60], heads=6, heads_kv=2,
                     head_dim=head_dim, capacity=400, page_size=16, new=1, rotary=rotary,
                     rotary_dim=head_dim // 2 if rotary == "half" else None, dtype=dtype)
    check(args, causal=True)
    args = make_case(r, batch=2, seqlen_q=CHUNK + 2, heads=6, heads_kv=2, head_dim=head_dim, capacity=300,
                     new=CHUNK + 2, rotary=rotary, dtype=dtype)
    check(args)  # a contiguous cache; not causal: q rotated at cache_seqlens


@pytest.mark.parametrize("new", [0, CHUNK + 1])
def test_chunked_prefill_cache_batch_idx(new):
    r = np.random.default_rng(13 + new)
    args = case(r, batch=3, seqlen_q=CHUNK + 1, heads=8, heads_kv=2, capacity=400, batch_idx=True, new=new,
                rotary="half" if new else None)
    assert checked_plan(args, causal=True).forward is not None


def test_chunked_prefill_without_append_and_int_lengths():
    r = np.random.default_rng(12)
    args = case(r, batch=3, seqlen_q=CHUNK + 9, heads=4, heads_kv=4, capacity=333, page_size=16, new=0)
    check(args, causal=True)  # the first rows of a sequence with fewer keys than queries see none: 0
    args = case(r, batch=2, seqlen_q=CHUNK + 9, heads=4, heads_kv=4, capacity=333, page_size=16, new=0,
                lens=[300, 300])
    args["cache_seqlens"] = 300
    check(args, causal=True, validate=True)


def test_validate_refuses_out_of_range_pages_before_any_write():
    import cupy as cp

    r = np.random.default_rng(7)
    args = case(r, batch=2, new=1, page_size=4, capacity=16, lens=[3, 8])
    args["page_table"][1, 2] = 10**6
    device = {name: to_device(value) for name, value in args.items()}
    before = cp.asnumpy(device["k_cache"])
    with pytest.raises(ValueError, match=r"page_table: entry \[1, 2\]"):
        cuflash.attention_with_kvcache(**device, validate=True)
    assert same_bytes(cp.asnumpy(device["k_cache"]), before)


def misaligned(x):
    """A CuPy copy of ``x`` whose data pointer is 2 bytes past a 16-byte boundary."""
    import cupy as cp

    base = cp.empty(x.size + 1, x.dtype)
    view = base[1:].reshape(x.shape)
    view[...] = cp.asarray(x)
    return view


# A bad argument the checks read after k_cache (in check_kvcache's order), with the error it gets.
BAD_AFTER_K_CACHE = [
    ("v_cache", lambda cp, x: cp.asarray(x.astype(np.float32)), TypeError, "v_cache: dtype float32"),
    ("v_cache", lambda cp, x: cp.asarray(x[:, :, :1]), ValueError, "v_cache: shape"),
    ("v_cache", lambda cp, x: misaligned(x), ValueError, "v_cache: data pointer and strides must be 16-byte"),
    ("v_cache", lambda cp, x: x, TypeError, "v_cache: is on the CPU"),
    ("v", lambda cp, x: cp.asarray(x.astype(np.float16)), TypeError, "v: dtype float16"),
    ("cache_seqlens", lambda cp, x: cp.asarray(x.astype(np.int64)), TypeError, "cache_seqlens: expected int32"),
    ("rotary_sin", lambda cp, x: cp.asarray(x[:, :2]), ValueError, "rotary_cos, rotary_sin: expected equal"),
]


@pytest.mark.parametrize("cached_plan", [False, True], ids=["first call", "after a good call"])
@pytest.mark.parametrize("name, bad, error, words", BAD_AFTER_K_CACHE)
def test_bad_argument_refused_before_the_append_writes(name, bad, error, words, cached_plan):
    """The append kernel writes both caches, so every check, of every argument, runs before it is
    launched: the caches keep every byte. ``cached_plan``: a good call with the same caches first,
    so that a plan is cached for them and the bad call's key must miss it."""
    import cupy as cp

    args = case(np.random.default_rng(8), batch=2, new=2, seqlen_q=2, page_size=16, capacity=32, lens=[3, 17],
                rotary="half")
    device = {key: to_device(value) for key, value in args.items()}
    if cached_plan:
        check(args, causal=True)
    before = {key: cp.asnumpy(device[key]) for key in ("k_cache", "v_cache")}
    with pytest.raises(error, match=words):
        cuflash.attention_with_kvcache(**(device | {name: bad(cp, args[name])}), causal=True)
    cp.cuda.Device().synchronize()
    for key, values in before.items():
        assert same_bytes(cp.asnumpy(device[key]), values), f"{key} was written before the checks refused {name}"


def test_bad_torch_argument_refused_before_the_append_writes():
    """The same through cuflash.torch: a v_cache of another dtype leaves k_cache as it was."""
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_with_kvcache

    args = case(np.random.default_rng(9), batch=2, new=1, page_size=16, capacity=32, lens=[3, 17])
    t = {key: to_torch(value) for key, value in args.items() if isinstance(value, np.ndarray)}
    before = t["k_cache"].clone()
    with pytest.raises(TypeError, match="v_cache: dtype float16 does not match k_cache's bfloat16"):
        flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"].half(), t["k"], t["v"],
                                cache_seqlens=t["cache_seqlens"], page_table=t["page_table"])
    torch.cuda.synchronize()
    assert torch.equal(t["k_cache"].view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("descales", ["scalar", "array", "none"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_fp8_cache(page_size, descales, dtype):
    r = np.random.default_rng(11 + (page_size or 0))
    args = make_case(r, batch=3, seqlen_q=2, heads=8, heads_kv=2, head_dim=128, capacity=200, page_size=page_size,
                     new=2, leftpad=True, dtype=dtype, cache_dtype=E4M3)
    if descales == "scalar":
        args |= dict(descale_k=0.25, descale_v=3.0)
    elif descales == "array":
        args |= dict(descale_k=r.uniform(0.05, 2.0, (3, 2)).astype(np.float32),
                     descale_v=r.uniform(0.05, 2.0, (3, 2)).astype(np.float32))
    args["k"][0, 0, 0, :4] = [1e4, -1e4, 1e-6, 0.0]  # saturated, subnormal, zero
    for num_splits in (1, 3):
        check(dict(args, k_cache=args["k_cache"].copy(), v_cache=args["v_cache"].copy()), causal=True,
              num_splits=num_splits)


@pytest.mark.parametrize("rotary", ["interleaved", "half"])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_fp8_cache_rotary_head_dims_softcap(rotary, head_dim):
    r = np.random.default_rng(head_dim)
    args = make_case(r, batch=2, seqlen_q=3, heads=4, heads_kv=1, head_dim=head_dim, capacity=70, page_size=16,
                     new=3, rotary=rotary, dtype=BF16, cache_dtype=E4M3)
    args |= dict(descale_k=np.full((2, 1), 0.5, np.float32), descale_v=0.125)
    check(args, causal=True, softcap=20.0)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_fp8_cache_widens_every_byte_exactly(dtype):
    """One cached key, so out is its value row: a row of all 256 e4m3 byte values must come out as
    exactly those values in q's type (NaN as NaN)."""
    import cupy as cp

    r = np.random.default_rng(12)
    v_row = np.arange(256, dtype=np.uint8)
    r.shuffle(v_row)
    k_cache = np.zeros((1, 32, 1, 256), np.uint8)
    k_cache[0, 0, 0] = r.integers(0, 0x7f, 256)  # finite bytes
    v_cache = np.full((1, 32, 1, 256), 0x7f, np.uint8)  # NaN past the cached key
    v_cache[0, 0, 0] = v_row
    q = r.standard_normal((1, 1, 2, 256)).astype(dtype)
    out = cuflash.attention_with_kvcache(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cache_seqlens=1,
                                         dtype="e4m3")
    want = v_row.view(E4M3).astype(np.float32)
    for head in range(2):
        np.testing.assert_array_equal(cp.asnumpy(out)[0, 0, head].astype(np.float32), want)


def test_fp8_cache_torch():
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_with_kvcache

    r = np.random.default_rng(12)
    args = make_case(r, batch=2, seqlen_q=1, new=1, page_size=16, capacity=64, heads=8, heads_kv=2, head_dim=128,
                     dtype=BF16, cache_dtype=E4M3)
    descale_k = np.array([[0.5, 1.0], [2.0, 0.25]], np.float32)
    ref_out, _, ref_k, _ = kvcache_reference(**reference_args(args), descale_k=descale_k, descale_v=0.5)

    k_cache, v_cache = to_torch(args["k_cache"]), to_torch(args["v_cache"])
    out = flash_attn_with_kvcache(to_torch(args["q"]), k_cache, v_cache, to_torch(args["k"]), to_torch(args["v"]),
                                  cache_seqlens=to_torch(args["cache_seqlens"]),
                                  page_table=to_torch(args["page_table"]), k_descale=to_torch(descale_k), v_descale=0.5)
    assert same_bytes(k_cache.cpu().view(torch.uint8).numpy().view(E4M3), ref_k)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [(4, 2, 3, 8, 128), (1, 5, 4, 64), (37, 9, 2, 80)])
@pytest.mark.parametrize("out_dtype", [None, "bfloat16", "float16"])
def test_combine(shape, out_dtype):
    import cupy as cp

    r = np.random.default_rng(8)
    o = r.standard_normal(shape).astype(np.float32)
    lse = r.standard_normal(shape[:-1]).astype(np.float32) * 3
    lse.reshape(shape[0], -1)[:, 0] = -np.inf
    lse.reshape(shape[0], -1)[0, 1] = -np.inf
    o.reshape(shape[0], -1, shape[-1])[0, 1] = np.nan
    out, merged = cuflash.combine(cp.asarray(o), cp.asarray(lse), out_dtype=out_dtype, return_lse=True)
    ref_out, ref_lse = combine_reference(o, lse)
    np.testing.assert_allclose(cp.asnumpy(out).astype(np.float64), ref_out, rtol=1e-2 if out_dtype else 1e-5,
                               atol=1e-2 if out_dtype else 1e-5)
    np.testing.assert_allclose(cp.asnumpy(merged), ref_lse, rtol=1e-5, atol=1e-5)


def test_torch_flash_attn_with_kvcache_updates_the_cache():
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_with_kvcache

    r = np.random.default_rng(9)
    args = case(r, batch=2, seqlen_q=1, new=1, page_size=16, capacity=64, heads=8, heads_kv=2)
    ref_out, _, ref_k, _ = kvcache_reference(**reference_args(args))

    k_cache, v_cache = to_torch(args["k_cache"]), to_torch(args["v_cache"])
    out = flash_attn_with_kvcache(to_torch(args["q"]), k_cache, v_cache, to_torch(args["k"]), to_torch(args["v"]),
                                  cache_seqlens=to_torch(args["cache_seqlens"]),
                                  page_table=to_torch(args["page_table"]))
    assert isinstance(out, torch.Tensor) and out.is_cuda
    assert same_bytes(k_cache.cpu().view(torch.int16).numpy().view(BF16), ref_k)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [0, 1])
def test_torch_cuda_graph_replays_with_new_cache_and_q(num_splits):
    """flash_attn_with_kvcache with an append, captured in a torch CUDA graph (no synchronisation,
    nothing allocated but through torch's allocator, or the capture fails) and replayed after the
    cache, q, new tokens, lengths and page table are overwritten in place: each replay matches the
    reference of what the tensors then hold."""
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_with_kvcache

    r = np.random.default_rng(13)
    shape = dict(batch=3, seqlen_q=2, new=2, heads=8, heads_kv=2, head_dim=128, capacity=640, page_size=16)
    steps = [case(r, **shape, lens=lens) for lens in ([0, 17, 638], [300, 1, 64])]
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "page_table")
    static = {name: to_torch(steps[0][name]) for name in names}

    def step():
        return flash_attn_with_kvcache(static["q"], static["k_cache"], static["v_cache"], static["k"], static["v"],
                                       cache_seqlens=static["cache_seqlens"], page_table=static["page_table"],
                                       causal=True, num_splits=num_splits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles, loads and caches the plan outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for args in steps:
        for name in names:
            static[name].copy_(to_torch(args[name]))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, _, ref_k, ref_v = kvcache_reference(**reference_args(args), causal=True)
        lowp_out = kvcache_reference(**reference_args(args), causal=True, dtype=BF16)[0]
        ok, err, bound = max_error_bound(out.cpu().view(torch.int16).numpy().view(BF16), ref_out, lowp_out,
                                         atol=ATOL)
        assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
        for name, ref in (("k_cache", ref_k), ("v_cache", ref_v)):
            assert same_bytes(static[name].cpu().view(torch.int16).numpy().view(BF16), ref), name


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("chunk, num_splits", [(1, 1), (1, 4), (CHUNK + 3, 0)], ids=["unsplit", "split", "prefill"])
def test_out_is_written_in_place(framework, chunk, num_splits):
    """out= receives the result (decode unsplit and split, where the combine writes it, and the
    chunked prefill's forward): the same array returned, NaN poison overwritten, equal to a call
    without out; and again on the repeated call, which the signature serves."""
    import cupy as cp

    r = np.random.default_rng(chunk + num_splits)
    args = case(r, batch=3, varlen=True, counts=[chunk, 1, 2], heads=8, heads_kv=2, head_dim=128, capacity=300,
                page_size=16, new=0)
    move = to_device if framework == "cupy" else to_torch
    device = {name: move(value) if isinstance(value, np.ndarray) else value for name, value in args.items()}
    options = dict(causal=True, num_splits=num_splits, max_seqlen_q=chunk, return_lse=True)
    expected, expected_lse = cuflash.attention_with_kvcache(**device, **options)
    as_numpy = cp.asnumpy if framework == "cupy" else (lambda t: t.float().cpu().numpy())
    for _ in range(2):
        out = move(np.full(args["q"].shape, np.nan, args["q"].dtype))
        got, lse = cuflash.attention_with_kvcache(**device, **options, out=out)
        assert got is out
        assert np.array_equal(as_numpy(out), as_numpy(expected))
        assert np.array_equal(as_numpy(lse), as_numpy(expected_lse))


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("chunk", [1, CHUNK + 3], ids=["decode", "prefill"])
def test_cache_batch_idx_picks_the_page_table_row(framework, chunk):
    """FlashAttention-3's rule: with a page_table, sequence b reads and appends through row
    cache_batch_idx[b] of a table with more rows than the batch: checked against the reference on
    the gathered table, the caches included; an index past the table is refused with validate."""
    import cupy as cp

    r = np.random.default_rng(chunk)
    args = case(r, batch=3, varlen=True, counts=[chunk, 1, 2], heads=8, heads_kv=2, head_dim=128, capacity=400,
                page_size=16, new=1)
    rows = np.array([4, 0, 2], np.int32)
    table = np.full((6, args["page_table"].shape[1]), -1, np.int32)
    table[rows] = args["page_table"]
    move = to_device if framework == "cupy" else to_torch
    device = {name: move(value) if isinstance(value, np.ndarray) else value for name, value in args.items()}
    device |= {"page_table": move(table), "cache_batch_idx": move(rows)}
    out = cuflash.attention_with_kvcache(**device, causal=True, max_seqlen_q=chunk)
    ref_out, _, ref_k, _ = kvcache_reference(**reference_args(args), causal=True)
    lowp_out = kvcache_reference(**reference_args(args), causal=True, dtype=BF16)[0]
    host = cp.asnumpy(out) if framework == "cupy" else out.cpu().view(torch_int16()).numpy().view(BF16)
    ok, err, bound = max_error_bound(host, ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
    k_cache = cp.asnumpy(device["k_cache"]) if framework == "cupy" else \
        device["k_cache"].cpu().view(torch_int16()).numpy().view(BF16)
    assert same_bytes(k_cache, ref_k)
    device["cache_batch_idx"] = move(np.array([4, 0, 6], np.int32))
    with pytest.raises(ValueError, match="cache_batch_idx: entry 2 is 6"):
        cuflash.attention_with_kvcache(**device, causal=True, max_seqlen_q=chunk, validate=True)


def torch_int16():
    import torch

    return torch.int16


@pytest.mark.parametrize("chunk", [2, CHUNK + 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("rotary", ["interleaved", "half"])
def test_rotary_seqlens(chunk, rotary):
    """rotary_seqlens: the new keys and queries rotated from their own positions (past the cache's
    capacity too), the append still at cache_seqlens; against the reference, caches included."""
    r = np.random.default_rng(chunk + len(rotary))
    args = case(r, batch=3, varlen=True, counts=[chunk, 1, 2], heads=8, heads_kv=2, head_dim=128, capacity=300,
                page_size=16, new=1, rotary=rotary)
    half = args["rotary_cos"].shape[1]
    angles = r.uniform(-np.pi, np.pi, (1000, half))
    args["rotary_cos"], args["rotary_sin"] = (f(angles).astype(BF16) for f in (np.cos, np.sin))
    args["rotary_seqlens"] = np.array([700, 0, 5], np.int32)
    check(args, causal=True, validate=True)


@pytest.mark.parametrize("varlen, counts", [(False, None), (True, [CHUNK + 3, 1, 0])], ids=["decode", "prefill"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cu_seqlens_k_new(varlen, counts, num_splits):
    """New tokens packed by cu_seqlens_k_new, their counts apart from the query counts (0 and more
    than the queries included): against the reference, caches included, values validated."""
    r = np.random.default_rng(num_splits + varlen)
    args = case(r, batch=3, seqlen_q=2, varlen=varlen, counts=counts, heads=8, heads_kv=2, head_dim=128,
                capacity=400, page_size=16, new=0, lens=[0, 17, 100])
    args["cu_seqlens_k_new"] = np.array([0, 5, 5, 12], np.int32)
    args["k"], args["v"] = (r.standard_normal((12, 2, 128)).astype(BF16) for _ in range(2))
    check(args, causal=True, num_splits=num_splits, validate=True)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("varlen, num_splits", [(False, 1), (False, 3), (True, 0)])
def test_fp8_queries_over_an_fp8_cache(framework, varlen, num_splits):
    """An e4m3 q with descale_q (FlashAttention-3's FP8 attention over an FP8 cache): widened
    exactly, its descale on the scores with k's, bf16 out; against the reference on the
    dequantized q by the correctness rule, a bf16 q of the same values as the low-precision
    baseline."""
    import cupy as cp

    r = np.random.default_rng(17 + num_splits + varlen)
    args = make_case(r, batch=3, seqlen_q=2, varlen=varlen, heads=8, heads_kv=2, head_dim=128, capacity=300,
                     page_size=16, new=0, dtype=BF16, cache_dtype=E4M3)
    args["q"] = (args["q"].astype(np.float32) * 4).astype(E4M3)
    descales = dict(descale_q=r.uniform(0.05, 0.5, (3, 2)).astype(np.float32), descale_k=0.5, descale_v=2.0)
    move = to_device if framework == "cupy" else to_torch
    device = {name: move(value) if isinstance(value, np.ndarray) else value for name, value in (args | descales).items()}
    extra = {"dtype": "e4m3"} if framework == "cupy" else {}
    out = cuflash.attention_with_kvcache(**device, **extra, causal=True, num_splits=num_splits)
    host = cp.asnumpy(out) if framework == "cupy" else out.cpu().view(torch_int16()).numpy().view(BF16)
    assert host.dtype == BF16
    ref_out = kvcache_reference(**reference_args(args), **descales, causal=True)[0]
    lowp_out = kvcache_reference(**reference_args(args), **descales, causal=True, dtype=BF16)[0]
    ok, err, bound = max_error_bound(host, ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
