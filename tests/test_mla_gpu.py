"""mla_decode on the GPU, both kernel families, against the float64 reference
(reference_kvcache.mla_decode_reference) with the correctness rule (docs/measuring.md): out and
lse over odd cache lengths, lengths 0 and 1, page boundaries, page sizes from 1, heads 4..128,
one or two query tokens (causal), key splits (chosen, one, several, more than there are steps),
FP8 (e4m3) caches with a scalar and a per-sequence descale, torch tensors. Pages and rows no
sequence uses are NaN, so a stray read shows in out."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._cpu.reference import max_error_bound
from cuflash._cpu.reference_kvcache import mla_decode_reference

pytestmark = pytest.mark.gpu
D, DV = 576, 512
ATOL = 1e-3
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16)}


def make_case(rng, batch: int, seqlen_q: int, heads: int, seqlens, page_size: int, dtype: str, fp8: bool = False):
    """q, a NaN-poisoned paged cache with each sequence's rows written through a shuffled page
    table (one spare page per sequence, never used), page_table and cache_seqlens."""
    seqlens = np.asarray(seqlens, np.int32)
    max_pages = max(1, -(-int(seqlens.max()) // page_size)) + 1
    num_pages = batch * max_pages + 2
    cache_dtype = E4M3 if fp8 else DTYPES[dtype]
    kv = np.full((num_pages, page_size, 1, D), np.nan, np.float32).astype(cache_dtype)
    page_table = rng.permutation(num_pages)[:batch * max_pages].astype(np.int32).reshape(batch, max_pages)
    for b, n in enumerate(seqlens):
        for pos in range(n):
            kv[page_table[b, pos // page_size], pos % page_size, 0] = rng.standard_normal(D).astype(cache_dtype)
    q = rng.standard_normal((batch, seqlen_q, heads, D)).astype(DTYPES[dtype])
    return q, kv, page_table, seqlens


def run_and_check(q, kv, page_table, seqlens, *, framework: str = "cupy", descale=None, **options):
    import cupy as cp

    fp8 = kv.dtype == E4M3
    extra = {"return_lse": True} | ({"dtype": "e4m3"} if fp8 and framework == "cupy" else {})
    ref_descale = descale
    if framework == "torch":
        import torch

        def dev(x):
            if x.dtype == BF16:
                return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
            if x.dtype == E4M3:
                return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn).cuda()
            return torch.from_numpy(x).cuda()
    else:
        def dev(x):
            return cp.asarray(x.view(np.uint8) if x.dtype == E4M3 else x)
    if isinstance(descale, np.ndarray):
        descale = dev(descale)
    out, lse = cuflash.mla_decode(dev(q), dev(kv), dev(page_table), dev(seqlens), descale_kv=descale, **extra,
                                  **options)
    if framework == "torch":
        assert isinstance(out, torch.Tensor) and out.dtype == {BF16: torch.bfloat16}.get(q.dtype, torch.float16)
        out_h = out.float().cpu().numpy()
        lse_h = lse.cpu().numpy()
    else:
        out_h, lse_h = cp.asnumpy(out).astype(np.float32), cp.asnumpy(lse)
    ref_options = {k: v for k, v in options.items() if k in ("causal", "softmax_scale")}
    ref_out, ref_lse = mla_decode_reference(q, kv, page_table, seqlens, head_dim_v=DV, descale_kv=ref_descale,
                                            **ref_options)
    lowp_out = mla_decode_reference(q, kv, page_table, seqlens, head_dim_v=DV, descale_kv=ref_descale,
                                    dtype=q.dtype, **ref_options)[0]
    assert out_h.shape == ref_out.shape and lse_h.shape == ref_lse.shape
    assert np.isfinite(out_h).all(), "out holds NaN: a poisoned cache row was read"
    ok, err, bound = max_error_bound(out_h, ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
    assert np.array_equal(np.isneginf(lse_h), np.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_h[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads,seqlen_q", [(16, 1), (64, 1), (128, 1), (16, 2), (128, 2), (24, 3)],
                         ids=lambda x: str(x))
def test_matches_reference(family, dtype, heads, seqlen_q):
    rng = np.random.default_rng()
    seqlens = [1, 63, 64, 65, 333, 1000][:4 if heads >= 128 else 6]
    case = make_case(rng, len(seqlens), seqlen_q, heads, seqlens, 64, dtype)
    run_and_check(*case, causal=True)


@pytest.mark.parametrize("page_size", [1, 16, 64, 100, 128])
def test_page_sizes_and_boundaries(family, page_size):
    rng = np.random.default_rng()
    seqlens = [page_size, page_size + 1, 2 * page_size - 1, 5 * page_size + 3]
    run_and_check(*make_case(rng, 4, 1, 16, seqlens, page_size, "bfloat16"))


def test_rows_of_length_zero(family):
    rng = np.random.default_rng()
    run_and_check(*make_case(rng, 3, 2, 16, [0, 77, 0], 16, "bfloat16"), causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_several_query_tokens(family, causal):
    # Sequences shorter than seqlen_q leave causal rows that see no key: out 0, lse -inf.
    rng = np.random.default_rng()
    run_and_check(*make_case(rng, 3, 4, 32, [2, 129, 1025], 64, "float16"), causal=causal)


@pytest.mark.parametrize("heads,seqlen_q", [(16, 1), (4, 3), (24, 1), (16, 2)], ids=lambda x: str(x))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_few_query_rows(family, heads, seqlen_q, num_splits):
    # At most 32 packed rows, where sm90 transposes its products over enough keys a split (the rows
    # wgmma's N, 16 or 32, some of them padding; dispatch.MLA_NARROW_MIN_KEYS, which the longest
    # sequence's capacity passes for both in three splits): lengths 0, shorter than seqlen_q
    # (causal rows that see no key), odd, in one split and across several.
    rng = np.random.default_rng()
    case = make_case(rng, 4, seqlen_q, heads, [0, 1, 333, 24601], 64, "float16")
    run_and_check(*case, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 3, 40])
def test_splits(family, num_splits):
    rng = np.random.default_rng()
    run_and_check(*make_case(rng, 2, 2, 64, [5, 3001], 64, "bfloat16"), causal=True, num_splits=num_splits)


def test_softmax_scale(family):
    rng = np.random.default_rng()
    run_and_check(*make_case(rng, 2, 1, 16, [200, 17], 32, "bfloat16"), softmax_scale=0.3 / math.sqrt(D))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("per_sequence", [False, True], ids=["scalar", "per_sequence"])
def test_fp8_cache(family, dtype, per_sequence):
    rng = np.random.default_rng()
    case = make_case(rng, 3, 2, 64, [1, 190, 700], 64, dtype, fp8=True)
    descale = rng.uniform(0.01, 0.05, (3, 1)).astype(np.float32) if per_sequence else 0.03
    run_and_check(*case, descale=descale, causal=True, num_splits=2)


def test_torch_tensors(family):
    pytest.importorskip("torch")
    rng = np.random.default_rng()
    run_and_check(*make_case(rng, 2, 2, 16, [90, 300], 64, "bfloat16"), framework="torch", causal=True)
    run_and_check(*make_case(rng, 2, 1, 16, [90, 300], 64, "float16", fp8=True), framework="torch", descale=0.5)


def test_validate_finds_a_page_out_of_range(family):
    import cupy as cp

    rng = np.random.default_rng()
    q, kv, page_table, seqlens = make_case(rng, 2, 1, 16, [10, 20], 16, "bfloat16")
    page_table[1, 0] = kv.shape[0]
    with pytest.raises(ValueError, match="page_table"):
        cuflash.mla_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(page_table), cp.asarray(seqlens), validate=True)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_split_form(family, fp8):
    # FA3's qv form: the latent and rope parts in separate arrays (their own strides: slices of
    # wider buffers here), the same attention as the single array.
    import cupy as cp

    rng = np.random.default_rng()
    q, kv, page_table, seqlens = make_case(rng, 3, 2, 64, [1, 190, 700], 64, "bfloat16", fp8=fp8)
    descale = 0.03 if fp8 else None
    ref_out, ref_lse = mla_decode_reference(q, kv, page_table, seqlens, head_dim_v=DV, descale_kv=descale)
    lowp_out = mla_decode_reference(q, kv, page_table, seqlens, head_dim_v=DV, descale_kv=descale, dtype=q.dtype)[0]

    def dev(x):  # into a buffer 16 columns wider, so each part has strides of its own
        wide = np.zeros((*x.shape[:-1], x.shape[-1] + 16), x.dtype)
        wide[..., :x.shape[-1]] = x
        return cp.asarray(wide.view(np.uint8) if x.dtype == E4M3 else wide)[..., :x.shape[-1]]
    extra = {"dtype": "e4m3", "descale_kv": descale} if fp8 else {}
    out, lse = cuflash.mla_decode(dev(q[..., :DV]), dev(kv[..., :DV]), cp.asarray(page_table), cp.asarray(seqlens),
                                  q_rope=dev(q[..., DV:]), kv_rope_cache=dev(kv[..., DV:]), return_lse=True, **extra)
    out_h, lse_h = cp.asnumpy(out).astype(np.float32), cp.asnumpy(lse)
    ok, err, bound = max_error_bound(out_h, ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_h[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_flash_attn_with_kvcache_qv_form(family, paged):
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_with_kvcache

    rng = np.random.default_rng()
    if paged:
        q, kv, page_table, seqlens = make_case(rng, 2, 2, 16, [90, 300], 64, "float16")
    else:  # one page of the whole capacity per sequence
        q, kv, _, seqlens = make_case(rng, 2, 2, 16, [90, 300], 320, "float16")
        kv = np.stack([kv[0], kv[0]])  # rows past each length are NaN, never read
        kv[1, :300, 0] = rng.standard_normal((300, D)).astype(np.float16)
        kv[0, :90, 0] = rng.standard_normal((90, D)).astype(np.float16)
        page_table = np.arange(2, dtype=np.int32)[:, None]
    ref_out, ref_lse = mla_decode_reference(q, kv, page_table, seqlens, head_dim_v=DV, causal=True)
    lowp_out = mla_decode_reference(q, kv, page_table, seqlens, head_dim_v=DV, causal=True, dtype=q.dtype)[0]
    t = {name: torch.from_numpy(np.ascontiguousarray(x)).cuda() for name, x in
         (("q", q[..., DV:]), ("k_cache", kv[..., DV:]), ("v_cache", kv[..., :DV]), ("qv", q[..., :DV]),
          ("cache_seqlens", seqlens), ("page_table", page_table))}
    if not paged:
        del t["page_table"]
    out, lse = flash_attn_with_kvcache(**t, causal=True, return_softmax_lse=True)
    ok, err, bound = max_error_bound(out.float().cpu().numpy(), ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-3, atol=1e-3)
