"""The CPU path: NumPy in, NumPy out, computed by the float64 reference (cuflash.reference) and
cast to the inputs' dtype. The callers check the arguments exactly as for the GPU (checks.py)."""

from __future__ import annotations

import numpy as np

from cuflash import reference

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward"]


def _output(result: np.ndarray, lse: np.ndarray, dtype, out, return_lse: bool):
    """The float64 result cast to the inputs' dtype, into ``out`` when given."""
    if out is None:
        out = result.astype(dtype)
    else:
        out[...] = result.astype(dtype)
    return (out, lse.astype(np.float32)) if return_lse else out


def _gradients(result, given: dict, dtype) -> tuple:
    """The float64 (dq, dk, dv) cast to the inputs' dtype, into the arrays given by name."""
    grads = []
    for name, value in zip(("dq", "dk", "dv"), result):
        if given.get(name) is not None:
            given[name][...] = value.astype(dtype)
            grads.append(given[name])
        else:
            grads.append(value.astype(dtype))
    return tuple(grads)


def attention(q, k, v, causal: bool, scale: float, window, softcap: float, return_lse: bool, out):
    """The blockwise online-softmax algorithm in float64."""
    result, lse = reference.attention_blockwise(q, k, v, causal=causal, softmax_scale=scale, window=window,
                                                softcap=softcap)
    return _output(result, lse, q.dtype, out, return_lse)


def attention_backward(arrays: dict, causal: bool, scale: float, window, softcap: float) -> tuple:
    """The reference gradients of arrays q, k, v, dout (by name), into dq, dk, dv where given."""
    q = arrays["q"]
    result = reference.attention_backward_reference(arrays["dout"], q, arrays["k"], arrays["v"], causal=causal,
                                                    softmax_scale=scale, window=window, softcap=softcap)
    return _gradients(result, arrays, q.dtype)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, window, softcap: float,
                     return_lse: bool, out):
    result, lse = reference.attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                                       softmax_scale=scale, window=window, softcap=softcap)
    return _output(result, lse, q.dtype, out, return_lse)


def attention_varlen_backward(arrays: dict, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, window,
                              softcap: float) -> tuple:
    q = arrays["q"]
    result = reference.attention_varlen_backward_reference(arrays["dout"], q, arrays["k"], arrays["v"], cu_seqlens_q,
                                                           cu_seqlens_k, causal=causal, softmax_scale=scale,
                                                           window=window, softcap=softcap)
    return _gradients(result, arrays, q.dtype)
