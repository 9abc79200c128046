"""Random attention_with_kvcache calls for the CPU and GPU tests: NumPy arguments whose caches hold
random values only where the call may read them (positions cache_leftpad .. cache_seqlens - 1 of
each sequence) and NaN everywhere else, so a read or a write outside them shows."""

from __future__ import annotations

import numpy as np


def make_case(r: np.random.Generator, *, batch: int = 3, seqlen_q: int = 1, heads: int = 4, heads_kv: int = 2,
              head_dim: int = 64, capacity: int = 40, page_size: int | None = None, new: int = 1,
              lens: list[int] | None = None, leftpad: bool = False, batch_idx: bool = False,
              rotary: str | None = None, rotary_dim: int | None = None, varlen: bool = False,
              counts: list[int] | None = None, dtype=np.float64, cache_dtype=None) -> dict:
    """Keyword arguments of attention_with_kvcache (NumPy, ``dtype``). ``new``: tokens appended
    per sequence (0: no k, v); with ``varlen`` q is packed and each sequence's query count (random,
    0 included, at most ``seqlen_q``; or ``counts``) is also its append count. ``lens``: cache_seqlens per
    sequence, random (0 and the largest that leaves room included) when None. ``rotary``:
    "interleaved" or "half"."""
    cache_dtype = np.dtype(dtype if cache_dtype is None else cache_dtype)
    if varlen:
        if counts is None:
            counts = r.integers(0, seqlen_q + 1, batch)
            counts[r.integers(batch)] = seqlen_q
        counts = np.asarray(counts)
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        q = r.standard_normal((int(cu[-1]), heads, head_dim))
        appended = counts if new else np.zeros(batch, np.int64)
    else:
        q = r.standard_normal((batch, seqlen_q, heads, head_dim))
        appended = np.full(batch, new)
    room = capacity - appended
    if lens is None:
        lens = r.integers(0, room + 1)
        lens[0], lens[-1] = 0, room[-1]
    lens = np.asarray(lens, np.int32)
    pads = np.array([r.integers(0, n + 1) for n in lens], np.int32) if leftpad else np.zeros(batch, np.int32)
    shape_tail = (heads_kv, head_dim)
    args: dict = {}
    if page_size is not None:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 2
        table = r.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
        k_cache = np.full((num_pages, page_size, *shape_tail), np.nan)
        args["page_table"] = table
        slot = lambda b, p: (table[b, p // page_size], p % page_size)  # noqa: E731
    else:
        rows = r.permutation(batch + 2)[:batch].astype(np.int32) if batch_idx else np.arange(batch, dtype=np.int32)
        k_cache = np.full((batch + 2 if batch_idx else batch, capacity, *shape_tail), np.nan)
        if batch_idx:
            args["cache_batch_idx"] = rows
        slot = lambda b, p: (rows[b], p)  # noqa: E731
    v_cache = k_cache.copy()
    for b in range(batch):
        for p in range(pads[b], lens[b]):
            k_cache[slot(b, p)] = r.standard_normal(shape_tail)
            v_cache[slot(b, p)] = r.standard_normal(shape_tail)
    args |= dict(q=q.astype(dtype), k_cache=k_cache.astype(cache_dtype), v_cache=v_cache.astype(cache_dtype),
                 cache_seqlens=lens)
    if leftpad:
        args["cache_leftpad"] = pads
    if varlen:
        args["cu_seqlens_q"] = cu
        if new:
            args["k"], args["v"] = (r.standard_normal((q.shape[0], *shape_tail)).astype(dtype) for _ in range(2))
    elif new:
        args["k"], args["v"] = (r.standard_normal((batch, new, *shape_tail)).astype(dtype) for _ in range(2))
    if rotary is not None:
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        positions = capacity if page_size is None else -(-capacity // page_size) * page_size
        angles = r.uniform(0, 2 * np.pi, (positions, rotary_dim // 2))
        args |= dict(rotary_cos=np.cos(angles).astype(dtype), rotary_sin=np.sin(angles).astype(dtype),
                     rotary_interleaved=rotary == "interleaved")
    return args


def reference_args(args: dict) -> dict:
    """``args`` as kvcache_reference takes them (it has no num_splits, validate, return_lse,
    max_seqlen_q)."""
    return {name: value for name, value in args.items()
            if name not in ("num_splits", "validate", "return_lse", "max_seqlen_q")}


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
