"""Benchmarks need a GPU; without one they are skipped with the reason (tests/conftest.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import gpu_unavailable_reason  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is not None:
        here = Path(__file__).resolve().parent
        for item in items:
            if Path(str(item.fspath)).resolve().is_relative_to(here):  # the hook sees every item
                item.add_marker(pytest.mark.skip(reason=f"benchmark needs a GPU: {reason}"))
