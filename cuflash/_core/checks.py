"""What the entry points accept: argument checks and option resolving, the one place that says it.

Every check raises a TypeError or ValueError naming the argument, before anything is launched.
The checks read DeviceTensors (GPU arrays, interop.describe) or NumPy arrays alike, so the CPU
path refuses exactly what the GPU path refuses.

A checked GPU call is a record (ForwardCall, BackwardCall, KvCall, CombineCall, MlaCall,
QuantizeCall) whose ``plan_key`` is the key of its launch plan (plan.run): everything the plan
reads but pointers, written beside the fields it reads so that a new field meets its key.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from cuflash._core import dispatch, interop

__all__ = [
    "BackwardCall",
    "Bias",
    "CombineCall",
    "Dropout",
    "FP8_DTYPE",
    "ForwardCall",
    "Fp8",
    "KV_ARRAYS",
    "KvCall",
    "MLA_ARRAYS",
    "MlaCall",
    "Lengths",
    "NO_BIAS",
    "NO_DROPOUT_WORDS",
    "QuantizeCall",
    "as_batch_of_one",
    "check_backward",
    "check_backward_inputs",
    "check_combine",
    "check_dropout",
    "check_forward",
    "check_kvcache",
    "check_mla",
    "check_out",
    "check_qkv",
    "check_sinks_alibi",
    "check_varlen",
    "check_varlen_grid",
    "check_writable",
    "bias_layouts",
    "declared_dtype",
    "described_bias",
    "framework",
    "output_shape",
    "plain_window",
    "resolve_fp8",
    "resolve_dropout_p",
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


def _layout(x: Any) -> Any:
    """What a plan key holds of a field that may be an array: a DeviceTensor's layout, any other
    value (a number, None) as it is."""
    return x.layout if isinstance(x, interop.DeviceTensor) else x


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
    """Shapes, dtypes, strides and devices of q, k, v (DeviceTensors, or NumPy arrays); v's
    head_dim may differ from q's; ``min_seqlen`` 0 for a packed batch, whose total length may be 0;
    ``fp8``: the caller (a forward) also takes float8_e4m3fn."""
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
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)} but for head_dim")
    if k.shape[3] != head_dim:
        raise ValueError(f"k: head_dim {k.shape[3]} must equal q's {head_dim}")
    for name, size, least in (("batch", batch, 1), ("seqlen_q", seqlen_q, min_seqlen),
                              ("seqlen_k", k.shape[1], min_seqlen), ("heads", heads, 1), ("heads_kv", k.shape[2], 1)):
        if size < least:
            raise ValueError(f"q, k: {name} must be at least {least}, got {size}")
    if heads % k.shape[2] != 0:
        raise ValueError(f"k: heads_kv ({k.shape[2]}) must divide q's heads ({heads}) for GQA/MQA")
    for name, size in (("q", head_dim), ("v", v.shape[3])):
        if size < 8 or size % 8 != 0 or size > 256:
            raise ValueError(f"{name}: head_dim must be a positive multiple of 8 and at most 256, got {size}")
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
    """Whether ``window`` is a tuple of two plain ints (which a signature may hold as they are,
    plan.run)."""
    return type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int


def resolve_window(window: Any) -> tuple[int, int]:
    """``(left, right)``: two integers >= -1 (-1 unbounded)."""
    # Plain int pairs skip the numbers.Integral checks: ABC instance checks, slow on a per-call path.
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


def framework(arrays: dict[str, Any], lead: str = "q") -> str:
    """The framework of ``arrays[lead]``; every array (by argument name) must be on the same side
    (NumPy vs device) as it."""
    q = arrays[lead]
    kind, cls = interop.framework_of(q, lead), type(q)
    # Arrays of q's own type are on q's side, except torch tensors, whose type holds CPU and CUDA.
    # A loop, not all() over a generator: no generator object per call.
    if kind != "torch":
        for x in arrays.values():
            if type(x) is not cls:
                break
        else:
            return kind
    found = {name: interop.framework_of(x, name) for name, x in arrays.items()}
    q_side = found[lead] == "numpy"
    for name, kind in found.items():
        if (kind == "numpy") != q_side:
            sides = ("on the CPU (NumPy)", "on the GPU")
            raise TypeError(f"{name}: is {sides[kind != 'numpy']}, but {lead} is {sides[not q_side]}; "
                            f"pass every array on the same side")
    return found[lead]


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
    check_writable(name, t)
    if on_device and not t.aligned_16:
        raise ValueError(f"{name}: data pointer and strides must be 16-byte aligned (the kernel "
                         f"writes 16-byte vectors)")


def check_writable(name: str, t) -> None:
    """A NumPy array cuflash writes into (an output, a cache it appends to) must be writable;
    CuPy arrays and torch tensors carry no such flag."""
    if isinstance(t, np.ndarray) and not t.flags.writeable:
        raise ValueError(f"{name}: is read-only (its NumPy flag writeable is False); pass a writable array")


def output_shape(q, v) -> tuple[int, ...]:
    """The shape of attention's output (and of its gradient dout): q's with v's head_dim."""
    return (*q.shape[:-1], v.shape[-1])


def check_backward_inputs(tensors: dict, lse_shape: tuple[int, ...], on_device: bool) -> None:
    """dout and out of output_shape, q's dtype; lse float32, contiguous, of ``lse_shape``, on q's
    device; gradients passed in dq, dk, dv shaped like q, k, v."""
    qt, kt, vt = tensors["q"], tensors["k"], tensors["v"]
    _check_like("dout", tensors["dout"], output_shape(qt, vt), qt, on_device)
    _check_like("out", tensors["out"], output_shape(qt, vt), qt, on_device)
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
    for name, like_shape in (("dq", qt.shape), ("dk", kt.shape), ("dv", vt.shape)):
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
        check_out("out", out, output_shape(q, v), q, on_device, fp8 and fp8.out_dtype)
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


# Attention sinks and ALiBi, checked alike on both paths.
SINK_DTYPES = ("float32", "bfloat16", "float16")


class Bias(NamedTuple):
    """The checked sinks and ALiBi slopes of a GPU call as the kernels read them (cuda_src/common/
    bias.cuh): float32 DeviceTensors, None where not given; the sinks contiguous, the slopes'
    heads contiguous."""

    sinks: Any = None
    alibi: Any = None

    @property
    def pointers(self) -> tuple[int, int]:
        """(sinks, alibi_slopes) pointers, 0 where not given, in the params' order."""
        return (self.sinks.ptr if self.sinks is not None else 0, self.alibi.ptr if self.alibi is not None else 0)

    @property
    def alibi_stride(self) -> int | None:
        """What a plan reads of the slopes: None without them, else their batch stride (0 for one
        slope per head)."""
        if self.alibi is None:
            return None
        return self.alibi.strides[0] if self.alibi.ndim == 2 else 0


NO_BIAS = Bias()


def described_bias(sinks: Any, alibi_slopes: Any, framework_name: str) -> Bias | None:
    """The Bias of GPU ``sinks`` and ``alibi_slopes`` (either may be None) as they are: float32 of
    q's framework with a contiguous last dimension, described but not checked, for a call whose
    signature holds their layouts (plan.run records a signature only after the full checks,
    check_sinks_alibi, have passed its call). None where a copy may be due or the checks must
    speak: another dtype, framework or stride."""
    described = []
    for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if x is None:
            described.append(None)
            continue
        if interop.framework_of(x, name) != framework_name:
            return None
        t = interop.describe(x, framework_name, name)
        if t.dtype != "float32" or t.strides[-1] != 1:
            return None
        described.append(t)
    return Bias(*described)


def bias_layouts(bias: Bias) -> tuple:
    """What a signature holds of a call's sinks and slopes: their layouts (None where absent)."""
    return _layout(bias.sinks), _layout(bias.alibi)


def check_sinks_alibi(sinks: Any, alibi_slopes: Any, framework_name: str, q, heads: int, batch: int,
                      batch_name: str = "batch") -> Any:
    """``sinks`` (heads,) and ``alibi_slopes`` (heads,) or (batch, heads), each None or an array on
    q's side. For NumPy q: (sinks, alibi_slopes) as NumPy arrays, their values checked (a sink
    finite or -inf, slopes finite). For GPU q: a Bias (shape, dtype and device checked; values are
    not, which would wait for the device: a NaN or +inf sink makes its head's rows NaN)."""
    on_device = framework_name != "numpy"
    checked = []
    for name, x, allowed, shapes, shape_text in (
            ("sinks", sinks, SINK_DTYPES if on_device else (*SINK_DTYPES, "float64"), ((heads,),), f"({heads},)"),
            ("alibi_slopes", alibi_slopes, ("float32",), ((heads,), (batch, heads)),
             f"({heads},) or ({batch_name}, heads) = ({batch}, {heads})")):
        if x is None:
            checked.append(None)
            continue
        kind = interop.framework_of(x, name)
        if (kind == "numpy") == on_device:
            raise TypeError(f"{name}: must be on the same side as q ({'GPU' if on_device else 'NumPy'})")
        t = interop.describe(x, kind, name) if on_device else x
        if dtype_name(t) not in allowed:
            raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {dtype_name(t)}")
        if tuple(t.shape) not in shapes:
            raise ValueError(f"{name}: expected shape {shape_text}, got {tuple(t.shape)}")
        if on_device:
            if t.device != q.device:
                raise ValueError(f"{name}: on device {t.device}, but q is on device {q.device}")
            checked.append(interop.float32_contiguous(t, kind))
            continue
        values = np.asarray(t, np.float64)
        # A sink of -inf is no sink; +inf or NaN would make every row's output NaN.
        if name == "sinks" and (np.isnan(values).any() or np.isposinf(values).any()):
            raise ValueError("sinks: every entry must be finite or -inf")
        if name == "alibi_slopes" and not np.isfinite(values).all():
            raise ValueError("alibi_slopes: every entry must be finite")
        checked.append(t)
    if on_device:
        return Bias(*checked) if checked != [None, None] else NO_BIAS
    return tuple(checked)


# score_mod and mask_mod (_core/expressions.py): a user's attention variant.

class Mods(NamedTuple):
    """Checked score_mod and mask_mod (expressions.Mod or None) and the mod_args arrays by name."""

    score: Any
    mask: Any
    args: dict


def check_mods(score_mod: Any, mask_mod: Any, mod_args: Any, framework_name: str) -> Mods | None:
    """The expressions checked (expressions.parse_mod: each error names the argument and what is
    wrong) over mod_args (a dict of arrays on q's side), then refused on the GPU, whose kernels do
    not take them yet. None when neither is given (and mod_args then must not be)."""
    from cuflash._core import expressions

    if score_mod is None and mask_mod is None:
        if mod_args:
            raise ValueError("mod_args: given without score_mod or mask_mod, which read them")
        return None
    if mod_args is None:
        mod_args = {}
    if not isinstance(mod_args, dict):
        raise TypeError(f"mod_args: expected a dict of name -> array, got {type(mod_args).__name__}")
    on_device = framework_name != "numpy"
    for name, array in mod_args.items():
        kind = interop.framework_of(array, f"mod_args[{name!r}]")
        if (kind == "numpy") == on_device:
            raise TypeError(f"mod_args[{name!r}]: must be on the same side as q ({'GPU' if on_device else 'NumPy'})")
    mods = Mods(*(expressions.parse_mod(kind, text, mod_args) if text is not None else None
                  for kind, text in (("score_mod", score_mod), ("mask_mod", mask_mod))), dict(mod_args))
    if on_device:
        raise NotImplementedError("score_mod, mask_mod: the GPU kernels do not take them yet; NumPy arrays (the CPU "
                                  "path) do")
    return mods


# Dropout: checked alike on both paths.
_U64_END = 1 << 64


class Dropout(NamedTuple):
    """A checked dropout: P's elements dropped with probability ``p``, the keep mask drawn from the
    counter-based stream at (``seed``, ``offset``) (cuflash/_cpu/philox.py, common/philox.cuh).
    On a GPU call ``seed`` may be the DeviceTensor of an int64 (seed, offset) pair (offset 0)."""

    p: float
    seed: Any
    offset: int

    @property
    def words(self) -> tuple[int, int, int]:
        """What each launch writes into the params' DROPOUT_WORDS (params.py): the device pair's
        pointer, which the kernels then read, or 0 and the seed and offset."""
        if isinstance(self.seed, int):
            return 0, self.seed, self.offset
        return self.seed.ptr, 0, 0


# The DROPOUT_WORDS of a launch without dropout (its params' dropout_scale 0 switches it off).
NO_DROPOUT_WORDS = (0, 0, 0)


def _counter(name: str, value: Any) -> int:
    """``seed`` or ``offset``: an integer in [0, 2**64)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}")
    if not 0 <= int(value) < _U64_END:
        raise ValueError(f"{name}: expected an integer in [0, 2**64), got {value}")
    return int(value)


def resolve_dropout_p(dropout_p: Any) -> float:
    """``dropout_p``: a real number in [0, 1)."""
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:  # the common case, without ABC checks
        return dropout_p
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a real number, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    return p


def _device_seed(seed: Any, offset: Any, q) -> Any:
    """A GPU call's seed given as a device array: int64 (2,) holding (seed, offset), on q's device,
    which the kernels will read at run time (a CUDA graph's replays then draw the values of each
    replay, and the caller never waits for the device); offset stays 0, being the second element."""
    kind = interop.framework_of(seed, "seed")
    if kind == "numpy":
        raise TypeError("seed: expected an integer, or an int64 array (seed, offset) on q's device")
    t = interop.describe(seed, kind, "seed")
    if t.dtype != "int64" or tuple(t.shape) != (2,) or t.strides != (1,):
        raise ValueError(f"seed: a device array holds (seed, offset) as contiguous int64 of shape (2,), got "
                         f"{t.dtype} {tuple(t.shape)} with strides {t.strides}")
    if t.device != q.device:
        raise ValueError(f"seed: on device {t.device}, but q is on device {q.device}")
    if _counter("offset", offset) != 0:
        raise ValueError("offset: a device seed array holds the offset; leave offset 0")
    return t


def check_dropout(dropout_p: Any, seed: Any, offset: Any, framework_name: str, q=None) -> Dropout | None:
    """``dropout_p`` a real number in [0, 1); with it above 0, ``seed`` an integer in [0, 2**64)
    (there is no global generator outside torch, so none is made up) and ``offset`` one too
    (default 0): a Dropout, or None for dropout_p 0. A seed or offset given with dropout_p 0 is
    checked and changes nothing. A GPU call (``q`` its DeviceTensor) may give ``seed`` as a device
    array instead (_device_seed), whose DeviceTensor the Dropout then holds."""
    p = resolve_dropout_p(dropout_p)
    on_device = framework_name != "numpy"
    if seed is None or (isinstance(seed, numbers.Integral) or not on_device):
        seed = None if seed is None else _counter("seed", seed)
        offset = _counter("offset", offset)
    else:
        seed, offset = _device_seed(seed, offset, q), 0
    if p == 0.0:
        return None
    if seed is None:
        raise ValueError("seed: dropout_p > 0 needs a seed (an integer in [0, 2**64)); the torch wrappers draw "
                         "one from torch's generator")
    if on_device and not GPU_DROPOUT:
        raise NotImplementedError("dropout_p: not yet taken by the GPU kernels; NumPy inputs and CPU torch tensors "
                                  "run it")
    return Dropout(p, seed, offset)


# Whether GPU calls take dropout. The kernels' dropout (docs/dropout.md) is built and its host
# side tested on the CPU; it is turned on once tests/test_dropout_gpu.py has passed on a GPU.
GPU_DROPOUT = False


# Checked GPU forward and backward calls, fixed-length (api.py) or packed (varlen.py).

class ForwardCall(NamedTuple):
    """A checked GPU forward call, of a fixed-length batch (BSHD) or a packed one (``lengths``):
    the DeviceTensors the kernel reads (16-byte-aligned copies of any that were not) and the
    resolved options."""

    q: Any
    k: Any
    v: Any
    out: Any  # None: allocated per call
    scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    fp8: Fp8 | None
    lengths: Lengths | None = None
    alibi: int | None = None  # Bias.alibi_stride: None without ALiBi slopes
    dropout: float = 0.0  # Dropout.p; its seed and offset are the launch's, not the plan's

    def plan_key(self) -> tuple:
        """Everything plan.build_forward reads but pointers; of a packed batch's lengths, the number
        of sequences and the longest query sequence (the grid)."""
        lengths = self.lengths
        return ("forward", self.q.layout, self.k.layout, self.v.layout, _layout(self.out), self.scale, self.causal,
                self.window, self.softcap, self.fp8 and self.fp8.plan_key(),
                lengths and (lengths.batch, lengths.max_seqlen_q), self.alibi, self.dropout)


class BackwardCall(NamedTuple):
    """A checked GPU backward call, fixed-length or packed, as ForwardCall: the inputs the kernels
    read, the gradients given (None: allocated per call) and the resolved options."""

    q: Any
    k: Any
    v: Any
    out: Any
    dout: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any
    scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    deterministic: bool
    lengths: Lengths | None = None
    alibi: int | None = None  # Bias.alibi_stride: None without ALiBi slopes
    dropout: float = 0.0  # as ForwardCall's

    def plan_key(self) -> tuple:
        """Everything plan.build_backward reads but pointers; of a packed batch's lengths, the
        number of sequences and the longest query and key sequences (the grids)."""
        lengths = self.lengths
        return ("backward", self.q.layout, self.k.layout, self.v.layout, self.out.layout, self.dout.layout,
                self.lse.layout, _layout(self.dq), _layout(self.dk), _layout(self.dv), self.scale, self.causal,
                self.window, self.softcap, self.deterministic,
                lengths and (lengths.batch, lengths.max_seqlen_q, lengths.max_seqlen_k), self.alibi, self.dropout)


# Packed batches (varlen.py).

def as_batch_of_one(x: Any) -> Any:
    """A packed (total, heads, head_dim) tensor seen as (1, total, heads, head_dim)."""
    if isinstance(x, interop.DeviceTensor):
        return interop.DeviceTensor(x.native, x.ptr, (1, *x.shape), (0, *x.strides), x.dtype, x.itemsize, x.device)
    return x[None]


class Lengths(NamedTuple):
    """The checked cumulative lengths: host copies (int64; None where a GPU array was not copied),
    the DeviceTensors (None for NumPy), the batch size and the longest lengths (None if not
    known). A tuple, not a frozen dataclass, because one is built per call and a frozen dataclass's
    constructor sets each field through object.__setattr__."""

    host_q: np.ndarray | None
    host_k: np.ndarray | None
    device_q: Any
    device_k: Any
    batch: int
    max_seqlen_q: int | None
    max_seqlen_k: int | None = None
    # seqused_q / seqused_k: host int64 copies (None unless NumPy or validated) and DeviceTensors.
    used_q: np.ndarray | None = None
    used_k: np.ndarray | None = None
    device_used_q: Any = None
    device_used_k: Any = None


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


def check_seqused(lengths: Lengths, seqused_q: Any, seqused_k: Any, on_device: bool, device: int | None,
                  validate: bool) -> Lengths:
    """``lengths`` with the used prefixes of a packed forward: each None or int32 (batch,),
    contiguous, on q's side and device; their values (0 <= seqused[i] <= sequence i's length) are
    checked on the host, and for GPU arrays with ``validate`` (a device-to-host copy)."""
    found = {}
    for name, used, cu in (("seqused_q", seqused_q, lengths.host_q), ("seqused_k", seqused_k, lengths.host_k)):
        if used is None:
            found[name] = (None, None)
            continue
        kind = interop.framework_of(used, name)
        if (kind == "numpy") == on_device:
            raise TypeError(f"{name}: must be on the same side as q ({'GPU' if on_device else 'NumPy'})")
        t = interop.describe(used, kind, name) if on_device else used
        _int_array(name, t, (lengths.batch,), on_device, device)
        host = None
        if not on_device or validate:
            host = _host_values(t, kind)
            sizes = np.diff(cu)
            bad = np.flatnonzero((host < 0) | (host > sizes))
            if bad.size:
                i = bad[0]
                raise ValueError(f"{name}: entry {i} ({host[i]}) is outside 0..{sizes[i]}, sequence {i}'s length")
        found[name] = (host, t if on_device else None)
    (used_q, device_q), (used_k, device_k) = found["seqused_q"], found["seqused_k"]
    return lengths._replace(used_q=used_q, used_k=used_k, device_used_q=device_q, device_used_k=device_k)


def used_prefix_sequences(lengths: Lengths, framework: str) -> Lengths:
    """The backward of a packed batch with seqused_q / seqused_k as that of a packed batch without
    them, of three sequences per sequence: its used queries against its used keys (the masks
    aligned against the used lengths, as the forward's), its other queries against no key, and its
    other keys against no query. The last two give zero gradients, so the gradients are those of
    the used prefixes, 0 elsewhere. A used length past its sequence's counts as all of it, as in
    the forward. The new cumulative lengths are computed from the host copies where there are any,
    and from the GPU arrays by their framework on its current stream (no synchronisation)."""
    sides = {"q": (lengths.host_q, lengths.device_q, lengths.used_q, lengths.device_used_q),
             "k": (lengths.host_k, lengths.device_k, lengths.used_k, lengths.device_used_k)}
    found = {}
    for side, (host, device, used_host, used_device) in sides.items():
        new_host = new_device = None
        if host is not None and (used_host is not None or used_device is None):
            new_host = _three_per_sequence(np, host, used_host, side == "q")
        if device is not None:
            xp = _array_module(framework)
            used = used_device.native if used_device is not None else None
            new_device = interop.describe(_three_per_sequence(xp, device.native, used, side == "q"), framework,
                                          f"cu_seqlens_{side}")
        found[side] = (new_host, new_device)
    (host_q, device_q), (host_k, device_k) = found["q"], found["k"]
    return Lengths(host_q, host_k, device_q, device_k, 3 * lengths.batch, lengths.max_seqlen_q, lengths.max_seqlen_k)


def _three_per_sequence(xp, cu, used, queries: bool):
    """used_prefix_sequences' cumulative lengths of one side, in array module ``xp``: queries
    [begin, middle) (with the used keys), [middle, end) (with no key), then none; keys [begin,
    middle) (with the used queries), none, then [middle, end) (with no query)."""
    begin, end = cu[:-1], cu[1:]
    sizes = end - begin
    middle = begin + (xp.maximum(xp.minimum(used, sizes), sizes * 0) if used is not None else sizes)
    parts = (begin, middle, end) if queries else (begin, middle, middle)
    return xp.concatenate([xp.stack(parts, 1).reshape(-1), cu[-1:]])


def _array_module(framework: str):
    """The module whose functions act on ``framework``'s arrays (torch or CuPy)."""
    if framework == "torch":
        import torch

        return torch
    import cupy

    return cupy


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

    @property
    def descales(self) -> tuple:
        return self.descale_q, self.descale_k, self.descale_v

    def plan_key(self) -> tuple:
        """What a plan reads: the output dtype, each scalar descale's value (folded into the
        kernel argument) and each descale array's layout."""
        return self.out_dtype, _layout(self.descale_q), _layout(self.descale_k), _layout(self.descale_v)


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



# Attention against a KV cache (kvcache.py).

class KvCall(NamedTuple):
    """A checked attention_with_kvcache call. ``tensors``: by argument name, DeviceTensors (GPU) or
    NumPy arrays, for every array given (q, k_cache, v_cache, k, v, cache_seqlens, page_table,
    cache_batch_idx, cache_leftpad, cu_seqlens_q, rotary_cos, rotary_sin, out, rotary_seqlens,
    cu_seqlens_k_new). ``host``: int64 host
    copies of the integer arrays whose values were read (all of them on the CPU path, only with
    validate on the GPU). ``cache_seqlens``: None (the whole capacity), an int, or the array in
    ``tensors``. ``seqlen_new``: tokens appended per sequence (fixed-length q; with cu_seqlens_q
    each sequence appends as many as it has queries; with cu_seqlens_k_new the packed total, a
    bound on any sequence's), 0 when k, v are not given."""

    framework: str
    tensors: dict
    host: dict
    batch: int
    max_seqlen_q: int
    heads: int
    heads_kv: int
    head_dim: int
    page_size: int  # 0: a contiguous cache
    capacity: int  # positions per sequence: seqlen_cache, or max_pages * page_size
    seqlen_new: int
    varlen: bool
    cache_seqlens: Any
    scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    rotary_dim: int  # 0: no rotary
    rotary_interleaved: bool
    rotary_per_row: bool
    num_splits: int
    descale_k: Any  # FP8 cache: float or (batch, heads_kv) float32 array; else None
    descale_v: Any
    return_lse: bool
    alibi: int | None = None  # Bias.alibi_stride: None without ALiBi slopes
    descale_q: Any = None  # e4m3 q: float or (batch, heads_kv) float32 array; else None

    def plan_key(self) -> tuple:
        """Everything plan.build_kvcache reads but pointers: each array's layout by name, every
        resolved option (cache_seqlens and the descales where numbers) and whether q's pointer is
        16-byte aligned (dispatch.kvcache_prefill); not the host copies, nor return_lse (the
        launch's)."""
        t = self.tensors
        return ("attention_with_kvcache", *(_layout(t.get(name)) for name in KV_ARRAYS), t["q"].ptr % 16 == 0,
                self.batch, self.max_seqlen_q, self.heads, self.heads_kv, self.head_dim, self.page_size,
                self.capacity, self.seqlen_new, self.varlen, _layout(self.cache_seqlens), self.scale, self.causal,
                self.window, self.softcap, self.rotary_dim, self.rotary_interleaved, self.rotary_per_row,
                self.num_splits, _layout(self.descale_k), _layout(self.descale_v), self.alibi,
                _layout(self.descale_q))


# KvCall.tensors' names, in the order KvCachePlan.launch takes their pointers.
KV_ARRAYS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "page_table", "cache_batch_idx", "cache_leftpad",
             "cu_seqlens_q", "rotary_cos", "rotary_sin", "out", "rotary_seqlens", "cu_seqlens_k_new")


class KvOptions(NamedTuple):
    """attention_with_kvcache's arguments but the arrays, as passed: check_kvcache's after ``arrays``."""

    cache_seqlens: Any
    max_seqlen_q: Any
    rotary_interleaved: Any
    causal: Any
    softmax_scale: Any
    window: Any
    softcap: Any
    num_splits: Any
    descale_k: Any
    descale_v: Any
    return_lse: Any
    validate: Any
    dtype: Any = None
    descale_q: Any = None


# The output dtype of an e4m3 q's attention (FlashAttention-3's FP8 forward writes bf16).
KV_FP8_Q_OUT = "bfloat16"
_KV_INT_ARRAYS = ("cache_seqlens", "page_table", "cache_batch_idx", "cache_leftpad", "cu_seqlens_q", "rotary_seqlens")


def _int_array(name: str, t, shape: tuple[int, ...], on_device: bool, device) -> None:
    """An int32 argument of ``shape``, contiguous (the kernels index it directly), on q's device."""
    if dtype_name(t) != "int32":
        raise TypeError(f"{name}: expected int32, got {dtype_name(t)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    dense = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if any(s != d for s, d, n in zip(element_strides(t), dense, shape) if n > 1):
        raise ValueError(f"{name}: must be contiguous (the kernels index it directly)")
    if on_device and t.device != device:
        raise ValueError(f"{name}: on device {t.device}, but q is on device {device}")


def page_rows(page_table: Any, cache_batch_idx: Any, batch: int, validate: Any) -> Any:
    """FlashAttention-3's cache_batch_idx with a page_table: sequence b reads the page-table row
    cache_batch_idx[b]. Those rows gathered into a table (batch, max_pages) of the arrays'
    framework (on the GPU one small gather on the framework's stream), after the checks of both:
    int32, page_table 2-D and contiguous, cache_batch_idx (batch,), one side and device; the
    indices within page_table's rows where their values are read (NumPy, or ``validate``)."""
    validate = resolve_flag("validate", validate)
    arrays = {"page_table": page_table, "cache_batch_idx": cache_batch_idx}
    kind = framework(arrays, "page_table")
    on_device = kind != "numpy"
    table, index = (interop.describe(x, interop.framework_of(x, n), n) if on_device else x for n, x in arrays.items())
    if table.ndim != 2:
        raise ValueError(f"page_table: expected shape (batch_cache, max_pages), got {tuple(table.shape)}")
    _int_array("page_table", table, tuple(table.shape), on_device, table.device if on_device else None)
    _int_array("cache_batch_idx", index, (batch,), on_device, table.device if on_device else None)
    if validate or not on_device:
        values = _host_values(index, kind)
        bad = np.flatnonzero((values < 0) | (values >= table.shape[0]))
        if bad.size:
            raise ValueError(f"cache_batch_idx: entry {bad[0]} is {values[bad[0]]}, outside page_table's "
                             f"{table.shape[0]} rows")
    if not on_device:
        return page_table[cache_batch_idx]
    return page_table[cache_batch_idx.long()] if kind == "torch" else page_table[cache_batch_idx]


def _host_values(t, kind: str) -> np.ndarray:
    """An int array's values on the host, int64 (a device-to-host copy for GPU arrays)."""
    if isinstance(t, interop.DeviceTensor):
        host = t.native.cpu().numpy() if kind == "torch" else t.native.get()
        return np.asarray(host).astype(np.int64)
    return np.asarray(t).astype(np.int64)


def check_kvcache(arrays: dict, cache_seqlens: Any, max_seqlen_q: Any, rotary_interleaved: Any, causal: Any,
                  softmax_scale: Any, window: Any, softcap: Any, num_splits: Any, descale_k: Any, descale_v: Any,
                  return_lse: Any, validate: Any, dtype: Any = None, descale_q: Any = None) -> KvCall:
    """attention_with_kvcache's arguments: ``arrays`` by name (None where not given), the rest as
    passed; ``dtype`` ("e4m3" or None) declares uint8 caches as e4m3 bytes. Everything is checked here, before any launch, alike for NumPy and GPU arrays; the
    values of the integer arrays are checked where they are on the host, and with
    ``validate=True`` for GPU arrays (a device-to-host copy and a synchronisation)."""
    given = {name: x for name, x in arrays.items() if x is not None}
    if isinstance(cache_seqlens, (numbers.Integral,)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        cache_seqlens = int(cache_seqlens)
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens: must be >= 0, got {cache_seqlens}")
    elif cache_seqlens is not None:
        given["cache_seqlens"] = cache_seqlens
    kind = framework(given)
    on_device = kind != "numpy"
    t = {name: interop.describe(x, interop.framework_of(x, name), name) if on_device else x
         for name, x in given.items()}
    validate, return_lse = resolve_flag("validate", validate), resolve_flag("return_lse", return_lse)
    causal, rotary_interleaved = resolve_flag("causal", causal), resolve_flag("rotary_interleaved", rotary_interleaved)
    window, softcap = resolve_window(window), resolve_softcap(softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits: expected an int, got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits: must be >= 0 (0 chooses), got {num_splits}")
    num_splits = int(num_splits)

    declared = ("q", "k_cache", "v_cache") if dtype is not None and dtype_name(t["q"]) == "uint8" else ("k_cache",
                                                                                                      "v_cache")
    for name in declared:
        t[name] = declared_dtype(name, t[name], dtype)
    q, kc, vc = t["q"], t["k_cache"], t["v_cache"]
    varlen = "cu_seqlens_q" in t
    if q.ndim != (3 if varlen else 4):
        expected = "(total_q, heads, head_dim) with cu_seqlens_q" if varlen else "(batch, seqlen_q, heads, head_dim)"
        raise ValueError(f"q: expected {3 if varlen else 4} dims {expected}, got shape {tuple(q.shape)}")
    for name, x in (("k_cache", kc), ("v_cache", vc)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected 4 dims (batch_cache, seqlen_cache, heads_kv, head_dim), or "
                             f"(num_pages, page_size, heads_kv, head_dim) with page_table, got shape {tuple(x.shape)}")
    if tuple(vc.shape) != tuple(kc.shape):
        raise ValueError(f"v_cache: shape {tuple(vc.shape)} must equal k_cache's {tuple(kc.shape)}")
    allowed = DEVICE_DTYPES if on_device else HOST_DTYPES
    cache_dtype = dtype_name(kc)
    fp8_cache = cache_dtype == FP8_DTYPE
    q_fp8 = dtype_name(q) == FP8_DTYPE  # FP8 attention over an FP8 cache (FlashAttention-3's q_descale)
    q_dtype = FP8_DTYPE if q_fp8 else _check_dtype("q", q, allowed, on_device)
    if q_fp8:
        if not fp8_cache:
            raise TypeError(f"q: an e4m3 q takes an e4m3 (FP8) cache, got k_cache {cache_dtype}")
        for name in ("k", "rotary_cos"):
            if name in t:
                raise NotImplementedError(f"{name}: not taken with an e4m3 q (write the cache first, rotate q "
                                          f"before quantizing it)")
    elif descale_q is not None:
        raise ValueError(f"descale_q: only an e4m3 (float8_e4m3fn) q takes it, but q is {q_dtype}")
    if fp8_cache and not q_fp8:
        if q_dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise TypeError(f"q: dtype {q_dtype} is not supported with an FP8 cache")
    elif cache_dtype != q_dtype:
        raise TypeError(f"k_cache: dtype {cache_dtype} does not match q's {q_dtype} (or float8_e4m3fn, an FP8 cache)")
    if dtype_name(vc) != cache_dtype:
        raise TypeError(f"v_cache: dtype {dtype_name(vc)} does not match k_cache's {cache_dtype}")
    heads, head_dim = q.shape[-2], q.shape[-1]
    heads_kv = kc.shape[2]
    if kc.shape[3] != head_dim:
        raise ValueError(f"k_cache: head_dim {kc.shape[3]} must equal q's {head_dim}")
    if heads < 1 or heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k_cache: heads_kv ({heads_kv}) must divide q's heads ({heads}) for GQA/MQA")
    if head_dim < 8 or head_dim % 8 or head_dim > 256:
        raise ValueError(f"q: head_dim must be a positive multiple of 8 and at most 256, got {head_dim}")
    if fp8_cache and on_device and head_dim % 16:
        raise ValueError(f"q: an FP8 cache on the GPU takes head_dim a multiple of 16 (16-byte rows), got "
                         f"{head_dim}")
    for name, x in (("q", q), ("k_cache", kc), ("v_cache", vc)):
        if 0 not in x.shape and element_strides(x)[-1] != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
        if on_device and x.device != q.device:
            raise ValueError(f"{name}: on device {x.device}, but q is on device {q.device}")
    if on_device:
        for name in ("k_cache", "v_cache"):
            if not t[name].aligned_16:
                raise ValueError(f"{name}: data pointer and strides must be 16-byte aligned (the cache is updated "
                                 f"in place, so it cannot be copied to an aligned buffer)")
    device = q.device if on_device else None

    if varlen:
        cu = t["cu_seqlens_q"]
        if dtype_name(cu) != "int32" or cu.ndim != 1 or cu.shape[0] < 2:
            raise (TypeError if dtype_name(cu) != "int32" else ValueError)(
                f"cu_seqlens_q: expected int32 of shape (batch + 1,) with batch >= 1, got {dtype_name(cu)} "
                f"{tuple(cu.shape)}")
        batch = cu.shape[0] - 1
        _int_array("cu_seqlens_q", cu, (batch + 1,), on_device, device)
    else:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q: only taken with cu_seqlens_q (a packed q)")
        batch = q.shape[0]
    if batch < 1:
        raise ValueError(f"q: batch must be at least 1, got {batch}")

    paged = "page_table" in t
    if paged:
        if "cache_batch_idx" in t:
            raise ValueError("cache_batch_idx: not taken with a page_table (the table says which pages a row reads)")
        pt = t["page_table"]
        if pt.ndim != 2:
            raise ValueError(f"page_table: expected shape (batch, max_pages), got {tuple(pt.shape)}")
        _int_array("page_table", pt, (batch, pt.shape[1]), on_device, device)
        page_size = kc.shape[1]
        capacity = pt.shape[1] * page_size
        if page_size < 1:
            raise ValueError("k_cache: page_size (dimension 1 of a paged cache) must be at least 1")
    else:
        page_size, capacity = 0, kc.shape[1]
        if "cache_batch_idx" in t:
            _int_array("cache_batch_idx", t["cache_batch_idx"], (batch,), on_device, device)
        elif kc.shape[0] < batch:
            raise ValueError(f"k_cache: batch_cache ({kc.shape[0]}) is smaller than q's batch ({batch}); pass "
                             f"cache_batch_idx to pick rows")
    for name in ("cache_seqlens", "cache_leftpad"):
        if name in t:
            _int_array(name, t[name], (batch,), on_device, device)

    # New tokens.
    if ("k" in t) != ("v" in t):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    seqlen_new = 0
    packed_new = "cu_seqlens_k_new" in t
    if packed_new:
        if "k" not in t:
            raise ValueError("cu_seqlens_k_new: packs the new tokens; pass k and v")
        _int_array("cu_seqlens_k_new", t["cu_seqlens_k_new"], (batch + 1,), on_device, device)
    if "k" in t:
        k, v = t["k"], t["v"]
        expected = ((None, heads_kv, head_dim) if packed_new else (q.shape[0], heads_kv, head_dim) if varlen
                    else (batch, None, heads_kv, head_dim))
        for name, x in (("k", k), ("v", v)):
            if x.ndim != len(expected) or any(e is not None and e != s for e, s in zip(expected, x.shape)):
                layout = ("(total_new, heads_kv, head_dim), packed by cu_seqlens_k_new" if packed_new
                          else "(total_q, heads_kv, head_dim), sharing cu_seqlens_q" if varlen
                          else "(batch, seqlen_new, heads_kv, head_dim)")
                raise ValueError(f"{name}: expected {layout} = {tuple('*' if e is None else e for e in expected)}, "
                                 f"got {tuple(x.shape)}")
            if dtype_name(x) != q_dtype:
                raise TypeError(f"{name}: dtype {dtype_name(x)} does not match q's {q_dtype}")
            if 0 not in x.shape and element_strides(x)[-1] != 1:
                raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
            if on_device and x.device != device:
                raise ValueError(f"{name}: on device {x.device}, but q is on device {device}")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
        for name in ("k_cache", "v_cache"):  # the append writes both
            check_writable(name, t[name])
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: required when k, v are appended (where the new tokens go)")
        seqlen_new = k.shape[0] if packed_new else None if varlen else k.shape[1]

    # The packed lengths.
    host = {}
    read_values = validate or not on_device
    if varlen:
        cu_host = _host_values(t["cu_seqlens_q"], kind) if read_values or max_seqlen_q is None else None
        _check_lengths("cu_seqlens_q", cu_host, q.shape[0], max_seqlen_q, "max_seqlen_q", read_values)
        if cu_host is not None:
            host["cu_seqlens_q"] = cu_host
        if max_seqlen_q is None:
            max_seqlen_q = int(np.diff(cu_host).max())
        max_seqlen_q = int(max_seqlen_q)
        if "k" in t and not packed_new:
            seqlen_new = max_seqlen_q  # the longest append
    else:
        max_seqlen_q = q.shape[1]
    if packed_new and read_values:
        host["cu_seqlens_k_new"] = _host_values(t["cu_seqlens_k_new"], kind)
        _check_lengths("cu_seqlens_k_new", host["cu_seqlens_k_new"], seqlen_new, None, "", True)
    # Per-sequence appends of packed new tokens are known only from their values (checked with them).
    if seqlen_new and not packed_new and seqlen_new > capacity:
        raise ValueError(f"k: {seqlen_new} new tokens do not fit a cache of {capacity} positions per sequence")
    if type(cache_seqlens) is int:
        if cache_seqlens > capacity:
            raise ValueError(f"cache_seqlens: {cache_seqlens} is beyond the cache's {capacity} positions")
        if not packed_new and cache_seqlens + (seqlen_new or 0) > capacity:
            raise ValueError(f"k: the cache is too small for the append: cache_seqlens {cache_seqlens} + "
                             f"{seqlen_new} new tokens > {capacity} positions")

    if "out" in t:
        _check_kv_out(t["out"], q, on_device, KV_FP8_Q_OUT if q_fp8 else None)

    # Rotary.
    rotary_dim, per_row = 0, False
    if ("rotary_cos" in t) != ("rotary_sin" in t):
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if "rotary_cos" in t:
        if "k" not in t:
            raise ValueError("rotary_cos: rotary embedding is applied with an append; pass k and v")
        cos, sin = t["rotary_cos"], t["rotary_sin"]
        if cos.ndim != 2 or tuple(sin.shape) != tuple(cos.shape):
            raise ValueError(f"rotary_cos, rotary_sin: expected equal shapes (seqlen_ro, rotary_dim / 2), got "
                             f"{tuple(cos.shape)} and {tuple(sin.shape)}")
        rotary_dim = 2 * cos.shape[1]
        if rotary_dim < 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_cos: rotary_dim (2 x {cos.shape[1]}) must be between 2 and head_dim {head_dim}")
        if cos.shape[0] < capacity and "rotary_seqlens" not in t:
            raise ValueError(f"rotary_cos: {cos.shape[0]} positions, but the cache holds {capacity}")
        rot_dtypes = (q_dtype, "float32") if on_device else HOST_DTYPES
        for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
            if dtype_name(x) not in rot_dtypes:
                raise TypeError(f"{name}: expected {' or '.join(rot_dtypes)}, got {dtype_name(x)}")
            if dtype_name(x) != dtype_name(cos):
                raise TypeError("rotary_sin: dtype must match rotary_cos's")
            if 0 not in x.shape and (element_strides(x)[1] != 1 or element_strides(x)[0] != x.shape[1]):
                raise ValueError(f"{name}: must be contiguous")
            if on_device and x.device != device:
                raise ValueError(f"{name}: on device {x.device}, but q is on device {device}")
        from cuflash._cpu.reference_kvcache import rotary_per_row
        per_row = rotary_per_row(causal, window, capacity, max_seqlen_q)
        if per_row and not varlen and not packed_new and max_seqlen_q > seqlen_new:
            raise ValueError(f"q: with rotary embedding and a causal or local mask, row i is rotated at "
                             f"cache_seqlens + i, so seqlen_q ({max_seqlen_q}) may not exceed the new tokens "
                             f"({seqlen_new})")
    if "rotary_seqlens" in t:
        if "rotary_cos" not in t:
            raise ValueError("rotary_seqlens: only taken with rotary_cos and rotary_sin")
        _int_array("rotary_seqlens", t["rotary_seqlens"], (batch,), on_device, device)

    # FP8 cache descales.
    if fp8_cache:
        descale_k, descale_v = (_resolve_descale(name, value, (batch, heads_kv), q, on_device)
                                for name, value in (("descale_k", descale_k), ("descale_v", descale_v)))
        if q_fp8:
            descale_q = _resolve_descale("descale_q", descale_q, (batch, heads_kv), q, on_device)
    else:
        for name, value in (("descale_k", descale_k), ("descale_v", descale_v)):
            if value is not None:
                raise ValueError(f"{name}: only an FP8 (float8_e4m3fn) cache takes it, but k_cache is {cache_dtype}")
        descale_k = descale_v = None

    # Values of the integer arrays.
    if read_values:
        for name in _KV_INT_ARRAYS:
            if name in t and name not in host:
                host[name] = _host_values(t[name], kind)
        _check_kv_values(host, cache_seqlens, batch, capacity, page_size, kc.shape[0], seqlen_new,
                         varlen and "k" in t and not packed_new)
        if "rotary_seqlens" in host:
            rows = np.diff(host["cu_seqlens_q"]) if varlen else np.full(batch, max_seqlen_q, np.int64)
            new = (np.diff(host["cu_seqlens_k_new"]) if packed_new else rows if varlen
                   else np.full(batch, seqlen_new, np.int64))
            _check_rotary_starts(host["rotary_seqlens"], np.maximum(new, rows if per_row else 1),
                                 t["rotary_cos"].shape[0])
    if on_device:
        if batch > dispatch.MAX_GRID_YZ or heads_kv > dispatch.MAX_GRID_YZ:
            raise ValueError(f"q: batch and heads_kv must be at most {dispatch.MAX_GRID_YZ}, got {batch} and {heads_kv}")
    if "cache_seqlens" in t:
        cache_seqlens = t["cache_seqlens"]
    return KvCall(kind, t, host, batch, max_seqlen_q, heads, heads_kv, head_dim, page_size, capacity,
                  seqlen_new or 0, varlen, cache_seqlens, resolve_scale(softmax_scale, head_dim), causal, window,
                  softcap, rotary_dim, rotary_interleaved, per_row, num_splits, descale_k, descale_v, return_lse,
                  descale_q=descale_q if q_fp8 else None)


def _check_rotary_starts(starts: np.ndarray, positions: np.ndarray, seqlen_ro: int) -> None:
    """rotary_seqlens' values: sequence b rotates its new keys and queries at starts[b] + 0, 1, ...,
    ``positions[b]`` of them, which must be rows of the tables."""
    bad = np.flatnonzero((starts < 0) | (starts + positions > seqlen_ro))
    if bad.size:
        b = bad[0]
        raise ValueError(f"rotary_seqlens: entry {b} ({starts[b]}) puts positions outside the rotary tables' "
                         f"{seqlen_ro} rows")


def _check_kv_out(out, q, on_device: bool, dtype: str | None) -> None:
    """attention_with_kvcache's ``out``: q's shape and dtype (``dtype`` for an e4m3 q), written as a
    freshly allocated output would be (the decode, forward and combine kernels take its rows at
    q's packed strides), so it must be contiguous; a dimension of extent 1 may have any stride."""
    check_out("out", out, tuple(q.shape), q, on_device, dtype)
    expected = tuple(math.prod(out.shape[i + 1:]) for i in range(out.ndim))
    if any(n != 1 and s != e for n, s, e in zip(out.shape, element_strides(out), expected)):
        raise ValueError(f"out: must be contiguous (strides {expected} in elements), got strides "
                         f"{element_strides(out)}")


def _check_kv_values(host: dict, cache_seqlens: Any, batch: int, capacity: int, page_size: int, batch_cache: int,
                     seqlen_new: int | None, packed_append: bool) -> None:
    """The integer arrays' values (host copies): lengths inside the cache with room for the
    append (``packed_append``: each sequence appends its query count), leftpad within the cached
    length, batch indices and the pages used in range."""
    if "cache_seqlens" in host:
        cached = host["cache_seqlens"]
    elif cache_seqlens is None:
        cached = np.full(batch, capacity, np.int64)
    else:
        cached = np.full(batch, cache_seqlens, np.int64)
    if "cu_seqlens_k_new" in host:
        new = np.diff(host["cu_seqlens_k_new"])
    elif packed_append:
        new = np.diff(host["cu_seqlens_q"])
    else:
        new = np.full(batch, seqlen_new or 0, np.int64)
    bad = np.flatnonzero((cached < 0) | (cached > capacity))
    if bad.size:
        raise ValueError(f"cache_seqlens: entry {bad[0]} ({cached[bad[0]]}) is outside 0..{capacity}, the cache's "
                         f"positions per sequence")
    bad = np.flatnonzero(cached + new > capacity)
    if bad.size:
        b = bad[0]
        raise ValueError(f"k: the cache is too small for the append: sequence {b} holds {cached[b]} and appends "
                         f"{new[b]}, more than {capacity} positions")
    start = host.get("cache_leftpad", np.zeros(batch, np.int64))
    bad = np.flatnonzero((start < 0) | (start > cached))
    if bad.size:
        raise ValueError(f"cache_leftpad: entry {bad[0]} ({start[bad[0]]}) must be within 0..cache_seqlens "
                         f"({cached[bad[0]]})")
    if "cache_batch_idx" in host:
        idx = host["cache_batch_idx"]
        bad = np.flatnonzero((idx < 0) | (idx >= batch_cache))
        if bad.size:
            raise ValueError(f"cache_batch_idx: entry {bad[0]} ({idx[bad[0]]}) is outside 0..{batch_cache - 1}")
    if "page_table" in host:
        table, end = host["page_table"], cached + new
        for b in range(batch):
            if end[b] > start[b]:
                used = table[b, start[b] // page_size:(end[b] - 1) // page_size + 1]
                bad = np.flatnonzero((used < 0) | (used >= batch_cache))
                if bad.size:
                    p = start[b] // page_size + bad[0]
                    raise ValueError(f"page_table: entry [{b}, {p}] ({table[b, p]}) is not a page of the cache "
                                     f"(0..{batch_cache - 1})")


class CombineCall(NamedTuple):
    """A checked combine call: DeviceTensors (GPU) or NumPy arrays, the output dtype's name."""

    framework: str
    out_partial: Any
    lse_partial: Any
    out_dtype: str
    return_lse: bool

    def plan_key(self) -> tuple:
        """Everything plan.build_combine reads but pointers."""
        return "combine", self.out_partial.layout, self.lse_partial.layout, self.out_dtype


def check_combine(out_partial: Any, lse_partial: Any, out_dtype: Any, return_lse: Any) -> CombineCall:
    kind = framework({"out_partial": out_partial, "lse_partial": lse_partial}, "out_partial")
    on_device = kind != "numpy"
    o, l = (interop.describe(x, interop.framework_of(x, name), name) if on_device else x
            for name, x in (("out_partial", out_partial), ("lse_partial", lse_partial)))
    for name, x in (("out_partial", o), ("lse_partial", l)):
        if dtype_name(x) != "float32":
            raise TypeError(f"{name}: expected float32, got {dtype_name(x)}")
    if o.ndim not in (4, 5):
        raise ValueError(f"out_partial: expected (splits, batch, seqlen, heads, head_dim) or (splits, total, heads, "
                         f"head_dim), got shape {tuple(o.shape)}")
    if tuple(l.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"lse_partial: expected shape {tuple(o.shape[:-1])} (out_partial's without head_dim), got "
                         f"{tuple(l.shape)}")
    if o.shape[0] < 1:
        raise ValueError("out_partial: at least one split")
    if on_device and o.shape[0] > 256:
        raise ValueError(f"out_partial: at most 256 splits, got {o.shape[0]}")
    if 0 not in o.shape and element_strides(o)[-1] != 1:
        raise ValueError("out_partial: the last (head_dim) dimension must be contiguous")
    if on_device and l.device != o.device:
        raise ValueError(f"lse_partial: on device {l.device}, but out_partial is on device {o.device}")
    if on_device and o.shape[-1] > 256:
        raise ValueError(f"out_partial: head_dim at most 256, got {o.shape[-1]}")
    if out_dtype is None:
        name = "float32"
    elif isinstance(out_dtype, str):
        name = out_dtype
    elif type(out_dtype).__module__.startswith("torch"):
        name = str(out_dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(out_dtype).name
        except TypeError:
            name = None
    allowed = ("float32", "bfloat16", "float16") + (() if on_device else ("float64",))
    if name not in allowed:
        raise TypeError(f"out_dtype: expected one of {', '.join(allowed)}, got {out_dtype!r}")
    return CombineCall(kind, o, l, name, resolve_flag("return_lse", return_lse))


class MergeCall(NamedTuple):
    """A checked merge_states call: DeviceTensors (GPU) or NumPy arrays, by argument name (out_a,
    lse_a, out_b, lse_b, and out, out_lse where given); every one seen as (outer, inner, heads[,
    head_dim]) (merge_rows), rows = outer x inner."""

    framework: str
    tensors: dict
    rows: int
    inner_rows: int
    heads: int
    head_dim: int
    return_lse: bool

    def plan_key(self) -> tuple:
        """Everything plan.build_merge reads but pointers."""
        t = self.tensors
        return ("merge_states", *(_layout(t.get(name)) for name in MERGE_ARRAYS), self.rows, self.inner_rows,
                self.heads, self.head_dim)


# MergeCall.tensors' names, in the order MergePlan.launch takes their pointers.
MERGE_ARRAYS = ("out_a", "lse_a", "out_b", "lse_b", "out", "out_lse")


def merge_rows(name: str, t) -> tuple[int, int, int]:
    """(outer, inner, head) strides in elements of ``t`` seen as (outer, inner, heads[,
    head_dim]): inner is its last dimension before heads, outer the ones before it, which must
    collapse into one (each stride the next one's times its extent; dimensions of extent 1 take
    any), so that (batch, seqlen, heads) views of (batch, heads, seqlen) LSEs serve as they are."""
    lead = 2 if name in ("lse_a", "lse_b", "out_lse") else 3
    shape, strides = tuple(t.shape), element_strides(t)
    heads_at = len(shape) - lead + 1
    if heads_at == 0:
        return 0, 0, strides[0]
    kept = [(n, s) for n, s in zip(shape[:heads_at - 1], strides) if n != 1]
    for (_, s_outer), (n_inner, s_inner) in zip(kept, kept[1:]):
        if s_outer != s_inner * n_inner:
            raise ValueError(f"{name}: the dimensions before its last two ({shape[:heads_at - 1]}) must collapse "
                             f"into one (strides {strides})")
    return (kept[-1][1] if kept else 0), strides[heads_at - 1], strides[heads_at]


def check_merge(arrays: dict, return_lse: Any) -> MergeCall:
    """merge_states's arrays by name (out and out_lse None where not given): out_a and out_b
    (..., heads, head_dim) of one shape and dtype (float32, bfloat16, float16; NumPy float64 too),
    last dimension contiguous; lse_a, lse_b float32 of that shape without head_dim, any strides;
    out like out_a, out_lse like the LSEs; one side, one device; rows as merge_rows sees them. On
    the GPU head_dim is a multiple of 8 and the outputs' rows 16-byte aligned (16-byte loads)."""
    for name in ("out_a", "lse_a", "out_b", "lse_b"):
        if arrays[name] is None:
            raise TypeError(f"{name}: required, got None")
    given = {name: x for name, x in arrays.items() if x is not None}
    kind = framework(given, "out_a")
    on_device = kind != "numpy"
    t = {name: interop.describe(x, interop.framework_of(x, name), name) if on_device else x
         for name, x in given.items()}
    a = t["out_a"]
    if a.ndim < 2:
        raise ValueError(f"out_a: expected (..., heads, head_dim), got shape {tuple(a.shape)}")
    allowed = ("float32", "bfloat16", "float16") + (() if on_device else ("float64",))
    if dtype_name(a) not in allowed:
        raise TypeError(f"out_a: expected one of {', '.join(allowed)}, got {dtype_name(a)}")
    lse_shape = tuple(a.shape[:-1])
    _check_like("out_b", t["out_b"], tuple(a.shape), a, on_device)
    if "out" in t:
        check_out("out", t["out"], tuple(a.shape), a, on_device)
    if 0 not in a.shape and element_strides(a)[-1] != 1:
        raise ValueError("out_a: the last (head_dim) dimension must be contiguous")
    for name in ("lse_a", "lse_b", "out_lse"):
        if name not in t:
            continue
        x = t[name]
        if dtype_name(x) != "float32":
            raise TypeError(f"{name}: expected float32, got {dtype_name(x)}")
        if tuple(x.shape) != lse_shape:
            raise ValueError(f"{name}: expected shape {lse_shape} (out_a's without head_dim), got {tuple(x.shape)}")
        if on_device and x.device != a.device:
            raise ValueError(f"{name}: on device {x.device}, but out_a is on device {a.device}")
    if "out_lse" in t:
        check_writable("out_lse", t["out_lse"])
    heads, head_dim = a.shape[-2], a.shape[-1]
    if on_device:
        if head_dim % 8 or head_dim > 1024:
            raise ValueError(f"out_a: head_dim must be a multiple of 8 and at most 1024 on the GPU, got {head_dim}")
        for name in ("out_a", "out_b", "out"):
            if name in t and not t[name].aligned_16:
                raise ValueError(f"{name}: data pointer and strides must be 16-byte aligned (16-byte loads)")
    for name, x in t.items():
        merge_rows(name, x)
    rows = math.prod(a.shape[:-2])
    inner_rows = a.shape[-3] if a.ndim > 2 else 1
    return MergeCall(kind, t, rows, inner_rows, heads, head_dim, resolve_flag("return_lse", return_lse))


# MLA decoding (mla.py).

class MlaCall(NamedTuple):
    """A checked mla_decode call: DeviceTensors (GPU) or NumPy arrays by argument name (q,
    kv_cache, page_table, cache_seqlens, and q_rope, kv_rope_cache in the split form), and the
    resolved options. head_dim counts both parts of the split form."""

    framework: str
    tensors: dict
    batch: int
    seqlen_q: int
    heads: int
    head_dim: int
    head_dim_v: int
    page_size: int
    capacity: int  # positions per sequence: max_pages * page_size
    scale: float
    causal: bool
    num_splits: int
    descale_kv: Any  # FP8 cache: float or (batch,) float32 array; else None
    return_lse: bool

    def plan_key(self) -> tuple:
        """Everything plan.build_mla reads but pointers: each array's layout by name and every
        resolved option (the descale where a number); check_mla has required 16-byte-aligned
        pointers."""
        t = self.tensors
        return ("mla_decode", *(_layout(t.get(name)) for name in MLA_ARRAYS), self.batch, self.seqlen_q, self.heads,
                self.head_dim, self.head_dim_v, self.page_size, self.capacity, self.scale, self.causal,
                self.num_splits, _layout(self.descale_kv))


# MlaCall.tensors' names.
MLA_ARRAYS = ("q", "kv_cache", "cache_seqlens", "page_table", "q_rope", "kv_rope_cache")


# FP8 quantizing (quantize.py).

class QuantizeCall(NamedTuple):
    """A checked GPU quantize_fp8 call: x's DeviceTensor and the resolved options."""

    x: Any
    granularity: str
    group_heads: int
    block_size: int
    rotate: bool
    seed: int

    def plan_key(self) -> tuple:
        """Everything plan.build_quantize reads but pointers; the seed (the rotation's signs) only
        with ``rotate``, since a call without rotation never reads it."""
        return ("quantize_fp8", self.x.layout, self.granularity, self.group_heads, self.block_size, self.rotate,
                self.seed if self.rotate else None)


MLA_MAX_REQUESTED_SPLITS = 256  # kv_combine's limit


def check_mla(arrays: dict, head_dim_v: Any, softmax_scale: Any, causal: Any, num_splits: Any, descale_kv: Any,
              return_lse: Any, validate: Any, dtype: Any) -> MlaCall:
    """mla_decode's arguments: ``arrays`` (q, kv_cache, page_table, cache_seqlens) by name, the rest
    as passed; checked before any launch, alike for NumPy and GPU arrays, the integer arrays'
    values on the host, and on the GPU with ``validate=True`` (a synchronisation)."""
    if (arrays.get("q_rope") is None) != (arrays.get("kv_rope_cache") is None):
        raise ValueError("q_rope, kv_rope_cache: the split form takes both")
    # The required arrays stay when None, so that framework() names the one missing.
    arrays = {name: x for name, x in arrays.items() if x is not None or name not in ("q_rope", "kv_rope_cache")}
    kind = framework(arrays)
    on_device = kind != "numpy"
    t = {name: interop.describe(x, interop.framework_of(x, name), name) if on_device else x
         for name, x in arrays.items()}
    causal, return_lse, validate = (resolve_flag(name, value) for name, value in
                                    (("causal", causal), ("return_lse", return_lse), ("validate", validate)))
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits: expected an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MLA_MAX_REQUESTED_SPLITS:
        raise ValueError(f"num_splits: expected 0 (chooses) .. {MLA_MAX_REQUESTED_SPLITS}, got {num_splits}")
    split = "q_rope" in t
    for name in ("kv_cache", "kv_rope_cache") if split else ("kv_cache",):
        t[name] = declared_dtype(name, t[name], dtype)
    q, kv = t["q"], t["kv_cache"]
    if q.ndim != 4:
        raise ValueError(f"q: expected 4 dims (batch, seqlen_q, heads, head_dim), got shape {tuple(q.shape)}")
    if kv.ndim != 4 or kv.shape[2] != 1:
        raise ValueError(f"kv_cache: expected (num_pages, page_size, 1, head_dim): one latent head, got shape "
                         f"{tuple(kv.shape)}")
    batch, seqlen_q, heads, head_dim = q.shape
    if min(batch, seqlen_q, heads) < 1:
        raise ValueError(f"q: batch, seqlen_q and heads must be at least 1, got shape {tuple(q.shape)}")
    if on_device and batch > dispatch.MAX_GRID_YZ:  # the kernel's grid.y
        raise ValueError(f"q: batch at most {dispatch.MAX_GRID_YZ} on the GPU, got {batch}")
    q_dtype = _check_dtype("q", q, DEVICE_DTYPES if on_device else HOST_DTYPES, on_device)
    cache_dtype = dtype_name(kv)
    fp8_cache = cache_dtype == FP8_DTYPE
    if not fp8_cache and cache_dtype != q_dtype:
        raise TypeError(f"kv_cache: dtype {cache_dtype} does not match q's {q_dtype} (or float8_e4m3fn, an FP8 cache)")
    if kv.shape[3] != head_dim:
        raise ValueError(f"kv_cache: head_dim {kv.shape[3]} must equal q's {head_dim}")
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, numbers.Integral):
        raise TypeError(f"head_dim_v: expected an int, got {type(head_dim_v).__name__}")
    head_dim_v = int(head_dim_v)
    if split:
        qr, kr = t["q_rope"], t["kv_rope_cache"]
        if qr.ndim != 4 or tuple(qr.shape[:3]) != tuple(q.shape[:3]):
            raise ValueError(f"q_rope: expected q's (batch, seqlen_q, heads) = {tuple(q.shape[:3])} and its own head "
                             f"dim, got shape {tuple(qr.shape)}")
        if kr.ndim != 4 or tuple(kr.shape[:3]) != tuple(kv.shape[:3]) or kr.shape[3] != qr.shape[3]:
            raise ValueError(f"kv_rope_cache: expected kv_cache's (num_pages, page_size, 1) = {tuple(kv.shape[:3])} "
                             f"and q_rope's head dim {qr.shape[3]}, got shape {tuple(kr.shape)}")
        if dtype_name(qr) != q_dtype:
            raise TypeError(f"q_rope: dtype {dtype_name(qr)} does not match q's {q_dtype}")
        if dtype_name(kr) != cache_dtype:
            raise TypeError(f"kv_rope_cache: dtype {dtype_name(kr)} does not match kv_cache's {cache_dtype}")
        if head_dim_v != head_dim:
            raise ValueError(f"head_dim_v: in the split form the values are kv_cache's {head_dim} dims, got "
                             f"{head_dim_v}")
        head_dim += qr.shape[3]
    if not 1 <= head_dim_v <= head_dim:
        raise ValueError(f"head_dim_v: expected 1 .. q's head_dim ({head_dim}), got {head_dim_v}")
    if on_device and (head_dim, head_dim_v) != (dispatch.MLA_HEAD_DIM, dispatch.MLA_HEAD_DIM_V):
        raise ValueError(f"q: the GPU kernel is built for head_dim {dispatch.MLA_HEAD_DIM} and head_dim_v "
                         f"{dispatch.MLA_HEAD_DIM_V} (DeepSeek's latent head), got {head_dim} and {head_dim_v}")
    page_size = kv.shape[1]
    if page_size < 1:
        raise ValueError("kv_cache: page_size (dimension 1) must be at least 1")
    for name, x in ((name, t[name]) for name in ("q", "kv_cache", "q_rope", "kv_rope_cache") if name in t):
        if 0 not in x.shape and element_strides(x)[-1] != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
        if on_device:
            if x.device != q.device:
                raise ValueError(f"{name}: on device {x.device}, but q is on device {q.device}")
            if not x.aligned_16:
                raise ValueError(f"{name}: data pointer and strides must be 16-byte aligned")
    device = q.device if on_device else None
    pt, seqlens = t["page_table"], t["cache_seqlens"]
    if pt.ndim != 2:
        raise ValueError(f"page_table: expected shape (batch, max_pages), got {tuple(pt.shape)}")
    _int_array("page_table", pt, (batch, pt.shape[1]), on_device, device)
    _int_array("cache_seqlens", seqlens, (batch,), on_device, device)
    capacity = pt.shape[1] * page_size
    if fp8_cache:
        descale = _resolve_descale("descale_kv", descale_kv, (batch, 1), q, on_device)
    elif descale_kv is not None:
        raise ValueError("descale_kv: only taken with an FP8 (e4m3) cache")
    else:
        descale = None
    if not on_device or validate:
        host = {name: _host_values(t[name], kind) for name in ("cache_seqlens", "page_table")}
        _check_kv_values(host, None, batch, capacity, page_size, kv.shape[0], 0, False)
    return MlaCall(kind, t, batch, seqlen_q, heads, head_dim, head_dim_v, page_size, capacity,
                   resolve_scale(softmax_scale, head_dim), causal, int(num_splits), descale, return_lse)
