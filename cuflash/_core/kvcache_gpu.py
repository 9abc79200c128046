"""The GPU path of attention_with_kvcache and combine: the plan cached under a key of everything
it reads but pointers, then its launches (plan.KvCachePlan, plan.CombinePlan).

attention_with_kvcache takes its key before the checks, as attention does (plan.py), so that a
decoding loop's repeated call costs reading its arrays' layouts and pointers, a dictionary look-up
and the launches: the key holds each array's layout as CuPy or torch has it (no DeviceTensor but
q's, for its outputs) and each option as passed, and is formed only where the checks read nothing
else (CuPy arrays or torch CUDA tensors, all of q's framework; validate=False, max_seqlen_q given
with a packed q, options of the plain types of plan.KEY_SCALARS); other calls run the checks
every time.
"""

from __future__ import annotations

from typing import Any

from cuflash._core import checks, interop, plan

__all__ = ["attention_with_kvcache", "combine"]

# The arrays of KvCachePlan.launch's pointers, by argument name; the descales' follow.
_INPUTS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "page_table", "cache_batch_idx", "cache_leftpad",
           "cu_seqlens_q", "rotary_cos", "rotary_sin")
_POINTERS = (*_INPUTS, "descale_k", "descale_v")
# The options that are a number (or None), held in the key, or an array among the others: their
# places among the pointers.
_NUMBER_SLOTS = tuple(_POINTERS.index(name) for name in ("cache_seqlens", "descale_k", "descale_v"))


def attention_with_kvcache(arrays: dict, options: checks.KvOptions) -> Any:
    """``arrays``: the array arguments but cache_seqlens by name, None where not given;
    ``options``: the rest, as passed. The caches' pointers must be 16-byte aligned for a cached
    plan to serve (the checks read that of them), and q's (the plan may read q with cp.async,
    dispatch.kvcache_prefill)."""
    keyed = _unchecked_key(arrays, options)
    if keyed is None:
        return _run_checked(checks.check_kvcache(arrays, *options))
    key, framework, operands = keyed
    q, pointers = operands
    out, lse = plan.run(key, q.device, (pointers[0] | pointers[1] | pointers[2]) % 16 == 0, _prepare,
                        (arrays, options), framework, operands, (None,), (None,), options.return_lse)
    return (out, lse) if options.return_lse else out


def _unchecked_key(arrays: dict, options: checks.KvOptions) -> tuple | None:
    """(key, q's framework, KvCachePlan.launch's operands) of a call whose checks read only what
    the key holds; None for any other call (NumPy or DLPack arrays, frameworks mixed, validate,
    options of other types), which the checks then take in full. The key holds the arrays'
    layouts as the framework has them (interop.layouts_and_pointers): a decoding loop's repeated
    call describes only q, for its outputs."""
    (cache_seqlens, max_seqlen_q, rotary_interleaved, causal, softmax_scale, window, softcap, num_splits, descale_k,
     descale_v, return_lse, validate, dtype) = options
    if (validate is not False or type(causal) is not bool or type(rotary_interleaved) is not bool
            or type(return_lse) is not bool or not checks.plain_window(window)
            or (dtype is not None and type(dtype) is not str)
            or (max_seqlen_q is None and arrays["cu_seqlens_q"] is not None)):
        return None
    scalar = plan.KEY_SCALARS
    for value in (max_seqlen_q, softmax_scale, softcap, num_splits):
        if type(value) not in scalar:
            return None
    values = [arrays.get(name) for name in _POINTERS]
    numbers = [cache_seqlens, descale_k, descale_v]
    for index, slot in enumerate(_NUMBER_SLOTS):
        if type(numbers[index]) not in scalar:
            values[slot], numbers[index] = numbers[index], "array"
    found = interop.layouts_and_pointers(values)
    if found is None:
        return None
    framework, layouts, pointers = found
    key = ("attention_with_kvcache", framework, *layouts, *numbers, max_seqlen_q, softmax_scale, softcap, num_splits,
           rotary_interleaved, causal, window, dtype)
    return key, framework, (interop.describe(values[0], framework, "q"), pointers)


def _operands(tensors: tuple) -> tuple:
    """KvCachePlan.launch's operands of a checked call's tensors (q's DeviceTensor, every pointer)."""
    return tensors[0], tuple(t.ptr if t is not None else 0 for t in tensors)


def _launch_tensors(call: checks.KvCall) -> tuple:
    """The DeviceTensors of a checked call: the inputs (None where not given), then the descale
    arrays (None where scalar, or the cache is 16-bit)."""
    t = call.tensors
    descales = tuple(d if isinstance(d, interop.DeviceTensor) else None for d in (call.descale_k, call.descale_v))
    return (*(t.get(name) for name in _INPUTS), *descales)


def _prepare(arrays: dict, options: checks.KvOptions):
    call = checks.check_kvcache(arrays, *options)
    tensors = _launch_tensors(call)
    return plan.build_kvcache(call, tensors), _operands(tensors), plan.aligned_pointers(tensors[0])


def _run_checked(call: checks.KvCall) -> Any:
    """A checked call's launches, its plan cached under a key of the checked values."""
    tensors = _launch_tensors(call)
    scalar_lengths = call.cache_seqlens if not isinstance(call.cache_seqlens, interop.DeviceTensor) else "array"
    scalar_descales = tuple(d if isinstance(d, float) else None for d in (call.descale_k, call.descale_v))
    key = ("attention_with_kvcache checked", *(x.layout if x is not None else None for x in tensors), scalar_lengths,
           scalar_descales, call.batch, call.max_seqlen_q, call.scale, call.causal, call.window, call.softcap,
           call.rotary_interleaved, call.rotary_per_row, call.num_splits)
    operands = _operands(tensors)
    aligned = plan.aligned_pointers(tensors[0])  # a plan built for an unaligned q serves only that q
    out, lse = plan.run(key, tensors[0].device, aligned, lambda: (plan.build_kvcache(call, tensors), operands, aligned),
                        (), call.framework, operands, (None,), (None,), call.return_lse)
    return (out, lse) if call.return_lse else out


def combine(call: checks.CombineCall) -> Any:
    o, l = call.out_partial, call.lse_partial
    key = ("combine", o.layout, l.layout, call.out_dtype)
    out, lse = plan.run(key, o.device, True, lambda: (plan.build_combine(o, l, call.out_dtype), (o, l), True), (),
                        call.framework, (o, l), (None,), (None,), call.return_lse)
    return (out, lse) if call.return_lse else out
