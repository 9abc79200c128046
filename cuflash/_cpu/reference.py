"""NumPy reference attention and the blockwise online-softmax algorithm on the CPU.

Everything here is NumPy only (no CuPy), so it runs anywhere and serves three roles:

* :func:`attention_reference` -- naive attention, the float64 ground truth, and (with
  ``dtype=float16/bfloat16``) the same-dtype baseline ``out_lowp_ref`` of the correctness rule;
* :func:`attention_blockwise` -- the FlashAttention-2 forward loop (running max, running sum,
  unnormalised accumulator, ``exp2`` domain, causal block skipping), the library's CPU path;
* :func:`attention_flops` and :func:`max_error_bound` -- the FLOP count and the ``2x + atol``
  correctness rule;
* :func:`dequantize` -- FP8 (e4m3) inputs with their descales as the float64 values they stand
  for; ``attention_reference(..., p_dtype=ml_dtypes.float8_e4m3fn)`` is FlashAttention-3's FP8
  baseline (P rounded to e4m3 before ``P @ v``).

Layout is ``(batch, seqlen, heads, head_dim)`` ("BSHD"). ``v`` may have its own head dim
``head_dim_v`` (then so do ``out`` and ``dout``). ``k`` and ``v`` may have
``heads_kv`` heads with ``heads_q % heads_kv == 0``; query head ``h`` uses kv head
``h // (heads_q // heads_kv)``. Which keys a query sees is :func:`allowed_keys` (causal and
sliding windows, flash-attn's semantics, aligned bottom-right). ``softcap > 0`` replaces the
scaled scores ``s`` by ``softcap * tanh(s / softcap)`` before the softmax. A row whose keys are
all masked gives ``out = 0`` and ``lse = -inf``, never NaN. ``alibi_slopes`` (heads,) or (batch,
heads) adds flash-attn's bias ``-slope * |i + seqlen_k - seqlen_q - j|`` to the (softcapped) score.
``sinks`` (heads,) adds ``exp(sink)`` to each row's softmax denominator (gpt-oss's extra score column,
not scaled): the lse includes it, and a row that sees no key then gives ``out = 0`` and
``lse = sink``. Dropout (``dropout_p`` with a keep mask, or with the ``seed`` and ``offset`` of
:mod:`cuflash._cpu.philox`'s stream, which the kernels draw too) multiplies the normalised P by
``mask / (1 - dropout_p)`` before ``P @ v``; the lse is of the undropped P. Variable-length batches
(:func:`attention_varlen_reference`) are packed ``(total_tokens, heads, head_dim)`` with
cumulative lengths, each sequence attending only to itself.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import numpy.typing as npt

from cuflash._cpu import philox

__all__ = [
    "allowed_keys",
    "dropout_keep",
    "attention_backward_from_lse",
    "attention_backward_reference",
    "attention_varlen_backward_reference",
    "attention_varlen_reference",
    "attention_reference",
    "attention_blockwise",
    "attention_flops",
    "dequantize",
    "max_error_bound",
    "sinks_gradient",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_FLOP_MODES = ("fwd", "bwd", "fwd_bwd")


def _check_inputs(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, softmax_scale: float | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Validate BSHD shapes and GQA head counts; return arrays and the resolved scale."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {x.shape}"
            )
        if not (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"):
            raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
    b, _, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"k, v: expected batch {b} like q, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(
            f"v: expected (seqlen_k, heads_kv) = {k.shape[1:3]} like k, got {v.shape[1:3]}"
        )
    if k.shape[3] != d:
        raise ValueError(f"k: expected head_dim {d} like q, got {k.shape[3]}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k, v: heads_kv={hkv} must divide heads_q={hq}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    return q, k, v, scale


def key_bounds(rows: np.ndarray, seqlen_q: int, seqlen_k: int, causal: bool,
               window: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Keys ``[lo, hi)`` that query rows ``rows`` see (``lo >= hi``: none).

    flash-attn's rules, aligned bottom-right with ``offset = seqlen_k - seqlen_q``: query ``i``
    sees key ``j`` iff ``0 <= j < seqlen_k``, ``j <= i + offset + right`` unless ``right == -1``
    and ``j >= i + offset - left`` unless ``left == -1``; ``causal`` sets ``right = 0``.
    """
    left, right = window
    if causal:
        right = 0
    offset = seqlen_k - seqlen_q
    rows = np.asarray(rows)
    lo = np.zeros_like(rows) if left < 0 else np.clip(rows + offset - left, 0, seqlen_k)
    hi = np.full_like(rows, seqlen_k) if right < 0 else np.clip(rows + offset + right + 1, 0, seqlen_k)
    return lo, hi


def allowed_keys(seqlen_q: int, seqlen_k: int, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
                 rows: np.ndarray | None = None, cols: np.ndarray | None = None) -> np.ndarray:
    """Boolean ``(len(rows), len(cols))`` mask of the (query, key) pairs that take part (see
    :func:`key_bounds`); ``rows`` and ``cols`` default to every query and key."""
    rows = np.arange(seqlen_q) if rows is None else np.asarray(rows)
    cols = np.arange(seqlen_k) if cols is None else np.asarray(cols)
    lo, hi = key_bounds(rows, seqlen_q, seqlen_k, causal, window)
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


def _softcapped(s: np.ndarray, softcap: float) -> np.ndarray:
    """``softcap * tanh(s / softcap)`` (Gemma 2, Grok); ``s`` unchanged when ``softcap == 0``."""
    return s if softcap == 0 else softcap * np.tanh(s / softcap)


def alibi_bias(slopes: npt.ArrayLike, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
               rows: slice = slice(None), cols: slice = slice(None)) -> np.ndarray:
    """flash-attn's ALiBi bias ``-slope * |i + seqlen_k - seqlen_q - j|`` as a float64
    ``(batch, heads, rows, cols)`` array for query rows ``rows`` and keys ``cols``; ``slopes`` is
    ``(heads,)`` or ``(batch, heads)``."""
    slopes = np.broadcast_to(np.asarray(slopes, np.float64), (batch, heads))
    distance = np.abs(np.arange(seqlen_q)[rows, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, cols])
    return -slopes[:, :, None, None] * distance


def _sink_logits(sinks: npt.ArrayLike | None, heads: int) -> np.ndarray:
    """The per-head sink logits as float64 ``(heads,)``; ``-inf`` (no sink) where None."""
    if sinks is None:
        return np.full(heads, -np.inf)
    sinks = np.asarray(sinks, np.float64)
    if sinks.shape != (heads,):
        raise ValueError(f"sinks: expected shape ({heads},), got {sinks.shape}")
    return sinks


def dropout_keep(dropout_p: float, dropout_mask: npt.ArrayLike | None, seed: int | None, offset: int,
                 batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> np.ndarray | None:
    """Dropout's factor ``keep / (1 - dropout_p)``, float64 (batch, heads, seqlen_q, seqlen_k), from
    a keep mask (True: kept) or from ``seed`` and ``offset`` (:func:`cuflash._cpu.philox.keep_mask`);
    None without dropout."""
    if not dropout_p:
        return None
    if (dropout_mask is None) == (seed is None):
        raise ValueError("dropout_mask, seed: with dropout_p > 0 give exactly one of them")
    if dropout_mask is None:
        dropout_mask = philox.keep_mask(seed, offset, dropout_p, heads, seqlen_q, seqlen_k, batch)
    dropout_mask = np.asarray(dropout_mask)
    if dropout_mask.shape != (batch, heads, seqlen_q, seqlen_k) or dropout_mask.dtype != np.bool_:
        raise ValueError(f"dropout_mask: expected bool of shape {(batch, heads, seqlen_q, seqlen_k)}, got "
                         f"{dropout_mask.dtype} {dropout_mask.shape}")
    return dropout_mask / (1.0 - dropout_p)


def _finalize(
    acc: np.ndarray, m: np.ndarray, l: np.ndarray, *, base2: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``acc / l`` and the natural-log ``lse`` from running max ``m`` and sum ``l``.

    ``m`` is in the exp2 domain when ``base2`` (``lse = (m + log2 l) * ln 2``), else natural
    (``lse = m + ln l``). Rows with ``l == 0`` (all keys masked) give ``out = 0``, ``lse = -inf``.
    """
    empty = l == 0
    l_safe = np.where(empty, 1, l)
    out = acc / l_safe[..., None]
    m_safe = np.where(empty, 0, m)
    lse = (m_safe + np.log2(l_safe)) * _LN2 if base2 else m_safe + np.log(l_safe)
    lse[empty] = -np.inf
    return out, lse.astype(acc.dtype, copy=False)


def attention_reference(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dtype: npt.DTypeLike = np.float64,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    p_dtype: npt.DTypeLike | None = None,
    sinks: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    dropout_mask: npt.ArrayLike | None = None,
    seed: int | None = None,
    offset: int = 0,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Naive attention ``softmax(q k^T * scale) v``, one (batch, head) at a time.

    Parameters
    ----------
    q : ndarray, (batch, seqlen_q, heads, head_dim), any float dtype (incl. ml_dtypes.bfloat16)
    k : ndarray, (batch, seqlen_k, heads_kv, head_dim), ``heads % heads_kv == 0``
    v : ndarray, (batch, seqlen_k, heads_kv, head_dim_v)
    causal : bool
        Bottom-right aligned: query ``i`` attends key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    window : (left, right)
        Sliding window, ``-1`` unbounded (:func:`key_bounds`).
    softcap : float
        ``> 0``: scores ``s`` become ``softcap * tanh(s / softcap)`` before the softmax.
    dtype : dtype, default float64
        The dtype every step is rounded to. ``float64``: the exact reference. Anything else
        (float32, float16, bfloat16) gives flash-attn's same-dtype baseline: inputs cast to
        ``dtype``; ``S = q @ k^T * scale`` accumulated in float32 and rounded to ``dtype``;
        softmax in float32; ``P`` rounded to ``dtype``; ``P @ v`` accumulated in float32;
        ``out`` rounded to ``dtype``.
    p_dtype : dtype, optional
        The dtype the normalised ``P`` is rounded to before ``P @ v``; default ``dtype``.
        ``ml_dtypes.float8_e4m3fn`` (with ``dtype`` bfloat16 or float16 and dequantized inputs)
        is FlashAttention-3's FP8 baseline, as its tests compute it.
    sinks : array, optional
        (heads,) logits, one extra score per row that takes part in the softmax's denominator
        only; in the accumulation dtype.
    alibi_slopes : array, optional
        (heads,) or (batch, heads): the bias :func:`alibi_bias` added after the softcap.
    dropout_p, dropout_mask, seed, offset
        Dropout of the normalised P: with ``dropout_p > 0``, either ``dropout_mask`` (bool (batch,
        heads, seqlen_q, seqlen_k), True where kept) or the ``seed`` and ``offset`` of the
        kernels' stream (:mod:`cuflash._cpu.philox`); kept entries are divided by
        ``1 - dropout_p`` (before rounding P to ``p_dtype``). The lse does not change.
    score_mod, mask_mod : callables, optional
        A user's modification of the scores, applied after the softcap and the ALiBi bias:
        ``score_mod(s, b, h, q_idx, kv_idx)`` gives the new scores of (batch entry b, head h)
        from ``s`` (seqlen_q, seqlen_k), ``q_idx`` (seqlen_q, 1) and ``kv_idx`` (1, seqlen_k)
        being the positions; ``mask_mod(b, h, q_idx, kv_idx)`` is True where the key is seen
        (with the built-in masks).

    Returns
    -------
    out : ndarray, (batch, seqlen_q, heads, head_dim_v), ``dtype``
    lse : ndarray, (batch, heads, seqlen_q), float64 if ``dtype`` is float64, else float32
        Natural-log log-sum-exp of the scaled scores and the sink; ``-inf`` (and ``out = 0``)
        for a row whose keys are all masked and that has no sink.
    """
    q, k, v, scale = _check_inputs(q, k, v, softmax_scale)
    dtype = np.dtype(dtype)
    p_dtype = dtype if p_dtype is None else np.dtype(p_dtype)
    acc = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)

    def rounded(x: np.ndarray, to: np.dtype = dtype) -> np.ndarray:
        """Round to ``to`` and come back to the accumulation dtype."""
        return x if to == acc else x.astype(to).astype(acc)

    # (batch, heads, seqlen, dim) in the accumulation dtype, after rounding inputs to ``dtype``.
    qh, kh, vh = (x.astype(dtype).astype(acc).transpose(0, 2, 1, 3) for x in (q, k, v))
    b, hq, sq, _ = qh.shape
    hkv, sk, dv = kh.shape[1], kh.shape[2], vh.shape[3]
    group = hq // hkv
    masked = ~allowed_keys(sq, sk, causal=causal, window=window)
    bias = None if alibi_slopes is None else alibi_bias(alibi_slopes, b, hq, sq, sk).astype(acc)
    sink_logits = _sink_logits(sinks, hq).astype(acc)
    keep = dropout_keep(dropout_p, dropout_mask, seed, offset, b, hq, sq, sk)

    out = np.empty((b, hq, sq, dv), dtype)
    lse = np.empty((b, hq, sq), acc)
    q_idx, kv_idx = np.arange(sq)[:, None], np.arange(sk)[None, :]
    for bi in range(b):
        for h in range(hq):
            s = qh[bi, h] @ kh[bi, h // group].T
            s *= acc.type(scale)
            s = rounded(s)
            if softcap:
                s = rounded(_softcapped(s, acc.type(softcap)))
            if bias is not None:
                s = rounded(s + bias[bi, h])
            if score_mod is not None:
                s = rounded(np.broadcast_to(score_mod(s, bi, h, q_idx, kv_idx), s.shape).astype(acc))
            hidden = masked if mask_mod is None else masked | ~np.broadcast_to(mask_mod(bi, h, q_idx, kv_idx), s.shape)
            if hidden.any():
                np.copyto(s, -np.inf, where=hidden)
            m = np.maximum(s.max(axis=-1, initial=-np.inf), sink_logits[h])
            m_safe = np.where(np.isneginf(m), 0, m)  # fully masked row: avoid -inf - -inf
            s -= m_safe[:, None]
            p = np.exp(s, out=s)
            l = p.sum(axis=-1) + np.exp(sink_logits[h] - m_safe)
            p, lse[bi, h] = _finalize(p, m, l, base2=False)
            if keep is not None:
                p *= keep[bi, h].astype(acc)
            out[bi, h] = (rounded(p, p_dtype) @ vh[bi, h // group]).astype(dtype)
    return out.transpose(0, 2, 1, 3), lse


def attention_blockwise(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
    dtype: npt.DTypeLike = np.float64,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    offset: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention-2 forward: online softmax over key blocks, vectorised over batch and heads.

    For each block of ``block_m`` queries, loop over blocks of ``block_n`` keys keeping a running
    max ``m``, running sum ``l`` and an unnormalised accumulator, all in the ``exp2`` domain
    (``scale * log2(e)`` folded into the scores once); rescale by ``exp2(m_old - m_new)``; visit
    only the key blocks some row of the query block may see (causal diagonal, sliding window), so
    the cost follows the window; mask only the tiles a boundary crosses; normalise once at the
    end. The full score matrix is never formed. A sink starts each row's running max and sum as
    the one score seen before the first key. Dropout, as the kernels do it: each tile's P is
    masked after the running sum has taken it, and the output divided by ``1 - dropout_p`` once.

    Parameters
    ----------
    q, k, v, causal, softmax_scale, window, softcap, sinks, alibi_slopes
        As in :func:`attention_reference` (BSHD layout, GQA/MQA allowed).
    dropout_p, seed, offset
        As in :func:`attention_reference`, each tile's mask drawn from the stream.
    block_m, block_n : int
        Query and key tile sizes; they need not divide the sequence lengths.
    dtype : float64 or float32
        Compute dtype.

    Returns
    -------
    out : ndarray, (batch, seqlen_q, heads, head_dim_v), ``dtype``
    lse : ndarray, (batch, heads, seqlen_q), ``dtype``, natural log; ``-inf`` and ``out = 0``
        for fully masked rows.
    """
    q, k, v, scale = _check_inputs(q, k, v, softmax_scale)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    if dropout_p and seed is None:
        raise ValueError("seed: dropout_p > 0 draws its mask from a seed")
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block_m, block_n: expected >= 1, got {block_m}, {block_n}")
    b, sq, hq, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    scale_log2 = dtype.type(scale * _LOG2E)

    # q as (b, hkv, group, sq, d) and k, v as (b, hkv, 1, sk, d): GQA by broadcasting, no copies.
    qg = q.astype(dtype).reshape(b, sq, hkv, group, -1).transpose(0, 2, 3, 1, 4)
    kg = k.astype(dtype).transpose(0, 2, 1, 3)[:, :, None]
    vg = v.astype(dtype).transpose(0, 2, 1, 3)[:, :, None]

    out = np.empty((b, hkv, group, sq, dv), dtype)
    lse = np.empty((b, hkv, group, sq), dtype)
    # The sink in the exp2 domain, per (hkv, group) head.
    sink = (_sink_logits(sinks, hq) * _LOG2E).astype(dtype).reshape(hkv, group, 1)
    for i0 in range(0, sq, block_m):
        i1 = min(i0 + block_m, sq)
        q_blk = qg[..., i0:i1, :]
        m = np.broadcast_to(sink, q_blk.shape[:-1]).copy()
        l = np.where(np.isneginf(m), 0, 1).astype(dtype)
        acc = np.zeros(q_blk.shape[:-1] + (dv,), dtype)
        lo, hi = key_bounds(np.arange(i0, i1), sq, sk, causal, window)
        n_begin, n_end = int(lo.min()) // block_n * block_n, int(hi.max())  # keys outside: all masked
        for j0 in range(n_begin, n_end, block_n):
            j1 = min(j0 + block_n, sk)
            s = q_blk @ kg[..., j0:j1, :].swapaxes(-1, -2)
            if softcap:
                s = _softcapped(s * dtype.type(scale), dtype.type(softcap)) * dtype.type(_LOG2E)
            else:
                s *= scale_log2
            if alibi_slopes is not None:
                tile_bias = alibi_bias(alibi_slopes, b, hq, sq, sk, slice(i0, i1), slice(j0, j1)) * _LOG2E
                s += tile_bias.astype(dtype).reshape(s.shape)
            if lo.max() > j0 or hi.min() < j1:  # a window or diagonal boundary crosses this tile
                allowed = (np.arange(j0, j1)[None, :] >= lo[:, None]) & (np.arange(j0, j1)[None, :] < hi[:, None])
                np.copyto(s, -np.inf, where=~allowed)
            m_new = np.maximum(m, s.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0, m_new)  # rows with nothing seen yet
            alpha = np.exp2(m - m_safe)
            s -= m_safe[..., None]
            p = np.exp2(s, out=s)
            l = alpha * l + p.sum(axis=-1)
            if dropout_p:
                p *= philox.keep_mask(seed, offset, dropout_p, hq, np.arange(i0, i1), np.arange(j0, j1),
                                      b).reshape(p.shape)
            acc *= alpha[..., None]
            acc += p @ vg[..., j0:j1, :]
            m = m_new
        out[..., i0:i1, :], lse[..., i0:i1] = _finalize(acc, m, l, base2=True)
        if dropout_p:
            out[..., i0:i1, :] /= dtype.type(1.0 - dropout_p)
    return (
        out.reshape(b, hq, sq, dv).transpose(0, 2, 1, 3),
        lse.reshape(b, hq, sq),
    )


def attention_backward_reference(
    dout: npt.ArrayLike,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    dropout_mask: npt.ArrayLike | None = None,
    seed: int | None = None,
    offset: int = 0,
    score_mod: Callable | None = None,
    score_mod_derivative: Callable | None = None,
    mask_mod: Callable | None = None,
) -> tuple[np.ndarray, ...]:
    """Float64 gradients of ``out = attention(q, k, v)`` against the upstream gradient ``dout``.

    With ``P = softmax(S)``, ``S = q kᵀ · scale``: ``dv = Pᵀ dout``, ``dP = dout vᵀ``,
    ``dS = P ∘ (dP - rowsum(dP ∘ P))``, ``dq = dS k · scale``, ``dk = dSᵀ q · scale``. With a
    softcap, ``S = c · tanh(q kᵀ · scale / c)`` and dS is multiplied by its derivative
    ``1 - (S / c)²``. For GQA/MQA, dk and dv of a kv head are summed over the query heads that
    share it. Masked scores, and rows that see no key, contribute nothing. An ALiBi bias is a
    constant of the score: it changes P, not the chain rule. A sink is a score column whose value
    is 0, so ``rowsum(dP ∘ P)`` is over the keys only and the sink's own gradient is
    ``-P_sink · rowsum(dP ∘ P)`` summed over every row of its head (:func:`sinks_gradient`).
    Dropout (arguments as for :func:`attention_reference`) with ``Z = P ∘ M / (1 - p)`` the
    dropped P: ``dv = Zᵀ dout``, and dP becomes ``dP ∘ M / (1 - p)`` in dS (so that
    ``rowsum(dP ∘ P)`` is ``rowsum(dout ∘ out)`` still). A ``score_mod`` (as for
    :func:`attention_reference`) multiplies dS by ``score_mod_derivative`` (the same arguments:
    d score_mod / d s) before the softcap's; a ``mask_mod`` masks as it does there.

    Returns
    -------
    dq : (batch, seqlen_q, heads, head_dim), dk : (batch, seqlen_k, heads_kv, head_dim),
    dv : (batch, seqlen_k, heads_kv, head_dim_v), all float64; with ``sinks``, also
    dsinks : (heads,).
    """
    sink_logits = _sink_logits(sinks, np.shape(q)[2])
    dsinks = np.zeros_like(sink_logits)

    def softmax(bi, h, s, dp):
        m = np.maximum(s.max(axis=-1, keepdims=True, initial=-np.inf), sink_logits[h])
        m_safe = np.where(np.isneginf(m), 0, m)
        p = np.exp(s - m_safe)
        sink_weight = np.exp(sink_logits[h] - m_safe)
        l = p.sum(axis=-1, keepdims=True) + sink_weight
        p /= np.where(l == 0, 1, l)
        delta = (p * dp).sum(axis=-1, keepdims=True)
        dsinks[h] -= float((sink_weight / np.where(l == 0, 1, l) * delta).sum())
        return p, delta

    batch, seqlen_q, heads = np.shape(q)[:3]
    keep = dropout_keep(dropout_p, dropout_mask, seed, offset, batch, heads, seqlen_q, np.shape(k)[1])
    grads = _backward(dout, q, k, v, causal, softmax_scale, window, softcap, softmax, alibi_slopes, keep,
                      (score_mod, score_mod_derivative, mask_mod))
    return grads if sinks is None else (*grads, dsinks)


def attention_backward_from_lse(
    dout: npt.ArrayLike,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    out: npt.ArrayLike,
    lse: npt.ArrayLike,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    dropout_mask: npt.ArrayLike | None = None,
    seed: int | None = None,
    offset: int = 0,
    score_mod: Callable | None = None,
    score_mod_derivative: Callable | None = None,
    mask_mod: Callable | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients as the kernels compute them, in float64: ``P = exp(S - lse)`` and
    ``rowsum(dP ∘ P) = rowsum(dout ∘ out)`` from the given ``out`` (batch, seqlen_q, heads,
    head_dim) and ``lse`` (batch, heads, seqlen_q), not from a softmax over these keys alone.

    Equal to :func:`attention_backward_reference` when out and lse are this call's; with those of
    an attention over more keys (a ring's other blocks), the contribution of these keys to the
    whole attention's gradients. Rows with ``lse = -inf`` contribute nothing. An lse that
    includes a sink gives the gradients with that sink; its own gradient is
    :func:`sinks_gradient`. Dropout, score_mod and mask_mod as in
    :func:`attention_backward_reference`.
    """
    out_h = np.asarray(out, dtype=np.float64).transpose(0, 2, 1, 3)
    dout_h = np.asarray(dout, dtype=np.float64).transpose(0, 2, 1, 3)
    lse = np.asarray(lse, dtype=np.float64)

    def softmax(bi, h, s, dp):
        row_lse = lse[bi, h, :, None]
        p = np.where(np.isneginf(row_lse), 0, np.exp(s - np.where(np.isneginf(row_lse), 0, row_lse)))
        return p, (dout_h[bi, h] * out_h[bi, h]).sum(axis=-1, keepdims=True)

    keep = dropout_keep(dropout_p, dropout_mask, seed, offset, lse.shape[0], lse.shape[1], lse.shape[2],
                        np.shape(k)[1])
    return _backward(dout, q, k, v, causal, softmax_scale, window, softcap, softmax, alibi_slopes, keep,
                     (score_mod, score_mod_derivative, mask_mod))


def _backward(dout, q, k, v, causal, softmax_scale, window, softcap, softmax, alibi_slopes=None, keep=None,
              mods=(None, None, None)):
    """The backward's loop over (batch, head), ``softmax(bi, h, s, dp)`` giving P and
    ``rowsum(dP ∘ P)`` from the masked scores ``s`` (bias included) and ``dP``. ``keep``: dropout's
    ``M / (1 - p)`` (dropout_keep), which weighs P in dv and dP in dS. ``mods``: (score_mod, its
    derivative, mask_mod), as attention_backward_reference takes them."""
    q, k, v, scale = _check_inputs(q, k, v, softmax_scale)
    dout = np.asarray(dout, dtype=np.float64)
    if dout.shape != q.shape[:3] + (v.shape[3],):
        raise ValueError(f"dout: expected shape {q.shape[:3] + (v.shape[3],)}, got {dout.shape}")
    qh, kh, vh, doh = (x.astype(np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    b, hq, sq, _ = qh.shape
    hkv, sk = kh.shape[1], kh.shape[2]
    group = hq // hkv
    allowed = allowed_keys(sq, sk, causal=causal, window=window)
    bias = np.zeros((b, hq, 1, 1)) if alibi_slopes is None else alibi_bias(alibi_slopes, b, hq, sq, sk)
    dq, dk, dv = np.zeros_like(qh), np.zeros_like(kh), np.zeros_like(vh)
    score_mod, score_mod_derivative, mask_mod = mods
    q_idx, kv_idx = np.arange(sq)[:, None], np.arange(sk)[None, :]
    for bi in range(b):
        for h in range(hq):
            kv = h // group
            capped = _softcapped(qh[bi, h] @ kh[bi, kv].T * scale, softcap)
            biased = capped + bias[bi, h]
            seen = allowed if mask_mod is None else allowed & np.broadcast_to(mask_mod(bi, h, q_idx, kv_idx),
                                                                              allowed.shape)
            if score_mod is not None:
                modified = np.broadcast_to(score_mod(biased, bi, h, q_idx, kv_idx), biased.shape)
                s = np.where(seen, modified, -np.inf)
            else:
                s = np.where(seen, biased, -np.inf)
            dp = doh[bi, h] @ vh[bi, kv].T
            if keep is not None:
                dp *= keep[bi, h]
            p, delta = softmax(bi, h, s, dp)
            dv[bi, kv] += (p if keep is None else p * keep[bi, h]).T @ doh[bi, h]
            ds = p * (dp - delta)
            if score_mod is not None:
                ds *= np.where(seen, np.broadcast_to(score_mod_derivative(biased, bi, h, q_idx, kv_idx), ds.shape), 0)
            if softcap:
                ds *= 1 - np.where(seen, capped / softcap, 0) ** 2
            dq[bi, h] = ds @ kh[bi, kv] * scale
            dk[bi, kv] += ds.T @ qh[bi, h] * scale
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


def sinks_gradient(dout: npt.ArrayLike, out: npt.ArrayLike, lse: npt.ArrayLike, sinks: npt.ArrayLike) -> np.ndarray:
    """``dsinks_h = -sum_{b,i} exp(sink_h - lse_bhi) * D_bhi``, ``D = rowsum(dout ∘ out)``, in
    float64: the sink's gradient from the forward's ``out`` (batch, seqlen_q, heads, head_dim_v)
    and its ``lse`` (batch, heads, seqlen_q), which includes the sink. A packed batch passes
    ``out`` and ``dout`` as (1, total_q, heads, head_dim_v) and ``lse`` as (1, heads, total_q)."""
    lse = np.asarray(lse, np.float64)
    sinks = _sink_logits(sinks, lse.shape[1])
    delta = (np.asarray(dout, np.float64) * np.asarray(out, np.float64)).sum(axis=-1).transpose(0, 2, 1)
    # A row of lse -inf (past seqused_q, or neither keys nor sink) has out = 0: it adds nothing.
    finite = np.isfinite(lse)
    weight = np.exp(np.where(finite, sinks[None, :, None] - np.where(finite, lse, 0), -np.inf))
    return -(weight * delta).sum(axis=(0, 2))


def dequantize(x: np.ndarray, descale, cu_seqlens: npt.ArrayLike | None = None) -> np.ndarray:
    """``x`` (FP8 or any float) in float64 times its descale: a scalar, or an array of shape
    (batch, heads_kv) whose entry [b, h] scales kv head h of batch entry (or packed sequence) b
    and, for q, the ``heads // heads_kv`` query heads of that group.

    ``x`` is (batch, seqlen, heads, head_dim), or packed (total, heads, head_dim) with
    ``cu_seqlens`` saying which sequence each row belongs to.
    """
    values = np.asarray(x).astype(np.float64)
    if np.ndim(descale) == 0:
        return values * float(descale)
    descale = np.asarray(descale, np.float64)
    per_head = np.repeat(descale, values.shape[-2] // descale.shape[1], axis=1)  # (batch, heads)
    if cu_seqlens is None:
        return values * per_head[:, None, :, None]
    sequence_of_row = np.repeat(np.arange(descale.shape[0]), np.diff(np.asarray(cu_seqlens, np.int64)))
    return values * per_head[sequence_of_row][:, :, None]


def _options_of_sequence(options: dict, i: int) -> dict:
    """``options`` for sequence ``i`` of a packed batch: (batch, heads) ALiBi slopes cut to its row;
    score_mod, its derivative and mask_mod called with ``b = i`` (the sequence's index), the
    batch-of-one's 0 replaced."""
    found = dict(options)
    slopes = options.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:
        found["alibi_slopes"] = np.asarray(slopes)[i:i + 1]
    for name in ("score_mod", "score_mod_derivative"):
        if options.get(name) is not None:
            found[name] = lambda s, b, h, q_idx, kv_idx, f=options[name]: f(s, i, h, q_idx, kv_idx)
    if options.get("mask_mod") is not None:
        found["mask_mod"] = lambda b, h, q_idx, kv_idx, f=options["mask_mod"]: f(i, h, q_idx, kv_idx)
    return found


def _dropout_of_sequence(options: dict, i: int, heads: int, seqlen_q: int, seqlen_k: int) -> dict:
    """``options`` for sequence ``i`` of a packed batch: a seed and offset become the keep mask that
    the stream draws for batch entry ``i`` (positions within the sequence)."""
    if not options.get("dropout_p") or options.get("seed") is None:
        return options
    mask = philox.keep_mask(options["seed"], options.get("offset", 0), options["dropout_p"], heads, seqlen_q,
                            seqlen_k, [i])
    return {**options, "dropout_mask": mask, "seed": None, "offset": 0}


def _sequences(cu_seqlens_q: npt.ArrayLike, cu_seqlens_k: npt.ArrayLike):
    """(query slice, key slice) of each sequence of a packed batch."""
    cu_q, cu_k = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1 or cu_q.size < 2:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected equal shapes (batch + 1,), got {cu_q.shape}, {cu_k.shape}")
    return [(slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])) for i in range(cu_q.size - 1)]


def attention_varlen_reference(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    seqused_q: npt.ArrayLike | None = None,
    seqused_k: npt.ArrayLike | None = None,
    **options,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`attention_reference` of each sequence of a packed batch.

    q is ``(total_q, heads, head_dim)``, k ``(total_k, heads_kv, head_dim)`` and v
    ``(total_k, heads_kv, head_dim_v)``; sequence ``i``
    owns queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``
    (either may be empty) and sees only its own keys, with causal and window alignment per
    sequence. ``options``: causal, softmax_scale, window, softcap, dtype, sinks and alibi_slopes
    (``(heads,)`` or ``(batch, heads)``, a row per sequence), dropout_p with seed and offset (each
    sequence's mask that of batch entry ``i``), score_mod and mask_mod (``b`` the sequence's index,
    positions within the sequence). ``seqused_q`` /
    ``seqused_k`` (batch,): only the first ``seqused_q[i]`` queries and ``seqused_k[i]`` keys of
    sequence ``i`` are used (masks align against those lengths); the rows past seqused_q are 0 with
    lse ``-inf``.

    Returns
    -------
    out : (total_q, heads, head_dim_v) ; lse : (heads, total_q), ``-inf`` for rows that see no key.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dtype = np.dtype(options.get("dtype", np.float64))
    out = np.zeros(q.shape[:2] + (v.shape[2],), dtype)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, np.float64 if dtype == np.float64 else np.float32)
    for i, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if seqused_q is not None:
            rows = slice(rows.start, rows.start + min(int(np.asarray(seqused_q)[i]), rows.stop - rows.start))
        if seqused_k is not None:
            keys = slice(keys.start, keys.start + min(int(np.asarray(seqused_k)[i]), keys.stop - keys.start))
        if rows.stop > rows.start:  # a sequence of no keys still has its sinks' lse
            sequence_options = _dropout_of_sequence(_options_of_sequence(options, i), i, q.shape[1],
                                                    rows.stop - rows.start, keys.stop - keys.start)
            o, l = attention_reference(q[None, rows], k[None, keys], v[None, keys], **sequence_options)
            out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


def attention_varlen_backward_reference(
    dout: npt.ArrayLike,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    **options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`attention_backward_reference` of each sequence of a packed batch (layout as in
    :func:`attention_varlen_reference`; ``options``: causal, softmax_scale, window, softcap, sinks,
    alibi_slopes, dropout_p with seed and offset). With ``sinks``, also dsinks summed over the sequences (a row that sees no key
    has ``out = 0``, so ``D = 0``: it adds nothing)."""
    dout, q, k, v = (np.asarray(x) for x in (dout, q, k, v))
    dq, dk, dv = (np.zeros(x.shape, np.float64) for x in (q, k, v))
    dsinks = np.zeros(q.shape[1])
    for i, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rows.stop > rows.start and keys.stop > keys.start:
            sequence_options = _dropout_of_sequence(_options_of_sequence(options, i), i, q.shape[1],
                                                    rows.stop - rows.start, keys.stop - keys.start)
            grads = attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                                 **sequence_options)
            dq[rows], dk[keys], dv[keys] = (g[0] for g in grads[:3])
            if options.get("sinks") is not None:
                dsinks += grads[3]
    return (dq, dk, dv) if options.get("sinks") is None else (dq, dk, dv, dsinks)


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    *,
    causal: bool = False,
    mode: str = "fwd",
    head_dim_v: int | None = None,
) -> float:
    """FLOPs of attention as the benchmarks count them.

    ``4 * batch * heads * seqlen_q * seqlen_k * head_dim`` for the forward (two GEMMs of
    ``2*sq*sk*d``), half that when ``causal``, times 2.5 for ``mode="bwd"`` and 3.5 for
    ``mode="fwd_bwd"``. With a ``head_dim_v`` of its own, each GEMM counts its own inner or
    outer dim: the forward's Q K^T ``head_dim`` and P V ``head_dim_v``; the backward's Q K^T
    again, dQ and dK ``head_dim``, dP and dV ``head_dim_v``.

    Returns
    -------
    float
    """
    if mode not in _FLOP_MODES:
        raise ValueError(f"mode: expected one of {list(_FLOP_MODES)}, got {mode!r}")
    dv = head_dim if head_dim_v is None else head_dim_v
    gemm = 2.0 * batch * heads * seqlen_q * seqlen_k / (2 if causal else 1)
    forward = gemm * (head_dim + dv)
    backward = gemm * (3 * head_dim + 2 * dv)
    return {"fwd": forward, "bwd": backward, "fwd_bwd": forward + backward}[mode]


def max_error_bound(
    out: npt.ArrayLike, ref: npt.ArrayLike, out_lowp_ref: npt.ArrayLike, atol: float = 0.0
) -> tuple[bool, float, float]:
    """The correctness rule ``max|out - ref| <= 2 * max|out_lowp_ref - ref| + atol``.

    Equal entries (including matching infinities, e.g. ``lse = -inf`` of masked rows) count as
    zero error; any NaN in ``out`` fails.

    Parameters
    ----------
    out : array, the result under test (any float dtype, same shape as ``ref``)
    ref : array, the float64 reference
    out_lowp_ref : array, the naive reference computed in the input dtype
    atol : float

    Returns
    -------
    ok : bool
    err : float
        ``max|out - ref|`` (NaN if ``out`` has NaN).
    bound : float
        ``2 * max|out_lowp_ref - ref| + atol``.
    """

    def max_abs_diff(a: npt.ArrayLike) -> float:
        a = np.asarray(a, dtype=np.float64)
        r = np.asarray(ref, dtype=np.float64)
        if a.shape != r.shape:
            raise ValueError(f"expected shape {r.shape} like ref, got {a.shape}")
        with np.errstate(invalid="ignore"):
            diff = np.where(a == r, 0.0, np.abs(a - r))
        if diff.size == 0:
            return 0.0
        return float(np.nan if np.isnan(diff).any() else diff.max())

    err = max_abs_diff(out)
    bound = 2.0 * max_abs_diff(out_lowp_ref) + float(atol)
    return bool(err <= bound), err, bound
