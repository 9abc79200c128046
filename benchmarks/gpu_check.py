"""The GPU check the benchmark scripts share: without a usable GPU a script says why and exits 0
(the reason is tests/conftest.py's, as for the pytest benchmarks)."""

from __future__ import annotations

import sys
from pathlib import Path


def skipped_without_gpu(script: str) -> bool:
    """True, having printed ``script``'s skip line, when no usable GPU is present."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"{script}: skipped, {reason}")
    return reason is not None
