"""cuflash.quantize_fp8: float tensors to e4m3 bytes and the descales the attention entry points take.

Per group (the whole tensor, each head group of each batch entry, or each block of rows of one),
in float32: ``amax = max |x|``, ``scale = 448 / amax``, ``e4m3 = round(clip(x * scale, ±448))``
(round to nearest even) and ``descale = amax / 448``; a group of zeros gets scale and descale 1.
NumPy arrays are quantized by NumPy, GPU arrays by one kernel launch (generic/quantize_fp8.cu)
that computes the same float32 steps in the same order, so both give the same bits.

``rotate=True`` first multiplies each row of head_dim values by ``R = diag(signs) · H``: random
signs from ``seed`` and block-diagonal Hadamard matrices (the largest power of two dividing
head_dim, normalised by its square root). R is orthogonal, so q and k rotated with the same seed
keep ``q kᵀ``, while an outlier coordinate is spread over a whole block (FlashAttention-3's
incoherent processing). V must not be rotated: it would rotate the output.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import ml_dtypes
import numpy as np

from cuflash._core import checks, dispatch, interop, params, plan

__all__ = ["GRANULARITIES", "quantize_fp8", "rotation"]

GRANULARITIES = params.QUANTIZE_GRANULARITIES
_E4M3_MAX = np.float32(448.0)
_MAX_HEAD_DIM = dispatch.HEAD_DIM_BUCKETS[-1]  # the kernel's shared-memory row
_HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")
_DEVICE_DTYPES = ("float16", "bfloat16", "float32")


def rotation(head_dim: int, seed: int) -> tuple[np.ndarray, int, np.float32]:
    """(signs, block, norm) of the rotation along head_dim: float32 random signs from ``seed``,
    the Hadamard block size (the largest power of two dividing head_dim) and 1/sqrt(block) in
    float32."""
    signs = np.where(np.random.default_rng(seed).integers(0, 2, head_dim) == 1, -1.0, 1.0).astype(np.float32)
    block = head_dim & -head_dim
    return signs, block, np.float32(1.0 / math.sqrt(block))


def _rotated(x: np.ndarray, seed: int) -> np.ndarray:
    """float32 ``x`` times the rotation, as the kernel computes it: signs, then butterflies of
    stride 1, 2, 4, ... within each Hadamard block, then the norm."""
    signs, block, norm = rotation(x.shape[-1], seed)
    values = x * signs
    h = 1
    while h < block:
        pairs = values.reshape(*values.shape[:-1], -1, 2, h)
        lo, hi = pairs[..., 0, :], pairs[..., 1, :]
        values = np.stack((lo + hi, lo - hi), axis=-2).reshape(x.shape)
        h *= 2
    return values * norm if block > 1 else values


def _check(x, on_device: bool, granularity: Any, block_size: Any, rotate: Any, seed: Any,
           heads_kv: Any) -> tuple[int, int, bool]:
    """The arguments' checks; returns (heads per head group, block size, rotate)."""
    if x.ndim != 4:
        raise ValueError(f"x: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    allowed = _DEVICE_DTYPES if on_device else _HOST_DTYPES
    dtype = checks.dtype_name(x)
    if dtype not in allowed:
        raise TypeError(f"x: dtype {dtype} is not supported (expected one of {', '.join(allowed)})")
    heads, head_dim = x.shape[2], x.shape[3]
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"x: head_dim must be between 1 and {_MAX_HEAD_DIM}, got {head_dim}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    for name, value in (("block_size", block_size), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {value!r}")
    if block_size < 1:
        raise ValueError(f"block_size: must be at least 1, got {block_size}")
    if seed < 0:  # NumPy's generators take non-negative seeds
        raise ValueError(f"seed: must be >= 0, got {seed}")
    if heads_kv is None:
        group_heads = 1
    elif isinstance(heads_kv, bool) or not isinstance(heads_kv, numbers.Integral):
        raise TypeError(f"heads_kv: expected an int or None, got {heads_kv!r}")
    elif heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"heads_kv: must divide x's heads ({heads}), got {heads_kv}")
    else:
        group_heads = heads // int(heads_kv)
    return group_heads, int(block_size), checks.resolve_flag("rotate", rotate)


def _quantize_host(x: np.ndarray, granularity: str, group_heads: int, block_size: int, rotate: bool,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    # A value that is not finite in float32 is refused here rather than warned about by NumPy
    # several steps later (a float64 beyond float32's range overflows the cast, the rotation's sums
    # can overflow too).
    with np.errstate(over="ignore", invalid="ignore"):
        values = x.astype(np.float32)
        if rotate:
            values = _rotated(values, seed)
    if not np.isfinite(values).all():
        if not np.isfinite(x).all():
            raise ValueError("x: holds NaN or infinity; quantize_fp8 takes finite values")
        steps = "cast and rotated" if rotate else "cast"
        raise ValueError(f"x: holds values beyond float32's range (3.4e38) once {steps}: quantize_fp8 computes in "
                         f"float32")
    batch, seqlen, heads, head_dim = x.shape
    groups = heads // group_heads
    if granularity == "tensor":
        amax = np.full((batch, groups), np.abs(values).max(initial=0), np.float32)
        per_row = amax[:, None, :, None, None]  # every entry is the same
    elif granularity == "head":
        amax = np.abs(values).reshape(batch, seqlen, groups, group_heads, head_dim).max(axis=(1, 3, 4), initial=0)
        per_row = amax[:, None, :, None, None]
    else:
        blocks = -(-seqlen // block_size)
        padded = np.zeros((batch, blocks * block_size, heads, head_dim), np.float32)
        padded[:, :seqlen] = np.abs(values)
        amax = padded.reshape(batch, blocks, block_size, groups, group_heads, head_dim).max(axis=(2, 4, 5))
        per_row = np.repeat(amax, block_size, axis=1)[:, :seqlen, :, None, None]
        amax = amax.transpose(0, 2, 1)  # (batch, head groups, blocks)
    # A group of zeros keeps scale and descale 1.
    descale = np.divide(amax, _E4M3_MAX, out=np.ones_like(amax), where=amax > 0)
    scale = np.divide(_E4M3_MAX, per_row, out=np.ones_like(per_row), where=per_row > 0)
    grouped = values.reshape(batch, seqlen, groups, group_heads, head_dim)
    scaled = np.clip(grouped * scale, -_E4M3_MAX, _E4M3_MAX).reshape(x.shape)
    return scaled.astype(ml_dtypes.float8_e4m3fn), descale


def quantize_fp8(x: Any, granularity: str = "tensor", *, block_size: int = 128, rotate: bool = False,
                 seed: int = 0, heads_kv: int | None = None) -> tuple[Any, Any]:
    """Quantize ``x`` to FP8 e4m3 for :func:`cuflash.attention`; returns ``(x_e4m3, descale)``.

    Parameters
    ----------
    x : array, (batch, seqlen, heads, head_dim), head_dim at most 256
        NumPy (float16, bfloat16, float32, float64: converted to float32 first), or a CuPy
        array, torch CUDA tensor or other DLPack tensor of float16, bfloat16 or float32.
    granularity : "tensor", "head" or "block"
        What shares one amax: the whole tensor; each (batch, head group); each (batch, head
        group, block of ``block_size`` rows).
    block_size : int
        Rows per block for ``"block"``.
    rotate : bool
        Multiply each row by a random orthogonal rotation first (module docstring). Rotate q
        and k with the same ``seed``, never v.
    seed : int
        The rotation's random signs.
    heads_kv : int, optional
        Put ``heads // heads_kv`` consecutive heads in one group: pass k's heads when quantizing
        the q of a GQA/MQA call, so that q's descale is (batch, heads_kv) as attention takes it.
        k and v leave it None (one group per head).

    Returns
    -------
    x_e4m3 : array of x's shape
        NumPy ``ml_dtypes.float8_e4m3fn``; torch ``float8_e4m3fn``; CuPy uint8 holding the e4m3
        bytes (pass ``dtype="e4m3"`` to the attention entry points).
    descale : float32 array, in x's framework and on its device
        ``(batch, heads // group)`` for "tensor" (every entry the same) and "head": what
        attention's descale_q/k/v take. ``(batch, heads // group, ceil(seqlen / block_size))``
        for "block": the attention kernels take per-tensor and per-head descales only, so
        block-quantized tensors serve the accuracy study (benchmarks/fp8_accuracy.py).

    Raises
    ------
    TypeError, ValueError
        Every bad argument, naming it, before anything is launched; a NumPy ``x`` holding NaN or
        infinity is a ValueError. A GPU ``x``'s values are not read on the host (that would be a
        synchronisation): a NaN or infinity there gives wrong bytes, not an error.

    Notes
    -----
    On the GPU one CTA quantizes one group, so "tensor" runs on a single multiprocessor: prefer
    "head" for large tensors.
    """
    kind = interop.framework_of(x, "x")
    on_device = kind != "numpy"
    t = interop.describe(x, kind, "x") if on_device else x
    group_heads, block_size, rotate = _check(t, on_device, granularity, block_size, rotate, seed, heads_kv)
    if not on_device:
        return _quantize_host(x, granularity, group_heads, block_size, rotate, int(seed))
    if checks.element_strides(t)[3] != 1 and 0 not in t.shape:
        raise ValueError(f"x: the last (head_dim) dimension must be contiguous, stride is {t.strides[3]} elements")
    call = checks.QuantizeCall(t, granularity, group_heads, block_size, rotate, int(seed))
    return plan.run(None, t.device, _prepared, (call,), _build, kind, (), (), ())


def _prepared(call: checks.QuantizeCall):
    """plan.run's prepare of a checked call: the call, the tensors to launch on (x) and True (x
    itself)."""
    return call, (call.x,), True


def _build(call: checks.QuantizeCall) -> plan.QuantizePlan:
    return plan.build_quantize(call, *rotation(call.x.shape[3], call.seed))
