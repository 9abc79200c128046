"""The four attention entry points called alike on NumPy inputs, for tests that check an option on
each of them (tests/test_sinks_alibi_host.py, tests/test_dropout_host.py)."""

from __future__ import annotations

import numpy as np

import cuflash

ENTRIES = ("forward", "backward", "varlen", "varlen_backward")


def call_entry(entry: str, q, k, v, **options):
    """``entry`` (one of ENTRIES) on fixed-length (batch, seqlen, heads, head_dim) q, k, v or their
    packed forms (one sequence per batch entry); the backward ones on the plain forward's out and
    lse, with ``options`` given to the entry under test only."""
    if entry == "forward":
        return cuflash.attention(q, k, v, **options)
    if entry == "backward":
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        return cuflash.attention_backward(out, q, k, v, out, lse, **options)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    cu_q = np.arange(0, q.shape[0] * q.shape[1] + 1, q.shape[1], dtype=np.int32)
    cu_k = np.arange(0, k.shape[0] * k.shape[1] + 1, k.shape[1], dtype=np.int32)
    if entry == "varlen":
        return cuflash.attention_varlen(*packed, cu_q, cu_k, **options)
    out, lse = cuflash.attention_varlen(*packed, cu_q, cu_k, return_lse=True)
    return cuflash.attention_varlen_backward(out, *packed, out, lse, cu_q, cu_k, **options)


def random_qkv(rng: np.random.Generator, shape_q, shape_kv, dtype, head_dim_v=None):
    """Standard-normal q (shape_q), k (shape_kv) and v (shape_kv with ``head_dim_v``) of ``dtype``,
    drawn in that order."""
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_kv).astype(dtype)
    v = rng.standard_normal((*shape_kv[:-1], head_dim_v or shape_kv[-1])).astype(dtype)
    return q, k, v
