"""FP8 (e4m3) forward on the GPU against the float64 reference on the dequantized inputs.

The rule is docs/measuring.md's, max|out - ref| <= 2 max|lowp - ref| + atol, with the
low-precision baseline computed as FlashAttention-3's FP8 test does: the dequantized inputs, S and
out rounded to the output dtype, P rounded to e4m3 before P V. CuPy carries the e4m3 inputs as
uint8 bytes with ``dtype="e4m3"``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

# Every test runs once per kernel family the device has (conftest.family): sm80's FP8 forward
# (bytes widened to 16 bits), and on an sm90 device sm90's (e4m3 wgmma, V transposed in shared
# memory).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

FP8 = "float8_e4m3fn"
E4M3_MAX = 448.0


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def quantize(x: np.ndarray, heads_kv: int, per_head: bool):
    """(e4m3 bytes on the GPU, descale) of float64 ``x`` (batch, seqlen, heads, head_dim): one
    scale per (batch, kv head group) as a float32 (batch, heads_kv) array, or one scalar."""
    import cupy as cp
    import ml_dtypes

    batch, _, heads, _ = x.shape
    grouped = np.abs(x).reshape(batch, x.shape[1], heads_kv, heads // heads_kv, x.shape[3])
    if per_head:
        descale = (grouped.max(axis=(1, 3, 4)) / E4M3_MAX).astype(np.float32)  # (batch, heads_kv)
        per_query_head = np.repeat(descale, heads // heads_kv, axis=1)[:, None, :, None]
    else:
        descale = float(np.float32(np.abs(x).max() / E4M3_MAX))
        per_query_head = descale
    stored = (x / per_query_head).astype(ml_dtypes.float8_e4m3fn)
    return cp.asarray(stored.view(np.uint8)), (cp.asarray(descale) if per_head else descale)


def dequantize(stored, descale):
    """float64 CuPy values that e4m3 bytes ``stored`` (batch or packed rows first, then heads,
    head_dim) and their descale stand for; an array descale is (batch, heads_kv), or per packed
    row's sequence after the caller has expanded it."""
    import cupy as cp
    import ml_dtypes

    table = cp.asarray(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    values = table[stored]
    if isinstance(descale, float):
        return values * descale
    heads = stored.shape[-2]
    per_head = cp.repeat(descale.astype(cp.float64), heads // descale.shape[1], axis=1)
    return values * per_head[:, None, :, None]


def inputs(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, per_head=True, head_dim_v=None):
    """Quantized q, k, v (bytes, descale) pairs, each kv head group at its own magnitude so that
    the per-head descales differ; v of ``head_dim_v`` (default head_dim)."""
    spread = np.geomspace(0.5, 4.0, heads_kv)
    q_spread = np.repeat(spread, heads // heads_kv)
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)) * q_spread[None, None, :, None]
    k, v = (rng.standard_normal((batch, seqlen_k, heads_kv, dim)) * spread[::-1][None, None, :, None]
            for dim in (head_dim, head_dim_v or head_dim))
    return quantize(q, heads_kv, per_head), quantize(k, heads_kv, per_head), quantize(v, heads_kv, per_head)


def check(got, lse, q, k, v, out_dtype, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """got and lse of a call on quantized q, k, v against the float64 reference with the FP8 rule."""
    from tests.gpu_reference import attention, check_rule

    q64, k64, v64 = (dequantize(*x) for x in (q, k, v))
    options = {"causal": causal, "window": window, "softcap": softcap,
               "scale": scale or 1 / math.sqrt(q64.shape[3])}
    out_ref, lse_ref = attention(q64, k64, v64, **options)
    out_lowp, lse_lowp = attention(q64, k64, v64, lowp=out_dtype, p_lowp=FP8, **options)
    check_rule("out", got, out_ref, out_lowp, out_dtype)
    check_rule("lse", lse, lse_ref, lse_lowp, out_dtype)


def run(q, k, v, out_dtype="bfloat16", **options):
    """cuflash.attention on quantized inputs into a NaN-filled out from a poisoned pool: (out, lse)."""
    import cupy as cp
    import ml_dtypes

    import cuflash
    from tests.gpu_reference import poison_pool

    poison_pool()
    out = cp.full((*q[0].shape[:-1], v[0].shape[-1]), cp.nan, dtype=np.dtype(getattr(ml_dtypes, out_dtype, out_dtype)))
    result, lse = cuflash.attention(q[0], k[0], v[0], descale_q=q[1], descale_k=k[1], descale_v=v[1], dtype="e4m3",
                                    out_dtype=out_dtype, out=out, return_lse=True, **options)
    assert result is out
    return out, lse


SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (113, 1023), (1023, 17)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_fp8_forward_matches_reference(head_dim, causal, seqlens, rng):
    seqlen_q, seqlen_k = seqlens
    q, k, v = inputs(rng, 2, seqlen_q, seqlen_k, 4, 2, head_dim)
    out, lse = run(q, k, v, causal=causal)
    check(out, lse, q, k, v, "bfloat16", causal=causal)


OPTIONS = {
    "window": {"window": (64, 16)},
    "causal-window": {"causal": True, "window": (100, -1)},
    "softcap": {"softcap": 30.0},
    "causal-softcap": {"causal": True, "softcap": 5.0},
    "scale": {"softmax_scale": 0.05},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_fp8_masks_and_softcap(option, rng):
    options = dict(OPTIONS[option])
    q, k, v = inputs(rng, 2, 300, 517, 4, 2, 128)
    out, lse = run(q, k, v, **options)
    scale = options.pop("softmax_scale", None)
    check(out, lse, q, k, v, "bfloat16", scale=scale, **options)


@pytest.mark.parametrize("heads", [(4, 4), (8, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "scalar"])
def test_fp8_heads_out_dtype_and_descale_kinds(heads, out_dtype, per_head, rng):
    q, k, v = inputs(rng, 2, 200, 333, *heads, 192, per_head=per_head)
    out, lse = run(q, k, v, out_dtype=out_dtype, causal=True)
    check(out, lse, q, k, v, out_dtype, causal=True)


def test_fp8_default_descales_and_output(rng):
    """No descale (1) and no out_dtype: a bfloat16 output."""
    import cupy as cp
    import ml_dtypes

    import cuflash

    q, k, v = (cp.asarray(rng.standard_normal((1, 129, 2, 64)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
               for _ in range(3))
    out, lse = cuflash.attention(q, k, v, dtype="e4m3", return_lse=True)
    assert out.dtype.name == "bfloat16" and out.shape == q.shape
    assert bool(cp.isfinite(lse).all())
    check(out, lse, (q, 1.0), (k, 1.0), (v, 1.0), "bfloat16")


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_fp8_descale_of_the_wrong_head_fails(tensor, rng):
    """The per-head descales, flipped along heads_kv for one tensor, give results that break the
    rule: each entry must scale its own kv head (and q's group)."""
    q, k, v = inputs(rng, 2, 200, 200, 4, 2, 128)
    given = {"q": q, "k": k, "v": v}
    swapped = dict(given)
    swapped[tensor] = (given[tensor][0], given[tensor][1][:, ::-1].copy())
    out, lse = run(swapped["q"], swapped["k"], swapped["v"])
    with pytest.raises(AssertionError, match="max error"):
        check(out, lse, q, k, v, "bfloat16")


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_every_e4m3_value_is_widened_exactly(out_dtype):
    """One key (P = 1): out is v's 256 byte values as they are, NaN for e4m3's two NaNs (zeros of
    either sign come out +0: the accumulator starts at +0)."""
    import cupy as cp
    import ml_dtypes

    import cuflash

    v = cp.arange(256, dtype=cp.uint8).reshape(1, 1, 1, 256)
    q = k = cp.zeros((1, 1, 1, 256), dtype=cp.uint8)
    out = cuflash.attention(q, k, v, dtype="e4m3", out_dtype=out_dtype)
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = (cp.asnumpy(out.view(cp.uint16)).astype(np.uint32) << 16).view(np.float32) if out_dtype == "bfloat16" \
        else cp.asnumpy(out)
    got = got.astype(np.float64).ravel()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_with_an_empty_sequence(causal, rng):
    import cupy as cp

    import cuflash
    from tests.gpu_reference import attention_varlen, check_rule, poison_pool

    lengths_q, lengths_k = [113, 0, 1, 1023, 17], [200, 5, 0, 1023, 17]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    heads, heads_kv, head_dim = 4, 2, 96
    spread = np.geomspace(0.5, 4.0, heads_kv)
    data = {"q": rng.standard_normal((cu_q[-1], heads, head_dim)) * np.repeat(spread, 2)[None, :, None]}
    for name in ("k", "v"):
        data[name] = rng.standard_normal((cu_k[-1], heads_kv, head_dim)) * spread[None, :, None]
    # Per (sequence, kv head) descales: quantize each sequence as a batch of one.
    stored, descales, values = {}, {}, {}
    for name, x in data.items():
        cu = cu_q if name == "q" else cu_k
        parts = [quantize(x[None, cu[i]:cu[i + 1]], heads_kv, True) if cu[i + 1] > cu[i] else None
                 for i in range(len(cu) - 1)]
        ones = cp.ones((1, heads_kv), cp.float32)
        stored[name] = cp.concatenate([p[0][0] for p in parts if p is not None])
        descales[name] = cp.concatenate([p[1] if p is not None else ones for p in parts])
        values[name] = cp.concatenate([dequantize(p[0], p[1])[0] for p in parts if p is not None])
    poison_pool()
    out = cp.full(stored["q"].shape, cp.nan, dtype=cp.float16)
    result, lse = cuflash.attention_varlen(stored["q"], stored["k"], stored["v"], cp.asarray(cu_q), cp.asarray(cu_k),
                                           causal=causal, descale_q=descales["q"], descale_k=descales["k"],
                                           descale_v=descales["v"], dtype="e4m3", out_dtype="float16", out=out,
                                           return_lse=True)
    assert result is out
    options = {"causal": causal, "scale": 1 / math.sqrt(head_dim)}
    out_ref, lse_ref = attention_varlen(values["q"], values["k"], values["v"], cu_q, cu_k, **options)
    out_lowp, lse_lowp = attention_varlen(values["q"], values["k"], values["v"], cu_q, cu_k, lowp="float16",
                                          p_lowp=FP8, **options)
    check_rule("out", out, out_ref, out_lowp, "float16")
    check_rule("lse", lse, lse_ref, lse_lowp, "float16")


def test_explain_names_the_familys_fp8_kernel(family, rng):
    """Each family runs its own FP8 forward, into out_dtype."""
    import cuflash

    q, k, v = inputs(rng, 1, 64, 64, 2, 2, 128)
    choice = cuflash.explain(q[0], k[0], v[0], causal=True, dtype="e4m3", out_dtype="float16")
    assert choice.family == family
    assert choice.name_expression.startswith(f"cuflash::{'sm90::flash_fwd_sm90' if family == 'sm90' else 'flash_fwd_sm80'}<")
    assert choice.name_expression.endswith("true, false, false, cuflash::f16, cuflash::e4m3>")


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_fp8_one_hot_probabilities_pick_v_rows_exactly(head_dim):
    """Query i sees one key, j(i) = (37 i + 11) % 512, with a score 256 above every other (q and k
    rows 16 e_a + 16 e_b in two halves of the head dim, scale 1), so P is one-hot and out[i] must be
    exactly v[j(i)]: every V row and column through the sm90 kernel's V transpose and its key
    permutation (and sm80's widening). A layout bug names the rows and columns that went wrong."""
    import cupy as cp
    import ml_dtypes

    import cuflash

    seqlen, half = 512, head_dim // 2
    picked = (37 * np.arange(seqlen) + 11) % seqlen
    sixteen = np.array(16.0, ml_dtypes.float8_e4m3fn).view(np.uint8)
    keys, queries = np.zeros((seqlen, head_dim), np.uint8), np.zeros((seqlen, head_dim), np.uint8)
    keys[np.arange(seqlen), np.arange(seqlen) % half] = sixteen
    keys[np.arange(seqlen), half + np.arange(seqlen) // half] = sixteen
    queries[np.arange(seqlen), picked % half] = sixteen
    queries[np.arange(seqlen), half + picked // half] = sixteen
    rng = np.random.default_rng(head_dim)
    values = rng.integers(0, 256, (seqlen, head_dim), dtype=np.uint8)
    values[(values & 0x7F) == 0x7F] = 0x38  # no NaN: 1.0 instead
    q, k, v = (cp.asarray(x.reshape(1, seqlen, 1, head_dim)) for x in (queries, keys, values))
    out = cp.asnumpy(cuflash.attention(q, k, v, softmax_scale=1.0, dtype="e4m3", out_dtype="float16"))[0, :, 0]
    want = values.view(ml_dtypes.float8_e4m3fn).astype(np.float16)[picked]
    wrong = np.argwhere(out != want)
    assert not len(wrong), (f"{len(wrong)} wrong values; first (query, column) pairs {wrong[:8].tolist()}, "
                            f"keys {picked[wrong[:8, 0]].tolist()}")


def test_fp8_has_no_backward():
    torch = pytest.importorskip("torch")
    import cuflash

    q, k, v = (torch.randn((1, 64, 2, 64), device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="forward path only"):
        cuflash.attention_backward(out, q, k, v, out, lse)


def test_torch_float8_with_fa3_keywords_runs_the_cupy_path_bitwise(rng):
    """torch float8_e4m3fn tensors and FA3's q_descale/k_descale/v_descale: the same kernel and
    bits as the CuPy bytes with descale_q/k/v, which the tests above hold to the reference."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    import cuflash
    from cuflash.torch import flash_attn_func

    q, k, v = inputs(rng, 2, 150, 150, 4, 2, 128)
    as_torch = [torch.from_dlpack(x[0]).view(torch.float8_e4m3fn) for x in (q, k, v)]
    descales = [torch.from_dlpack(x[1]) for x in (q, k, v)]
    got = flash_attn_func(*as_torch, causal=True, q_descale=descales[0], k_descale=descales[1],
                          v_descale=descales[2])
    assert got.dtype == torch.bfloat16
    want = cuflash.attention(q[0], k[0], v[0], causal=True, descale_q=q[1], descale_k=k[1], descale_v=v[1],
                             dtype="e4m3")
    torch.cuda.synchronize()
    assert bool(cp.all(cp.from_dlpack(got.view(torch.int16)) == want.view(cp.int16)))
