"""JAX integration: :func:`attention` and :func:`attention_varlen` as differentiable JAX functions,
and :func:`attention_with_kvcache` and :func:`mla_decode` (inference), callable inside ``jax.jit``.

Shapes, dtypes and options are static at trace time and checked there by the same checks as
cuflash's entry points (an error names the argument before anything runs). The forward and the
backward (``jax.custom_vjp``) run as ``jax.pure_callback`` calls of cuflash's entry points on the
arrays' host copies, which is JAX's way to call host code from a jitted function: on the CPU
backend that is cuflash's CPU path. GPU arrays under ``jax.jit`` need cuflash's kernels launched on
XLA's stream through its FFI, which is not built yet: tracing on a GPU backend raises
NotImplementedError (eager GPU arrays go to :func:`cuflash.attention` through DLPack).
``jax.vmap`` over a leading axis runs the callback once per element.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import cuflash
from cuflash._core import checks

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "mla_decode"]


class _Spec(NamedTuple):
    """A call's static part: the options resolved, and a packed batch's longest lengths."""

    varlen: bool
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks=None):
    """:func:`cuflash.attention` on JAX arrays (batch, seqlen, heads, head_dim), float16,
    bfloat16, float32 or float64, inside ``jax.jit`` or not; differentiable in q, k, v and
    ``sinks`` ((heads,) float, gpt-oss's attention sinks) through
    :func:`cuflash.attention_backward`. Returns out (batch, seqlen_q, heads, head_dim_v) in q's
    dtype."""
    _check_arrays(q=q, k=k, v=v, sinks=sinks)
    scale = _check_forward(q, k, v, softmax_scale, sinks)
    spec = _Spec(False, checks.resolve_flag("causal", causal), scale, checks.resolve_window(window),
                 checks.resolve_softcap(softcap))
    return _attention(spec, q, k, v, sinks, None, None)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: float | None = None, window: tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, sinks=None):
    """:func:`cuflash.attention_varlen` on JAX arrays: q (total_q, heads, head_dim), k and v
    (total_k, heads_kv, head_dim), int32 ``cu_seqlens_*`` (batch + 1,); ``max_seqlen_q`` and
    ``max_seqlen_k`` are Python ints (static under ``jax.jit``, where the lengths are traced).
    Differentiable in q, k, v and sinks, as :func:`attention`."""
    _check_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 3:
            raise ValueError(f"{name}: expected 3 dims (total, heads, head_dim), got shape {tuple(x.shape)}")
    scale = _check_forward(q[None], k[None], v[None], softmax_scale, sinks)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if np.dtype(cu.dtype) != np.int32 or len(cu.shape) != 1 or cu.shape[0] < 2:
            raise (TypeError if np.dtype(cu.dtype) != np.int32 else ValueError)(
                f"{name}: expected int32 of shape (batch + 1,), got {np.dtype(cu.dtype).name} {tuple(cu.shape)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: shape {tuple(cu_seqlens_k.shape)} must equal cu_seqlens_q's")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise TypeError(f"{name}: expected a non-negative Python int (static under jax.jit), got {value!r}")
    spec = _Spec(True, checks.resolve_flag("causal", causal), scale, checks.resolve_window(window),
                 checks.resolve_softcap(softcap), int(max_seqlen_q), int(max_seqlen_k))
    return _attention(spec, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)


def _check_arrays(**arrays) -> None:
    """Each given argument is an array (a JAX array, or a tracer of one), named if not; and JAX's
    backend is the CPU's (see the module docstring)."""
    for name, x in arrays.items():
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name}: expected a JAX array, got {type(x).__name__}")
    if jax.default_backend() != "cpu":
        raise NotImplementedError("cuflash.jax: on a GPU backend it needs cuflash's kernels on XLA's stream (XLA's "
                                  "FFI), not built yet; call cuflash.attention on the arrays eagerly instead")


def _check_forward(q, k, v, softmax_scale, sinks) -> float:
    """The softmax scale, after cuflash's checks of q, k, v (and sinks) on NumPy stand-ins of
    their shapes and dtypes (np.empty: nothing is filled)."""
    stand_ins = [np.empty(x.shape, _numpy_dtype(name, x.dtype)) for name, x in (("q", q), ("k", k), ("v", v))]
    scale, _ = checks.check_forward(*stand_ins, None, softmax_scale, False)
    if sinks is not None:
        if tuple(sinks.shape) != (q.shape[2],):
            raise ValueError(f"sinks: expected shape (heads,) = ({q.shape[2]},), got {tuple(sinks.shape)}")
        _numpy_dtype("sinks", sinks.dtype)
    return scale


def _numpy_dtype(name: str, dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.name not in checks.HOST_DTYPES:
        raise TypeError(f"{name}: dtype {dtype.name} is not one of {', '.join(checks.HOST_DTYPES)}")
    return dtype


def _options(spec: _Spec) -> dict:
    return dict(causal=spec.causal, softmax_scale=spec.scale, window=spec.window, softcap=spec.softcap)


def _host(*arrays):
    return [None if x is None else np.asarray(x) for x in arrays]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, sinks, cu_q, cu_k):
    return _forward(spec, q, k, v, sinks, cu_q, cu_k)[0]


def _forward(spec, q, k, v, sinks, cu_q, cu_k):
    out_shape = jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype)
    lse_dims = (q.shape[1], q.shape[0]) if spec.varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse_shape = jax.ShapeDtypeStruct(lse_dims, jnp.float32)

    def run(q, k, v, sinks, cu_q, cu_k):
        q, k, v, sinks, cu_q, cu_k = _host(q, k, v, sinks, cu_q, cu_k)
        if spec.varlen:
            return cuflash.attention_varlen(q, k, v, cu_q, cu_k, spec.max_seqlen_q, spec.max_seqlen_k, sinks=sinks,
                                            return_lse=True, **_options(spec))
        return cuflash.attention(q, k, v, sinks=sinks, return_lse=True, **_options(spec))

    return jax.pure_callback(run, (out_shape, lse_shape), q, k, v, sinks, cu_q, cu_k, vmap_method="sequential")


def _attention_fwd(spec, q, k, v, sinks, cu_q, cu_k):
    out, lse = _forward(spec, q, k, v, sinks, cu_q, cu_k)
    return out, (q, k, v, sinks, cu_q, cu_k, out, lse)


def _attention_bwd(spec, residuals, dout):
    q, k, v, sinks, cu_q, cu_k, out, lse = residuals
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        shapes.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))

    def run(dout, q, k, v, out, lse, sinks, cu_q, cu_k):
        dout, q, k, v, out, lse, sinks, cu_q, cu_k = _host(dout, q, k, v, out, lse, sinks, cu_q, cu_k)
        if spec.varlen:
            return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, spec.max_seqlen_q,
                                                     spec.max_seqlen_k, sinks=sinks, **_options(spec))
        return cuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks, **_options(spec))

    grads = jax.pure_callback(run, tuple(shapes), dout.astype(q.dtype), q, k, v, out, lse, sinks, cu_q, cu_k,
                              vmap_method="sequential")
    dsinks = grads[3].astype(sinks.dtype) if sinks is not None else None
    return (*grads[:3], dsinks, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, **options):
    """:func:`cuflash.attention_with_kvcache` on JAX arrays, inside ``jax.jit`` or not; returns
    ``(out, k_cache, v_cache)``, the caches with the new tokens appended (JAX arrays are
    immutable: the callback appends into copies). ``options`` as there, arrays among them (page
    table, lengths, ...) JAX arrays too; ``max_seqlen_q`` must be given with ``cu_seqlens_q``
    (a Python int: static under ``jax.jit``). ``return_lse`` adds the lse last. Not
    differentiable."""
    arrays = {name: value for name, value in options.items() if hasattr(value, "shape")}
    _check_arrays(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **arrays)
    if "cu_seqlens_q" in arrays and not isinstance(options.get("max_seqlen_q"), (int, np.integer)):
        raise TypeError("max_seqlen_q: a Python int with cu_seqlens_q (static under jax.jit)")
    scalars = {name: value for name, value in options.items() if name not in arrays}
    names = tuple(arrays)
    out_dims = (*q.shape[:-1], q.shape[-1])
    rows = q.shape[0] * (q.shape[1] if len(q.shape) == 4 else 1)
    heads = q.shape[-2]
    shapes = [jax.ShapeDtypeStruct(out_dims, q.dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
              jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    if scalars.get("return_lse"):
        lse_dims = (heads, rows) if len(q.shape) == 3 else (q.shape[0], heads, q.shape[1])
        shapes.append(jax.ShapeDtypeStruct(lse_dims, jnp.float32))

    def run(q, k_cache, v_cache, k, v, *values):
        k_cache, v_cache = np.array(k_cache), np.array(v_cache)  # copies: the append writes them
        host = dict(zip(names, _host(*values)))
        result = cuflash.attention_with_kvcache(*_host(q), k_cache, v_cache, *_host(k, v), **host, **scalars)
        out, *lse = result if isinstance(result, tuple) else (result,)
        return (out, k_cache, v_cache, *lse)

    return jax.pure_callback(run, tuple(shapes), q, k_cache, v_cache, k, v, *arrays.values(),
                             vmap_method="sequential")


def mla_decode(q, kv_cache, page_table, cache_seqlens, **options):
    """:func:`cuflash.mla_decode` on JAX arrays, inside ``jax.jit`` or not (``head_dim_v`` and
    the other options static); returns out, or (out, lse) with ``return_lse``. Not
    differentiable."""
    arrays = {name: value for name, value in options.items() if hasattr(value, "shape")}
    _check_arrays(q=q, kv_cache=kv_cache, page_table=page_table, cache_seqlens=cache_seqlens, **arrays)
    scalars = {name: value for name, value in options.items() if name not in arrays}
    names = tuple(arrays)
    head_dim_v = scalars.get("head_dim_v", 512)
    shapes = [jax.ShapeDtypeStruct((*q.shape[:-1], head_dim_v), q.dtype)]
    if scalars.get("return_lse"):
        shapes.append(jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))

    def run(q, kv_cache, page_table, cache_seqlens, *values):
        result = cuflash.mla_decode(*_host(q, kv_cache, page_table, cache_seqlens),
                                    **dict(zip(names, _host(*values))), **scalars)
        return result if isinstance(result, tuple) else (result,)

    found = jax.pure_callback(run, tuple(shapes), q, kv_cache, page_table, cache_seqlens, *arrays.values(),
                              vmap_method="sequential")
    return found if scalars.get("return_lse") else found[0]

