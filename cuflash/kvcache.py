"""Inference: attention against a KV cache (contiguous or paged), with the new tokens appended in
place, and the combine step of split-KV attention.

NumPy inputs run the float64 reference on the CPU (numpy_path.py) and update the NumPy caches in place
exactly where the GPU does: the appended positions, nothing else. GPU inputs run the append
kernel (rotary embedding and the cache writes), the decode kernel over key splits, and the
combine kernel (cuda_src/common/kv_cache.cuh), planned through plan.py and dispatch.py.
"""

from __future__ import annotations

from typing import Any

from cuflash._core import checks, interop, kvcache_gpu
from cuflash._cpu import numpy_path

__all__ = ["attention_with_kvcache", "combine", "merge_states"]


def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    *,
    cache_seqlens: Any = None,
    page_table: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    cu_seqlens_q: Any = None,
    max_seqlen_q: int | None = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    rotary_interleaved: bool = True,
    rotary_seqlens: Any = None,
    cu_seqlens_k_new: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    descale_k: Any = None,
    descale_v: Any = None,
    descale_q: Any = None,
    return_lse: bool = False,
    out: Any = None,
    validate: bool = False,
    dtype: str | None = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
) -> Any:
    """Attention of ``q`` against a KV cache, after appending new keys and values to it in place
    (FlashAttention-3's ``flash_attn_with_kvcache``).

    Sequence ``b`` sees the cached positions ``cache_leftpad[b] .. cache_seqlens[b] - 1`` and
    then its new tokens, written first into the cache at ``cache_seqlens[b]``,
    ``cache_seqlens[b] + 1``, ... Nothing else in the cache changes. Causal masks and windows are
    aligned bottom-right against the sequence's key count ``cache_seqlens[b] - cache_leftpad[b]
    + new tokens``; a row that sees no key gives 0 (lse -inf).

    Parameters
    ----------
    q : array, (batch, seqlen_q, heads, head_dim), or (total_q, heads, head_dim) with cu_seqlens_q
        float16 or bfloat16 on the GPU (CuPy, torch, DLPack); NumPy float16, bfloat16, float32 or
        float64 on the CPU path; or e4m3 over an e4m3 cache (see descale_q; CuPy's as uint8 with
        ``dtype="e4m3"``).
    k_cache, v_cache : arrays
        Contiguous cache (batch_cache, seqlen_cache, heads_kv, head_dim) or, with page_table, a
        pool of pages (num_pages, page_size, heads_kv, head_dim), any page_size from 1. q's dtype,
        or FP8 e4m3 (torch float8_e4m3fn, NumPy ml_dtypes.float8_e4m3fn, or uint8 bytes with
        ``dtype="e4m3"``: CuPy has no float8 dtype) with descale_k/descale_v; on the GPU an FP8
        cache takes head_dim a multiple of 16. Updated in place when k, v are given; last
        dimension contiguous; on the GPU 16-byte aligned.
    k, v : arrays, optional
        New tokens, (batch, seqlen_new, heads_kv, head_dim), or with cu_seqlens_q packed
        (total_q, heads_kv, head_dim): sequence b then appends as many tokens as it has queries
        (chunked prefill); or packed by cu_seqlens_k_new. q's dtype.
    cache_seqlens : int or int32 array (batch,), optional
        Tokens cached per sequence (the append position). None: the whole capacity is cached (no
        append possible).
    page_table : int32 array (batch, max_pages), optional
        Page of each block of page_size positions of each sequence; capacity max_pages x page_size.
    cache_batch_idx : int32 array (batch,), optional
        Which cache row serves each batch row, default b; with a page_table, which row of the
        table (FlashAttention-3's rule; the table then has any number of rows, and the rows a call
        reads are gathered first: one small gather on the GPU, its indices checked with validate).
    cache_leftpad : int32 array (batch,), optional
        The first cached position each sequence uses; default 0.
    cu_seqlens_q : int32 array (batch + 1,), optional
        A packed q: sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1.
    max_seqlen_q : int, optional
        The longest packed sequence; computed on the host when omitted (a device-to-host copy).
    rotary_cos, rotary_sin : arrays (seqlen_ro, rotary_dim / 2), optional
        Rotary embedding of the new keys at their positions and of q: row i at cache_seqlens + i
        when the mask is causal or local, else every row at cache_seqlens (FlashAttention's rule).
        Only with k, v; seqlen_ro at least the cache's positions per sequence; q's dtype or
        float32.
    rotary_interleaved : bool
        True: rotate dimension pairs (2i, 2i + 1); False: (i, i + rotary_dim / 2) (GPT-NeoX).
    cu_seqlens_k_new : int32 array (batch + 1,), optional
        New tokens packed apart from q (FlashAttention-3's): k and v (total_new, heads_kv,
        head_dim), sequence b appending rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] - 1,
        whatever its query count. Values checked with ``validate`` (or always for NumPy): start at
        0, non-decreasing, ending at total_new, each append fitting the cache. Ignored without k, v
        (as FlashAttention-3 does).
    rotary_seqlens : int32 array (batch,), optional
        The rotary position of each sequence's first new token, in place of cache_seqlens
        (FlashAttention-3's ``rotary_seqlens``): its new keys and queries are rotated from there,
        wherever they are written. seqlen_ro then need only hold the positions used (checked with
        ``validate``, or always for NumPy).
    causal, softmax_scale, window, softcap
        As for :func:`cuflash.attention`.
    num_splits : int
        Key splits per sequence on the GPU, merged by the combine kernel; 0 chooses from the shapes
        and the SM count; 1 runs unsplit. Ignored by the CPU path (the result is the same).
    descale_k, descale_v : float or float32 array (batch, heads_kv), optional
        FP8 cache only (default 1): the cache holds ``value / descale``; new tokens are quantized
        on write as cuflash.quantize_fp8 rounds: ``k / descale_k`` in float32, saturated to
        +-448, rounded to nearest even (the rotated key when rotary). Device arrays' values are
        not checked.
    descale_q : float or float32 array (batch, heads_kv), optional
        An e4m3 q (FP8 attention over an FP8 cache, FlashAttention-3's ``q_descale``; default 1):
        q holds ``value / descale``, each query head taking its KV head's. The call then writes
        bfloat16, and takes no append or rotary (write the cache and rotate q before quantizing).
    return_lse : bool
        Also return lse, float32 (batch, heads, seqlen_q), or (heads, total_q) for a packed q.
    out : array, optional
        Written with the result instead of a new array (and returned): q's shape, dtype and
        device, contiguous.
    validate : bool
        GPU arrays: copy the integer arrays to the host and check their values (lengths within the
        cache and room for the append, leftpad, batch indices, the pages used in range): a
        synchronisation. NumPy arrays are always checked.
    dtype : str, optional
        ``"e4m3"``: k_cache and v_cache are uint8 arrays of e4m3 bytes, and so is q where it is
        uint8. None: their own dtype.
    sinks, alibi_slopes : arrays, optional
        As for :func:`cuflash.attention`: the sink enters each sequence's softmax once, whatever
        the split of its keys (the lse includes it; a row that sees no key has out 0 and lse =
        sink); alibi_slopes is (heads,) or (batch, heads), the bias aligned against the
        sequence's key count.

    Returns
    -------
    out or (out, lse)
        In the caller's framework, as for :func:`cuflash.attention`.

    Raises
    ------
    TypeError, ValueError
        Every bad argument, naming it, before anything is written or launched.
    """
    if k is None and v is None:
        cu_seqlens_k_new = None  # nothing to pack
    if page_table is not None and cache_batch_idx is not None:
        lead, name = (q, "q") if cu_seqlens_q is None else (cu_seqlens_q, "cu_seqlens_q")
        interop.framework_of(lead, name)  # an array, or a TypeError naming it
        batch = lead.shape[0] - (cu_seqlens_q is not None)
        page_table, cache_batch_idx = checks.page_rows(page_table, cache_batch_idx, batch, validate), None
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "page_table": page_table,
              "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad, "cu_seqlens_q": cu_seqlens_q,
              "rotary_cos": rotary_cos, "rotary_sin": rotary_sin, "out": out, "rotary_seqlens": rotary_seqlens,
              "cu_seqlens_k_new": cu_seqlens_k_new}
    options = checks.KvOptions(cache_seqlens, max_seqlen_q, rotary_interleaved, causal, softmax_scale, window, softcap,
                               num_splits, descale_k, descale_v, return_lse, validate, dtype, descale_q)
    if sinks is not None or alibi_slopes is not None:  # checked every call, as NumPy ones are
        call = checks.check_kvcache(arrays, *options)
        checked = checks.check_sinks_alibi(sinks, alibi_slopes, call.framework, call.tensors["q"], call.heads,
                                           call.batch)
        if call.framework == "numpy":
            return numpy_path.attention_with_kvcache(call, *checked)
        return kvcache_gpu.attention_with_kvcache_checked(call._replace(alibi=checked.alibi_stride), checked)
    if interop.framework_of(q, "q") == "numpy":
        return numpy_path.attention_with_kvcache(checks.check_kvcache(arrays, *options))
    return kvcache_gpu.attention_with_kvcache(arrays, options)


def combine(out_partial: Any, lse_partial: Any, *, out_dtype: Any = None, return_lse: bool = False) -> Any:
    """Merge the partial results of attention over disjoint key ranges (split-KV):
    ``lse = log(sum_s exp(lse_s))``, ``out = sum_s exp(lse_s - lse) * out_s``.

    Parameters
    ----------
    out_partial : float32 array, (splits, batch, seqlen, heads, head_dim) or (splits, total, heads,
        head_dim), last dimension contiguous
    lse_partial : float32 array, out_partial's shape without head_dim (natural log; -inf for a split
        that saw no key, whose out_partial is then ignored)
    out_dtype : float32 (default), bfloat16 or float16 (NumPy: also float64)
    return_lse : bool
        Also return the merged lse, float32 of lse_partial's shape without splits.

    Returns
    -------
    out, (splits-merged) of out_partial's shape without splits; or (out, lse). Rows whose splits
    all have lse -inf give out 0 and lse -inf.
    """
    call = checks.check_combine(out_partial, lse_partial, out_dtype, return_lse)
    if call.framework == "numpy":
        return numpy_path.combine(call)
    return kvcache_gpu.combine(call)


def merge_states(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any, *, out: Any = None, out_lse: Any = None,
                 return_lse: bool = False) -> Any:
    """Merge two partial attention results over disjoint key sets through their LSEs (cascade
    attention: a shared prefix attended once for many queries, then merged with each query's own
    suffix; vLLM's ``merge_attn_states``, FlashInfer's ``merge_state``):
    ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``.

    Parameters
    ----------
    out_a, out_b : arrays (..., heads, head_dim), one shape and dtype (float32, bfloat16, float16;
        NumPy float64 too), last dimension contiguous, the dimensions before heads collapsible to
        one (any strides otherwise); on the GPU head_dim a multiple of 8 and the rows 16-byte
        aligned.
    lse_a, lse_b : float32 arrays of out_a's shape without head_dim (natural log), any strides
        whose leading dimensions collapse: the LSEs cuflash returns fit as views, attention's
        (batch, heads, seqlen) as ``lse.transpose(0, 2, 1)`` (torch: ``.transpose(1, 2)``) for out
        (batch, seqlen, heads, head_dim), the packed (heads, total) as ``lse.T``. A part whose LSE
        is -inf (it saw no key) is ignored, its output not read; +inf counts as -inf (vLLM's rule).
    out, out_lse : arrays, optional
        Written with the result instead of new arrays: out like out_a, out_lse like lse_a (any
        strides as they take). out may be out_a or out_b itself (each element is read before it is
        written).
    return_lse : bool
        Also return the merged lse (out_lse when given).

    Returns
    -------
    out, or (out, lse), in the caller's framework. A row whose two LSEs are -inf gives out 0 and
    lse -inf.

    Raises
    ------
    TypeError, ValueError
        Every bad argument, naming it, before anything is launched.
    """
    call = checks.check_merge({"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b, "out": out,
                               "out_lse": out_lse}, return_lse or out_lse is not None)
    result = numpy_path.merge_states(call) if call.framework == "numpy" else kvcache_gpu.merge_states(call)
    if return_lse:
        return result
    return result[0] if out_lse is not None else result
