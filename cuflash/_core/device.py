"""Whether a CUDA GPU can run cuflash's kernels here, and if not, what is missing."""

from __future__ import annotations

import ctypes

__all__ = ["gpu_unavailable"]


def gpu_unavailable() -> str | None:
    """None where CuPy sees a CUDA device; otherwise what is missing, in words. Without an NVIDIA
    driver the CUDA runtime reports "CUDA driver version is insufficient", which on a machine with
    no GPU misleads: the driver's library is looked for first."""
    try:
        import cupy
    except ImportError as error:
        return f"CuPy is not importable ({error}); install cuflash with its cuda12 or cuda13 extra"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver found (libcuda.so.1 is not installed): no GPU on this machine, or its driver is missing"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "the NVIDIA driver found no CUDA device"
    except Exception as error:  # the driver's own reason: too old for the runtime, no device, ...
        return f"no usable CUDA device ({type(error).__name__}: {error})"
    return None
