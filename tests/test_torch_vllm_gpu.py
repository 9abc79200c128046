"""cuflash.torch.vllm on the GPU: vLLM's flash_attn_varlen_func over a paged bf16 (or e4m3) cache for
mixed batches (decodes with prefill chunks short and long, the long ones running the forward kernel
over the cache), block sizes 1-64, NHD and HND pools, repeated block-table entries, GQA 8:1,
softcap, windows, sinks; out= written in place; a CUDA graph captured at maxima and replayed at
shorter lengths equal to an eager call; each sequence against the float64 reference by the
correctness rule (docs/measuring.md)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuflash._cpu.reference import max_error_bound

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from cuflash._core import dispatch  # noqa: E402
from cuflash.torch import vllm  # noqa: E402
from vllm_cases import HEADS, HEADS_KV, mixed_batch, reference  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
ATOL = 1e-3
LONG = dispatch.KV_PREFILL_ROWS + 5  # a chunk that runs the forward kernel over the cache


def on_gpu(*tensors):
    return tuple(t.cuda() for t in tensors)


def step(r, block_size, query_lens, cached_lens, hnd=False, dtype=torch.bfloat16, blocks_per_seq=None):
    q, kc, vc, table, cu, used, keys, values = mixed_batch(r, block_size, query_lens, cached_lens, hnd, dtype,
                                                           blocks_per_seq)
    return (*on_gpu(q, kc, vc, table, cu, used), keys, values)


def call(q, kc, vc, table, cu, used, max_seqlen_q, **options):
    return vllm.flash_attn_varlen_func(q, kc, vc, max_seqlen_q=max_seqlen_q, cu_seqlens_q=cu,
                                       max_seqlen_k=int(used.max()), seqused_k=used, block_table=table, **options)


def check(out, q, cu, keys, values, lse=None, **options):
    ref_out, ref_lse = reference(q.cpu(), cu.cpu(), keys, values, **options)
    lowp_out, _ = reference(q.cpu(), cu.cpu(), keys, values, dtype=BF16, **options)
    ok, err, bound = max_error_bound(out.float().cpu().numpy(), ref_out, lowp_out, atol=ATOL)
    assert ok, f"out: max error {err:.3e} over the bound {bound:.3e}"
    if lse is not None:
        got = lse.cpu().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(got[finite], ref_lse[finite], rtol=1e-2, atol=1e-2)


MIXES = {"decodes": ([1, 1, 1, 0, 1], [300, 45, 1, 9, 17]),
         "short chunks": ([1, 1, 37, 0, 1], [45, 20, 70, 9, 1]),
         "long chunk": ([1, LONG, 1, 0, 3], [500, LONG + 40, 1, 9, 64])}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("block_size", [1, 16, 32, 64])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_mixed_batch(mix, block_size, hnd):
    r = np.random.default_rng(block_size + 7 * hnd + len(mix))
    query_lens, cached_lens = MIXES[mix]
    q, kc, vc, table, cu, used, keys, values = step(r, block_size, query_lens, cached_lens, hnd)
    out = torch.full_like(q, float("nan"))
    got, lse = call(q, kc, vc, table, cu, used, max(query_lens), causal=True, out=out, return_softmax_lse=True)
    assert got is out and lse.shape == (HEADS, q.shape[0])
    check(out, q, cu, keys, values, lse, causal=True)


@pytest.mark.parametrize("mix", ["short chunks", "long chunk"])
@pytest.mark.parametrize("options", [dict(softcap=5.0), dict(window_size=[6, 0]), dict(window_size=(3, 2)),
                                     dict(causal=False), dict(num_splits=4)],
                         ids=["softcap", "window", "window-both", "not-causal", "splits"])
def test_masks_softcap_splits(mix, options):
    r = np.random.default_rng(3)
    query_lens, cached_lens = MIXES[mix]
    q, kc, vc, table, cu, used, keys, values = step(r, 16, query_lens, cached_lens)
    options = {"causal": True} | options
    got = call(q, kc, vc, table, cu, used, max(query_lens), **options)
    options.pop("num_splits", None)
    window = tuple(options.pop("window_size", (-1, -1)))
    check(got, q, cu, keys, values, window=window, **options)


@pytest.mark.parametrize("mix", ["decodes", "long chunk"])
def test_sinks(mix):
    r = np.random.default_rng(4)
    query_lens, cached_lens = MIXES[mix]
    q, kc, vc, table, cu, used, keys, values = step(r, 16, query_lens, cached_lens, True)
    sinks = torch.from_numpy(r.standard_normal(HEADS).astype(np.float32)).cuda()
    got, lse = call(q, kc, vc, table, cu, used, max(query_lens), causal=True, s_aux=sinks, return_softmax_lse=True)
    check(got, q, cu, keys, values, lse, causal=True, sinks=sinks.cpu().numpy())


def test_fp8_cache_with_expanded_descales():
    r = np.random.default_rng(5)
    query_lens, cached_lens = MIXES["decodes"]
    q, kc, vc, table, cu, used, keys, values = step(r, 16, query_lens, cached_lens)
    scale = 0.5
    k8, v8 = (torch.nan_to_num(c.float() / scale).to(torch.float8_e4m3fn) for c in (kc, vc))
    descale = torch.tensor([scale], device="cuda").expand(len(query_lens), HEADS_KV)
    got = call(q, k8, v8, table, cu, used, 1, causal=True, k_descale=descale, v_descale=descale)
    rounded = [[(x.float() / scale).to(torch.float8_e4m3fn).float() * scale for x in side] for side in (keys, values)]
    check(got, q, cu, *rounded, causal=True)


def test_cuda_graph_at_maxima_replays_shorter_lengths_as_eager():
    """Captured once at the maxima (with get_scheduler_metadata's tensor), replayed after the
    lengths, table and q are overwritten with a shorter step: equal to the eager call bit for bit."""
    r = np.random.default_rng(6)
    query_lens = [1, 1, 1, 1]
    long_step = step(r, 16, query_lens, [400, 300, 200, 100], blocks_per_seq=26)
    short_step = step(r, 16, query_lens, [7, 1, 150, 33], blocks_per_seq=26)
    static = [t.clone() for t in long_step[:6]]
    q, kc, vc, table, cu, used = static
    metadata = vllm.get_scheduler_metadata(4, 1, 400, HEADS, HEADS_KV, q.shape[-1], used, cu_seqlens_q=cu,
                                           page_size=16, causal=True)
    out = torch.empty_like(q)

    def run():
        return vllm.flash_attn_varlen_func(q, kc, vc, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=400,
                                           seqused_k=used, block_table=table, causal=True, out=out,
                                           scheduler_metadata=metadata)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for source in (long_step, short_step):
        for target, value in zip(static, source[:6]):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = vllm.flash_attn_varlen_func(*source[:3], max_seqlen_q=1, cu_seqlens_q=source[4], max_seqlen_k=400,
                                            seqused_k=source[5], block_table=source[3], causal=True)
        assert torch.equal(replayed, eager)
        check(replayed, source[0], source[4], *source[6:], causal=True)
