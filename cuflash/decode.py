"""The GPU path of attention_with_kvcache and combine (kvcache.py checks the arguments first):
the plan cached under a key of everything it reads but pointers, then its launches
(plan.KvCachePlan, plan.CombinePlan)."""

from __future__ import annotations

from typing import Any

from cuflash import checks, interop, plan

__all__ = ["attention_with_kvcache", "combine"]

# KvCachePlan.launch's tensors, by argument name.
_INPUTS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "page_table", "cache_batch_idx", "cache_leftpad",
           "cu_seqlens_q", "rotary_cos", "rotary_sin")


def attention_with_kvcache(call: checks.KvCall) -> Any:
    t = call.tensors
    # An FP8 cache's descale arrays follow the named inputs; scalars (and 16-bit caches) give None.
    descales = tuple(d if isinstance(d, interop.DeviceTensor) else None for d in (call.descale_k, call.descale_v))
    tensors = (*(t.get(name) for name in _INPUTS), *descales)
    scalar_lengths = call.cache_seqlens if not isinstance(call.cache_seqlens, interop.DeviceTensor) else "array"
    scalar_descales = tuple(d if isinstance(d, float) else None for d in (call.descale_k, call.descale_v))
    key = ("attention_with_kvcache", *(x.layout if x is not None else None for x in tensors), scalar_lengths,
           scalar_descales, call.batch, call.max_seqlen_q, call.scale, call.causal, call.window, call.softcap,
           call.rotary_interleaved, call.rotary_per_row, call.num_splits)
    out, lse = plan.run(key, tensors[0].device, True, _prepare, (call, tensors), call.framework, tensors, (None,),
                        (None,), call.return_lse)
    return (out, lse) if call.return_lse else out


def _prepare(call: checks.KvCall, tensors: tuple):
    return plan.build_kvcache(call, tensors), tensors, True


def combine(call: checks.CombineCall) -> Any:
    o, l = call.out_partial, call.lse_partial
    key = ("combine", o.layout, l.layout, call.out_dtype)
    out, lse = plan.run(key, o.device, True, lambda: (plan.build_combine(o, l, call.out_dtype), (o, l), True), (),
                        call.framework, (o, l), (None,), (None,), call.return_lse)
    return (out, lse) if call.return_lse else out
