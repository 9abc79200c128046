"""The GPU check the benchmark scripts share: without a usable GPU a script says why and exits 0
(the reason is cuflash._core.device's, as for the pytest benchmarks)."""

from __future__ import annotations

from cuflash._core.device import gpu_unavailable


def skipped_without_gpu(script: str) -> bool:
    """True, having printed ``script``'s skip line, when no usable GPU is present."""
    reason = gpu_unavailable()
    if reason is not None:
        print(f"{script}: skipped, {reason}")
    return reason is not None
