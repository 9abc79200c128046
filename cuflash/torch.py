"""PyTorch integration: differentiable attention and flash-attn's entry point.

``cuflash.torch.attention`` is a ``torch.library.custom_op`` pair (forward, backward) with fake
implementations and a registered autograd formula, so it trains like any op and traces under
``torch.compile(fullgraph=True)`` without a graph break. ``flash_attn_func`` takes flash-attn's
signature and return convention, so ``from cuflash.torch import flash_attn_func`` replaces
``from flash_attn import flash_attn_func``; arguments cuflash does not support yet raise
NotImplementedError naming them, never silently ignored.
"""

# No `from __future__ import annotations`: custom_op reads the signature's real types.
import math

import torch

import cuflash

__all__ = ["attention", "flash_attn_func"]


@torch.library.custom_op("cuflash::attention_forward", mutates_args=(), device_types="cuda")
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic only shapes the backward; it is an input here so that autograd's context
    # receives it.
    return cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)


@_forward.register_fake
def _(q, k, v, causal, softmax_scale, deterministic):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_backward", mutates_args=(), device_types="cuda")
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, causal: bool, softmax_scale: float,
              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                      deterministic=deterministic)


@_backward.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic


def _autograd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, deterministic: bool = False) -> torch.Tensor:
    """Differentiable :func:`cuflash.attention` on torch CUDA tensors (batch, seqlen, heads, head_dim).

    Gradients flow to q, k and v through :func:`cuflash.attention_backward`, bitwise reproducible
    when ``deterministic`` (see there for the cost).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, _ = _forward(q, k, v, bool(causal), scale, bool(deterministic))
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, heads, head_dim), k and v
    (batch, seqlen_k, heads_kv, head_dim); returns out (batch, seqlen_q, heads, head_dim).

    ``deterministic=True`` makes the backward bitwise reproducible. Raises NotImplementedError,
    naming the argument, for dropout_p != 0, a window_size other than (-1, -1), softcap != 0,
    alibi_slopes and return_attn_probs=True.
    """
    unsupported = {
        "dropout_p": dropout_p != 0.0,
        "window_size": tuple(window_size) != (-1, -1),
        "softcap": softcap != 0.0,
        "alibi_slopes": alibi_slopes is not None,
        "return_attn_probs": bool(return_attn_probs),
    }
    for name, used in unsupported.items():
        if used:
            raise NotImplementedError(f"flash_attn_func: cuflash does not support {name} yet")
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic)
