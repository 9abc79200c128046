"""Benchmarks need a GPU; without one they are skipped with the reason (cuflash._core.device)."""

from pathlib import Path

import pytest

from cuflash._core.device import gpu_unavailable


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable()
    if reason is not None:
        here = Path(__file__).resolve().parent
        for item in items:
            if Path(str(item.fspath)).resolve().is_relative_to(here):  # the hook sees every item
                item.add_marker(pytest.mark.skip(reason=f"benchmark needs a GPU: {reason}"))
