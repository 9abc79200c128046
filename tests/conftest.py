"""GPU detection: tests marked ``gpu`` are skipped, with the reason, where no CUDA GPU works."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError as error:
        return f"CuPy is not importable ({error})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as error:  # no driver, or no device behind it
        return f"no usable CUDA device ({type(error).__name__}: {error})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
