"""PyTorch integration: differentiable attention and flash-attn's entry point.

``cuflash.torch.attention`` is a ``torch.library.custom_op`` pair (forward, backward) with fake
implementations and a registered autograd formula, so it trains like any op and traces under
``torch.compile(fullgraph=True)`` without a graph break. CUDA tensors run the kernels; CPU tensors
run cuflash's CPU path, as NumPy arrays do (the float64 reference, cast to the inputs' dtype).
``flash_attn_func`` takes flash-attn's signature and return convention, so
``from cuflash.torch import flash_attn_func`` replaces ``from flash_attn import flash_attn_func``,
and ``flash_attn_varlen_func`` its packed-batch twin (``attention_varlen`` the cuflash-style one);
``flash_attn_with_kvcache`` and ``flash_attn_combine`` are FlashAttention-3's inference entry
points (forward only, the caches updated in place, called directly rather than as custom ops);
arguments cuflash does not support yet raise NotImplementedError naming them, never silently
ignored. ``cuflash.torch.distributed.ring_attention`` is the attention of a sequence sharded
across the processes of a ``torch.distributed`` group (context parallelism).
"""

# No `from __future__ import annotations`: custom_op reads the signature's real types.
import math
from typing import Optional

import numpy as np
import torch

import cuflash
from cuflash._core import checks
from cuflash.torch._bridge import check_tensors, direct

__all__ = ["attention", "attention_varlen", "distributed", "flash_attn_combine", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]


# The tensor arguments of the entry points below, in check_tensors's order: required, then optional.
_QKV = ("q", "k", "v", "sinks", "alibi_slopes")
_PACKED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "sinks", "alibi_slopes")
_KVCACHE = ("q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad",
            "page_table", "cu_seqlens_q", "sinks", "rotary_seqlens", "cu_seqlens_k_new")


def _on_host(body):
    """``body`` for CPU tensors (a custom op's CPU kernel), through direct."""

    def run(*args):
        return direct(body, *args)

    return run


def _output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty output for a fake op: q's shape with v's head_dim, q's dtype and device."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _op(name: str, body):
    """The custom op ``name``: ``body`` on CUDA tensors, and on CPU tensors through _on_host."""
    op = torch.library.custom_op(name, body, mutates_args=(), device_types="cuda")
    op.register_kernel("cpu", _on_host(body))
    return op


# Fixed-length batches (batch, seqlen, heads, head_dim). deterministic only shapes the backward;
# it is an input of the forward op so that autograd's context receives it.
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                       window_left: int, window_right: int, softcap: float,
                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=(window_left, window_right),
                             softcap=softcap, return_lse=True)


_forward = _op("cuflash::attention_forward", _attention_forward)


@_forward.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, deterministic):
    return _output_like(q, v), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int,
                        softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                      window=(window_left, window_right), softcap=softcap, deterministic=deterministic)


_backward = _op("cuflash::attention_backward", _attention_backward)


@_backward.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Packed batches (total_tokens, heads, head_dim) with int32 cumulative lengths.
def _attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                              softmax_scale: float, window_left: int, window_right: int, softcap: float,
                              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap,
                                    return_lse=True)


_varlen_forward = _op("cuflash::attention_varlen_forward", _attention_varlen_forward)


@_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
      window_right, softcap, deterministic):
    return _output_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


# The used prefix of each packed sequence (seqused_q, seqused_k), FlashAttention-3's.
def _attention_varlen_used_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],
                                   seqused_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                                   causal: bool, softmax_scale: float, window_left: int, window_right: int,
                                   softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap,
                                    return_lse=True, seqused_q=seqused_q, seqused_k=seqused_k)


_varlen_used_forward = _op("cuflash::attention_varlen_used_forward", _attention_varlen_used_forward)


@_varlen_used_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, deterministic):
    return _output_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _attention_varlen_used_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],
                                    seqused_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                                    causal: bool, softmax_scale: float, window_left: int, window_right: int,
                                    softcap: float, deterministic: bool
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                             window=(window_left, window_right), softcap=softcap,
                                             deterministic=deterministic, seqused_q=seqused_q, seqused_k=seqused_k)


_varlen_used_backward = _op("cuflash::attention_varlen_used_backward", _attention_varlen_used_backward)


@_varlen_used_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                               softmax_scale: float, window_left: int, window_right: int, softcap: float,
                               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                             window=(window_left, window_right), softcap=softcap,
                                             deterministic=deterministic)


_varlen_backward = _op("cuflash::attention_varlen_backward", _attention_varlen_backward)


@_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Attention sinks and ALiBi: ops of their own, so that the ops above keep their schemas and their
# backward its three outputs. The backward's fourth output is dsinks, float32 (heads,), or (0,)
# without sinks (an op returns tensors, never None).
def _dsinks_or_empty(grads: tuple, q) -> tuple:
    """cuflash's (dq, dk, dv[, dsinks]) with an empty float32 dsinks where there are no sinks, in
    q's framework (NumPy on the CPU path, torch otherwise)."""
    if len(grads) == 4:
        return grads
    empty = np.zeros(0, np.float32) if isinstance(q, np.ndarray) else q.new_zeros(0, dtype=torch.float32)
    return (*grads, empty)


def _dsinks_like(q: torch.Tensor, sinks: Optional[torch.Tensor], heads: int) -> torch.Tensor:
    return q.new_empty((heads if sinks is not None else 0,), dtype=torch.float32)


def _attention_biased_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                              alibi_slopes: Optional[torch.Tensor], causal: bool, softmax_scale: float,
                              window_left: int, window_right: int, softcap: float,
                              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=(window_left, window_right),
                             softcap=softcap, return_lse=True, sinks=sinks, alibi_slopes=alibi_slopes)


_biased_forward = _op("cuflash::attention_biased_forward", _attention_biased_forward)


@_biased_forward.register_fake
def _(q, k, v, sinks, alibi_slopes, causal, softmax_scale, window_left, window_right, softcap, deterministic):
    return _output_like(q, v), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _attention_biased_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor],
                               alibi_slopes: Optional[torch.Tensor], causal: bool, softmax_scale: float,
                               window_left: int, window_right: int, softcap: float,
                               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _dsinks_or_empty(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                       softmax_scale=softmax_scale, window=(window_left, window_right),
                                                       softcap=softcap, deterministic=deterministic, sinks=sinks,
                                                       alibi_slopes=alibi_slopes), q)


_biased_backward = _op("cuflash::attention_biased_backward", _attention_biased_backward)


@_biased_backward.register_fake
def _(dout, q, k, v, out, lse, sinks, alibi_slopes, causal, softmax_scale, window_left, window_right, softcap,
      deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _dsinks_like(q, sinks, q.shape[2])


def _attention_varlen_biased_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                     cu_seqlens_k: torch.Tensor, sinks: Optional[torch.Tensor],
                                     alibi_slopes: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                                     causal: bool, softmax_scale: float, window_left: int, window_right: int,
                                     softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap,
                                    return_lse=True, sinks=sinks, alibi_slopes=alibi_slopes)


_varlen_biased_forward = _op("cuflash::attention_varlen_biased_forward", _attention_varlen_biased_forward)


@_varlen_biased_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, deterministic):
    return _output_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _attention_varlen_biased_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                      cu_seqlens_k: torch.Tensor, sinks: Optional[torch.Tensor],
                                      alibi_slopes: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                                      causal: bool, softmax_scale: float, window_left: int, window_right: int,
                                      softcap: float, deterministic: bool
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _dsinks_or_empty(cuflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        sinks=sinks, alibi_slopes=alibi_slopes), q)


_varlen_biased_backward = _op("cuflash::attention_varlen_biased_backward", _attention_varlen_biased_backward)


@_varlen_biased_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _dsinks_like(q, sinks, q.shape[1])


def _register_autograd(forward, backward, tensor_inputs: int, sinks_input: int | None = None) -> None:
    """Autograd for a forward op whose first three inputs are q, k, v and whose first
    ``tensor_inputs`` inputs are tensors (or None): the backward op takes (dout, q, k, v, out, lse),
    the other tensor inputs, then the forward's non-tensor inputs. With ``sinks_input`` (the
    index of the sinks input) the backward op also returns dsinks, its gradient where sinks were
    given."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:tensor_inputs], *output)
        ctx.options = inputs[tensor_inputs:]

    def autograd_backward(ctx, dout, _dlse):
        q, k, v, *extra, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv, *dsinks = backward(dout, q, k, v, out, lse, *extra, *ctx.options)
        grads = [dq, dk, dv] + [None] * (tensor_inputs - 3 + len(ctx.options))
        sinks = extra[sinks_input - 3] if sinks_input is not None else None
        if sinks is not None:
            grads[sinks_input] = dsinks[0].to(sinks.dtype)  # accumulated in float32, returned in the sinks' dtype
        return tuple(grads)

    forward.register_autograd(autograd_backward, setup_context=setup_context)


_register_autograd(_forward, _backward, tensor_inputs=3)
_register_autograd(_varlen_forward, _varlen_backward, tensor_inputs=5)
_register_autograd(_varlen_used_forward, _varlen_used_backward, tensor_inputs=7)
_register_autograd(_biased_forward, _biased_backward, tensor_inputs=5, sinks_input=3)
_register_autograd(_varlen_biased_forward, _varlen_biased_backward, tensor_inputs=7, sinks_input=5)


# Dropout: ops of their own (with the sinks and ALiBi slopes, which dropout combines with), whose
# `rng` input is the keep mask's (seed, offset), int64 (2,) on q's device, drawn by _dropout_rng
# from torch's generator: a traced op under torch.compile, so every call draws afresh, and the
# backward op receives the forward's (saved with the other tensor inputs).
_I64 = torch.iinfo(torch.int64)


def _dropout_rng(q: torch.Tensor) -> torch.Tensor:
    """(seed, offset) of a dropout call from the default generator of q's device (torch's CUDA
    generator for CUDA tensors), so that torch.manual_seed makes runs repeat, as in flash-attn."""
    return torch.randint(_I64.min, _I64.max, (2,), dtype=torch.int64, device=q.device)


def _seed_offset(rng) -> tuple:
    """cuflash's seed and offset: on the CPU (where the op's body sees the rng tensor as a NumPy
    view) its two int64 as unsigned 64-bit integers; on a GPU the tensor itself (with offset 0),
    which the kernels read at run time, so that no call waits for the device and a captured CUDA
    graph draws afresh on every replay."""
    if isinstance(rng, torch.Tensor) and rng.is_cuda:
        return rng, 0
    seed, offset = rng.tolist()
    return seed % 2**64, offset % 2**64


def _attention_dropout_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                               alibi_slopes: Optional[torch.Tensor], rng: torch.Tensor, causal: bool,
                               softmax_scale: float, window_left: int, window_right: int, softcap: float,
                               deterministic: bool, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    seed, offset = _seed_offset(rng)
    return cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=(window_left, window_right),
                             softcap=softcap, return_lse=True, sinks=sinks, alibi_slopes=alibi_slopes,
                             dropout_p=dropout_p, seed=seed, offset=offset)


_dropout_forward = _op("cuflash::attention_dropout_forward", _attention_dropout_forward)


@_dropout_forward.register_fake
def _(q, k, v, sinks, alibi_slopes, rng, causal, softmax_scale, window_left, window_right, softcap, deterministic,
      dropout_p):
    return _output_like(q, v), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _attention_dropout_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor],
                                alibi_slopes: Optional[torch.Tensor], rng: torch.Tensor, causal: bool,
                                softmax_scale: float, window_left: int, window_right: int, softcap: float,
                                deterministic: bool, dropout_p: float
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    seed, offset = _seed_offset(rng)
    return _dsinks_or_empty(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                       softmax_scale=softmax_scale, window=(window_left, window_right),
                                                       softcap=softcap, deterministic=deterministic, sinks=sinks,
                                                       alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                                                       offset=offset), q)


_dropout_backward = _op("cuflash::attention_dropout_backward", _attention_dropout_backward)


@_dropout_backward.register_fake
def _(dout, q, k, v, out, lse, sinks, alibi_slopes, rng, causal, softmax_scale, window_left, window_right, softcap,
      deterministic, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _dsinks_like(q, sinks, q.shape[2])


def _attention_varlen_dropout_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                      cu_seqlens_k: torch.Tensor, sinks: Optional[torch.Tensor],
                                      alibi_slopes: Optional[torch.Tensor], rng: torch.Tensor, max_seqlen_q: int,
                                      max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int,
                                      window_right: int, softcap: float, deterministic: bool,
                                      dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    seed, offset = _seed_offset(rng)
    return cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap,
                                    return_lse=True, sinks=sinks, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                    seed=seed, offset=offset)


_varlen_dropout_forward = _op("cuflash::attention_varlen_dropout_forward", _attention_varlen_dropout_forward)


@_varlen_dropout_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, rng, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, window_left, window_right, softcap, deterministic, dropout_p):
    return _output_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _attention_varlen_dropout_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                       cu_seqlens_k: torch.Tensor, sinks: Optional[torch.Tensor],
                                       alibi_slopes: Optional[torch.Tensor], rng: torch.Tensor, max_seqlen_q: int,
                                       max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int,
                                       window_right: int, softcap: float, deterministic: bool, dropout_p: float
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    seed, offset = _seed_offset(rng)
    return _dsinks_or_empty(cuflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        sinks=sinks, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset), q)


_varlen_dropout_backward = _op("cuflash::attention_varlen_dropout_backward", _attention_varlen_dropout_backward)


@_varlen_dropout_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, rng, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, window_left, window_right, softcap, deterministic, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _dsinks_like(q, sinks, q.shape[1])


_register_autograd(_dropout_forward, _dropout_backward, tensor_inputs=6, sinks_input=3)
_register_autograd(_varlen_dropout_forward, _varlen_dropout_backward, tensor_inputs=8, sinks_input=5)


def _flags_and_options(q: torch.Tensor, causal, softmax_scale, window, softcap,
                       deterministic) -> tuple[bool, float, int, int, float, bool]:
    """(causal, scale, left, right, softcap, deterministic) in the ops' argument order, validated
    before they reach an op's schema."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left, right = checks.resolve_window(window)
    return (checks.resolve_flag("causal", causal), scale, left, right, checks.resolve_softcap(softcap),
            checks.resolve_flag("deterministic", deterministic))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              deterministic: bool = False, sinks: torch.Tensor | None = None,
              alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Differentiable :func:`cuflash.attention` on torch tensors (batch, seqlen, heads, head_dim), CUDA
    or CPU.

    Gradients flow to q, k and v through :func:`cuflash.attention_backward`, bitwise reproducible
    when ``deterministic`` (see there for the cost). ``sinks`` (heads,) (gpt-oss's attention
    sinks, differentiable: their gradient comes back in their dtype) and ``alibi_slopes``
    ((heads,) or (batch, heads), float32) as for :func:`cuflash.attention`. ``dropout_p`` in [0, 1)
    drops attention probabilities with the seed and offset drawn from the default generator of
    q's device (so ``torch.manual_seed`` makes a run repeat; the backward regenerates the
    forward's mask); applied whatever the module's training mode, as flash-attn does. CPU tensors
    only so far.
    """
    check_tensors(_QKV, (q, k, v, sinks, alibi_slopes), 3)
    options = _flags_and_options(q, causal, softmax_scale, window, softcap, deterministic)
    dropout_p = checks.resolve_dropout_p(dropout_p)
    if dropout_p:
        out, _ = _dropout_forward(q, k, v, sinks, alibi_slopes, _dropout_rng(q), *options, dropout_p)
    elif sinks is not None or alibi_slopes is not None:
        out, _ = _biased_forward(q, k, v, sinks, alibi_slopes, *options)
    else:
        out, _ = _forward(q, k, v, *options)
    return out


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *,
                     causal: bool = False, softmax_scale: float | None = None, window: tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, deterministic: bool = False, seqused_q: torch.Tensor | None = None,
                     seqused_k: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Differentiable :func:`cuflash.attention_varlen` on packed torch tensors, CUDA or CPU,
    (total_tokens, heads, head_dim) with int32 ``cu_seqlens_*`` (batch + 1,).

    Omitted ``max_seqlen_*`` are read from the lengths (a device-to-host copy, and a graph break
    under torch.compile). Gradients through :func:`cuflash.attention_varlen_backward`.
    ``seqused_q`` / ``seqused_k`` (int32 (batch,)): the used prefix of each sequence, as for
    :func:`cuflash.attention_varlen`, differentiable (gradients 0 past the prefixes).
    ``sinks`` and ``alibi_slopes`` ((heads,) or (num_sequences, heads)) and ``dropout_p`` as for
    :func:`attention`, not with seqused_q / seqused_k.
    """
    check_tensors(_PACKED, (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, alibi_slopes), 5)
    max_seqlen_q, max_seqlen_k = (int(torch.diff(cu).max()) if given is None else int(given)
                                  for cu, given in ((cu_seqlens_q, max_seqlen_q), (cu_seqlens_k, max_seqlen_k)))
    biased = sinks is not None or alibi_slopes is not None
    dropout_p = checks.resolve_dropout_p(dropout_p)
    if seqused_q is not None or seqused_k is not None:
        if dropout_p:
            raise NotImplementedError("attention_varlen: dropout_p is not taken with seqused_q / seqused_k yet")
        if biased:
            raise NotImplementedError("attention_varlen: sinks and alibi_slopes are not taken with seqused_q / "
                                      "seqused_k yet")
        out, _ = _varlen_used_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                      max_seqlen_k, *_flags_and_options(q, causal, softmax_scale, window, softcap,
                                                                        deterministic))
        return out
    options = _flags_and_options(q, causal, softmax_scale, window, softcap, deterministic)
    if dropout_p:
        out, _ = _varlen_dropout_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, _dropout_rng(q),
                                         max_seqlen_q, max_seqlen_k, *options, dropout_p)
    elif biased:
        out, _ = _varlen_biased_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, max_seqlen_q,
                                        max_seqlen_k, *options)
    else:
        out, _ = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options)
    return out


def _refuse(function: str, return_attn_probs) -> None:
    """flash-attn arguments cuflash does not support raise, never silently ignored."""
    if return_attn_probs:
        raise NotImplementedError(f"{function}: cuflash does not support return_attn_probs yet")


def _refuse_fp8_dropout(function: str, dropout_p) -> None:
    """The FP8 forward is for inference (as FlashAttention-3's): no dropout."""
    if checks.resolve_dropout_p(dropout_p):
        raise NotImplementedError(f"{function}: dropout_p is not taken with FP8 inputs (a forward for inference)")


def _sinks(sinks, learnable_sink):
    """The sinks given as cuflash's ``sinks`` or FlashAttention-4's ``learnable_sink``, one of them."""
    if sinks is not None and learnable_sink is not None:
        raise TypeError("sinks, learnable_sink: the same argument under two names; pass one of them")
    return learnable_sink if sinks is None else sinks


def _fp8_call(q, descales) -> bool:
    """Whether a flash-attn call takes the FP8 forward: float8_e4m3fn inputs, or descales given
    (which cuflash then refuses for 16-bit inputs, naming the argument)."""
    return q.dtype == torch.float8_e4m3fn or any(d is not None for d in descales)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, q_descale=None,
                    k_descale=None, v_descale=None, sinks=None, learnable_sink=None):
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, heads, head_dim), k (batch,
    seqlen_k, heads_kv, head_dim) and v (batch, seqlen_k, heads_kv, head_dim_v); returns out
    (batch, seqlen_q, heads, head_dim_v).

    ``deterministic=True`` makes the backward bitwise reproducible. ``alibi_slopes`` (float32
    (heads,) or (batch, heads)) and ``sinks`` (FlashAttention-4's ``learnable_sink``; pass one
    of the two) as for :func:`attention`. ``dropout_p`` as for :func:`attention` (seed and offset
    from torch's generator; CPU tensors only so far). Raises NotImplementedError, naming the
    argument, for return_attn_probs=True.
    float8_e4m3fn CUDA tensors take FlashAttention-3's ``q_descale``, ``k_descale`` and
    ``v_descale`` (None, a number, or float32 (batch, heads_kv)) and return bfloat16: a forward
    only, as in FlashAttention-3, so not differentiable, and called directly rather than as a
    custom op.
    """
    sinks = _sinks(sinks, learnable_sink)
    check_tensors(_QKV, (q, k, v, sinks, alibi_slopes), 3)
    _refuse("flash_attn_func", return_attn_probs)
    if _fp8_call(q, (q_descale, k_descale, v_descale)):
        _refuse_fp8_dropout("flash_attn_func", dropout_p)
        return direct(cuflash.attention, q, k, v, causal=causal, softmax_scale=softmax_scale, window=window_size,
                       softcap=softcap, descale_q=q_descale, descale_k=k_descale, descale_v=v_descale, sinks=sinks,
                       alibi_slopes=alibi_slopes)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window_size, softcap=softcap,
                     deterministic=deterministic, sinks=sinks, alibi_slopes=alibi_slopes, dropout_p=dropout_p)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, q_descale=None, k_descale=None,
                           v_descale=None, seqused_q=None, seqused_k=None, sinks=None, learnable_sink=None):
    """flash-attn's ``flash_attn_varlen_func``: q (total_q, heads, head_dim), k (total_k,
    heads_kv, head_dim) and v (total_k, heads_kv, head_dim_v), int32 cu_seqlens (batch + 1,);
    returns out (total_q, heads, head_dim_v). Raises NotImplementedError, and takes dropout_p and
    FP8 inputs with their descales (of shape (batch, heads_kv), batch the number of sequences), as
    :func:`flash_attn_func` does; alibi_slopes is (heads,) or (num_sequences, heads), sinks
    (or learnable_sink) as there.
    ``seqused_q`` / ``seqused_k``: FlashAttention-3's used prefix of each sequence (forward only).
    """
    sinks = _sinks(sinks, learnable_sink)
    check_tensors(_PACKED, (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, alibi_slopes), 5)
    _refuse("flash_attn_varlen_func", return_attn_probs)
    if _fp8_call(q, (q_descale, k_descale, v_descale)):
        _refuse_fp8_dropout("flash_attn_varlen_func", dropout_p)
        return direct(cuflash.attention_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       causal=causal, softmax_scale=softmax_scale, window=window_size, softcap=softcap,
                       descale_q=q_descale, descale_k=k_descale, descale_v=v_descale, seqused_q=seqused_q,
                       seqused_k=seqused_k, sinks=sinks, alibi_slopes=alibi_slopes)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                            softmax_scale=softmax_scale, window=window_size, softcap=softcap,
                            deterministic=deterministic, seqused_q=seqused_q, seqused_k=seqused_k, sinks=sinks,
                            alibi_slopes=alibi_slopes, dropout_p=dropout_p)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, sinks=None):
    """FlashAttention-3's ``flash_attn_with_kvcache``: attention of q against k_cache/v_cache after
    writing k/v into them in place at cache_seqlens (through page_table when paged), with
    optional rotary embedding; see :func:`cuflash.attention_with_kvcache` for every argument.
    Returns out, or (out, softmax_lse) with ``return_softmax_lse``. CUDA tensors run the kernels,
    CPU tensors the CPU path (their caches updated in place too). Not differentiable.

    With ``cu_seqlens_q``, k and v are packed like q: each sequence appends as many tokens as it
    has queries. ``pack_gqa`` is accepted and changes nothing (the decode kernel always packs the
    query heads of a KV head). ``sinks`` (SGLang's name; (heads,)) as for
    :func:`cuflash.attention_with_kvcache`. Raises NotImplementedError,
    naming it, for attention_chunk and sm_margin. A float8_e4m3fn q over a float8_e4m3fn cache
    takes ``q_descale`` (FP8 attention, bf16 out; no append or rotary).
    ``scheduler_metadata`` (cuflash.torch.vllm.get_scheduler_metadata's) is accepted and not read:
    cuflash's plan depends on the call's static arguments only.

    With ``qv`` (MLA decoding's split form): q and k_cache hold the 64 rotary dims, qv and v_cache
    the 512 latent ones, one kv head; this is :func:`cuflash.mla_decode` with q_rope=q and
    kv_rope_cache=k_cache, the default scale 1 / sqrt(576) as FlashAttention-3's. It takes no
    append (k, v), rotary, cache_batch_idx, cache_leftpad, cu_seqlens_q, window or softcap, and one
    descale for the latent cache (k_descale, v_descale the same tensor or one of them).
    """
    check_tensors(_KVCACHE, (q, k_cache, v_cache, k, v, qv, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                             page_table, cu_seqlens_q, sinks, rotary_seqlens, cu_seqlens_k_new), 3)
    unsupported = {"attention_chunk": attention_chunk != 0, "sm_margin": sm_margin != 0}
    for name, used in unsupported.items():
        if used:
            raise NotImplementedError(f"flash_attn_with_kvcache: cuflash does not support {name} yet")
    if scheduler_metadata is not None and (not isinstance(scheduler_metadata, torch.Tensor)
                                           or scheduler_metadata.dtype != torch.int32):
        raise TypeError("scheduler_metadata: expected get_scheduler_metadata's int32 tensor")
    if pack_gqa not in (None, True, False):
        raise TypeError(f"pack_gqa: expected None or a bool, got {pack_gqa!r}")
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 0:
        cache_seqlens = int(cache_seqlens)
    if qv is not None:
        refused = {"k": k is not None, "v": v is not None, "rotary_cos": rotary_cos is not None,
                   "rotary_sin": rotary_sin is not None, "cache_batch_idx": cache_batch_idx is not None,
                   "cache_leftpad": cache_leftpad is not None, "cu_seqlens_q": cu_seqlens_q is not None,
                   "sinks": sinks is not None, "rotary_seqlens": rotary_seqlens is not None,
                   "cu_seqlens_k_new": cu_seqlens_k_new is not None,
                   "window_size": tuple(window_size) != (-1, -1), "softcap": softcap != 0,
                   "k_descale and v_descale that differ": (k_descale is not None and v_descale is not None
                                                           and k_descale is not v_descale)}
        for name, used in refused.items():
            if used:
                raise NotImplementedError(f"flash_attn_with_kvcache: cuflash does not take {name} with qv")
        return _mla_with_kvcache(q, k_cache, v_cache, qv, cache_seqlens, page_table, softmax_scale, causal,
                                 num_splits, k_descale if k_descale is not None else v_descale, return_softmax_lse)
    return direct(cuflash.attention_with_kvcache, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                   page_table=page_table, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                   rotary_interleaved=rotary_interleaved, rotary_seqlens=rotary_seqlens,
                   cu_seqlens_k_new=cu_seqlens_k_new, causal=causal, softmax_scale=softmax_scale, window=window_size,
                   softcap=softcap, num_splits=num_splits, descale_k=k_descale, descale_v=v_descale,
                   descale_q=q_descale, return_lse=return_softmax_lse, sinks=sinks)


def _mla_with_kvcache(q, k_cache, v_cache, qv, cache_seqlens, page_table, softmax_scale, causal, num_splits,
                      descale, return_lse):
    """flash_attn_with_kvcache's qv form as cuflash.mla_decode's split form. A contiguous cache
    (batch, seqlen_cache, 1, d) is a paged one of one page per sequence; cache_seqlens None (or an
    int) is every sequence at that length."""
    batch, device = qv.shape[0], qv.device
    if page_table is None:
        page_table = torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        capacity = v_cache.shape[1] * page_table.shape[1]
        cache_seqlens = torch.full((batch,), capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32,
                                   device=device)
    return direct(cuflash.mla_decode, qv, v_cache, page_table, cache_seqlens, head_dim_v=qv.shape[-1],
                   softmax_scale=softmax_scale, causal=causal, num_splits=num_splits, descale_kv=descale,
                   return_lse=return_lse, q_rope=q, kv_rope_cache=k_cache)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's ``flash_attn_combine``: out_partial float32 (splits, batch, seqlen, heads,
    head_dim), lse_partial float32 (splits, batch, seqlen, heads) (or both without batch, packed);
    returns (out, lse), out in ``out_dtype`` (default float32), written into ``out`` when given,
    lse float32 (batch, seqlen, heads). See :func:`cuflash.combine`."""
    check_tensors(("out_partial", "lse_partial", "out"), (out_partial, lse_partial, out), 2)
    if out is not None:  # checked before the combine runs, as every argument is
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out: dtype {out.dtype} does not match out_dtype {out_dtype}")
        if tuple(out.shape) != tuple(out_partial.shape[1:]):
            raise ValueError(f"out: expected shape {tuple(out_partial.shape[1:])} (out_partial's without splits), "
                             f"got {tuple(out.shape)}")
        if out.device != out_partial.device:
            raise ValueError(f"out: on {out.device}, but out_partial is on {out_partial.device}")
        out_dtype = out.dtype
    result, lse = direct(cuflash.combine, out_partial, lse_partial, out_dtype=out_dtype, return_lse=True)
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse


# Context parallelism (ring attention over torch.distributed), imported last: it runs this
# module's ops.
from cuflash.torch import distributed  # noqa: E402
