"""Host mirror of cuda_src/common/params.cuh: kernel arguments packed as one C struct.

CuPy passes a NumPy structured array by value as a struct argument; ``align=True`` gives the C
layout, and params.cuh static_asserts the same size.
"""

from __future__ import annotations

import math

import numpy as np

_STRIDES = [f"{t}_{s}_stride" for t in "qkvo" for s in ("batch", "row", "head")]

FWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "v", "o", "lse")]
    + [(name, np.int64) for name in _STRIDES]
    + [(name, np.int32) for name in ("heads", "kv_group", "seqlen_q", "seqlen_k", "head_dim")]
    + [("scale_log2", np.float32)],
    align=True,
)
FWD_PARAMS_SIZE = 160  # sizeof(FwdParams) in params.cuh


def element_strides(array) -> tuple[int, ...]:
    """Strides of a CuPy or NumPy array in elements rather than bytes."""
    return tuple(s // array.itemsize for s in array.strides)


def pack_fwd_params(q, k, v, out, lse, softmax_scale: float) -> np.ndarray:
    """One FwdParams struct for CuPy arrays q, k, v, out (BSHD) and lse (batch, heads, seqlen_q)."""
    params = np.zeros(1, dtype=FWD_PARAMS)
    for name, array in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse)):
        params[name] = array.data.ptr
    for name, array in (("q", q), ("k", k), ("v", v), ("o", out)):
        batch, row, head, _ = element_strides(array)
        params[f"{name}_batch_stride"] = batch
        params[f"{name}_row_stride"] = row
        params[f"{name}_head_stride"] = head
    params["heads"] = q.shape[2]
    params["kv_group"] = q.shape[2] // k.shape[2]
    params["seqlen_q"] = q.shape[1]
    params["seqlen_k"] = k.shape[1]
    params["head_dim"] = q.shape[3]
    params["scale_log2"] = softmax_scale * math.log2(math.e)
    return params
