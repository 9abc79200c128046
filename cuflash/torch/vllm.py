"""vLLM's FlashAttention interface (``vllm.vllm_flash_attn``) and its cascade merge
(``merge_attn_states``) on cuflash's kernels.

A vLLM attention backend imports these names in place of vllm_flash_attn's: one call per layer
for a mixed batch of prefill chunks and decodes over the paged KV cache (``block_table`` with
``seqused_k``), or over packed keys and values (``cu_seqlens_k``). The signatures are vLLM's;
an argument cuflash does not support raises NotImplementedError naming it, never ignored in a way
that changes the result. CUDA tensors run the kernels on torch's current stream, CPU tensors the
CPU path. Not differentiable: vLLM's calls are inference.

The paged form is :func:`cuflash.attention_with_kvcache` without an append (vLLM has written the
step's keys and values into the cache already): sequence ``b`` attends to its first
``seqused_k[b]`` cached positions, causal masks and windows aligned bottom-right per sequence.
A batch whose max_seqlen_q reaches ``dispatch.KV_PREFILL_ROWS`` runs two kernels, the forward over
the cache for its long chunks and kv_decode for its other sequences, each leaving the other's on
the device (no synchronisation); shorter batches run the split-KV decode kernel and its combine. The packed form is
:func:`cuflash.attention_varlen`.
"""

from __future__ import annotations

from typing import Optional

import torch

import cuflash
from cuflash._core.device import gpu_unavailable
from cuflash.torch._bridge import check_tensors, direct

__all__ = ["DEFAULT_FA_VERSION", "fa_version_unsupported_reason", "flash_attn_varlen_func", "get_scheduler_metadata",
           "is_fa_version_supported", "merge_attn_states"]

# vLLM picks a version by asking is_fa_version_supported; cuflash serves both interfaces' calls
# with the same kernels.
DEFAULT_FA_VERSION = 3
SERVED_VERSIONS = (2, 3)

_VARLEN_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "out", "s_aux",
                   "alibi_slopes", "k_descale", "v_descale")


def fa_version_unsupported_reason(fa_version: int, device=None) -> Optional[str]:
    """Why ``fa_version`` cannot run here, or None. cuflash serves versions 2 and 3 on every GPU it
    runs on (compute capability 8.0 and newer) and on the CPU path; version 4 (FlashAttention's
    Blackwell interface) is not served."""
    if fa_version not in (2, 3, 4):
        raise ValueError(f"fa_version: expected 2, 3 or 4, got {fa_version!r}")
    if fa_version not in SERVED_VERSIONS:
        return f"cuflash serves FlashAttention versions {SERVED_VERSIONS}, not {fa_version}"
    reason = gpu_unavailable()
    if reason is not None:
        return f"no usable GPU for cuflash's kernels: {reason}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"cuflash's kernels need compute capability 8.0 or newer, this GPU has {major}.{minor}"
    return None


def is_fa_version_supported(fa_version: int, device=None) -> bool:
    """Whether vLLM may call this module with ``fa_version`` (see fa_version_unsupported_reason)."""
    return fa_version_unsupported_reason(fa_version, device) is None


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens: torch.Tensor, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k_new: Optional[torch.Tensor] = None,
                           cache_leftpad: Optional[torch.Tensor] = None, page_size: Optional[int] = None,
                           max_seqlen_k_new=0, causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0) -> torch.Tensor:
    """FlashAttention-3's scheduler metadata, for vLLM's calls to pass unchanged: an int32 tensor on
    cache_seqlens' device, (batch_size + 1,), entry 0 the num_splits asked for (0: chosen by the
    plan), the others 0.

    FlashAttention-3 computes a split plan from the lengths and needs it fixed before a CUDA graph
    is captured. cuflash's plan is a function of a call's static arguments only (shapes,
    max_seqlen_q, the cache's capacity, num_splits), never of the lengths in device memory: a graph
    captured at some maxima replays exactly at any lengths within them, and an eager call with the
    same static arguments runs the same plan, bit for bit. So flash_attn_varlen_func accepts this
    tensor (or vLLM's copy of it in a persistent buffer) without reading it. The arguments are
    checked as FlashAttention-3 takes them."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch tensor, got {type(cache_seqlens).__name__}")
    refused = {"cu_seqlens_k_new": cu_seqlens_k_new is not None, "cache_leftpad": cache_leftpad is not None,
               "max_seqlen_k_new": max_seqlen_k_new != 0, "sm_margin": sm_margin != 0,
               "headdim_v != headdim": headdim_v not in (None, headdim)}
    for name, used in refused.items():
        if used:
            raise NotImplementedError(f"get_scheduler_metadata: cuflash does not support {name} yet")
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("headdim", headdim),
                        ("num_splits", num_splits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name}: expected a non-negative int, got {value!r}")
    if num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_kv: ({num_heads_kv}) must divide num_heads_q ({num_heads_q})")
    metadata = torch.zeros((batch_size + 1,), dtype=torch.int32, device=cache_seqlens.device)
    metadata[0] = num_splits
    return metadata


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                           k_descale=None, v_descale=None, num_splits: int = 0, fa_version: int = DEFAULT_FA_VERSION,
                           s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None):
    """vLLM's ``flash_attn_varlen_func``: q (total_q, heads, head_dim) packed by ``cu_seqlens_q``;
    returns out (total_q, heads, head_dim_v), written into ``out`` when given (q's shape and dtype,
    contiguous), or (out, softmax_lse) with ``return_softmax_lse``, lse float32 (heads, total_q).

    Keys and values, one of:

    - the paged cache: k, v (num_blocks, block_size, heads_kv, head_dim), any strides with a
      contiguous last dimension (vLLM's NHD or HND pools, views of one tensor), ``block_table``
      int32 (num_seqs, max_blocks) (entries may repeat across sequences), ``seqused_k`` int32
      (num_seqs,) the cached length of each sequence, the step's tokens included;
    - one cache row per sequence: k, v (num_seqs, seqlen_k, heads_kv, head_dim) with ``seqused_k``;
    - packed keys: k, v (total_k, heads_kv, head_dim) with ``cu_seqlens_k``.

    ``causal`` aligns each sequence's mask bottom-right; ``window_size`` (left, right), ``softcap``,
    ``alibi_slopes`` ((heads,) or (num_seqs, heads), float32), ``s_aux`` (gpt-oss's attention
    sinks, (heads,)) as cuflash's. An FP8 cache (float8_e4m3fn pools) takes ``k_descale`` and
    ``v_descale`` (num_seqs, heads_kv) float32 (vLLM's expanded per-layer scales are made
    contiguous here), and a float8_e4m3fn q its ``q_descale`` (FP8 attention, bf16 out); packed
    FP8 keys take FP8 queries, as cuflash.attention_varlen. ``num_splits``: key splits of the
    decode kernel (0 chooses; the packed form has none). ``scheduler_metadata``:
    get_scheduler_metadata's tensor, not read (see there).
    ``deterministic`` changes nothing: the forward is deterministic.

    Raises ValueError as vLLM does for cu_seqlens_k and seqused_k both or neither given and for a
    block_table without seqused_k; NotImplementedError for q_v, dropout_p > 0, return_attn_probs,
    context parallelism (cp_world_size > 1) and fa_version 4.
    """
    check_tensors(_VARLEN_TENSORS, (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, s_aux,
                                     alibi_slopes, k_descale, v_descale), 3)
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("cu_seqlens_k, seqused_k: pass one of them (packed keys, or the cached lengths)")
    if cu_seqlens_k is not None and seqused_k is not None:
        raise ValueError("cu_seqlens_k, seqused_k: pass only one of them")
    if block_table is not None and seqused_k is None:
        raise ValueError("block_table: needs seqused_k, each sequence's cached length")
    if fa_version not in SERVED_VERSIONS:
        raise NotImplementedError(f"fa_version: cuflash serves FlashAttention versions {SERVED_VERSIONS}, not "
                                  f"{fa_version!r}")
    refused = {"q_v": q_v is not None, "dropout_p": dropout_p != 0.0, "return_attn_probs": bool(return_attn_probs),
               "cp_world_size": cp_world_size != 1, "cp_tot_seqused_k": cp_tot_seqused_k is not None}
    for name, used in refused.items():
        if used:
            raise NotImplementedError(f"flash_attn_varlen_func: cuflash does not support {name} here")
    if scheduler_metadata is not None and (not isinstance(scheduler_metadata, torch.Tensor)
                                           or scheduler_metadata.dtype != torch.int32):
        raise TypeError("scheduler_metadata: expected get_scheduler_metadata's int32 tensor")
    if window_size is None:
        window = (-1, -1)
    elif len(window_size) != 2:
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}")
    else:
        window = (int(window_size[0]), int(window_size[1]))
    q_descale, k_descale, v_descale = (d.contiguous() if isinstance(d, torch.Tensor) else d
                                       for d in (q_descale, k_descale, v_descale))
    options = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                   return_lse=return_softmax_lse, out=out, sinks=s_aux, alibi_slopes=alibi_slopes)
    if seqused_k is not None:
        result = direct(cuflash.attention_with_kvcache, q, k, v, cache_seqlens=seqused_k, page_table=block_table,
                        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=int(max_seqlen_q), num_splits=num_splits,
                        descale_k=k_descale, descale_v=v_descale, descale_q=q_descale, **options)
    else:
        result = direct(cuflash.attention_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                        int(max_seqlen_k), validate=False, descale_q=q_descale, descale_k=k_descale,
                        descale_v=v_descale, **options)
    if out is None:
        return result
    # CPU tensors come back as new tensors over out's memory: answer with out itself, as vLLM's does.
    return (out, result[1]) if return_softmax_lse else out


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                      output_lse: Optional[torch.Tensor] = None) -> None:
    """vLLM's ``merge_attn_states`` (cascade attention): the prefix's and the suffix's partial
    results merged through their LSEs into ``output`` (and ``output_lse`` where given), in place.
    Outputs (num_tokens, num_heads, head_size), LSEs float32 (num_heads, num_tokens) as
    flash_attn_varlen_func returns them; an LSE of +inf drops its part, as vLLM's kernel does.
    :func:`cuflash.merge_states` on (tokens, heads) views of the LSEs, one kernel."""
    check_tensors(("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse"),
                  (output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse), 5)
    direct(cuflash.merge_states, prefix_output, prefix_lse.t(), suffix_output, suffix_lse.t(), out=output,
           out_lse=output_lse.t() if output_lse is not None else None)

