"""cuflash.merge_states and vLLM's merge_attn_states on the GPU: attention over two disjoint key sets
merged equals attention over all of them, against the float64 reference by the correctness rule
(docs/measuring.md), every dtype, head_dims 64-256, odd token counts; LSE views as cuflash
returns them; poisoned outputs of parts that saw no key; out= written in place; a CUDA graph
capture of vLLM's call."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash

pytestmark = pytest.mark.gpu


def _halves(dtype_name, head_dim, tokens, rng, split):
    """q (1, tokens, 8, head_dim), k, v (1, 300, 2, head_dim) on the GPU in ``dtype_name``; the two
    halves' (out, lse) by cuflash.attention, and the float64 reference over all keys."""
    import cupy as cp

    from tests import gpu_reference as ref

    q = ref.random_bshd((1, tokens, 8, head_dim), dtype_name, rng)
    k, v = (ref.random_bshd((1, 300, 2, head_dim), dtype_name, rng) for _ in range(2))
    parts = [cuflash.attention(q, k[:, keys], v[:, keys], return_lse=True)
             for keys in (slice(0, split), slice(split, None))]
    q64, k64, v64 = (ref.as_float64(x) for x in (q, k, v))
    exact = ref.attention(q64, k64, v64, causal=False, scale=1 / math.sqrt(head_dim))
    lowp = ref.attention(q64, k64, v64, causal=False, scale=1 / math.sqrt(head_dim), lowp=dtype_name)
    return parts, exact, lowp, cp


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("tokens", [1, 37, 1000])
def test_merge_is_attention_over_both_halves(dtype_name, head_dim, tokens):
    from tests import gpu_reference as ref

    rng = np.random.default_rng(head_dim + tokens)
    ((oa, la), (ob, lb)), exact, lowp, cp = _halves(dtype_name, head_dim, tokens, rng, 113)
    out = cp.full(oa.shape, cp.nan, dtype=oa.dtype)
    result, lse = cuflash.merge_states(oa, la.transpose(0, 2, 1), ob, lb.transpose(0, 2, 1), out=out, return_lse=True)
    assert result is out
    # Merging rounds once more than attention over all keys: the rule's low-precision baseline
    # (2x its error) covers it, as for the split-KV combine.
    ref.check_rule("out", out, exact[0], lowp[0], dtype_name)
    ref.check_rule("lse", lse.transpose(0, 2, 1), exact[1], lowp[1], dtype_name)


def test_float32_parts_and_a_part_without_keys():
    import cupy as cp

    rng = cp.random.default_rng(3)
    oa, ob = (rng.standard_normal((77, 8, 128), dtype=cp.float32) for _ in range(2))
    la, lb = (rng.standard_normal((8, 77), dtype=cp.float32) for _ in range(2))  # vLLM's (heads, tokens)
    lb[:, :10] = -cp.inf
    ob[:10] = cp.nan  # a part that saw no key: never read
    la[:, :5] = -cp.inf  # and rows where neither did
    out, lse = cuflash.merge_states(oa, la.T, ob, lb.T, return_lse=True)
    oa64, ob64, la64, lb64 = (cp.asnumpy(x).astype(np.float64) for x in (oa, ob, la.T, lb.T))
    from cuflash._cpu.reference_kvcache import combine_reference

    ref_out, ref_lse = combine_reference(np.stack([oa64, np.nan_to_num(ob64)]), np.stack([la64, lb64]))
    np.testing.assert_allclose(cp.asnumpy(out), ref_out, rtol=1e-5, atol=1e-5)
    assert (cp.asnumpy(out[:5]) == 0).all() and np.isneginf(cp.asnumpy(lse[:5])).all()
    np.testing.assert_allclose(cp.asnumpy(lse[5:]), ref_lse[5:], rtol=1e-5)


def test_vllm_merge_attn_states_and_its_cuda_graph():
    torch = pytest.importorskip("torch")
    from cuflash.torch.vllm import merge_attn_states

    g = torch.Generator(device="cuda").manual_seed(5)
    prefix, suffix = (torch.randn((333, 16, 128), generator=g, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
    prefix_lse, suffix_lse = (torch.randn((16, 333), generator=g, device="cuda") for _ in range(2))
    output, output_lse = torch.empty_like(prefix), torch.empty((16, 333), device="cuda")
    merge_attn_states(output, prefix, prefix_lse, suffix, suffix_lse, output_lse)
    m = torch.maximum(prefix_lse, suffix_lse)
    wa, wb = torch.exp(prefix_lse - m), torch.exp(suffix_lse - m)
    expected = ((wa.T[..., None] * prefix.float() + wb.T[..., None] * suffix.float())
                / (wa + wb).T[..., None]).bfloat16()
    torch.testing.assert_close(output, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(output_lse, m + torch.log(wa + wb), atol=1e-5, rtol=1e-5)
    graph = torch.cuda.CUDAGraph()
    replayed = torch.empty_like(output)
    with torch.cuda.graph(graph):
        merge_attn_states(replayed, prefix, prefix_lse, suffix, suffix_lse)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, output)
