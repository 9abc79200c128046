"""DeepSeek's multi-head latent attention (MLA) decoding over a paged latent cache.

NumPy inputs run the float64 reference (reference_kvcache.mla_decode_reference); GPU inputs run
the decode kernel (cuda_src/common/mla_decode.cuh: wgmma on Hopper, mma.sync elsewhere) over key
splits and kv_combine, planned through plan.MlaPlan.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuflash._core import checks, interop, plan
from cuflash._cpu.reference_kvcache import mla_decode_reference

__all__ = ["mla_decode"]


def mla_decode(
    q: Any,
    kv_cache: Any,
    page_table: Any,
    cache_seqlens: Any,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = True,
    num_splits: int = 0,
    descale_kv: Any = None,
    return_lse: bool = False,
    validate: bool = False,
    dtype: str | None = None,
    q_rope: Any = None,
    kv_rope_cache: Any = None,
) -> Any:
    """Multi-head latent attention decoding (FlashMLA's ``flash_mla_with_kvcache``): every query head
    attends one shared latent head whose first ``head_dim_v`` dims are also its values.

    Parameters
    ----------
    q : array, (batch, seqlen_q, heads, head_dim)
        DeepSeek-V3: head_dim 576 (512 latent + 64 rotary dims), heads 16..128, seqlen_q 1..8
        (speculative decoding's extra tokens). float16 or bfloat16 on the GPU (CuPy, torch,
        DLPack), which takes head_dim 576 with head_dim_v 512; NumPy float16, bfloat16, float32 or
        float64 on the CPU path, any head_dim_v <= head_dim.
    kv_cache : array, (num_pages, page_size, 1, head_dim)
        The paged latent cache, any page_size from 1: the keys, and in its first head_dim_v dims
        the values (read once for both). q's dtype, or FP8 e4m3 (torch float8_e4m3fn, NumPy
        ml_dtypes.float8_e4m3fn, or uint8 bytes with ``dtype="e4m3"``) holding ``value /
        descale_kv``. Last dimension contiguous; on the GPU 16-byte aligned.
    page_table : int32 array (batch, max_pages)
        Page of each block of page_size positions of each sequence.
    cache_seqlens : int32 array (batch,)
        Keys of each sequence (0 gives out 0 and lse -inf).
    head_dim_v : int
        The values' dims, the first of the latent head's.
    softmax_scale : float, optional
        Default 1 / sqrt(head_dim).
    causal : bool
        With seqlen_q > 1, query token t sees the keys up to position cache_seqlens - seqlen_q + t
        (the tokens being decoded are the sequence's last); no effect for seqlen_q = 1.
    num_splits : int
        Key splits per sequence on the GPU, merged by the combine kernel; 0 chooses from the shapes
        and the SM count. Ignored by the CPU path (the result is the same).
    descale_kv : float or float32 array (batch, 1), optional
        FP8 cache only (default 1): the cache holds ``value / descale_kv``. Device arrays' values
        are not checked.
    return_lse : bool
        Also return lse, float32 (batch, heads, seqlen_q).
    validate : bool
        GPU arrays: copy page_table and cache_seqlens to the host and check their values (lengths
        within the table's capacity, the pages used in range): a synchronisation. NumPy arrays are
        always checked.
    dtype : str, optional
        ``"e4m3"``: kv_cache (and kv_rope_cache) are uint8 arrays of e4m3 bytes. None: their own
        dtype.
    q_rope, kv_rope_cache : arrays, optional
        The split form (FlashAttention-3's ``qv``): q and kv_cache hold the latent dims (512, the
        values), these the rotary ones (64), q_rope (batch, seqlen_q, heads, 64) in q's dtype and
        kv_rope_cache (num_pages, page_size, 1, 64) in kv_cache's. The same attention as the
        single array [q, q_rope] against [kv_cache, kv_rope_cache], by the same kernel; head_dim_v
        is then kv_cache's head dim and the default scale 1 / sqrt(512 + 64).

    Returns
    -------
    out (batch, seqlen_q, heads, head_dim_v) in q's dtype, or (out, lse); in the caller's framework.

    Raises
    ------
    TypeError, ValueError
        Every bad argument, naming it, before anything is launched.
    """
    arrays = {"q": q, "kv_cache": kv_cache, "page_table": page_table, "cache_seqlens": cache_seqlens,
              "q_rope": q_rope, "kv_rope_cache": kv_rope_cache}
    call = checks.check_mla(arrays, head_dim_v, softmax_scale, causal, num_splits, descale_kv, return_lse, validate,
                            dtype)
    if call.framework == "numpy":
        return _on_host(call)
    out, lse = plan.run(None, call.tensors["q"].device, _prepared, (call,), _build, call.framework, (), (None,),
                        (None,), call.return_lse)
    return (out, lse) if call.return_lse else out


def _tensors(call: checks.MlaCall) -> tuple:
    """The DeviceTensors of MlaPlan.launch's pointers: q, kv_cache, cache_seqlens, page_table,
    descale_kv (None where scalar), q_rope and kv_rope_cache (None but in the split form)."""
    t = call.tensors
    descale = call.descale_kv if isinstance(call.descale_kv, interop.DeviceTensor) else None
    return t["q"], t["kv_cache"], t["cache_seqlens"], t["page_table"], descale, t.get("q_rope"), t.get("kv_rope_cache")


def _prepared(call: checks.MlaCall):
    """plan.run's prepare of a checked call: the call, MlaPlan.launch's operands, True (nothing is copied)."""
    tensors = _tensors(call)
    return call, (tensors[0], tuple(x.ptr if x is not None else 0 for x in tensors)), True


def _build(call: checks.MlaCall) -> plan.MlaPlan:
    return plan.build_mla(call, _tensors(call))


def _on_host(call: checks.MlaCall):
    t = call.tensors
    q, kv = t["q"], t["kv_cache"]
    if "q_rope" in t:  # the split form is the single array's attention
        q, kv = np.concatenate([q, t["q_rope"]], axis=-1), np.concatenate([kv, t["kv_rope_cache"]], axis=-1)
    out, lse = mla_decode_reference(q, kv, t["page_table"], t["cache_seqlens"],
                                    head_dim_v=call.head_dim_v, softmax_scale=call.scale, causal=call.causal,
                                    descale_kv=call.descale_kv)
    out = out.astype(t["q"].dtype)
    return (out, lse.astype(np.float32)) if call.return_lse else out
