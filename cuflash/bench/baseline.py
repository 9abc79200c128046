"""Standard attention in CuPy: S = QKᵀ and P = softmax(S) written to device memory in full.

The FlashAttention paper's baseline, for timing and memory comparisons (``python -m cuflash``,
benchmarks/). fp32 math on fp16/bf16 inputs; memory grows with seqlen_q x seqlen_k.
"""

from __future__ import annotations


def standard_attention(q, k, v, causal: bool = False):
    """q, k, v: CuPy (batch, seqlen, heads, head_dim), heads equal. Returns float32 BSHD."""
    import cupy as cp

    q, k, v = (x.transpose(0, 2, 1, 3).astype(cp.float32) for x in (q, k, v))
    s = cp.matmul(q, k.transpose(0, 1, 3, 2))
    s *= q.shape[-1] ** -0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = cp.where(cp.arange(sk)[None] <= cp.arange(sq)[:, None] + sk - sq, s, -cp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s, out=s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.matmul(p, v).transpose(0, 2, 1, 3)
