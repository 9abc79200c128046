"""The KV-cache reference against plain attention on the same keys, built independently: caches
written by hand, paged caches as permuted copies of contiguous ones, rotary against complex
multiplication, combine against attention over the whole key range."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash._cpu.reference import attention_reference
from cuflash._cpu.reference_kvcache import apply_rotary, combine_reference, kvcache_reference


def rng():
    return np.random.default_rng(7)


def to_paged(cache: np.ndarray, page_size: int, r) -> tuple[np.ndarray, np.ndarray]:
    """A contiguous (batch, seqlen, h, d) cache as pages in a shuffled pool plus its page table."""
    batch, seqlen = cache.shape[:2]
    pages_per_seq = -(-seqlen // page_size)
    padded = np.zeros((batch, pages_per_seq * page_size, *cache.shape[2:]), cache.dtype)
    padded[:, :seqlen] = cache
    order = r.permutation(batch * pages_per_seq)
    pool = np.zeros((batch * pages_per_seq + 3, page_size, *cache.shape[2:]), cache.dtype)
    table = order.reshape(batch, pages_per_seq).astype(np.int32)
    for b in range(batch):
        for p in range(pages_per_seq):
            pool[table[b, p]] = padded[b, p * page_size:(p + 1) * page_size]
    return pool, table


def test_plain_cache_is_attention_over_the_cached_prefix():
    r = rng()
    q = r.standard_normal((3, 2, 4, 16))
    kc, vc = r.standard_normal((2, 3, 20, 2, 16))
    lens = np.array([0, 7, 20])
    out, lse, kc2, vc2 = kvcache_reference(q, kc, vc, cache_seqlens=lens, causal=True)
    assert np.array_equal(kc2, kc) and np.array_equal(vc2, vc)
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all() and np.isneginf(lse[b]).all()
            continue
        o, l = attention_reference(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True)
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12)


def test_append_batch_idx_and_leftpad():
    r = rng()
    q = r.standard_normal((2, 3, 4, 8))
    kc, vc = r.standard_normal((2, 5, 12, 2, 8))
    k, v = r.standard_normal((2, 2, 3, 2, 8))
    lens, idx, pad = np.array([4, 9]), np.array([3, 1]), np.array([1, 0])
    out, lse, kc2, vc2 = kvcache_reference(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=idx,
                                           cache_leftpad=pad, causal=True, window=(5, -1))
    changed = np.zeros(kc.shape[:2], bool)
    for b in range(2):
        changed[idx[b], lens[b]:lens[b] + 3] = True
        np.testing.assert_array_equal(kc2[idx[b], lens[b]:lens[b] + 3], k[b])
        keys = np.concatenate([kc[idx[b], pad[b]:lens[b]], k[b]])[None]
        values = np.concatenate([vc[idx[b], pad[b]:lens[b]], v[b]])[None]
        o, l = attention_reference(q[b:b + 1], keys, values, causal=True, window=(5, -1))
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12, atol=1e-12)
    assert np.array_equal(kc2[~changed], kc[~changed]) and np.array_equal(vc2[~changed], vc[~changed])


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_equals_contiguous(page_size):
    r = rng()
    q = r.standard_normal((3, 2, 6, 8))
    kc, vc = r.standard_normal((2, 3, 37, 3, 8))
    k, v = r.standard_normal((2, 3, 2, 3, 8))
    lens = np.array([0, 16, 35])
    cos, sin = np.cos(r.uniform(0, 6, (40, 3))), np.sin(r.uniform(0, 6, (40, 3)))
    options = dict(cache_seqlens=lens, causal=True, rotary_cos=cos, rotary_sin=sin, softcap=3.0)
    out, lse, kc2, _ = kvcache_reference(q, kc, vc, k, v, **options)
    pool_k, table = to_paged(kc, page_size, r)
    pool_v = np.zeros_like(pool_k)
    for b in range(3):
        for p in range(table.shape[1]):
            rows = vc[b, p * page_size:(p + 1) * page_size]
            pool_v[table[b, p], :rows.shape[0]] = rows
    out_p, lse_p, pool_k2, _ = kvcache_reference(q, pool_k, pool_v, k, v, page_table=table, **options)
    np.testing.assert_allclose(out_p, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_p, lse, rtol=1e-12)
    for b in range(3):
        for pos in range(lens[b], lens[b] + 2):
            np.testing.assert_array_equal(pool_k2[table[b, pos // page_size], pos % page_size], kc2[b, pos])


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_is_complex_rotation(interleaved):
    r = rng()
    x = r.standard_normal((5, 2, 16))
    angles = r.uniform(0, 6, (9, 6))  # rotary_dim 12 of 16
    positions = np.array([0, 3, 8, 8, 1])
    got = apply_rotary(x, np.cos(angles), np.sin(angles), positions, interleaved)
    if interleaved:
        pairs = x[..., 0:12:2] + 1j * x[..., 1:12:2]
    else:
        pairs = x[..., :6] + 1j * x[..., 6:12]
    turned = pairs * np.exp(1j * angles[positions])[:, None, :]
    expected = x.copy()
    if interleaved:
        expected[..., 0:12:2], expected[..., 1:12:2] = turned.real, turned.imag
    else:
        expected[..., :6], expected[..., 6:12] = turned.real, turned.imag
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))])
def test_rotary_positions_of_q_and_new_k(causal, window):
    r = rng()
    q = r.standard_normal((1, 3, 2, 8))
    kc, vc = r.standard_normal((2, 1, 10, 1, 8))
    k, v = r.standard_normal((2, 1, 3, 1, 8))
    angles = r.uniform(0, 6, (10, 4))
    cos, sin = np.cos(angles), np.sin(angles)
    out, _, kc2, _ = kvcache_reference(q, kc, vc, k, v, cache_seqlens=4, rotary_cos=cos, rotary_sin=sin,
                                       causal=causal, window=window)
    np.testing.assert_allclose(kc2[0, 4:7], apply_rotary(k[0], cos, sin, np.arange(4, 7), True), rtol=1e-12)
    q_pos = np.arange(4, 7) if causal or window != (-1, -1) else np.full(3, 4)
    q_rot = apply_rotary(q[0], cos, sin, q_pos, True)[None]
    o, _ = attention_reference(q_rot, kc2[:, :7], np.concatenate([vc[0, :4], v[0]])[None],
                               causal=causal, window=window)
    np.testing.assert_allclose(out, o, rtol=1e-12, atol=1e-12)


def test_varlen_q_shares_lengths_with_new_tokens():
    r = rng()
    cu = np.array([0, 2, 2, 5])
    q = r.standard_normal((5, 4, 8))
    k, v = r.standard_normal((2, 5, 2, 8))
    kc, vc = r.standard_normal((2, 3, 9, 2, 8))
    lens = np.array([3, 0, 4])
    out, lse, kc2, _ = kvcache_reference(q, kc, vc, k, v, cache_seqlens=lens, cu_seqlens_q=cu, causal=True)
    assert lse.shape == (4, 5)
    for b in range(3):
        rows = slice(cu[b], cu[b + 1])
        np.testing.assert_array_equal(kc2[b, lens[b]:lens[b] + cu[b + 1] - cu[b]], k[rows])
        if cu[b + 1] == cu[b]:
            continue
        keys = np.concatenate([kc[b, :lens[b]], k[rows]])[None]
        values = np.concatenate([vc[b, :lens[b]], v[rows]])[None]
        o, l = attention_reference(q[None, rows], keys, values, causal=True)
        np.testing.assert_allclose(out[rows], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], l[0], rtol=1e-12)


def test_fp8_cache_dequantized_and_new_tokens_quantized():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    r = rng()
    q = r.standard_normal((2, 1, 4, 16))
    kc = r.standard_normal((2, 8, 2, 16)).astype(ml_dtypes.float8_e4m3fn)
    vc = r.standard_normal((2, 8, 2, 16)).astype(ml_dtypes.float8_e4m3fn)
    k, v = r.standard_normal((2, 2, 1, 2, 16))
    dk, dv = np.array([[0.5, 2.0], [1.0, 0.25]], np.float32), 0.75
    out, _, kc2, vc2 = kvcache_reference(q, kc, vc, k, v, cache_seqlens=np.array([3, 5]), descale_k=dk,
                                         descale_v=dv)
    np.testing.assert_array_equal(kc2[1, 5], (k[1, 0] / dk[1][:, None]).astype(ml_dtypes.float8_e4m3fn))
    keys = kc2[0:1, :4].astype(np.float64) * dk[0][None, None, :, None]
    values = vc2[0:1, :4].astype(np.float64) * dv
    o, _ = attention_reference(q[:1], keys, values)
    np.testing.assert_allclose(out[:1], o, rtol=1e-12, atol=1e-12)


def test_fp8_cache_appends_saturate_and_round_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q = np.ones((1, 1, 1, 16))
    kc = vc = np.zeros((1, 4, 1, 16), ml_dtypes.float8_e4m3fn)
    k = np.full((1, 1, 1, 16), 1000.0)
    k[0, 0, 0, 1] = -1e6
    k[0, 0, 0, 2] = 0.1  # float32(0.1) / float32(0.3) rounds once in float32
    _, _, kc2, vc2 = kvcache_reference(q, kc, vc, k, -k, cache_seqlens=1, descale_k=0.3, descale_v=1.0)
    stored = kc2[0, 1, 0].astype(np.float64)
    assert stored[0] == 448 and stored[1] == -448 and vc2[0, 1, 0, 0].astype(np.float64) == -448
    expected = (np.float32(0.1) / np.float32(0.3)).astype(ml_dtypes.float8_e4m3fn)
    assert kc2[0, 1, 0, 2] == expected and np.isfinite(stored).all()


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_combine_equals_attention_over_all_keys(splits):
    r = rng()
    q = r.standard_normal((2, 3, 4, 8))
    k, v = r.standard_normal((2, 2, 40, 2, 8))
    full, full_lse = attention_reference(q, k, v, causal=True)
    bounds = np.linspace(0, 40, splits + 1).astype(int)
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # keys lo..hi of a causal row i (aligned at 37 + i) are those <= 37 + i
        mask_q = np.arange(3)[:, None] + 37 >= np.arange(lo, hi)[None]
        s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k[:, lo:hi], 2, axis=2)) / np.sqrt(8)
        s = np.where(mask_q, s, -np.inf)
        m = s.max(-1, keepdims=True, initial=-np.inf)
        p = np.exp(s - np.where(np.isneginf(m), 0, m))
        l = p.sum(-1)
        o = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v[:, lo:hi], 2, axis=2))
        o = o / np.where(l == 0, 1, l).transpose(0, 2, 1)[..., None]
        lse = np.where(l == 0, -np.inf, np.log(np.where(l == 0, 1, l)) + np.where(np.isneginf(m[..., 0]), 0, m[..., 0]))
        outs.append(np.where((l == 0).transpose(0, 2, 1)[..., None], np.nan, o))  # garbage in empty splits
        lses.append(lse.transpose(0, 2, 1))
    out, lse = combine_reference(np.stack(outs), np.stack(lses))
    np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, full_lse.transpose(0, 2, 1), rtol=1e-12)


def test_combine_of_empty_rows():
    out, lse = combine_reference(np.full((3, 2, 4), np.nan), np.full((3, 2), -np.inf))
    assert (out == 0).all() and np.isneginf(lse).all()
