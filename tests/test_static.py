"""Static checks of the Python sources: the GPU code paths cannot run in CI, so an undefined name
there would first show up on a GPU machine (it did once: a refactor left ``lse_t`` unbound)."""
import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parent.parent


def test_pyflakes_finds_nothing():
    messages, errors = io.StringIO(), io.StringIO()
    warnings = checkRecursive([str(ROOT / d) for d in ("cuflash", "tests", "benchmarks")], Reporter(messages, errors))
    assert warnings == 0, messages.getvalue() + errors.getvalue()
