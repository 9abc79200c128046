"""Static checks of the Python sources: the GPU code paths cannot run in CI, so an undefined name
there would first show up on a GPU machine (it did once: a refactor left ``lse_t`` unbound)."""
import io
from pathlib import Path

import pytest

# The test extra installs pyflakes (CI runs this); a bare GPU machine may lack it.
pyflakes_api = pytest.importorskip("pyflakes.api", reason="pyflakes not installed (pip install -e '.[test]')")
pyflakes_reporter = pytest.importorskip("pyflakes.reporter")

ROOT = Path(__file__).resolve().parent.parent


def test_pyflakes_finds_nothing():
    messages, errors = io.StringIO(), io.StringIO()
    warnings = pyflakes_api.checkRecursive([str(ROOT / d) for d in ("cuflash", "tests", "benchmarks", "tools")], pyflakes_reporter.Reporter(messages, errors))
    assert warnings == 0, messages.getvalue() + errors.getvalue()
