"""cuflash.torch.vllm on CPU tensors (the CPU path): vLLM's flash_attn_varlen_func over a paged cache
for a mixed batch (decodes, prefill chunks, an empty query, a sequence of one cached token), block
sizes, NHD and HND pool strides, block tables with repeated entries, GQA, softcap, windows, sinks,
an FP8 cache, packed keys, out= written in place, lse in vLLM's (heads, total_q) layout; each
sequence against the float64 reference on its gathered keys. And the argument rules."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cuflash.torch import vllm  # noqa: E402
from vllm_cases import HEAD_DIM, HEADS, HEADS_KV, mixed_batch, reference  # noqa: E402

# A mixed batch: two decodes, a prefill chunk, an empty query, a sequence of one cached token.
QUERY_LENS = [1, 1, 37, 0, 1]
CACHED_LENS = [45, 20, 70, 9, 1]


def call(q, k_cache, v_cache, table, cu, used, **options):
    return vllm.flash_attn_varlen_func(q, k_cache, v_cache, max_seqlen_q=int(max(QUERY_LENS)), cu_seqlens_q=cu,
                                       max_seqlen_k=int(used.max()), seqused_k=used, block_table=table, **options)


@pytest.mark.parametrize("block_size", [1, 16, 32, 64])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_mixed_batch_over_the_paged_cache(block_size, hnd):
    r = np.random.default_rng(block_size + hnd)
    q, kc, vc, table, cu, used, keys, values = mixed_batch(r, block_size, QUERY_LENS, CACHED_LENS, hnd)
    out = torch.full_like(q, float("nan"))
    got, lse = call(q, kc, vc, table, cu, used, causal=True, out=out, return_softmax_lse=True)
    assert got is out and lse.shape == (HEADS, q.shape[0])
    ref_out, ref_lse = reference(q, cu, keys, values, causal=True)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("options", [dict(softcap=5.0), dict(window_size=[6, 0]), dict(window_size=(3, 2)),
                                     dict(causal=False)], ids=["softcap", "window", "window-both", "not-causal"])
def test_masks_and_softcap(options):
    r = np.random.default_rng(7)
    q, kc, vc, table, cu, used, keys, values = mixed_batch(r, 16, QUERY_LENS, CACHED_LENS, False)
    options = {"causal": True} | options
    got = call(q, kc, vc, table, cu, used, **options)
    window = tuple(options.pop("window_size", (-1, -1)))
    ref_out, _ = reference(q, cu, keys, values, window=window, **options)
    np.testing.assert_allclose(got.numpy(), ref_out, atol=1e-5)


def test_sinks_and_alibi():
    r = np.random.default_rng(8)
    q, kc, vc, table, cu, used, keys, values = mixed_batch(r, 16, QUERY_LENS, CACHED_LENS, True)
    sinks = torch.from_numpy(r.standard_normal(HEADS).astype(np.float32))
    got, lse = call(q, kc, vc, table, cu, used, causal=True, s_aux=sinks, return_softmax_lse=True)
    ref_out, ref_lse = reference(q, cu, keys, values, causal=True, sinks=sinks.numpy())
    np.testing.assert_allclose(got.numpy(), ref_out, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-5)
    slopes = torch.from_numpy(r.uniform(0.01, 0.5, HEADS).astype(np.float32))
    got = call(q, kc, vc, table, cu, used, causal=True, alibi_slopes=slopes)
    np.testing.assert_allclose(got.numpy(), reference(q, cu, keys, values, causal=True, alibi_slopes=slopes.numpy())[0],
                               atol=1e-5)


def test_fp8_cache_with_vllms_expanded_descales():
    r = np.random.default_rng(9)
    q, kc, vc, table, cu, used, keys, values = mixed_batch(r, 16, QUERY_LENS, CACHED_LENS, False)
    scale_k, scale_v = 0.5, 0.25
    k8, v8 = (torch.nan_to_num(c / s).to(torch.float8_e4m3fn) for c, s in ((kc, scale_k), (vc, scale_v)))
    batch = len(QUERY_LENS)
    descale_k = torch.tensor([scale_k]).expand(batch, HEADS_KV)  # vLLM's layer scale, expanded: stride 0
    descale_v = torch.tensor([scale_v]).expand(batch, HEADS_KV)
    got = call(q, k8, v8, table, cu, used, causal=True, k_descale=descale_k, v_descale=descale_v)
    dequantized = [((k / scale_k).to(torch.float8_e4m3fn).float() * scale_k,
                    (v / scale_v).to(torch.float8_e4m3fn).float() * scale_v) for k, v in zip(keys, values)]
    ref_out, _ = reference(q, cu, [d[0] for d in dequantized], [d[1] for d in dequantized], causal=True)
    np.testing.assert_allclose(got.numpy(), ref_out, atol=1e-5)


def test_one_cache_row_per_sequence():
    """seqused_k without a block table: k, v (num_seqs, seqlen_k, heads_kv, head_dim)."""
    r = np.random.default_rng(10)
    q, kc, vc, table, cu, used, keys, values = mixed_batch(r, 80, QUERY_LENS, CACHED_LENS, False, blocks_per_seq=1)
    rows = table[:, 0].long()
    got = vllm.flash_attn_varlen_func(q, kc[rows], vc[rows], max_seqlen_q=37, cu_seqlens_q=cu, max_seqlen_k=80,
                                      seqused_k=used, causal=True)
    np.testing.assert_allclose(got.numpy(), reference(q, cu, keys, values, causal=True)[0], atol=1e-5)


def test_packed_keys():
    r = np.random.default_rng(11)
    q_lens, k_lens = [3, 0, 17, 1], [5, 4, 17, 30]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32)
    q = torch.from_numpy(r.standard_normal((int(cu_q[-1]), HEADS, HEAD_DIM)))
    k, v = (torch.from_numpy(r.standard_normal((int(cu_k[-1]), HEADS_KV, HEAD_DIM))) for _ in range(2))
    out = torch.empty_like(q)
    got, lse = vllm.flash_attn_varlen_func(q, k, v, 17, cu_q, 30, cu_seqlens_k=cu_k, causal=True, out=out,
                                           return_softmax_lse=True, num_splits=4)
    keys = [k[cu_k[b]:cu_k[b + 1]] for b in range(4)]
    values = [v[cu_k[b]:cu_k[b + 1]] for b in range(4)]
    ref_out, ref_lse = reference(q, cu_q, keys, values, causal=True)
    assert got is out
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-10)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-6)


def test_scheduler_metadata_is_accepted_and_changes_nothing():
    r = np.random.default_rng(12)
    q, kc, vc, table, cu, used, *_ = mixed_batch(r, 16, QUERY_LENS, CACHED_LENS, False)
    metadata = vllm.get_scheduler_metadata(len(QUERY_LENS), 37, 80, HEADS, HEADS_KV, HEAD_DIM, used,
                                           cu_seqlens_q=cu, page_size=16, causal=True, num_splits=3)
    assert metadata.dtype == torch.int32 and metadata.tolist() == [3, 0, 0, 0, 0, 0]
    plain = call(q, kc, vc, table, cu, used, causal=True, num_splits=3)
    assert torch.equal(call(q, kc, vc, table, cu, used, causal=True, num_splits=3, scheduler_metadata=metadata), plain)


def test_versions():
    assert vllm.DEFAULT_FA_VERSION in (2, 3)
    assert not vllm.is_fa_version_supported(4)
    assert "not 4" in vllm.fa_version_unsupported_reason(4)
    with pytest.raises(ValueError, match="fa_version"):
        vllm.is_fa_version_supported(1)
    if not torch.cuda.is_available():
        assert "GPU" in vllm.fa_version_unsupported_reason(3) and not vllm.is_fa_version_supported(2)


def _bad_calls():
    r = np.random.default_rng(13)
    q, kc, vc, table, cu, used, *_ = mixed_batch(r, 16, QUERY_LENS, CACHED_LENS, False)
    base = dict(q=q, k=kc, v=vc, max_seqlen_q=37, cu_seqlens_q=cu, max_seqlen_k=80, seqused_k=used, block_table=table)
    return base, [
        (dict(seqused_k=None, cu_seqlens_k=cu), ValueError, "block_table: needs seqused_k"),
        (dict(seqused_k=None, block_table=None), ValueError, "cu_seqlens_k, seqused_k: pass one of them"),
        (dict(cu_seqlens_k=cu), ValueError, "pass only one"),
        (dict(q_v=q), NotImplementedError, "q_v"),
        (dict(dropout_p=0.1), NotImplementedError, "dropout_p"),
        (dict(return_attn_probs=True), NotImplementedError, "return_attn_probs"),
        (dict(q_descale=torch.ones(5, 2)), ValueError, "descale_q: only an e4m3"),
        (dict(cp_world_size=2), NotImplementedError, "cp_world_size"),
        (dict(fa_version=4), NotImplementedError, "fa_version"),
        (dict(window_size=(1, 2, 3)), ValueError, "window_size"),
        (dict(scheduler_metadata=[0]), TypeError, "scheduler_metadata"),
        (dict(block_table=table.long()), TypeError, "page_table: expected int32"),
        (dict(out=torch.empty(3, HEADS, HEAD_DIM)), ValueError, "out: expected shape"),
        (dict(k_descale=torch.ones(5, 2)), ValueError, "descale_k"),
        (dict(block_table=table.numpy()), TypeError, "block_table: expected a torch.Tensor"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls()[1])))
def test_bad_arguments(index):
    base, bad = _bad_calls()
    change, error, words = bad[index]
    with pytest.raises(error, match=words):
        vllm.flash_attn_varlen_func(**(base | change))


def test_fp8_queries_with_vllms_expanded_descales():
    r = np.random.default_rng(15)
    q, kc, vc, table, cu, used, *_ = mixed_batch(r, 16, QUERY_LENS, CACHED_LENS, False)
    k8, v8 = (torch.nan_to_num(c).to(torch.float8_e4m3fn) for c in (kc, vc))
    q8 = (q * 4).to(torch.float8_e4m3fn)
    batch = len(QUERY_LENS)
    descale = torch.tensor([0.25]).expand(batch, HEADS_KV)
    got = call(q8, k8, v8, table, cu, used, causal=True, q_descale=descale, k_descale=descale * 4,
               v_descale=descale * 4)
    expected = call(q8.float() * 0.25, k8, v8, table, cu, used, causal=True, k_descale=descale * 4,
                    v_descale=descale * 4)
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.float().numpy(), expected.numpy(), rtol=1e-2, atol=1e-2)
