"""Arrays in and out: CuPy, torch, any other DLPack producer, and NumPy.

Device tensors are reduced to a ``DeviceTensor`` record (pointer, shape, strides in elements,
dtype, device), read straight from the framework's own attributes: no copies, no DLPack capsule
per call for CuPy and torch, so the launch path costs microseconds. Outputs are allocated by the
caller's framework (torch's caching allocator for torch), and torch work goes on torch's current
stream. Other DLPack producers (JAX) are viewed through ``cupy.from_dlpack`` and get CuPy back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DeviceTensor", "describe", "empty", "framework_of", "realign", "stream_handle"]


@dataclass(frozen=True, slots=True)
class DeviceTensor:
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
    def aligned_16(self) -> bool:
        """Pointer and all but the last stride on 16-byte boundaries (the kernels' vector width)."""
        return self.ptr % 16 == 0 and all(s * self.itemsize % 16 == 0 for s in self.strides[:-1])


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def _cupy():
    try:
        import cupy
    except ImportError as error:
        raise ImportError(
            "cuflash: GPU inputs need CuPy; install cuflash[cuda13] (or [cuda12] for CUDA 12)"
        ) from error
    return cupy


def framework_of(x: Any, name: str) -> str:
    """``numpy``, ``cupy``, ``torch`` or ``dlpack`` for the argument called ``name``."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_torch(x):
        if not x.is_cuda:
            raise TypeError(
                f"{name}: a CPU torch tensor; move it to the GPU (.cuda()) or pass a NumPy array "
                f"for the CPU reference path"
            )
        return "torch"
    if type(x).__module__.startswith("cupy"):
        return "cupy"
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    raise TypeError(
        f"{name}: expected a CuPy array, a torch CUDA tensor, a DLPack tensor or a NumPy array, "
        f"got {type(x).__name__}"
    )


def describe(x: Any, framework: str, name: str) -> DeviceTensor:
    """The DeviceTensor of a CuPy array, torch CUDA tensor or other DLPack producer."""
    if framework == "torch":
        return DeviceTensor(x, x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                            str(x.dtype).removeprefix("torch."), x.element_size(), x.device.index)
    if framework == "dlpack":
        try:
            x = _cupy().from_dlpack(x)
        except Exception as error:  # the producer's own message says what it could not export
            raise TypeError(f"{name}: could not be viewed through DLPack ({error})") from error
    itemsize = x.itemsize
    return DeviceTensor(x, x.data.ptr, x.shape, tuple(s // itemsize for s in x.strides),
                        x.dtype.name, itemsize, x.device.id)


def realign(t: DeviceTensor, framework: str) -> DeviceTensor:
    """A 16-byte-aligned contiguous copy of ``t`` (same framework)."""
    if framework == "torch":
        return describe(t.native.clone(memory_format=_torch().contiguous_format), "torch", "")
    return describe(t.native.copy(), "cupy", "")


def _torch():
    import torch

    return torch


def empty(framework: str, like: DeviceTensor, shape: tuple[int, ...], dtype: str | None = None,
          zeroed: bool = False) -> DeviceTensor:
    """A new array shaped ``shape`` of ``dtype`` (default: ``like``'s), on ``like``'s device, from
    the caller's framework (CuPy for CuPy and other DLPack producers). Scratch buffers come from
    the caller's allocator too, so torch's stream-ordered caching allocator owns their lifetime;
    ``zeroed`` fills them on the caller's stream."""
    if framework == "torch":
        torch = _torch()
        make = torch.zeros if zeroed else torch.empty
        native = make(shape, dtype=getattr(torch, dtype) if dtype else like.native.dtype, device=like.native.device)
        return describe(native, "torch", "")
    cupy = _cupy()
    with cupy.cuda.Device(like.device):
        make = cupy.zeros if zeroed else cupy.empty
        native = make(shape, dtype=np.dtype(dtype) if dtype else like.native.dtype)
    return describe(native, "cupy", "")


def stream_handle(framework: str, device: int) -> int:
    """The raw CUDA stream to launch on: torch's current stream for torch callers, else CuPy's."""
    if framework == "torch":
        return _torch().cuda.current_stream(device).cuda_stream
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr
