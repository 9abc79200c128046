"""cuflash.torch.flash_attn_with_kvcache and flash_attn_combine on CPU tensors: the CPU path, the
caches updated in place through the tensors' memory, FlashAttention-3's argument names."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.reference_kvcache import combine_reference, kvcache_reference
from kvcache_cases import make_case, reference_args, same_bytes

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")
ct = pytest.importorskip("cuflash.torch")


def as_torch(x):
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [None, 16])
def test_flash_attn_with_kvcache_on_cpu(dtype, page_size):
    r = np.random.default_rng(11)
    args = make_case(r, seqlen_q=2, new=2, page_size=page_size, rotary="half", batch_idx=page_size is None,
                     leftpad=True)
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**reference_args(args), causal=True)
    t = {name: as_torch(value) for name, value in args.items()}
    for name in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin"):
        t[name] = t[name].to(dtype)
    interleaved = t.pop("rotary_interleaved")
    out, lse = ct.flash_attn_with_kvcache(t.pop("q"), t.pop("k_cache"), t.pop("v_cache"), t.pop("k"), t.pop("v"),
                                          rotary_interleaved=interleaved, causal=True, return_softmax_lse=True,
                                          **t)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    np.testing.assert_allclose(out.double().numpy(), ref_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=tol, rtol=tol)


def test_cache_updated_in_place_through_the_tensor():
    r = np.random.default_rng(12)
    args = make_case(r, seqlen_q=1, new=1, page_size=4)
    ref_k = kvcache_reference(**reference_args(args))[2]
    k_cache, v_cache = as_torch(args["k_cache"]), as_torch(args["v_cache"])
    ct.flash_attn_with_kvcache(as_torch(args["q"]), k_cache, v_cache, as_torch(args["k"]), as_torch(args["v"]),
                               cache_seqlens=as_torch(args["cache_seqlens"]), page_table=as_torch(args["page_table"]))
    assert same_bytes(k_cache.numpy(), ref_k)


@pytest.mark.parametrize("name, value", [("qv", 1), ("cu_seqlens_k_new", 1), ("rotary_seqlens", 1),
                                         ("q_descale", 1), ("attention_chunk", 4), ("scheduler_metadata", 1),
                                         ("sm_margin", 2)])
def test_unsupported_arguments_named(name, value):
    q = torch.zeros(1, 1, 2, 16)
    cache = torch.zeros(1, 4, 2, 16)
    with pytest.raises(NotImplementedError, match=name):
        ct.flash_attn_with_kvcache(q, cache, cache, **{name: value})


def test_flash_attn_combine_on_cpu():
    r = np.random.default_rng(13)
    o = torch.from_numpy(r.standard_normal((3, 2, 4, 5, 16)).astype(np.float32))
    lse = torch.from_numpy(r.standard_normal((3, 2, 4, 5)).astype(np.float32))
    out, merged = ct.flash_attn_combine(o, lse, out_dtype=torch.bfloat16)
    ref_out, ref_lse = combine_reference(o.numpy(), lse.numpy())
    assert out.dtype == torch.bfloat16 and merged.shape == (2, 4, 5)
    np.testing.assert_allclose(out.double().numpy(), ref_out, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(merged.numpy(), ref_lse, rtol=1e-6)
    given = torch.empty(2, 4, 5, 16)
    result, _ = ct.flash_attn_combine(o, lse, out=given)
    assert result is given
    np.testing.assert_allclose(given.numpy(), ref_out, rtol=1e-5, atol=1e-6)
