"""Float64 NumPy reference of attention against a KV cache, and of the split-KV combine.

NumPy only, written for clarity, one sequence at a time; it is the ground truth the CPU path and
the GPU kernels of :mod:`cuflash.kvcache` are tested against.

The cache is contiguous, ``(batch_cache, seqlen_cache, heads_kv, head_dim)`` indexed by
``cache_batch_idx[b]`` (default ``b``), or paged, ``(num_pages, page_size, heads_kv, head_dim)``
with ``page_table[b, p // page_size]`` holding logical position ``p`` of sequence ``b`` at row
``p % page_size`` of that page. Sequence ``b``'s keys are the logical positions
``cache_leftpad[b] .. cache_seqlens[b] + seqlen_new_b - 1``: the cached ones, then the new
``k``/``v`` tokens written at ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` (through the page
table). With rotary tables, the new keys are rotated at their positions before they are
written; q is rotated at ``cache_seqlens[b] + i`` (row ``i``) when the mask is causal or local,
else every row at ``cache_seqlens[b]``, as FlashAttention does. Causal masks and windows are
aligned bottom-right against the sequence's key count.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from cuflash._cpu.reference import attention_reference

__all__ = ["apply_rotary", "cache_slots", "combine_reference", "kvcache_reference", "mla_decode_reference",
           "quantize_e4m3", "rotary_per_row"]


def rotary_per_row(causal: bool, window: tuple[int, int], capacity: int, max_seqlen_q: int) -> bool:
    """Whether q row ``i`` is rotated at ``cache_seqlens + i`` (else every row at
    ``cache_seqlens``): causal, or a window that bounds a side once sides that bound nothing at
    this capacity and query length are dropped (``left >= capacity - 1``,
    ``right >= max_seqlen_q - 1``), FlashAttention's rule."""
    left, right = window
    if left >= capacity - 1:
        left = -1
    if right >= max_seqlen_q - 1:
        right = -1
    return causal or left >= 0 or right >= 0


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
                 interleaved: bool) -> np.ndarray:
    """``x`` (tokens, heads, head_dim) rotated in float64, token ``t`` at ``positions[t]`` of the
    tables ``cos``/``sin`` (seqlen_ro, rotary_dim / 2). Interleaved pairs dimensions (2i, 2i+1),
    half-split (GPT-NeoX) pairs (i, i + rotary_dim / 2); dimensions from rotary_dim on pass."""
    x = np.array(x, dtype=np.float64)
    half = cos.shape[1]
    c = np.asarray(cos, np.float64)[positions][:, None, :]
    s = np.asarray(sin, np.float64)[positions][:, None, :]
    if interleaved:
        first, second = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = first * c - second * s
        x[..., 1:2 * half:2] = first * s + second * c
    else:
        first, second = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = first * c - second * s
        x[..., half:2 * half] = first * s + second * c
    return x


def cache_slots(b: int, positions: np.ndarray, page_table, cache_batch_idx, page_size: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(cache rows or pages, rows within them): where logical ``positions`` of sequence ``b``
    live, through ``page_table`` (pages of ``page_size`` rows) or ``cache_batch_idx``."""
    positions = np.asarray(positions, np.int64)
    if page_table is not None:
        table = np.asarray(page_table, np.int64)[b]
        return table[positions // page_size], positions % page_size
    cb = b if cache_batch_idx is None else int(np.asarray(cache_batch_idx)[b])
    return np.full_like(positions, cb), positions


def quantize_e4m3(x: np.ndarray, descale: np.ndarray) -> np.ndarray:
    """``x / descale`` as an FP8 cache stores it: both in float32, the quotient rounded to float32,
    saturated to +-448 and rounded to nearest even e4m3."""
    import ml_dtypes

    quotient = np.asarray(x, np.float32) / np.asarray(descale, np.float32)
    return np.clip(quotient, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)


def _descale(descale, b: int, heads_kv: int) -> np.ndarray:
    """Per-kv-head factors (heads_kv,) of batch row ``b``: from None (1), a number, or an array
    of shape (batch, heads_kv)."""
    if descale is None:
        return np.ones(heads_kv)
    if np.ndim(descale) == 0:
        return np.full(heads_kv, float(descale))
    return np.asarray(descale, np.float64)[b]


def kvcache_reference(
    q: npt.ArrayLike,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    k: npt.ArrayLike | None = None,
    v: npt.ArrayLike | None = None,
    *,
    cache_seqlens=None,
    page_table=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    cu_seqlens_q=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved: bool = True,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    descale_k=None,
    descale_v=None,
    dtype: npt.DTypeLike = np.float64,
    sinks=None,
    alibi_slopes=None,
    rotary_seqlens=None,
    cu_seqlens_k_new=None,
    descale_q=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Attention of ``q`` over the KV cache after appending ``k``/``v`` (see the module docstring).

    Parameters
    ----------
    q : (batch, seqlen_q, heads, head_dim), or (total_q, heads, head_dim) with ``cu_seqlens_q``
    k_cache, v_cache : the cache, contiguous or paged (``page_table`` given); not modified. v_cache
        may have a head_dim of its own, which out then has
    k, v : (batch, seqlen_new, heads_kv, head_dim), or (total_q, heads_kv, head_dim) sharing
        ``cu_seqlens_q`` (sequence b appends as many tokens as it has queries); optional
    cache_seqlens : int or (batch,) ints; None: the whole capacity is cached
    page_table : (batch, max_pages) ints, optional
    cache_batch_idx, cache_leftpad : (batch,) ints, optional
    cu_seqlens_q : (batch + 1,) ints, optional
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2), optional (only with k and v)
    descale_q : None, a number, or (batch, heads_kv): an e4m3 q's values are ``stored * descale``
        (each query head taking its KV head's)
    cu_seqlens_k_new : (batch + 1,) ints, optional: k, v packed (total_new, heads_kv, head_dim),
        sequence b appending rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] - 1
    rotary_seqlens : (batch,) ints, optional: where each sequence's rotary positions start
        (FlashAttention-3's seqlens_rotary); default its cached length
    descale_k, descale_v : None, a number, or (batch, heads_kv): an FP8 cache's values are
        ``stored * descale``, and new tokens are stored as cuflash.quantize_fp8 rounds: the
        (rotated) key in float32 divided by the float32 descale, saturated to +-448, rounded to
        nearest even (``quantize_e4m3``).
    dtype : the attention's dtype: float64 is the reference, a 16-bit dtype flash-attn's
        same-dtype baseline (reference.attention_reference), with rotated q rounded to it.
    sinks : (heads,), optional: one sink per query head, entering each sequence's softmax once
        (the lse includes it; a row that sees no key has out 0 and lse = sink).
    alibi_slopes : (heads,) or (batch, heads), optional: flash-attn's ALiBi bias, aligned against
        each sequence's key count as its causal mask is.

    Returns
    -------
    out : q's shape but for v_cache's head_dim (``dtype``); lse : (batch, heads, seqlen_q) or
    (heads, total_q), ``-inf`` for rows that see no key (the sink with sinks); k_cache, v_cache : updated copies, in
    the caches' dtype.
    """
    q = np.asarray(q)
    dtype = np.dtype(dtype)
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    paged = page_table is not None
    varlen = cu_seqlens_q is not None
    if varlen:
        cu = np.asarray(cu_seqlens_q, np.int64)
        batch = cu.size - 1
        rows = [slice(cu[b], cu[b + 1]) for b in range(batch)]
        seqlen_q_max = int(np.diff(cu).max(initial=0))
    else:
        batch = q.shape[0]
        rows = [b for b in range(batch)]
        seqlen_q_max = q.shape[1]
    heads, head_dim = q.shape[-2], q.shape[-1]
    heads_kv = k_cache.shape[2]
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    per_row = rotary_per_row(causal, window, capacity, seqlen_q_max)
    fp8_cache = k_cache.dtype.name == "float8_e4m3fn"

    def seq(a, b):  # sequence b of a batched or packed tensor, (tokens, heads, dim)
        return a[rows[b]]

    def new_of(a, b):  # sequence b's new tokens
        if cu_seqlens_k_new is None:
            return seq(np.asarray(a), b)
        return np.asarray(a)[int(cu_seqlens_k_new[b]):int(cu_seqlens_k_new[b + 1])]

    def physical(b: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return cache_slots(b, positions, page_table, cache_batch_idx, k_cache.shape[1])

    out = np.zeros((*q.shape[:-1], v_cache.shape[-1]), dtype)
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    lse = np.full((batch, heads, seqlen_q_max) if not varlen else (heads, q.shape[0]), -np.inf, lse_dtype)
    for b in range(batch):
        if cache_seqlens is None:
            cached = capacity
        elif np.ndim(cache_seqlens) == 0:
            cached = int(cache_seqlens)
        else:
            cached = int(np.asarray(cache_seqlens)[b])
        start = 0 if cache_leftpad is None else int(np.asarray(cache_leftpad)[b])
        q_b = np.asarray(seq(q, b), np.float64)
        if descale_q is not None:
            q_b = q_b * np.repeat(_descale(descale_q, b, heads_kv), heads // heads_kv)[:, None]
        n_new = 0 if k is None else new_of(k, b).shape[0]
        dk, dv = _descale(descale_k, b, heads_kv), _descale(descale_v, b, heads_kv)
        rotary_start = cached if rotary_seqlens is None else int(np.asarray(rotary_seqlens)[b])
        if n_new:
            k_b, v_b = np.asarray(new_of(k, b), np.float64), np.asarray(new_of(v, b), np.float64)
            new_positions = cached + np.arange(n_new)
            if rotary_cos is not None:
                k_b = apply_rotary(k_b, rotary_cos, rotary_sin, rotary_start + np.arange(n_new), rotary_interleaved)
            if fp8_cache:
                k_b, v_b = quantize_e4m3(k_b, dk[:, None]), quantize_e4m3(v_b, dv[:, None])
            pages, offsets = physical(b, new_positions)
            k_cache[pages, offsets] = k_b.astype(k_cache.dtype)
            v_cache[pages, offsets] = v_b.astype(v_cache.dtype)
        if rotary_cos is not None:
            q_positions = rotary_start + (np.arange(q_b.shape[0]) if per_row else np.zeros(q_b.shape[0], np.int64))
            q_b = apply_rotary(q_b, rotary_cos, rotary_sin, q_positions, rotary_interleaved)
        key_positions = np.arange(start, cached + n_new)
        pages, offsets = physical(b, key_positions)
        keys = k_cache[pages, offsets].astype(np.float64)
        values = v_cache[pages, offsets].astype(np.float64)
        if fp8_cache:
            keys, values = keys * dk[:, None], values * dv[:, None]
        if q_b.shape[0] == 0 or (key_positions.size == 0 and sinks is None):
            continue  # out 0, lse -inf
        slopes = alibi_slopes if alibi_slopes is None or np.ndim(alibi_slopes) == 1 else alibi_slopes[b:b + 1]
        o, l = attention_reference(q_b[None], keys[None], values[None], causal=causal, softmax_scale=scale,
                                   dtype=dtype, window=window, softcap=softcap, sinks=sinks, alibi_slopes=slopes)
        if varlen:
            out[rows[b]], lse[:, rows[b]] = o[0], l[0]
        else:
            out[b], lse[b] = o[0], l[0]
    return out, lse, k_cache, v_cache


def mla_decode_reference(
    q: npt.ArrayLike,
    kv_cache: np.ndarray,
    page_table: npt.ArrayLike,
    cache_seqlens: npt.ArrayLike,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = True,
    descale_kv=None,
    dtype: npt.DTypeLike = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's multi-head latent attention decoding (FlashMLA's ``flash_mla_with_kvcache``): every
    query head attends one shared latent head whose first ``head_dim_v`` dims are also its values.

    Parameters
    ----------
    q : (batch, seqlen_q, heads, head_dim), DeepSeek-V3: head_dim 576 (512 latent + 64 rotary)
    kv_cache : (num_pages, page_size, 1, head_dim), paged through ``page_table``; q's dtype, or
        float8_e4m3fn holding ``value / descale_kv``
    page_table : (batch, max_pages) ints; cache_seqlens : (batch,) ints, the keys of each sequence
    head_dim_v : the values' dims, the first of the latent head's
    causal : bottom-right aligned, for seqlen_q > 1 (speculative decoding's extra query tokens)
    descale_kv : None, a number, or (batch, 1): an FP8 cache's factor
    dtype : as for kvcache_reference

    Returns
    -------
    out : (batch, seqlen_q, heads, head_dim_v); lse : (batch, heads, seqlen_q), ``-inf`` for rows
    that see no key.
    """
    kv_cache = np.asarray(kv_cache)
    out, lse, _, _ = kvcache_reference(q, kv_cache, kv_cache[..., :head_dim_v], cache_seqlens=cache_seqlens,
                                       page_table=page_table, causal=causal, softmax_scale=softmax_scale,
                                       descale_k=descale_kv, descale_v=descale_kv, dtype=dtype)
    return out, lse


def combine_reference(out_partial: npt.ArrayLike, lse_partial: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Merge split-KV partial results in float64: ``lse = log(sum_s exp(lse_s))`` and
    ``out = sum_s exp(lse_s - lse) * out_s`` over the leading (split) axis. ``out_partial`` is
    (splits, ..., head_dim), ``lse_partial`` (splits, ...); a row whose splits all have
    ``lse = -inf`` gives out 0 and lse -inf (its partial outputs are ignored, whatever they hold).
    """
    o = np.asarray(out_partial, np.float64)
    l = np.asarray(lse_partial, np.float64)
    m = l.max(axis=0, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    weights = np.exp(l - m_safe)  # exp(-inf) = 0 for empty splits
    total = weights.sum(axis=0)
    empty = total == 0
    lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, total)))
    scaled = np.where(weights[..., None] > 0, o, 0.0) * weights[..., None]  # 0 * NaN stays out
    out = scaled.sum(axis=0) / np.where(empty, 1.0, total)[..., None]
    return out, lse
