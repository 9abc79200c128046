"""vLLM-style steps for the tests of cuflash.torch.vllm: a mixed batch over a paged cache, and the
float64 reference per sequence."""

from __future__ import annotations

import numpy as np
import torch

from cuflash._cpu.reference import attention_reference

HEADS, HEADS_KV, HEAD_DIM = 8, 2, 32


def mixed_batch(r, block_size: int, query_lens, cached_lens, hnd: bool, dtype=torch.float32, blocks_per_seq=None):
    """A vLLM step: packed q, the k/v pools (views of one (2, num_blocks, ...) tensor, NHD or HND
    strides) holding each sequence's cached tokens (NaN elsewhere), a random block table whose
    entries repeat across sequences where two sequences share a prefix, cu_seqlens_q and seqused_k."""
    batch = len(query_lens)
    blocks_per_seq = blocks_per_seq or max(-(-n // block_size) for n in cached_lens) + 1
    num_blocks = batch * blocks_per_seq + 3
    shape = (2, num_blocks, HEADS_KV, block_size, HEAD_DIM) if hnd else (2, num_blocks, block_size, HEADS_KV, HEAD_DIM)
    pools = torch.full(shape, float("nan"), dtype=dtype)
    k_cache, v_cache = (pools[i].transpose(1, 2) if hnd else pools[i] for i in range(2))
    order = torch.from_numpy(r.permutation(num_blocks)[:batch * blocks_per_seq].astype(np.int32))
    table = order.view(batch, blocks_per_seq).clone()
    table[1, 0] = table[0, 0]  # sequences 0 and 1 share their first block (a common prefix)
    keys, values = [], []
    shared = None
    for b, n in enumerate(cached_lens):
        k = torch.from_numpy(r.standard_normal((n, HEADS_KV, HEAD_DIM))).to(dtype)
        v = torch.from_numpy(r.standard_normal((n, HEADS_KV, HEAD_DIM))).to(dtype)
        if b == 1 and shared is not None:  # the shared block holds sequence 0's first tokens
            m = min(n, block_size, shared[0].shape[0])
            k[:m], v[:m] = shared[0][:m], shared[1][:m]
        for pos in range(n):
            block, row = table[b, pos // block_size], pos % block_size
            k_cache[block, row], v_cache[block, row] = k[pos], v[pos]
        if b == 0:
            shared = (k[:block_size], v[:block_size])
        keys.append(k)
        values.append(v)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    q = torch.from_numpy(r.standard_normal((int(cu[-1]), HEADS, HEAD_DIM))).to(dtype)
    return q, k_cache, v_cache, table, cu, torch.tensor(cached_lens, dtype=torch.int32), keys, values


def reference(q, cu, keys, values, **options):
    """(out, lse (heads, total_q)) per sequence by the float64 reference on its own keys."""
    outs, lses = [], []
    for b in range(len(keys)):
        rows = q[cu[b]:cu[b + 1]].double().numpy()[None]
        out, lse = attention_reference(rows, keys[b].double().numpy()[None], values[b].double().numpy()[None],
                                       **options)
        outs.append(out[0])
        lses.append(lse[0])
    return np.concatenate(outs), np.concatenate(lses, axis=-1)
