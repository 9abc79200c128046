"""What the entry points accept: argument checks and option resolving, the one place that says it.

Every check raises a TypeError or ValueError naming the argument, before anything is launched.
The checks read DeviceTensors (GPU arrays, interop.describe) or NumPy arrays alike, so the CPU
path refuses exactly what the GPU path refuses.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from cuflash import dispatch, interop

__all__ = [
    "MAX_GRID_YZ",
    "Lengths",
    "as_batch_of_one",
    "check_backward",
    "check_backward_inputs",
    "check_forward",
    "check_out",
    "check_qkv",
    "check_varlen",
    "check_varlen_grid",
    "framework",
    "plain_window",
    "resolve_flag",
    "resolve_scale",
    "resolve_softcap",
    "resolve_window",
]

DEVICE_DTYPES = ("float16", "bfloat16")
HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_GRID_YZ = dispatch.MAX_GRID_YZ
# Query rows per block in the grids whose grid.z counts query blocks.
_GRID_Z_ROWS = 128


def dtype_name(x: Any) -> str:
    return x.dtype if isinstance(x, interop.DeviceTensor) else x.dtype.name


def element_strides(x: Any) -> tuple[int, ...]:
    return x.strides if isinstance(x, interop.DeviceTensor) else tuple(s // x.itemsize for s in x.strides)


def _check_dtype(name: str, x: Any, allowed: tuple[str, ...], on_device: bool) -> str:
    dtype = dtype_name(x)
    if dtype not in allowed:
        hint = (
            "; cast to float16 or bfloat16 first (x.astype(ml_dtypes.bfloat16) in CuPy, "
            "x.to(torch.bfloat16) in torch)"
            if on_device and dtype in ("float32", "float64")
            else ""
        )
        raise TypeError(f"{name}: dtype {dtype} is not supported (expected one of {', '.join(allowed)}){hint}")
    return dtype


def check_qkv(q, k, v, on_device: bool, min_seqlen: int = 1) -> None:
    """Shapes, dtypes, strides and devices of q, k, v (DeviceTensors, or NumPy arrays);
    ``min_seqlen`` 0 for a packed batch, whose total length may be 0."""
    allowed = DEVICE_DTYPES if on_device else HOST_DTYPES
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    dtype = _check_dtype("q", q, allowed, on_device)
    for name, x in (("k", k), ("v", v)):
        if _check_dtype(name, x, allowed, on_device) != dtype:
            raise TypeError(f"{name}: dtype {dtype_name(x)} does not match q's {dtype}")
    batch, seqlen_q, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k, v: batch must match q's {batch}, got {k.shape[0]} and {v.shape[0]}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k: head_dim {k.shape[3]} must equal q's {head_dim}")
    for name, size, least in (("batch", batch, 1), ("seqlen_q", seqlen_q, min_seqlen),
                              ("seqlen_k", k.shape[1], min_seqlen), ("heads", heads, 1), ("heads_kv", k.shape[2], 1)):
        if size < least:
            raise ValueError(f"q, k: {name} must be at least {least}, got {size}")
    if heads % k.shape[2] != 0:
        raise ValueError(f"k: heads_kv ({k.shape[2]}) must divide q's heads ({heads}) for GQA/MQA")
    if head_dim < 8 or head_dim % 8 != 0 or head_dim > 256:
        raise ValueError(f"q: head_dim must be a positive multiple of 8 and at most 256, got {head_dim}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if element_strides(x)[3] != 1 and 0 not in x.shape:  # an empty tensor's strides are arbitrary
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, stride is "
                             f"{element_strides(x)[3]} elements")
    if on_device:
        if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
            raise ValueError(f"q: batch and heads must be at most {MAX_GRID_YZ}, got {batch} and {heads}")
        if seqlen_q > MAX_GRID_YZ * _GRID_Z_ROWS:
            raise ValueError(f"q: seqlen_q must be at most {MAX_GRID_YZ * _GRID_Z_ROWS}, got {seqlen_q}")
        for name, x in (("k", k), ("v", v)):
            if x.device != q.device:
                raise ValueError(f"{name}: on device {x.device}, but q is on device {q.device}")


def resolve_flag(name: str, value: Any) -> bool:
    """A switch (``causal``, ``deterministic``, ``return_lse``, ``validate``): a bool, NumPy's
    included, or the integer 0 or 1. Anything else is refused rather than read by its truth
    value, which would make ``causal="false"`` causal."""
    if type(value) is bool:
        return value
    if isinstance(value, (np.bool_, numbers.Integral)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {value!r}")


def resolve_scale(softmax_scale: Any, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale: expected a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale: must be finite and positive, got {softmax_scale}")
    return scale


def plain_window(window: Any) -> bool:
    """Whether ``window`` is a tuple of two plain ints (which a plan key may hold as they are)."""
    return type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int


def resolve_window(window: Any) -> tuple[int, int]:
    """``(left, right)``: two integers >= -1 (-1 unbounded)."""
    # Plain int pairs skip the numbers.Integral checks (ABC instance checks, ~1 us each per call).
    if plain_window(window) and window[0] >= -1 and window[1] >= -1:
        return window
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window: expected a pair (left, right) of integers, got {window!r}")
    for side in window:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window: expected integers, got {window!r}")
    left, right = (int(side) for side in window)
    if left < -1 or right < -1:
        raise ValueError(f"window: values must be -1 (unbounded) or >= 0, got {window!r}")
    return left, right


def resolve_softcap(softcap: Any) -> float:
    if type(softcap) is float and 0.0 <= softcap < math.inf:  # the common case, without ABC checks
        return softcap
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap: must be finite and >= 0 (0 disables it), got {softcap}")
    return value


def framework(arrays: dict[str, Any]) -> str:
    """The framework of ``arrays["q"]``; every array (by argument name) must be on the same side
    (NumPy vs device) as q."""
    q = arrays["q"]
    kind, cls = interop.framework_of(q, "q"), type(q)
    # Arrays of q's own type are on q's side, except torch tensors, whose type holds CPU and CUDA.
    # A loop: all() over a generator costs ~0.25 us more per call.
    if kind != "torch":
        for x in arrays.values():
            if type(x) is not cls:
                break
        else:
            return kind
    found = {name: interop.framework_of(x, name) for name, x in arrays.items()}
    q_side = found["q"] == "numpy"
    for name, kind in found.items():
        if (kind == "numpy") != q_side:
            sides = ("on the CPU (NumPy)", "on the GPU")
            raise TypeError(f"{name}: is {sides[kind != 'numpy']}, but q is {sides[not q_side]}; "
                            f"pass q, k, v (and out) on the same side")
    return found["q"]


def _check_like(name: str, t, expected_shape: tuple[int, ...], like, on_device: bool) -> None:
    """``t`` (an output or a forward tensor) must have ``expected_shape``, ``like``'s dtype and
    device, and a contiguous last dimension."""
    if tuple(t.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {tuple(expected_shape)}, got {tuple(t.shape)}")
    if dtype_name(t) != dtype_name(like):
        raise TypeError(f"{name}: expected dtype {dtype_name(like)} like q, got {dtype_name(t)}")
    if element_strides(t)[-1] != 1 and 0 not in t.shape:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
    if on_device and t.device != like.device:
        raise ValueError(f"{name}: on device {t.device}, but q is on device {like.device}")


def check_out(name: str, t, expected_shape: tuple[int, ...], like, on_device: bool) -> None:
    """An output the kernels write with 16-byte stores."""
    _check_like(name, t, expected_shape, like, on_device)
    if on_device and not t.aligned_16:
        raise ValueError(f"{name}: data pointer and strides must be 16-byte aligned (the kernel "
                         f"writes 16-byte vectors)")


def check_backward_inputs(tensors: dict, lse_shape: tuple[int, ...], on_device: bool) -> None:
    """dout and out like q; lse float32, contiguous, of ``lse_shape``, on q's device; gradients
    passed in dq, dk, dv shaped like q, k, v."""
    qt, kt = tensors["q"], tensors["k"]
    _check_like("dout", tensors["dout"], qt.shape, qt, on_device)
    _check_like("out", tensors["out"], qt.shape, qt, on_device)
    lse_t = tensors["lse"]
    if dtype_name(lse_t) != "float32":
        raise TypeError(f"lse: expected float32 (as the forward's return_lse=True gives it), got {dtype_name(lse_t)}")
    if tuple(lse_t.shape) != tuple(lse_shape):
        raise ValueError(f"lse: expected shape {tuple(lse_shape)}, got {tuple(lse_t.shape)}")
    if (element_strides(lse_t) != tuple(math.prod(lse_shape[i + 1:]) for i in range(len(lse_shape)))
            and 0 not in lse_shape):
        raise ValueError("lse: must be contiguous")
    if on_device and lse_t.device != qt.device:
        raise ValueError(f"lse: on device {lse_t.device}, but q is on device {qt.device}")
    for name, like_shape in (("dq", qt.shape), ("dk", kt.shape), ("dv", kt.shape)):
        if name in tensors:
            check_out(name, tensors[name], like_shape, qt, on_device)


def check_forward(q, k, v, out, softmax_scale: Any, on_device: bool) -> float:
    """attention's arrays (DeviceTensors, or NumPy arrays; ``out`` None when not given), checked
    alike on both paths; returns the softmax scale."""
    check_qkv(q, k, v, on_device)
    scale = resolve_scale(softmax_scale, q.shape[3])
    if out is not None:
        check_out("out", out, tuple(q.shape), q, on_device)
    return scale


def check_backward(arrays: dict, softmax_scale: Any, window: Any, softcap: Any,
                   on_device: bool) -> tuple[float, tuple[int, int], float]:
    """attention_backward's arrays by name (DeviceTensors, or NumPy arrays), checked alike on both
    paths; returns the softmax scale, window and softcap."""
    q = arrays["q"]
    check_qkv(q, arrays["k"], arrays["v"], on_device)
    scale = resolve_scale(softmax_scale, q.shape[3])
    batch, seqlen_q, heads = q.shape[:3]
    check_backward_inputs(arrays, (batch, heads, seqlen_q), on_device)
    return scale, resolve_window(window), resolve_softcap(softcap)


# Packed batches (varlen.py).

def as_batch_of_one(x: Any) -> Any:
    """A packed (total, heads, head_dim) tensor seen as (1, total, heads, head_dim)."""
    if isinstance(x, interop.DeviceTensor):
        return interop.DeviceTensor(x.native, x.ptr, (1, *x.shape), (0, *x.strides), x.dtype, x.itemsize, x.device)
    return x[None]


class Lengths(NamedTuple):
    """The checked cumulative lengths: host copies (int64; None where a GPU array was not copied),
    the DeviceTensors (None for NumPy), the batch size and the longest lengths (None if not
    known). A tuple, not a frozen dataclass, because one is built per call (0.25 vs 0.8 us)."""

    host_q: np.ndarray | None
    host_k: np.ndarray | None
    device_q: Any
    device_k: Any
    batch: int
    max_seqlen_q: int | None
    max_seqlen_k: int | None = None


def _cumulative_lengths(name: str, cu: Any, on_device: bool, device: int | None,
                        copy: bool) -> tuple[Any, Any, int]:
    """(host int64 copy or None, DeviceTensor or None, batch) of a cu_seqlens argument after its
    type and shape checks. GPU arrays are copied to the host (a synchronisation) only if ``copy``."""
    kind = interop.framework_of(cu, name)
    if (kind == "numpy") == on_device:
        raise TypeError(f"{name}: must be on the same side as q ({'GPU' if on_device else 'NumPy'})")
    t = interop.describe(cu, kind, name) if on_device else None
    dtype, shape = (t.dtype, t.shape) if on_device else (str(cu.dtype), cu.shape)
    if dtype != "int32":
        raise TypeError(f"{name}: expected int32, got {dtype}")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name}: expected shape (batch + 1,) with batch >= 1, got {tuple(shape)}")
    if not on_device:
        return cu.astype(np.int64), None, shape[0] - 1
    if t.device != device:
        raise ValueError(f"{name}: on device {t.device}, but q is on device {device}")
    if t.strides != (1,):
        raise ValueError(f"{name}: must be contiguous (the kernel indexes it directly), stride is {t.strides[0]}")
    if not copy:
        return None, t, shape[0] - 1
    host = t.native.cpu().numpy() if kind == "torch" else t.native.get()
    return host.astype(np.int64), t, shape[0] - 1


def _check_lengths(name: str, cu: np.ndarray | None, total: int, max_seqlen: Any, max_name: str,
                   validate: bool) -> None:
    """Values of a cu_seqlens (None: not copied, so not checked) and its max_seqlen (the values
    behind ``validate``)."""
    if validate:
        lengths = np.diff(cu)
        if cu[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {cu[0]}")
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise ValueError(f"{name}: must not decrease, but entry {i + 1} ({cu[i + 1]}) < entry {i} ({cu[i]})")
        if cu[-1] != total:
            raise ValueError(f"{name}: last entry {cu[-1]} must equal the packed length {total}")
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)):
        raise TypeError(f"{max_name}: expected an int or None, got {type(max_seqlen).__name__}")
    least = 1 if total else 0  # a packed length above 0 puts a token in some sequence
    if max_seqlen < least:
        raise ValueError(f"{max_name}: must be at least {least}, got {max_seqlen}")
    if validate and max_seqlen < lengths.max(initial=0):
        i = int(np.argmax(lengths))
        raise ValueError(f"{max_name}: {max_seqlen} is smaller than sequence {i}'s length {lengths[i]}")


def check_varlen(arrays: dict, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 validate: bool, need_max_k: bool = False) -> tuple[str, dict, Lengths]:
    """Framework, validated tensors (packed, checked as a batch of one) and the lengths. GPU
    lengths reach the host only to be validated or to find an omitted max_seqlen_q (which every
    kernel needs) or, with ``need_max_k`` (the backward), an omitted max_seqlen_k."""
    kind = framework(arrays)
    on_device = kind != "numpy"
    tensors = {name: interop.describe(x, kind, name) if on_device else x for name, x in arrays.items()}
    for name in ("q", "k", "v"):
        if tensors[name].ndim != 3:
            raise ValueError(f"{name}: expected 3 dims (total_tokens, heads, head_dim), got shape "
                             f"{tuple(tensors[name].shape)}")
    qt, kt, vt = (as_batch_of_one(tensors[name]) for name in ("q", "k", "v"))
    check_qkv(qt, kt, vt, on_device=on_device, min_seqlen=0)
    device = tensors["q"].device if on_device else None
    cu_q, cu_q_t, batch = _cumulative_lengths("cu_seqlens_q", cu_seqlens_q, on_device, device,
                                              validate or max_seqlen_q is None)
    cu_k, cu_k_t, batch_k = _cumulative_lengths("cu_seqlens_k", cu_seqlens_k, on_device, device,
                                                validate or (need_max_k and max_seqlen_k is None))
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_k: {batch_k} sequences, but cu_seqlens_q has {batch}")
    _check_lengths("cu_seqlens_q", cu_q, tensors["q"].shape[0], max_seqlen_q, "max_seqlen_q", validate)
    _check_lengths("cu_seqlens_k", cu_k, tensors["k"].shape[0], max_seqlen_k, "max_seqlen_k", validate)
    if max_seqlen_q is None:  # cu_q was copied for it
        max_seqlen_q = int(np.diff(cu_q).max())
    if max_seqlen_k is None and cu_k is not None:
        max_seqlen_k = int(np.diff(cu_k).max())
    return kind, tensors, Lengths(cu_q, cu_k, cu_q_t, cu_k_t, batch, max_seqlen_q, max_seqlen_k)


def check_varlen_grid(lengths: Lengths) -> None:
    """The sequences index grid.y or grid.z, and causal grids put the query blocks in grid.z."""
    if lengths.batch > MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: at most {MAX_GRID_YZ} sequences, got {lengths.batch}")
    if lengths.max_seqlen_q > MAX_GRID_YZ * _GRID_Z_ROWS:
        raise ValueError(f"max_seqlen_q: must be at most {MAX_GRID_YZ * _GRID_Z_ROWS}, got {lengths.max_seqlen_q}")
