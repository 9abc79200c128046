"""The GPU path of attention_with_kvcache and combine: plan.run with a checked call (checks.KvCall,
checks.CombineCall), then its launches (plan.KvCachePlan, plan.CombinePlan).

attention_with_kvcache also gives plan.run the call's signature, so that a decoding loop's
repeated call costs reading its arrays' layouts and pointers, a dictionary look-up and the
launches: the signature holds each array's layout as CuPy or torch has it (no DeviceTensor but
q's, for its outputs) and each option as passed, and is formed only where the checks read nothing
else (CuPy arrays or torch CUDA tensors, all of q's framework; validate=False, max_seqlen_q given
with a packed q, options of the plain types of plan.SIGNATURE_SCALARS, 16-byte-aligned q and
caches); other calls run the checks every time.
"""

from __future__ import annotations

from typing import Any

from cuflash._core import checks, interop, plan

__all__ = ["attention_with_kvcache", "attention_with_kvcache_checked", "combine", "merge_states"]

# The pointers of KvCachePlan.launch by argument name: the arrays, then the descales'.
_POINTERS = (*checks.KV_ARRAYS, "descale_k", "descale_v", "descale_q")
_OUT = _POINTERS.index("out")
# The options that are a number (or None), held in the signature, or an array among the others:
# their places among the pointers.
_NUMBER_SLOTS = tuple(_POINTERS.index(name) for name in ("cache_seqlens", "descale_k", "descale_v", "descale_q"))


def attention_with_kvcache(arrays: dict, options: checks.KvOptions) -> Any:
    """``arrays``: the array arguments but cache_seqlens by name, None where not given;
    ``options``: the rest, as passed. The caches' pointers must be 16-byte aligned for a
    signature to serve (the checks read that of them), and q's (the plan may read q with cp.async,
    dispatch.kvcache_prefill)."""
    found = _signature(arrays, options)
    if found is None:
        call = checks.check_kvcache(arrays, *options)
        out, lse = plan.run(None, call.tensors["q"].device, _prepared, (call,), _build, call.framework, (),
                            (arrays["out"],), (None,), call.return_lse)
        return (out, lse) if call.return_lse else out
    signature, framework, operands = found
    out, lse = plan.run(signature, operands[0].device, _checked, (arrays, options), _build, framework, operands,
                        (arrays["out"],), (None,), options.return_lse)
    return (out, lse) if options.return_lse else out


def attention_with_kvcache_checked(call: checks.KvCall, bias: checks.Bias) -> Any:
    """attention_with_kvcache of a call checked already, with sinks or ALiBi slopes (``bias``;
    the call's alibi their stride): no signature, whose layouts would have to hold theirs."""
    out = call.tensors.get("out")
    out, lse = plan.run(None, call.tensors["q"].device, _prepared, (call,), _build, call.framework, (),
                        (out.native if out is not None else None,), (None,), call.return_lse, plan.NO_LENGTHS, bias)
    return (out, lse) if call.return_lse else out


def _signature(arrays: dict, options: checks.KvOptions) -> tuple | None:
    """(signature, q's framework, KvCachePlan.launch's operands) of a call whose checks read only
    what the signature holds; None for any other call (NumPy or DLPack arrays, frameworks mixed,
    validate, options of other types, pointers not 16-byte aligned), which the checks then take in
    full. The signature holds the arrays' layouts as the framework has them
    (interop.layouts_and_pointers): a decoding loop's repeated call describes only q, for its
    outputs."""
    (cache_seqlens, max_seqlen_q, rotary_interleaved, causal, softmax_scale, window, softcap, num_splits, descale_k,
     descale_v, return_lse, validate, dtype, descale_q) = options
    if (validate is not False or type(causal) is not bool or type(rotary_interleaved) is not bool
            or type(return_lse) is not bool or not checks.plain_window(window)
            or (dtype is not None and type(dtype) is not str)
            or (max_seqlen_q is None and arrays["cu_seqlens_q"] is not None)):
        return None
    scalar = plan.SIGNATURE_SCALARS
    for value in (max_seqlen_q, softmax_scale, softcap, num_splits):
        if type(value) not in scalar:
            return None
    values = [arrays.get(name) for name in _POINTERS]
    numbers = [cache_seqlens, descale_k, descale_v, descale_q]
    for index, slot in enumerate(_NUMBER_SLOTS):
        if type(numbers[index]) not in scalar:
            values[slot], numbers[index] = numbers[index], "array"
    found = interop.layouts_and_pointers(values)
    if found is None:
        return None
    framework, layouts, pointers = found
    if (pointers[0] | pointers[1] | pointers[2] | pointers[_OUT]) % 16:
        return None
    signature = ("attention_with_kvcache", framework, *layouts, *numbers, max_seqlen_q, softmax_scale, softcap,
                 num_splits, rotary_interleaved, causal, window, dtype)
    return signature, framework, (interop.describe(values[0], framework, "q"), pointers)


def _checked(arrays: dict, options: checks.KvOptions):
    return _prepared(checks.check_kvcache(arrays, *options))


def _prepared(call: checks.KvCall):
    """plan.run's prepare of a checked call: the call, KvCachePlan.launch's operands (q's
    DeviceTensor, every pointer) and True (nothing is copied)."""
    tensors = _launch_tensors(call)
    return call, (tensors[0], tuple(t.ptr if t is not None else 0 for t in tensors)), True


def _launch_tensors(call: checks.KvCall) -> tuple:
    """The DeviceTensors of a checked call: the arrays (None where not given), then the descale
    arrays (None where scalar, or the cache or q is 16-bit)."""
    t = call.tensors
    descales = tuple(d if isinstance(d, interop.DeviceTensor) else None
                     for d in (call.descale_k, call.descale_v, call.descale_q))
    return (*(t.get(name) for name in checks.KV_ARRAYS), *descales)


def _build(call: checks.KvCall) -> plan.KvCachePlan:
    return plan.build_kvcache(call, _launch_tensors(call))


def combine(call: checks.CombineCall) -> Any:
    out, lse = plan.run(None, call.out_partial.device, _combine_operands, (call,), plan.build_combine, call.framework,
                        (), (None,), (None,), call.return_lse)
    return (out, lse) if call.return_lse else out


def merge_states(call: checks.MergeCall) -> Any:
    t = call.tensors
    given = tuple(t[name].native if name in t else None for name in ("out", "out_lse"))
    out, lse = plan.run(None, t["out_a"].device, _merge_operands, (call,), plan.build_merge, call.framework, (),
                        given, (t.get("out"), t.get("out_lse")), call.return_lse)
    return (out, lse) if call.return_lse else out


def _merge_operands(call: checks.MergeCall):
    t = call.tensors
    return call, tuple(t[name] for name in ("out_a", "lse_a", "out_b", "lse_b")), True


def _combine_operands(call: checks.CombineCall):
    return call, (call.out_partial, call.lse_partial), True
