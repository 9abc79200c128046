"""The CPU path: NumPy in, NumPy out, computed by the float64 reference (cuflash._cpu.reference) and
cast to the inputs' dtype. FP8 inputs are dequantized first (x * descale, in float64) and give
their out_dtype. The callers check the arguments exactly as for the GPU (checks.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from cuflash._core import checks
from cuflash._cpu import reference

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "combine"]

# An FP8 call's out_dtype (checks.Fp8) as the NumPy dtype of its result.
_OUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def _output(result: np.ndarray, lse: np.ndarray, dtype, out, return_lse: bool):
    """The float64 result cast to the inputs' dtype, C-contiguous as the GPU path's (the torch
    ops' fake outputs say so), into ``out`` when given."""
    if out is None:
        out = result.astype(dtype, order="C")
    else:
        out[...] = result.astype(dtype)
    return (out, lse.astype(np.float32)) if return_lse else out


def _gradients(result, given: dict, dtype) -> tuple:
    """The float64 (dq, dk, dv) cast to the inputs' dtype, C-contiguous, into the arrays given by
    name."""
    grads = []
    for name, value in zip(("dq", "dk", "dv"), result):
        if given.get(name) is not None:
            given[name][...] = value.astype(dtype)
            grads.append(given[name])
        else:
            grads.append(value.astype(dtype, order="C"))
    return tuple(grads)


def _forward_inputs(q, k, v, fp8: checks.Fp8 | None, cu_seqlens: tuple = (None, None)):
    """(q, k, v, output dtype): FP8 inputs dequantized in float64 (cu_seqlens: a packed batch's
    (cu_seqlens_q, cu_seqlens_k)), and the dtype the result is cast to."""
    if fp8 is None:
        return q, k, v, q.dtype
    cu_q, cu_k = cu_seqlens
    return (reference.dequantize(q, fp8.descale_q, cu_q), reference.dequantize(k, fp8.descale_k, cu_k),
            reference.dequantize(v, fp8.descale_v, cu_k), _OUT_DTYPES[fp8.out_dtype])


def _dropout_options(dropout: checks.Dropout | None) -> dict:
    """A checked dropout as the references' keyword arguments."""
    return {} if dropout is None else dict(dropout_p=dropout.p, seed=dropout.seed, offset=dropout.offset)


def attention(q, k, v, causal: bool, scale: float, window, softcap: float, return_lse: bool, out,
              fp8: checks.Fp8 | None = None, sinks=None, alibi_slopes=None, dropout: checks.Dropout | None = None,
              mods: checks.Mods | None = None):
    """The blockwise online-softmax algorithm in float64; dropout's mask drawn tile by tile. With
    a score_mod or mask_mod, the naive reference, which evaluates them on whole score matrices."""
    q, k, v, dtype = _forward_inputs(q, k, v, fp8)
    options = dict(causal=causal, softmax_scale=scale, window=window, softcap=softcap, sinks=sinks,
                   alibi_slopes=alibi_slopes, **_dropout_options(dropout))
    if mods is not None:
        result, lse = reference.attention_reference(q, k, v, **options, **_mod_callables(mods, derivative=False))
    else:
        result, lse = reference.attention_blockwise(q, k, v, **options)
    return _output(result, lse, dtype, out, return_lse)


def _mod_callables(mods: checks.Mods, derivative: bool = True) -> dict:
    """The reference's score_mod (and its derivative) and mask_mod callables of checked expressions,
    each evaluated with NumPy over one (batch entry, head)'s scores and positions."""
    def env(b, h, q_idx, kv_idx, score=None):
        return {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, **mods.args}

    found = {}
    if mods.score is not None:
        found["score_mod"] = lambda s, b, h, qi, ki: mods.score.evaluate(env(b, h, qi, ki, s))
        if derivative:
            found["score_mod_derivative"] = lambda s, b, h, qi, ki: mods.score.derivative(env(b, h, qi, ki, s))
    if mods.mask is not None:
        found["mask_mod"] = lambda b, h, qi, ki: mods.mask.evaluate(env(b, h, qi, ki))
    return found


def _with_dsinks(grads: tuple, arrays: dict, sinks) -> tuple:
    """(dq, dk, dv), and dsinks (float32) when there are sinks: from the given out and lse (which
    includes the sink), as the kernels will compute it."""
    if sinks is None:
        return grads
    dsinks = reference.sinks_gradient(arrays["dout"], arrays["out"], arrays["lse"], sinks)
    return (*grads, dsinks.astype(np.float32))


def attention_backward(arrays: dict, causal: bool, scale: float, window, softcap: float, sinks=None,
                       alibi_slopes=None, dropout: checks.Dropout | None = None,
                       mods: checks.Mods | None = None) -> tuple:
    """The gradients of arrays q, k, v, dout, out, lse (by name), into dq, dk, dv where given: P
    recomputed from the given lse and rowsum(dP * P) from the given out, as the kernels do, so
    that a block of a longer attention (a ring's) gets its share of the whole one's gradients.
    With sinks, also dsinks. Dropout regenerates the forward's mask from its seed and offset."""
    q = arrays["q"]
    result = reference.attention_backward_from_lse(arrays["dout"], q, arrays["k"], arrays["v"], arrays["out"],
                                                   arrays["lse"], causal=causal, softmax_scale=scale, window=window,
                                                   softcap=softcap, alibi_slopes=alibi_slopes,
                                                   **_dropout_options(dropout),
                                                   **(_mod_callables(mods) if mods is not None else {}))
    return _with_dsinks(_gradients(result, arrays, q.dtype), arrays, sinks)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, window, softcap: float,
                     return_lse: bool, out, fp8: checks.Fp8 | None = None, seqused_q=None, seqused_k=None,
                     sinks=None, alibi_slopes=None, dropout: checks.Dropout | None = None,
                     mods: checks.Mods | None = None):
    q, k, v, dtype = _forward_inputs(q, k, v, fp8, (cu_seqlens_q, cu_seqlens_k))
    result, lse = reference.attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                                       causal=causal, softmax_scale=scale, window=window,
                                                       softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                                                       **_dropout_options(dropout),
                                                       **(_mod_callables(mods, False) if mods is not None else {}))
    return _output(result, lse, dtype, out, return_lse)


def attention_varlen_backward(arrays: dict, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, window,
                              softcap: float, sinks=None, alibi_slopes=None,
                              dropout: checks.Dropout | None = None, mods: checks.Mods | None = None) -> tuple:
    q = arrays["q"]
    result = reference.attention_varlen_backward_reference(arrays["dout"], q, arrays["k"], arrays["v"], cu_seqlens_q,
                                                           cu_seqlens_k, causal=causal, softmax_scale=scale,
                                                           window=window, softcap=softcap, sinks=sinks,
                                                           alibi_slopes=alibi_slopes, **_dropout_options(dropout),
                                                           **(_mod_callables(mods) if mods is not None else {}))
    grads = _gradients(result[:3], arrays, q.dtype)
    return grads if sinks is None else (*grads, result[3].astype(np.float32))


def attention_with_kvcache(call: checks.KvCall, sinks=None, alibi_slopes=None):
    """A checked NumPy call (checks.KvCall) with its checked sinks and ALiBi slopes: the
    reference's attention, and its appended cache rows copied into the caller's caches (only
    those positions are written)."""
    from cuflash._cpu import reference_kvcache

    t, h = call.tensors, call.host
    q = t["q"]
    cache_seqlens = h.get("cache_seqlens", call.cache_seqlens)
    out, lse, k_new, v_new = reference_kvcache.kvcache_reference(
        q, t["k_cache"], t["v_cache"], t.get("k"), t.get("v"), cache_seqlens=cache_seqlens,
        page_table=h.get("page_table"), cache_batch_idx=h.get("cache_batch_idx"),
        cache_leftpad=h.get("cache_leftpad"), cu_seqlens_q=h.get("cu_seqlens_q"), rotary_cos=t.get("rotary_cos"),
        rotary_sin=t.get("rotary_sin"), rotary_interleaved=call.rotary_interleaved, causal=call.causal,
        softmax_scale=call.scale, window=call.window, softcap=call.softcap, descale_k=call.descale_k,
        descale_v=call.descale_v, sinks=sinks, alibi_slopes=alibi_slopes, rotary_seqlens=h.get("rotary_seqlens"),
        cu_seqlens_k_new=h.get("cu_seqlens_k_new"), descale_q=call.descale_q)
    if "k" in t:
        cu = h.get("cu_seqlens_q")
        for b in range(call.batch):
            cached = int(cache_seqlens if np.ndim(cache_seqlens) == 0 else cache_seqlens[b])
            cu_new = h.get("cu_seqlens_k_new")
            n_new = (int(cu_new[b + 1] - cu_new[b]) if cu_new is not None else int(cu[b + 1] - cu[b]) if call.varlen
                     else call.seqlen_new)
            slots = reference_kvcache.cache_slots(b, cached + np.arange(n_new), h.get("page_table"),
                                                  h.get("cache_batch_idx"), t["k_cache"].shape[1])
            t["k_cache"][slots] = k_new[slots]
            t["v_cache"][slots] = v_new[slots]
    if "out" in t:
        t["out"][...] = out
        out = t["out"]
    else:
        out = out.astype(ml_dtypes.bfloat16 if call.descale_q is not None else q.dtype)  # an e4m3 q's: bf16
    if not call.varlen:
        lse = lse.reshape(call.batch, call.heads, q.shape[1])
    return (out, lse.astype(np.float32)) if call.return_lse else out


def combine(call: checks.CombineCall):
    """A checked NumPy combine (checks.CombineCall) by the float64 reference."""
    from cuflash._cpu import reference_kvcache

    out, lse = reference_kvcache.combine_reference(call.out_partial, call.lse_partial)
    out = out.astype(_COMBINE_DTYPES[call.out_dtype])
    return (out, lse.astype(np.float32)) if call.return_lse else out


def merge_states(call: checks.MergeCall):
    """A checked NumPy merge_states (checks.MergeCall) by the float64 combine reference of the two
    parts, an LSE of +inf counting as -inf (its part dropped), as the kernel does; written into
    out and out_lse where given."""
    from cuflash._cpu import reference_kvcache

    t = call.tensors
    lses = np.stack([t["lse_a"], t["lse_b"]]).astype(np.float64)
    lses[np.isposinf(lses)] = -np.inf
    out, lse = reference_kvcache.combine_reference(np.stack([t["out_a"], t["out_b"]]), lses)
    results = []
    for name, value, dtype in (("out", out, t["out_a"].dtype), ("out_lse", lse, np.float32)):
        if name in t:
            t[name][...] = value
            results.append(t[name])
        else:
            results.append(value.astype(dtype))
    return tuple(results) if call.return_lse else results[0]


_COMBINE_DTYPES = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
                   "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
