"""cuflash.torch.flash_attn_with_kvcache and flash_attn_combine on CPU tensors: the CPU path, the
caches updated in place through the tensors' memory, FlashAttention-3's argument names."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash._cpu.reference_kvcache import combine_reference, kvcache_reference, mla_decode_reference
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


@pytest.mark.parametrize("name, value", [("attention_chunk", 4), ("sm_margin", 2)])
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


@pytest.mark.parametrize("page_size", [None, 8])
def test_qv_form_is_mla_decoding_on_cpu(page_size):
    r = np.random.default_rng(12)
    batch, seqlen_q, heads, latent, rope = 2, 2, 4, 32, 8
    pages = 2 * 3 if page_size else batch
    rows = page_size or 24
    kv = r.standard_normal((pages, rows, 1, latent + rope)).astype(np.float32)
    q = r.standard_normal((batch, seqlen_q, heads, latent + rope)).astype(np.float32)
    if page_size:
        table = r.permutation(pages).astype(np.int32).reshape(batch, -1)
    else:
        table = np.arange(batch, dtype=np.int32)[:, None]
    lengths = np.array([19, 5], np.int32)
    ref_out, ref_lse = mla_decode_reference(q, kv, table, lengths, head_dim_v=latent, causal=True)
    out, lse = ct.flash_attn_with_kvcache(as_torch(q[..., latent:]), as_torch(kv[..., latent:]),
                                          as_torch(kv[..., :latent]), qv=as_torch(q[..., :latent]),
                                          cache_seqlens=as_torch(lengths),
                                          page_table=as_torch(table) if page_size else None, causal=True,
                                          return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == (batch, seqlen_q, heads, latent)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5)


@pytest.mark.parametrize("name, value", [("k", torch.zeros(1, 1, 1, 8)), ("window_size", (3, 0)), ("softcap", 5.0),
                                         ("cu_seqlens_q", torch.zeros(2, dtype=torch.int32))])
def test_qv_form_refuses_what_mla_decoding_does_not_take(name, value):
    q, cache = torch.zeros(1, 1, 2, 8), torch.zeros(1, 4, 1, 8)
    with pytest.raises(NotImplementedError, match=f"{name} with qv"):
        ct.flash_attn_with_kvcache(q, cache, torch.zeros(1, 4, 1, 32), qv=torch.zeros(1, 1, 2, 32), **{name: value})


def test_fp8_cache_on_cpu():
    """float8_e4m3fn CPU caches: the CPU path, as their NumPy views take it, appended in place."""
    import cuflash
    import ml_dtypes

    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    r = np.random.default_rng(14)
    args = make_case(r, seqlen_q=2, new=2, page_size=4, cache_dtype=e4m3)
    options = dict(cache_seqlens=args["cache_seqlens"], page_table=args["page_table"], causal=True)
    descale_k = r.uniform(0.5, 2.0, (3, 2)).astype(np.float32)
    caches = {name: args[name].copy() for name in ("k_cache", "v_cache")}
    expected = cuflash.attention_with_kvcache(args["q"], caches["k_cache"], caches["v_cache"], args["k"], args["v"],
                                              descale_k=descale_k, descale_v=0.5, **options)

    def fp8(x):
        return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)

    k_cache, v_cache = fp8(args["k_cache"].copy()), fp8(args["v_cache"].copy())
    got = ct.flash_attn_with_kvcache(as_torch(args["q"]), k_cache, v_cache, as_torch(args["k"]), as_torch(args["v"]),
                                     k_descale=torch.from_numpy(descale_k), v_descale=0.5,
                                     **{name: as_torch(value) for name, value in options.items()})
    np.testing.assert_array_equal(got.numpy(), expected)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert same_bytes(cache.view(torch.uint8).numpy().view(e4m3), caches[name]), name


def test_combine_refuses_a_wrong_out_before_combining(monkeypatch):
    import cuflash

    monkeypatch.setattr(cuflash, "combine", lambda *args, **kwargs: pytest.fail("combined before checking out"))
    partial, lse = torch.zeros(2, 1, 4, 2, 16), torch.zeros(2, 1, 4, 2)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 4, 2, 16\)"):
        ct.flash_attn_combine(partial, lse, out=torch.zeros(1, 4, 2, 8))
    with pytest.raises(TypeError, match="out: dtype torch.float32 does not match out_dtype"):
        ct.flash_attn_combine(partial, lse, out=torch.zeros(1, 4, 2, 16), out_dtype=torch.bfloat16)
