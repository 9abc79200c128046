"""JAX integration: :func:`attention` as a differentiable JAX function, callable inside ``jax.jit``.

Shapes, dtypes and options are static at trace time and checked there, by the same checks as
:func:`cuflash.attention` (an error names the argument before anything runs). The forward and the
backward (``jax.custom_vjp``) run as ``jax.pure_callback`` calls of cuflash's entry points on the
arrays' host copies, which is JAX's way to call host code from a jitted function: on the CPU
backend that is cuflash's CPU path. GPU arrays under ``jax.jit`` need cuflash's kernels launched on
XLA's stream through its FFI, which is not built yet: tracing on a GPU backend raises
NotImplementedError (eager GPU arrays go to :func:`cuflash.attention` through DLPack).
``jax.vmap`` over a leading batch axis runs the callback once per element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import cuflash
from cuflash._core import checks

__all__ = ["attention"]


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0):
    """:func:`cuflash.attention` on JAX arrays (batch, seqlen, heads, head_dim), float16,
    bfloat16, float32 or float64, inside ``jax.jit`` or not; differentiable in q, k and v
    (``jax.grad``, through :func:`cuflash.attention_backward`). Returns out (batch, seqlen_q,
    heads, head_dim_v) in q's dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected a JAX array, got {type(x).__name__}")
    options = _options(q, k, v, causal, softmax_scale, window, softcap)
    return _attention(q, k, v, options)


def _options(q, k, v, causal, softmax_scale, window, softcap) -> tuple:
    """The options resolved and the arrays' shapes and dtypes checked at trace time, on NumPy
    stand-ins of their shapes (np.empty: nothing is filled) by cuflash's own checks."""
    if jax.default_backend() != "cpu":
        raise NotImplementedError("cuflash.jax.attention: on a GPU backend it needs cuflash's kernels on XLA's stream "
                                  "(XLA's FFI), not built yet; call cuflash.attention on the arrays eagerly instead")
    stand_ins = [np.empty(x.shape, _numpy_dtype(name, x.dtype)) for name, x in (("q", q), ("k", k), ("v", v))]
    scale, _ = checks.check_forward(*stand_ins, None, softmax_scale, False)
    return (checks.resolve_flag("causal", causal), scale, checks.resolve_window(window), checks.resolve_softcap(softcap))


def _numpy_dtype(name: str, dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.name not in checks.HOST_DTYPES:
        raise TypeError(f"{name}: dtype {dtype.name} is not one of {', '.join(checks.HOST_DTYPES)}")
    return dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, options):
    return _forward(q, k, v, options)[0]


def _forward(q, k, v, options):
    causal, scale, window, softcap = options
    out_shape = jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype)
    lse_shape = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def run(q, k, v):
        return cuflash.attention(np.asarray(q), np.asarray(k), np.asarray(v), causal=causal, softmax_scale=scale,
                                 window=window, softcap=softcap, return_lse=True)

    return jax.pure_callback(run, (out_shape, lse_shape), q, k, v, vmap_method="sequential")


def _attention_fwd(q, k, v, options):
    out, lse = _forward(q, k, v, options)
    return out, (q, k, v, out, lse)


def _attention_bwd(options, residuals, dout):
    q, k, v, out, lse = residuals
    causal, scale, window, softcap = options
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))

    def run(dout, q, k, v, out, lse):
        return cuflash.attention_backward(*(np.asarray(x) for x in (dout, q, k, v, out, lse)), causal=causal,
                                          softmax_scale=scale, window=window, softcap=softcap)

    return jax.pure_callback(run, shapes, dout.astype(q.dtype), q, k, v, out, lse, vmap_method="sequential")


_attention.defvjp(_attention_fwd, _attention_bwd)
