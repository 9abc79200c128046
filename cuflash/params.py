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
_LOG2E = math.log2(math.e)


def pack_fwd_params(q, k, v, out, lse, softmax_scale: float) -> np.ndarray:
    """One FwdParams struct for DeviceTensors q, k, v, out (BSHD) and lse (batch, heads, seqlen_q).

    Built from one tuple in a single NumPy call: per-field assignment costs microseconds each,
    which a launch path cannot afford.
    """
    strides = [s for t in (q, k, v, out) for s in t.strides[:3]]
    return np.array(
        [(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, *strides, q.shape[2], q.shape[2] // k.shape[2],
          q.shape[1], k.shape[1], q.shape[3], softmax_scale * _LOG2E)],
        dtype=FWD_PARAMS,
    )
