"""The MLA decoding reference (one latent head, values its first dims, a paged cache) against a
softmax written out here with einsum over keys gathered page by page: odd lengths, page
boundaries, sequences of no keys, two query tokens under the causal mask, and an FP8 cache."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash._cpu.reference_kvcache import mla_decode_reference, quantize_e4m3

HEAD_DIM, HEAD_DIM_V = 576, 512


def paged_latents(r, lengths, page_size):
    """A shuffled pool of pages of one latent head and its page table, for these lengths."""
    pages = [-(-n // page_size) or 1 for n in lengths]
    order = r.permutation(sum(pages) + 2)
    table = np.zeros((len(lengths), max(pages)), np.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start:start + count]
        start += count
    pool = r.standard_normal((sum(pages) + 2, page_size, 1, HEAD_DIM))
    return pool, table


def expected(q, pool, table, lengths, scale, causal, descale=None):
    """(out, lse) in float64: the keys of sequence b gathered position by position."""
    batch, seqlen_q, heads, _ = q.shape
    out = np.zeros((batch, seqlen_q, heads, HEAD_DIM_V))
    lse = np.full((batch, heads, seqlen_q), -np.inf)
    page_size = pool.shape[1]
    for b, n in enumerate(lengths):
        positions = np.arange(n)
        latents = pool[table[b, positions // page_size], positions % page_size, 0].astype(np.float64)
        if descale is not None:
            latents = latents * descale[b, 0]
        scores = np.einsum("qhd,kd->hqk", q[b].astype(np.float64), latents) * scale
        if causal:  # bottom-right: query i sees keys up to n - seqlen_q + i
            seen = positions[None, :] <= n - seqlen_q + np.arange(seqlen_q)[:, None]
            scores = np.where(seen[None], scores, -np.inf)
        for h in range(heads):
            for i in range(seqlen_q):
                row = scores[h, i]
                if np.isneginf(row).all():
                    continue
                top = row.max()
                weights = np.exp(row - top)
                out[b, i, h] = weights @ latents[:, :HEAD_DIM_V] / weights.sum()
                lse[b, h, i] = top + math.log(weights.sum())
    return out, lse


@pytest.mark.parametrize("seqlen_q, causal", [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("page_size", [64, 16])
def test_latent_attention_matches_the_written_out_softmax(seqlen_q, causal, page_size):
    r = np.random.default_rng(seqlen_q * 100 + page_size)
    lengths = [1, 0, 129, 300, 64]  # one key, none, past a page edge, several pages, exactly one page
    pool, table = paged_latents(r, lengths, page_size)
    q = r.standard_normal((len(lengths), seqlen_q, 16, HEAD_DIM))
    out, lse = mla_decode_reference(q, pool, table, np.array(lengths), causal=causal)
    want_out, want_lse = expected(q, pool, table, lengths, 1 / math.sqrt(HEAD_DIM), causal)
    assert out.shape == (len(lengths), seqlen_q, 16, HEAD_DIM_V)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    # The sequence without keys, and with causal two query tokens over one key the first token.
    assert np.isneginf(lse[1]).all() and not out[1].any()
    if causal and seqlen_q == 2:
        assert np.isneginf(lse[0, :, 0]).all() and np.isfinite(lse[0, :, 1]).all()


def test_fp8_cache_with_descales():
    r = np.random.default_rng(3)
    lengths = [77, 200]
    pool, table = paged_latents(r, lengths, 64)
    descale = np.array([[0.02], [0.005]])
    stored = np.zeros(pool.shape, ml_dtypes.float8_e4m3fn)
    for b in range(len(lengths)):  # each sequence's pages at its own scale
        pages = np.unique(table[b, :-(-lengths[b] // 64)])
        stored[pages] = quantize_e4m3(pool[pages] * descale[b, 0] * 50, descale[b, 0])
    q = r.standard_normal((2, 1, 8, HEAD_DIM))
    out, lse = mla_decode_reference(q, stored, table, np.array(lengths), descale_kv=descale, softmax_scale=0.05)
    want_out, want_lse = expected(q, stored.astype(np.float64), table, lengths, 0.05, True, descale)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
