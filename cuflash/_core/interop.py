"""Arrays in and out: CuPy, torch, any other DLPack producer, and NumPy.

Device tensors are reduced to a ``DeviceTensor`` record (pointer, shape, strides in elements,
dtype, device), read straight from the framework's own attributes: no copies, no DLPack capsule
per call for CuPy and torch, so the launch path costs microseconds. Outputs are allocated by the
caller's framework (torch's caching allocator for torch), and torch work goes on torch's current
stream. Other DLPack producers (JAX) are viewed through ``cupy.from_dlpack`` and get CuPy back.

Everything here runs on every call, so it avoids what costs microseconds in Python: a frozen
dataclass's constructor, NumPy's ``dtype.name`` (computed in Python), CuPy's Device
context manager when the device is already current, torch's Stream objects.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, NamedTuple

import numpy as np

__all__ = ["DeviceTensor", "allocate", "contiguous", "describe", "float32_contiguous", "framework_of",
           "layouts_and_pointers", "on_device", "realign", "scratch", "stream_handle", "upload", "zero"]


class DeviceTensor(NamedTuple):
    """A tuple, not a dataclass, because one is built per tensor per call (by tuple.__new__, below)."""

    native: Any  # the caller's object, kept alive for the launch
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # "float16", "bfloat16", ...
    itemsize: int
    device: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def layout(self) -> tuple:
        """Everything but the object and the pointer: (shape, strides, dtype, itemsize, device),
        which is all that validation and a launch plan read."""
        return self[2:]

    @property
    def aligned_16(self) -> bool:
        """Pointer and all but the last stride on 16-byte boundaries (the kernels' vector width).
        gcd(s0, s1, ...) * itemsize is the largest byte alignment all strides share (0 for none)."""
        return self.ptr % 16 == 0 and math.gcd(*self.strides[:-1]) * self.itemsize % 16 == 0


@functools.lru_cache(maxsize=None)  # an import statement looks the module up again every call
def _cupy():
    try:
        import cupy
    except ImportError as error:
        raise ImportError(
            "cuflash: GPU inputs need CuPy; install cuflash[cuda13] (or [cuda12] for CUDA 12)"
        ) from error
    return cupy


@functools.lru_cache(maxsize=None)
def _torch():
    import torch

    return torch


# Framework of an array type: "numpy", "torch" or "cupy" (decided by the type alone, so cached);
# DLPack producers and rejected types take the full test every call.
_KIND_OF_TYPE: dict[type, str] = {}


def _kind_of_type(cls: type) -> str | None:
    if issubclass(cls, np.ndarray):
        return "numpy"
    if cls.__module__.startswith("torch") and hasattr(cls, "is_cuda"):
        return "torch"
    if cls.__module__.startswith("cupy"):
        return "cupy"
    return None


def framework_of(x: Any, name: str) -> str:
    """``numpy``, ``cupy``, ``torch`` or ``dlpack`` for the argument called ``name``."""
    cls = type(x)
    kind = _KIND_OF_TYPE.get(cls)
    if kind is None:
        kind = _kind_of_type(cls)
        if kind is not None:
            _KIND_OF_TYPE[cls] = kind
    if kind == "torch":
        if not x.is_cuda:
            raise TypeError(
                f"{name}: a CPU torch tensor, which cuflash's own functions do not take: pass a NumPy "
                f"array (the CPU path) or a CUDA tensor (.cuda()); cuflash.torch's functions take CPU "
                f"tensors"
            )
        return kind
    if kind is not None:
        return kind
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    raise TypeError(
        f"{name}: expected a CuPy array, a torch CUDA tensor, a DLPack tensor or a NumPy array, "
        f"got {type(x).__name__}"
    )


# (name, itemsize) per framework dtype object; NumPy's and torch's kept apart so that no
# cross-library __eq__ runs.
_NUMPY_DTYPES: dict[Any, tuple[str, int]] = {}
_TORCH_DTYPES: dict[Any, tuple[str, int]] = {}

# describe builds its DeviceTensor with tuple.__new__, all seven fields in order: the class's own
# constructor is a generated Python function, one more Python call per tensor.
_new_tuple = tuple.__new__


def describe(x: Any, framework: str, name: str) -> DeviceTensor:
    """The DeviceTensor of a CuPy array, torch CUDA tensor or other DLPack producer."""
    if framework == "torch":
        dtype = x.dtype
        info = _TORCH_DTYPES.get(dtype)
        if info is None:
            info = _TORCH_DTYPES[dtype] = (str(dtype).removeprefix("torch."), x.element_size())
        dtype_name, itemsize = info
        # get_device(): the index without building a torch.device.
        return _new_tuple(DeviceTensor, (x, x.data_ptr(), tuple(x.shape), x.stride(), dtype_name, itemsize,
                                         x.get_device()))
    if framework == "dlpack":
        try:
            x = _cupy().from_dlpack(x)
        except Exception as error:  # the producer's own message says what it could not export
            raise TypeError(f"{name}: could not be viewed through DLPack ({error})") from error
    dtype = x.dtype
    info = _NUMPY_DTYPES.get(dtype)
    if info is None:
        info = _NUMPY_DTYPES[dtype] = (dtype.name, dtype.itemsize)
    dtype_name, itemsize = info
    memory = x.data  # CuPy's MemoryPointer: pointer and device without building a Device
    return _new_tuple(DeviceTensor, (x, memory.ptr, x.shape, tuple([s // itemsize for s in x.strides]), dtype_name,
                                     itemsize, memory.device_id))


def layouts_and_pointers(arrays: list) -> tuple[str, tuple, tuple] | None:
    """(framework, layouts, pointers) of a call's ``arrays`` (None where not given), the first
    given, when all are CuPy arrays of its type or all torch CUDA tensors: what ``describe``
    reads, in the framework's own terms (CuPy's byte strides and dtype objects) and without
    building a DeviceTensor, because a repeated call's signature needs only that (signatures of
    two frameworks never meet: the framework leads the signature). Per array the layout (shape, strides,
    dtype, device) and the pointer; None and 0 where not given. None for any other mix (NumPy,
    DLPack producers, CPU tensors, numbers), which the caller then describes in full."""
    cls = type(arrays[0])
    framework = _KIND_OF_TYPE.get(cls)
    layouts, pointers = [], []
    for x in arrays:
        if x is None:
            layouts.append(None)
            pointers.append(0)
        elif type(x) is not cls:
            return None
        elif framework == "cupy":
            memory = x.data
            layouts.append((x.shape, x.strides, x.dtype, memory.device_id))
            pointers.append(memory.ptr)
        elif framework == "torch" and x.is_cuda:
            layouts.append((x.shape, x.stride(), x.dtype, x.get_device()))
            pointers.append(x.data_ptr())
        else:
            return None
    return framework, tuple(layouts), tuple(pointers)


def realign(t: DeviceTensor, framework: str) -> DeviceTensor:
    """A 16-byte-aligned contiguous copy of ``t`` (same framework), keeping ``t``'s dtype name
    (uint8 bytes declared e4m3 stay e4m3)."""
    if framework == "torch":
        copy = describe(t.native.clone(memory_format=_torch().contiguous_format), "torch", "")
    else:
        copy = describe(t.native.copy(), "cupy", "")
    return copy if copy.dtype == t.dtype else copy._replace(dtype=t.dtype)


def float32_contiguous(t: DeviceTensor, framework: str) -> DeviceTensor:
    """``t`` itself if it is float32 with a contiguous last dimension (its other strides any), else
    a contiguous float32 copy (same framework): how the kernels read small per-head arrays."""
    if t.dtype == "float32" and t.strides[-1] == 1:
        return t
    if framework == "torch":
        return describe(t.native.to(_torch().float32).contiguous(), "torch", "")
    return describe(_cupy().ascontiguousarray(t.native, dtype=np.float32), "cupy", "")


def contiguous(shape: tuple[int, ...], like: DeviceTensor, dtype: str | None = None) -> DeviceTensor:
    """The record of an array ``allocate(framework, like, shape, dtype)`` will return, without its
    object and pointer (0): what a launch plan needs of an array not allocated yet."""
    itemsize = like.itemsize if dtype is None else np.dtype(dtype).itemsize
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DeviceTensor(None, 0, tuple(shape), strides, dtype or like.dtype, itemsize, like.device)


def allocate(framework: str, like: DeviceTensor, shape: tuple[int, ...], dtype: str | None = None
             ) -> tuple[Any, int]:
    """(array, pointer): a new contiguous array of ``shape`` and ``dtype`` (default ``like``'s) on
    the current device (the caller holds ``on_device(like.device)``), from the caller's framework
    (CuPy for CuPy and other DLPack producers), so it is the caller's allocator that owns it: for
    torch the stream-ordered caching allocator on torch's current stream."""
    if framework == "torch":
        torch = _torch()
        native = torch.empty(shape, dtype=getattr(torch, dtype) if dtype else like.native.dtype,
                             device=like.native.device)
        return native, native.data_ptr()
    # cupy.ndarray directly: cupy.empty is a Python wrapper around it.
    native = _cupy().ndarray(shape, np.dtype(dtype) if dtype else like.native.dtype)
    return native, native.data.ptr


def scratch(framework: str, like: DeviceTensor, nbytes: int) -> tuple[Any, int]:
    """(owner, pointer): ``nbytes`` of device memory for buffers no caller sees, from the same
    allocator and on the same stream as ``allocate``; the memory is reused once ``owner`` is
    dropped, in stream order, so it lives until the kernels queued before that have run."""
    if framework == "torch":
        torch = _torch()
        owner = torch.empty((nbytes,), dtype=torch.uint8, device=like.native.device)
        return owner, owner.data_ptr()
    owner = _cupy().cuda.alloc(nbytes)
    return owner, owner.ptr


def upload(framework: str, like: DeviceTensor, host: np.ndarray) -> tuple[Any, int]:
    """(array, pointer): a copy of the NumPy array ``host`` on ``like``'s device, from the same
    framework and stream as ``allocate`` (the caller holds ``on_device(like.device)``)."""
    if framework == "torch":
        native = _torch().from_numpy(host).to(like.native.device)
        return native, native.data_ptr()
    native = _cupy().asarray(host)
    return native, native.data.ptr


def zero(ptr: int, nbytes: int, stream: int) -> None:
    """Zero ``nbytes`` at ``ptr`` on ``stream`` (cudaMemsetAsync: one call, no fill kernel)."""
    _cupy().cuda.runtime.memsetAsync(ptr, 0, nbytes, stream)


_CURRENT = contextlib.nullcontext()


def on_device(device: int):
    """A context that makes ``device`` current: cudaGetDevice alone when it already is (the
    common case; CuPy's Device context manager costs a few microseconds), else CuPy's
    ``Device``. Kernels launch into the current device's context, and CuPy allocates there."""
    cupy = _cupy()
    return _CURRENT if cupy.cuda.runtime.getDevice() == device else cupy.cuda.Device(device)


def stream_handle(framework: str, device: int) -> int:
    """The raw CUDA stream to launch on: torch's current stream for torch callers, else CuPy's
    current stream (of the current device: call inside ``on_device(device)``)."""
    if framework == "torch":
        torch = _torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object per call
        return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    return _cupy().cuda.get_current_stream().ptr
