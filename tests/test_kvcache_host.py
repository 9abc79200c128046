"""attention_with_kvcache and combine on NumPy arrays (the CPU path): results against the float64
reference, the in-place rule (every byte of the caches but the appended rows unchanged), and
every bad argument refused, naming it, before anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._cpu.reference_kvcache import combine_reference, kvcache_reference
from kvcache_cases import make_case, reference_args, same_bytes


def run_and_compare(args: dict, rtol=1e-12, atol=1e-12):
    before = {name: np.copy(value) if isinstance(value, np.ndarray) else value for name, value in args.items()}
    out, lse = cuflash.attention_with_kvcache(**args, return_lse=True)
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**reference_args(before))
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape and lse.dtype == np.float32
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.astype(np.float64), ref_out, rtol=rtol, atol=atol)
    np.testing.assert_allclose(lse, ref_lse.astype(np.float32), rtol=1e-6)
    assert same_bytes(args["k_cache"], ref_k) and same_bytes(args["v_cache"], ref_v)
    return out, lse


# Rotary embedding comes with an append: no rotary without new tokens.
@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("new, rotary", [(0, None), *((n, r) for n in (1, 3) for r in (None, "interleaved", "half"))])
def test_cache_options(page_size, new, rotary):
    r = np.random.default_rng(1)
    args = make_case(r, seqlen_q=max(new, 1), page_size=page_size, new=new, rotary=rotary, leftpad=True,
                     batch_idx=page_size is None, capacity=70, head_dim=32)
    run_and_compare(args | dict(causal=True))


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 5.0),
                                                     (False, (6, 0), 0.0), (True, (3, -1), 2.0)])
@pytest.mark.parametrize("group", [1, 4, 16])
def test_masks_softcap_gqa(causal, window, softcap, group):
    r = np.random.default_rng(2)
    args = make_case(r, seqlen_q=4, new=4, heads=2 * group, heads_kv=2, page_size=16, rotary="half", rotary_dim=16)
    run_and_compare(args | dict(causal=causal, window=window, softcap=softcap, softmax_scale=0.3))


@pytest.mark.parametrize("new", [0, 1])
def test_varlen_q(new):
    r = np.random.default_rng(3)
    args = make_case(r, batch=4, seqlen_q=5, varlen=True, new=new, page_size=8, rotary="interleaved" if new else None,
                     leftpad=True)
    out, lse = run_and_compare(args | dict(causal=True))
    assert lse.shape == (args["q"].shape[1], args["q"].shape[0])


def test_empty_sequences_give_zero_and_minus_inf():
    r = np.random.default_rng(4)
    args = make_case(r, new=0, lens=[0, 5, 5], leftpad=False)
    args["cache_leftpad"] = np.array([0, 5, 2], np.int32)
    out, lse = run_and_compare(args)
    assert (out[:2] == 0).all() and np.isneginf(lse[:2]).all() and np.isfinite(lse[2]).all()


def test_int_cache_seqlens_and_no_lengths():
    r = np.random.default_rng(5)
    args = make_case(r, new=2, seqlen_q=2, lens=[7, 7, 7])
    args["cache_seqlens"] = 7
    run_and_compare(args | dict(causal=True))
    full = make_case(r, new=0, lens=[40, 40, 40])
    del full["cache_seqlens"]
    run_and_compare(full)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_dtypes(dtype):
    r = np.random.default_rng(6)
    args = make_case(r, new=2, seqlen_q=2, page_size=4, dtype=dtype, rotary="interleaved")
    run_and_compare(args | dict(causal=True), rtol=1e-2, atol=1e-2)


def test_fp8_cache():
    r = np.random.default_rng(7)
    args = make_case(r, new=1, head_dim=16, cache_dtype=ml_dtypes.float8_e4m3fn, dtype=ml_dtypes.bfloat16)
    args["k_cache"] = np.nan_to_num(args["k_cache"].astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    args["v_cache"] = np.nan_to_num(args["v_cache"].astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    args |= dict(descale_k=np.full((3, 2), 0.5, np.float32), descale_v=2.0)
    run_and_compare(args, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("varlen", [False, True])
def test_fp8_queries_over_an_fp8_cache(varlen):
    """An e4m3 q with descale_q: the attention of the dequantized q (each query head taking its KV
    head's descale) over the same cache, written in bfloat16; no append or rotary with it."""
    r = np.random.default_rng(15)
    e4m3 = ml_dtypes.float8_e4m3fn
    args = make_case(r, batch=2, seqlen_q=3, varlen=varlen, new=0, head_dim=16, heads=4, heads_kv=2,
                     cache_dtype=e4m3, dtype=np.float32)
    for name in ("k_cache", "v_cache"):
        args[name] = np.nan_to_num(args[name].astype(np.float32)).astype(e4m3)
    q8 = (args["q"] * 8).astype(e4m3)
    descale_q = np.array([[0.5, 0.125], [0.25, 1.0]], np.float32)
    got = cuflash.attention_with_kvcache(**(args | {"q": q8}), descale_q=descale_q, descale_k=0.5, causal=True)
    group = np.repeat(descale_q, 2, axis=1)  # (batch, heads): each query head its KV head's
    if varlen:
        per_row = np.concatenate([np.repeat(group[b:b + 1], n, axis=0)
                                  for b, n in enumerate(np.diff(args["cu_seqlens_q"]))])
        dequantized = q8.astype(np.float64) * per_row[:, :, None]
    else:
        dequantized = q8.astype(np.float64) * group[:, None, :, None]
    expected = cuflash.attention_with_kvcache(**(args | {"q": dequantized}), descale_k=0.5, causal=True)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-2, atol=1e-2)
    out = np.zeros(q8.shape, ml_dtypes.bfloat16)
    assert cuflash.attention_with_kvcache(**(args | {"q": q8}), descale_q=descale_q, out=out, causal=True) is out
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        cuflash.attention_with_kvcache(**(args | {"q": q8}), out=np.zeros(q8.shape, np.float32))
    with pytest.raises(NotImplementedError, match="k: not taken with an e4m3 q"):
        cuflash.attention_with_kvcache(**(args | {"q": q8, "cache_seqlens": 1}), k=np.zeros((2, 1, 2, 16)),
                                       v=np.zeros((2, 1, 2, 16)))
    with pytest.raises(ValueError, match="descale_q: only an e4m3"):
        cuflash.attention_with_kvcache(**args, descale_q=0.5)


def test_host_path_matches_attention_on_gathered_keys():
    """Independently of the reference: a contiguous cache with an append is attention over the
    cached prefix and the new tokens."""
    r = np.random.default_rng(8)
    args = make_case(r, batch=2, seqlen_q=3, new=3, lens=[5, 9])
    q, kc, vc, k, v = (np.copy(args[n]) for n in ("q", "k_cache", "v_cache", "k", "v"))
    out = cuflash.attention_with_kvcache(**args, causal=True)
    for b, n in enumerate([5, 9]):
        keys = np.concatenate([kc[b, :n], k[b]])[None]
        values = np.concatenate([vc[b, :n], v[b]])[None]
        np.testing.assert_allclose(out[b:b + 1], cuflash.attention(q[b:b + 1], keys, values, causal=True),
                                   rtol=1e-10, atol=1e-12)


# Combine.

@pytest.mark.parametrize("shape", [(3, 2, 5, 4, 16), (1, 7, 4, 8), (6, 9, 2, 24)])
@pytest.mark.parametrize("out_dtype", [None, "bfloat16", np.float16])
def test_combine(shape, out_dtype):
    r = np.random.default_rng(9)
    o = r.standard_normal(shape).astype(np.float32)
    lse = r.standard_normal(shape[:-1]).astype(np.float32)
    lse.reshape(shape[0], -1)[:, 0] = -np.inf  # a row whose splits are all empty
    lse.reshape(shape[0], -1)[0, 1] = -np.inf  # one empty split
    o.reshape(shape[0], -1, shape[-1])[0, 1] = np.nan
    out, merged = cuflash.combine(o, lse, out_dtype=out_dtype, return_lse=True)
    ref_out, ref_lse = combine_reference(o, lse)
    assert out.dtype == np.dtype(out_dtype or np.float32) and merged.shape == shape[1:-1]
    np.testing.assert_allclose(out.astype(np.float64), ref_out, rtol=1e-2 if out_dtype else 1e-6, atol=1e-6)
    np.testing.assert_allclose(merged, ref_lse, rtol=1e-6)
    assert (out.reshape(-1, shape[-1])[0] == 0).all()


@pytest.mark.parametrize("bad, error, words", [
    (dict(out_partial=np.zeros((2, 3, 4, 8), np.float64)), TypeError, "out_partial: expected float32"),
    (dict(lse_partial=np.zeros((2, 3, 5), np.float32)), ValueError, "lse_partial: expected shape"),
    (dict(out_partial=np.zeros((2, 8), np.float32), lse_partial=np.zeros(2, np.float32)), ValueError, "out_partial"),
    (dict(out_dtype="int8"), TypeError, "out_dtype"),
    (dict(out_partial=None), TypeError, "out_partial: expected a CuPy array"),
    (dict(lse_partial=None), TypeError, "lse_partial: expected a CuPy array"),
])
def test_combine_refuses(bad, error, words):
    args = dict(out_partial=np.zeros((2, 3, 4, 8), np.float32), lse_partial=np.zeros((2, 3, 4), np.float32)) | bad
    with pytest.raises(error, match=words):
        cuflash.combine(**args)


# Validation.

def base_args():
    r = np.random.default_rng(10)
    return make_case(r, batch=2, seqlen_q=2, new=2, heads=4, heads_kv=2, head_dim=16, capacity=16, page_size=4,
                     lens=[3, 5])


def i32(*values):
    return np.array(values, np.int32)


def read_only(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x.flags.writeable = False
    return x


BAD_CALLS = [
    (dict(q=np.zeros((2, 2, 4, 16), np.int32)), TypeError, "q: dtype int32"),
    (dict(k_cache=np.zeros((10, 4, 2, 16), np.float32)), TypeError, "k_cache: dtype float32 does not match"),
    (dict(v_cache=np.zeros((10, 4, 2, 8))), ValueError, "v_cache: shape"),
    (dict(k_cache=np.zeros((10, 4, 3, 16)), v_cache=np.zeros((10, 4, 3, 16))), ValueError, "heads_kv"),
    (dict(k=None), ValueError, "k, v: pass both"),
    (dict(k=np.zeros((2, 2, 2, 8)), v=np.zeros((2, 2, 2, 8))), ValueError, "k: expected"),
    (dict(k=np.zeros((2, 2, 2, 16), np.float32), v=np.zeros((2, 2, 2, 16), np.float32)), TypeError, "k: dtype"),
    (dict(cache_seqlens=None), ValueError, "cache_seqlens: required"),
    (dict(cache_seqlens=np.array([3, 5], np.int64)), TypeError, "cache_seqlens: expected int32"),
    (dict(cache_seqlens=i32(3, 5, 1)), ValueError, "cache_seqlens: expected shape"),
    (dict(cache_seqlens=i32(3, 15)), ValueError, "too small for the append"),
    (dict(cache_seqlens=i32(3, 17)), ValueError, "cache_seqlens: entry 1"),
    (dict(cache_seqlens=15), ValueError, "too small for the append"),
    (dict(cache_seqlens=-1), ValueError, "cache_seqlens"),
    (dict(page_table=i32(0, 1, 2, 3, 4, 5, 6, 7).reshape(2, 4) + 5), ValueError, r"page_table: entry \[1, 1\]"),
    (dict(page_table=-i32(1, 1, 1, 1, 1, 1, 1, 1).reshape(2, 4)), ValueError, "page_table: entry"),
    (dict(page_table=np.zeros((2, 4), np.int64)), TypeError, "page_table: expected int32"),
    (dict(page_table=np.zeros((3, 4), np.int32)), ValueError, "page_table: expected shape"),
    (dict(page_table=np.zeros((2, 8), np.int32)[:, ::2]), ValueError, "page_table: must be contiguous"),
    (dict(cache_batch_idx=i32(0, 2)), ValueError, "cache_batch_idx: entry 1 is 2, outside page_table's 2 rows"),
    (dict(cache_batch_idx=i32(0)), ValueError, r"cache_batch_idx: expected shape \(2,\)"),
    (dict(cache_batch_idx=np.array([0, 1], np.int64)), TypeError, "cache_batch_idx: expected int32"),
    (dict(cache_leftpad=i32(4, 0)), ValueError, "cache_leftpad: entry 0"),
    (dict(rotary_cos=np.ones((16, 4))), ValueError, "rotary_cos, rotary_sin: pass both"),
    (dict(rotary_cos=np.ones((16, 9)), rotary_sin=np.ones((16, 9))), ValueError, "rotary_dim"),
    (dict(rotary_cos=np.ones((8, 4)), rotary_sin=np.ones((8, 4))), ValueError, "rotary_cos: 8 positions"),
    (dict(rotary_cos=np.ones((16, 4)), rotary_sin=np.ones((16, 4)), k=None, v=None), ValueError, "pass k and v"),
    (dict(descale_k=1.0), ValueError, "descale_k: only an FP8"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(num_splits=1.5), TypeError, "num_splits"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(window=(1,)), TypeError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q: only taken with cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(0, 2)), ValueError, "q: expected 3 dims"),
    (dict(out=np.zeros((2, 2, 4, 8))), ValueError, "out: expected shape"),
    (dict(out=np.zeros((2, 2, 4, 16), np.float32)), TypeError, "out: expected dtype"),
    (dict(out=np.zeros((2, 4, 2, 16)).transpose(0, 2, 1, 3)), ValueError, "out: must be contiguous"),
    (dict(out=read_only(np.zeros((2, 2, 4, 16)))), ValueError, "out: is read-only"),
    # The append writes k_cache, then v_cache: a read-only v_cache must stop it before the first.
    (dict(v_cache=read_only(base_args()["v_cache"])), ValueError, "v_cache: is read-only"),
    (dict(k_cache=read_only(base_args()["k_cache"])), ValueError, "k_cache: is read-only"),
]


@pytest.mark.parametrize("bad, error, words", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_bad_arguments_refused_before_any_write(bad, error, words):
    args = base_args() | bad
    args = {name: value for name, value in args.items() if value is not None or name == "cache_seqlens"}
    if args.get("cache_seqlens") is None:
        args.pop("cache_seqlens")
        args["cache_seqlens"] = None
    kc = np.copy(args["k_cache"])
    with pytest.raises(error, match=words):
        cuflash.attention_with_kvcache(**args)
    assert same_bytes(args["k_cache"], kc)


def test_read_only_caches_without_an_append():
    """Nothing is written without k, v: read-only caches serve."""
    args = base_args()
    args["k_cache"], args["v_cache"] = read_only(args["k_cache"]), read_only(args["v_cache"])
    del args["k"], args["v"]
    expected = cuflash.attention_with_kvcache(**(args | {name: args[name].copy() for name in ("k_cache", "v_cache")}))
    np.testing.assert_array_equal(cuflash.attention_with_kvcache(**args), expected)


@pytest.mark.parametrize("varlen", [False, True])
def test_out_is_written(varlen):
    """out= receives the result, in its own dtype, and is returned; the caches are appended as without it."""
    args = make_case(np.random.default_rng(11), batch=3, seqlen_q=3, varlen=varlen, new=1, heads=4, heads_kv=2,
                     head_dim=16, capacity=20, page_size=4)
    expected, lse = cuflash.attention_with_kvcache(**{n: np.copy(a) if isinstance(a, np.ndarray) else a
                                                      for n, a in args.items()}, causal=True, return_lse=True)
    out = np.full(args["q"].shape, np.nan)
    got, got_lse = cuflash.attention_with_kvcache(**args, causal=True, return_lse=True, out=out)
    assert got is out
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(got_lse, lse)


@pytest.mark.parametrize("varlen", [False, True])
def test_cache_batch_idx_picks_the_page_table_row(varlen):
    """FlashAttention-3's rule: with a page_table, sequence b reads (and appends through) row
    cache_batch_idx[b] of a table of any number of rows; the same as passing those rows."""
    args = make_case(np.random.default_rng(12), batch=3, seqlen_q=2, varlen=varlen, new=1, heads=4, heads_kv=2,
                     head_dim=16, capacity=12, page_size=4)
    rows = np.array([2, 0, 1], np.int32)
    table = np.zeros((5, args["page_table"].shape[1]), np.int32)
    table[rows] = args["page_table"]
    gathered = {n: np.copy(a) if isinstance(a, np.ndarray) else a for n, a in args.items()}
    expected = cuflash.attention_with_kvcache(**gathered, causal=True)
    got = cuflash.attention_with_kvcache(**(args | {"page_table": table, "cache_batch_idx": rows}), causal=True)
    np.testing.assert_array_equal(got, expected)
    for name in ("k_cache", "v_cache"):
        assert same_bytes(args[name], gathered[name])


@pytest.mark.parametrize("varlen", [False, True])
def test_rotary_seqlens_move_the_rotary_positions_only(varlen):
    """rotary_seqlens rotates the new keys and queries from its positions, the append still at
    cache_seqlens: the same as tables shifted by the difference, per sequence."""
    r = np.random.default_rng(13)
    args = make_case(r, batch=3, seqlen_q=2, varlen=varlen, new=2, heads=4, heads_kv=2, head_dim=16, capacity=12,
                     page_size=4, rotary="half")
    starts = np.array([30, 0, 7], np.int32)
    half = args.pop("rotary_cos").shape[1]
    del args["rotary_sin"]
    angles = r.uniform(-np.pi, np.pi, (36, half))  # positions past the cache's 12
    table = {"rotary_cos": np.cos(angles), "rotary_sin": np.sin(angles)}
    got_args = {n: np.copy(a) if isinstance(a, np.ndarray) else a for n, a in args.items()}
    got = cuflash.attention_with_kvcache(**got_args, **table, rotary_seqlens=starts, causal=True)
    cached = args["cache_seqlens"]
    for b in range(3):  # sequence b alone, its tables shifted so that cache_seqlens[b] lands on starts[b]
        shift = int(starts[b]) - int(cached[b])
        rows = np.roll(angles, -shift, axis=0)
        one = {n: np.copy(a) if isinstance(a, np.ndarray) else a for n, a in args.items()}
        expected = cuflash.attention_with_kvcache(**one, rotary_cos=np.cos(rows), rotary_sin=np.sin(rows),
                                                  causal=True)
        picked = (slice(args["cu_seqlens_q"][b], args["cu_seqlens_q"][b + 1]) if varlen else b)
        np.testing.assert_allclose(got[picked], expected[picked], atol=1e-12)
        page_rows = args["page_table"][b]
        np.testing.assert_allclose(got_args["k_cache"][page_rows], one["k_cache"][page_rows], atol=1e-12)
    with pytest.raises(ValueError, match="rotary_seqlens: entry 0"):
        cuflash.attention_with_kvcache(**args, **table, rotary_seqlens=np.array([40, 0, 0], np.int32), causal=True)
    with pytest.raises(ValueError, match="rotary_seqlens: only taken with rotary_cos"):
        cuflash.attention_with_kvcache(**args, rotary_seqlens=starts, causal=True)


@pytest.mark.parametrize("varlen", [False, True])
def test_cu_seqlens_k_new_packs_appends_of_their_own_lengths(varlen):
    """New tokens packed by cu_seqlens_k_new, each sequence appending its own count (0 included),
    apart from its query count: the same as writing them into the pages by hand and attending
    over the longer cache without an append."""
    r = np.random.default_rng(14)
    args = make_case(r, batch=3, seqlen_q=2, varlen=varlen, new=0, heads=4, heads_kv=2, head_dim=16, capacity=16,
                     page_size=4, lens=[3, 0, 9], counts=[2, 1, 0] if varlen else None)
    cu_new = np.array([0, 4, 4, 6], np.int32)
    k, v = (r.standard_normal((6, 2, 16)) for _ in range(2))
    appended = {n: np.copy(a) if isinstance(a, np.ndarray) else a for n, a in args.items()}
    got = cuflash.attention_with_kvcache(**appended, k=k, v=v, cu_seqlens_k_new=cu_new, causal=True)
    by_hand = {n: np.copy(a) if isinstance(a, np.ndarray) else a for n, a in args.items()}
    for b in range(3):
        for i, row in enumerate(range(cu_new[b], cu_new[b + 1])):
            pos = args["cache_seqlens"][b] + i
            page = args["page_table"][b, pos // 4]
            by_hand["k_cache"][page, pos % 4], by_hand["v_cache"][page, pos % 4] = k[row], v[row]
    by_hand["cache_seqlens"] = args["cache_seqlens"] + np.diff(cu_new).astype(np.int32)
    expected = cuflash.attention_with_kvcache(**by_hand, causal=True)
    np.testing.assert_array_equal(got, expected)
    for name in ("k_cache", "v_cache"):
        assert same_bytes(appended[name], by_hand[name])
    with pytest.raises(ValueError, match="cu_seqlens_k_new: last entry 6 must equal the packed length 5"):
        cuflash.attention_with_kvcache(**args, k=k[:5], v=v[:5], cu_seqlens_k_new=cu_new)
    with pytest.raises(ValueError, match="k: the cache is too small for the append: sequence 2"):
        cuflash.attention_with_kvcache(**args, k=np.zeros((11, 2, 16)), v=np.zeros((11, 2, 16)),
                                       cu_seqlens_k_new=np.array([0, 2, 2, 11], np.int32))
    with pytest.raises(ValueError, match=r"k: expected \(total_new, heads_kv, head_dim\)"):
        cuflash.attention_with_kvcache(**args, k=k[None], v=v[None], cu_seqlens_k_new=cu_new)
    # Without k, v it packs nothing and changes nothing (FlashAttention-3 ignores it too).
    np.testing.assert_array_equal(cuflash.attention_with_kvcache(**args, cu_seqlens_k_new=cu_new),
                                  cuflash.attention_with_kvcache(**args))


def test_rotary_with_more_queries_than_new_tokens_refused():
    args = base_args()
    args["k"], args["v"] = args["k"][:, :1], args["v"][:, :1]
    angles = np.zeros((16, 4))
    with pytest.raises(ValueError, match="seqlen_q"):
        cuflash.attention_with_kvcache(**args, rotary_cos=np.cos(angles), rotary_sin=np.sin(angles), causal=True)


def test_mixed_sides_refused():
    cupy = pytest.importorskip("cupy")
    del cupy
    args = base_args()
    args["page_table"] = [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(TypeError, match="page_table"):
        cuflash.attention_with_kvcache(**args)
