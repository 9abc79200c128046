"""What the entry points accept: argument checks and option resolving, the one place that says it.

Every check raises a TypeError or ValueError naming the argument, before anything is launched.
The checks read DeviceTensors (GPU arrays, interop.describe) or NumPy arrays alike, so the CPU
path refuses exactly what the GPU path refuses.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from cuflash import dispatch, interop

__all__ = [
    "FP8_DTYPE",
    "Fp8",
    "Lengths",
    "as_batch_of_one",
    "check_backward",
    "check_backward_inputs",
    "check_forward",
    "check_out",
    "check_qkv",
    "check_varlen",
    "check_varlen_grid",
    "declared_dtype",
    "framework",
    "plain_window",
    "resolve_fp8",
    "resolve_flag",
    "resolve_scale",
    "resolve_softcap",
    "resolve_window",
]

FP8_DTYPE = "float8_e4m3fn"  # the name torch and ml_dtypes give e4m3 (no infinities, max 448)
DEVICE_DTYPES = ("float16", "bfloat16")
HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")
FP8_OUT_DTYPES = ("bfloat16", "float16")
# Query rows per block in the grids whose grid.z counts query blocks.
_GRID_Z_ROWS = 128


def dtype_name(x: Any) -> str:
    return x.dtype if isinstance(x, interop.DeviceTensor) else x.dtype.name


def element_strides(x: Any) -> tuple[int, ...]:
    return x.strides if isinstance(x, interop.DeviceTensor) else tuple(s // x.itemsize for s in x.strides)


def _check_dtype(name: str, x: Any, allowed: tuple[str, ...], on_device: bool) -> str:
    dtype = dtype_name(x)
    if dtype not in allowed:
        if on_device and dtype in ("float32", "float64"):
            hint = ("; cast to float16 or bfloat16 first (x.astype(ml_dtypes.bfloat16) in CuPy, "
                    "x.to(torch.bfloat16) in torch)")
        elif dtype == FP8_DTYPE:
            hint = "; FP8 inputs have a forward path only"
        elif dtype.startswith("float8"):
            hint = "; of the FP8 formats only e4m3 (float8_e4m3fn) is supported"
        else:
            hint = ""
        raise TypeError(f"{name}: dtype {dtype} is not supported (expected one of {', '.join(allowed)}){hint}")
    return dtype


def check_qkv(q, k, v, on_device: bool, min_seqlen: int = 1, fp8: bool = False) -> None:
    """Shapes, dtypes, strides and devices of q, k, v (DeviceTensors, or NumPy arrays);
    ``min_seqlen`` 0 for a packed batch, whose total length may be 0; ``fp8``: the caller (a
    forward) also takes float8_e4m3fn."""
    allowed = (DEVICE_DTYPES if on_device else HOST_DTYPES) + ((FP8_DTYPE,) if fp8 else ())
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
        if batch > dispatch.MAX_GRID_YZ or heads > dispatch.MAX_GRID_YZ:
            raise ValueError(f"q: batch and heads must be at most {dispatch.MAX_GRID_YZ}, got {batch} and {heads}")
        if seqlen_q > dispatch.MAX_GRID_YZ * _GRID_Z_ROWS:
            raise ValueError(f"q: seqlen_q must be at most {dispatch.MAX_GRID_YZ * _GRID_Z_ROWS}, got {seqlen_q}")
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


def _check_like(name: str, t, expected_shape: tuple[int, ...], like, on_device: bool, dtype: str | None = None) -> None:
    """``t`` (an output or a forward tensor) must have ``expected_shape``, ``dtype`` (default
    ``like``'s), ``like``'s device, and a contiguous last dimension."""
    if tuple(t.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {tuple(expected_shape)}, got {tuple(t.shape)}")
    if dtype is None and dtype_name(t) != dtype_name(like):
        raise TypeError(f"{name}: expected dtype {dtype_name(like)} like q, got {dtype_name(t)}")
    if dtype is not None and dtype_name(t) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (out_dtype), got {dtype_name(t)}")
    if element_strides(t)[-1] != 1 and 0 not in t.shape:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
    if on_device and t.device != like.device:
        raise ValueError(f"{name}: on device {t.device}, but q is on device {like.device}")


def check_out(name: str, t, expected_shape: tuple[int, ...], like, on_device: bool, dtype: str | None = None) -> None:
    """An output the kernels write with 16-byte stores; ``dtype`` as for _check_like."""
    _check_like(name, t, expected_shape, like, on_device, dtype)
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


def check_forward(q, k, v, out, softmax_scale: Any, on_device: bool, descales: tuple = (None, None, None),
                  out_dtype: Any = None) -> tuple[float, Fp8 | None]:
    """attention's arrays (DeviceTensors, or NumPy arrays; ``out`` None when not given), checked
    alike on both paths; returns the softmax scale and the FP8 options (resolve_fp8)."""
    check_qkv(q, k, v, on_device, fp8=True)
    scale = resolve_scale(softmax_scale, q.shape[3])
    fp8 = resolve_fp8(q, k, v, *descales, out_dtype, on_device)
    if out is not None:
        check_out("out", out, tuple(q.shape), q, on_device, fp8 and fp8.out_dtype)
    return scale, fp8


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
                 validate: bool, need_max_k: bool = False, dtype: Any = None) -> tuple[str, dict, Lengths]:
    """Framework, validated tensors (packed, checked as a batch of one) and the lengths. GPU
    lengths reach the host only to be validated or to find an omitted max_seqlen_q (which every
    kernel needs) or, with ``need_max_k`` (the backward), an omitted max_seqlen_k. ``dtype``:
    the forward's declared dtype of q, k, v (declared_dtype); FP8 is taken only with the
    forward's ``need_max_k`` False."""
    kind = framework(arrays)
    on_device = kind != "numpy"
    tensors = {name: interop.describe(x, kind, name) if on_device else x for name, x in arrays.items()}
    if dtype is not None:
        for name in ("q", "k", "v"):
            tensors[name] = declared_dtype(name, tensors[name], dtype)
    for name in ("q", "k", "v"):
        if tensors[name].ndim != 3:
            raise ValueError(f"{name}: expected 3 dims (total_tokens, heads, head_dim), got shape "
                             f"{tuple(tensors[name].shape)}")
    qt, kt, vt = (as_batch_of_one(tensors[name]) for name in ("q", "k", "v"))
    check_qkv(qt, kt, vt, on_device=on_device, min_seqlen=0, fp8=not need_max_k)
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
    if lengths.batch > dispatch.MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: at most {dispatch.MAX_GRID_YZ} sequences, got {lengths.batch}")
    if lengths.max_seqlen_q > dispatch.MAX_GRID_YZ * _GRID_Z_ROWS:
        raise ValueError(f"max_seqlen_q: must be at most {dispatch.MAX_GRID_YZ * _GRID_Z_ROWS}, got {lengths.max_seqlen_q}")


# FP8 (e4m3) inputs.

class Fp8(NamedTuple):
    """An FP8 call's resolved options. Each descale is a float (a scalar, 1.0 for None) or a
    contiguous float32 array of shape (batch, heads_kv) -- (num_sequences, heads_kv) for a
    packed batch -- whose entry [b, h] multiplies kv head h of sequence b (and, for descale_q,
    every query head of that group): a DeviceTensor on the GPU, a NumPy array on the host.
    The inputs stand for ``x.astype(float) * descale``."""

    out_dtype: str  # "bfloat16" or "float16"
    descale_q: Any
    descale_k: Any
    descale_v: Any


def resolve_fp8(q, k, v, descale_q: Any, descale_k: Any, descale_v: Any, out_dtype: Any, on_device: bool,
                batch: int | None = None) -> Fp8 | None:
    """The FP8 options of a call whose q, k, v passed check_qkv (DeviceTensors or NumPy arrays,
    fixed-length 4-dim or packed 3-dim); None for 16-bit (or host float32/64) inputs.

    ``batch``: the descales' first dimension, q's batch when None (a packed batch passes its
    number of sequences). For FP8 inputs: ``out_dtype`` None (bfloat16), "bfloat16" or
    "float16" (NumPy/torch/CuPy dtypes naming those accepted too); each descale None, a real
    number (finite, > 0) or a float32 (batch, heads_kv) contiguous array on q's side and
    device. A host (NumPy) descale array is checked finite and positive; a device array's
    values are not checked (that would need a device-to-host copy and a synchronisation):
    NaN, infinite or non-positive entries there give NaN or wrong outputs, not an error.
    For inputs that are not FP8, any descale or out_dtype given is a ValueError (nothing is
    silently ignored). Raises TypeError/ValueError naming the argument, before any launch.
    """
    if dtype_name(q) != FP8_DTYPE:
        for name, value in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v),
                            ("out_dtype", out_dtype)):
            if value is not None:
                raise ValueError(f"{name}: only FP8 (float8_e4m3fn) inputs take it, but q is {dtype_name(q)}")
        return None
    shape = (q.shape[0] if batch is None else batch, k.shape[-2])
    descales = (_resolve_descale(name, value, shape, q, on_device)
                for name, value in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v)))
    return Fp8(_resolve_out_dtype(out_dtype), *descales)


def _resolve_out_dtype(out_dtype: Any) -> str:
    if out_dtype is None:
        return "bfloat16"
    if isinstance(out_dtype, str):
        name = out_dtype
    elif type(out_dtype).__module__.startswith("torch"):
        name = str(out_dtype).removeprefix("torch.")
    else:  # NumPy dtypes and scalar types, ml_dtypes.bfloat16
        try:
            name = np.dtype(out_dtype).name
        except TypeError:
            name = None
    if name not in FP8_OUT_DTYPES:
        raise TypeError(f"out_dtype: expected bfloat16 or float16 for FP8 inputs, got {out_dtype!r}")
    return name


def _resolve_descale(name: str, value: Any, shape: tuple[int, int], q, on_device: bool) -> Any:
    """A descale: a float, or the checked (batch, heads_kv) float32 array (see resolve_fp8)."""
    if value is None:
        return 1.0
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        scalar = float(value)
        if not math.isfinite(scalar) or scalar <= 0:
            raise ValueError(f"{name}: must be finite and positive, got {value}")
        return scalar
    kind = interop.framework_of(value, name)
    if (kind == "numpy") == on_device:
        raise TypeError(f"{name}: must be on the same side as q ({'GPU' if on_device else 'NumPy'}), or a number")
    t = interop.describe(value, kind, name) if on_device else value
    if dtype_name(t) != "float32":
        raise TypeError(f"{name}: expected float32, got {dtype_name(t)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape (batch, heads_kv) = {shape}, got {tuple(t.shape)}")
    if element_strides(t) != (shape[1], 1) and 0 not in shape:
        raise ValueError(f"{name}: must be contiguous (the kernel indexes it directly)")
    if on_device:
        if t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but q is on device {q.device}")
    elif not (np.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"{name}: every entry must be finite and positive")
    return t


def declared_dtype(name: str, x: Any, dtype: Any) -> Any:
    """``x`` (a DeviceTensor or NumPy array) as the entry point's ``dtype`` argument declares it:
    None leaves it as it is; ``"e4m3"`` reads a uint8 array as float8_e4m3fn bytes (CuPy cannot
    hold an ml_dtypes float8 array, so a CuPy caller passes the bytes as uint8), a view, no copy."""
    if dtype is None:
        return x
    if dtype not in ("e4m3", FP8_DTYPE):
        raise ValueError(f"dtype: expected None or 'e4m3', got {dtype!r}")
    given = dtype_name(x)
    if given == FP8_DTYPE:
        return x
    if given != "uint8":
        raise TypeError(f"{name}: dtype='e4m3' reads uint8 (or float8_e4m3fn) arrays as e4m3, got {given}")
    if isinstance(x, interop.DeviceTensor):
        return x._replace(dtype=FP8_DTYPE)
    return x.view(ml_dtypes.float8_e4m3fn)

