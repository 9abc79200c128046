"""Arrays in and out: CuPy, torch (through DLPack), any other DLPack producer, and NumPy.

The device path works on CuPy views of the caller's memory (zero-copy) and hands results back in
the caller's framework; torch work is launched on torch's current stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Framework", "as_cupy", "empty", "framework_of", "launch_stream"]


@dataclass(frozen=True)
class Framework:
    name: str  # "numpy", "cupy", "torch" or "dlpack"

    @property
    def on_device(self) -> bool:
        return self.name != "numpy"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def framework_of(x: Any, name: str) -> Framework:
    """Which framework ``x`` (the argument called ``name``) belongs to; TypeError if none."""
    if isinstance(x, np.ndarray):
        return Framework("numpy")
    if _is_torch(x):
        if not x.is_cuda:
            raise TypeError(
                f"{name}: a CPU torch tensor; move it to the GPU (.cuda()) or pass a NumPy array "
                f"for the CPU reference path"
            )
        return Framework("torch")
    cupy = _cupy_or_none()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return Framework("cupy")
    if hasattr(x, "__dlpack__"):
        return Framework("dlpack")
    raise TypeError(
        f"{name}: expected a CuPy array, a torch CUDA tensor, a DLPack tensor or a NumPy array, "
        f"got {type(x).__name__}"
    )


def _cupy_or_none():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def _require_cupy():
    cupy = _cupy_or_none()
    if cupy is None:
        raise ImportError(
            "cuflash: GPU inputs need CuPy; install cuflash[cuda13] (or [cuda12] for CUDA 12)"
        )
    return cupy


def as_cupy(x: Any, framework: Framework, name: str):
    """A CuPy view of a device tensor, sharing its memory."""
    cupy = _require_cupy()
    if framework.name == "cupy":
        return x
    try:
        return cupy.from_dlpack(x)
    except Exception as error:  # the producer's own message says what it could not export
        raise TypeError(f"{name}: could not be viewed as a CuPy array through DLPack ({error})") from error


def launch_stream(framework: Framework, device_id: int):
    """The stream to launch on: torch's current stream for torch inputs, else CuPy's."""
    cupy = _require_cupy()
    if framework.name == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream(device_id).cuda_stream, device_id)
    return cupy.cuda.get_current_stream()


def empty(framework: Framework, like: Any, like_cupy, shape: tuple[int, ...], float32: bool = False):
    """A new device array shaped ``shape``, of ``like``'s dtype (or float32), on its device.

    torch callers get memory from torch's allocator, so their memory accounting sees it; others
    get CuPy's. Returns ``(native, cupy_view)``.
    """
    cupy = _require_cupy()
    if framework.name == "torch":
        import torch

        native = torch.empty(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)
        return native, cupy.from_dlpack(native)
    array = cupy.empty(shape, dtype=np.float32 if float32 else like_cupy.dtype)
    return array, array
