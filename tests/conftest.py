"""GPU detection: tests marked ``gpu`` are skipped, with the reason, where no CUDA GPU works; the
skips are summed up by reason, one line each."""

from __future__ import annotations

import collections

import pytest

from cuflash._core.device import gpu_unavailable


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count, where ``-rs`` (which lists every skipped test's
    file and line: dozens of lines on a machine without a GPU) is not asked for."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or terminalreporter.hasopt("s"):
        return
    reasons = collections.Counter(report.longrepr[2].removeprefix("Skipped: ") for report in skipped
                                  if isinstance(report.longrepr, tuple))
    terminalreporter.section("skipped, by reason")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:5d}  {reason}")


@pytest.fixture(params=["sm80", "sm90"])
def family(request, monkeypatch):
    """Runs a GPU forward test once per kernel family the device can run (CUFLASH_FAMILY set, the
    cached device plan re-read); sm90 needs compute capability 9.x."""
    import cupy

    from cuflash._core import dispatch

    capability = divmod(int(cupy.cuda.Device().compute_capability), 10)
    try:
        dispatch.select_family(capability, request.param)
    except ValueError as error:
        pytest.skip(str(error))
    monkeypatch.setenv("CUFLASH_FAMILY", request.param)
    dispatch.device_target.cache_clear()
    yield request.param
    dispatch.device_target.cache_clear()


@pytest.fixture(params=["walk", "turns"])
def causal_dq_order(request, monkeypatch):
    """Runs a deterministic-mode test once per way sm90 orders dQ for short causal sequences: the
    walk (taken up to dispatch.WALK_CAUSAL_KEYS keys, here up to 2048 at every head dim) and turns
    per query block (taken beyond it, here from zero keys on). sm80 walks in both runs."""
    from cuflash._core import dispatch, plan

    keys = 2048 if request.param == "walk" else 0
    monkeypatch.setattr(dispatch, "WALK_CAUSAL_KEYS", dict.fromkeys(dispatch.SM90_BWD_TILES, keys))
    monkeypatch.setattr(plan, "PLANS", plan.PlanCache())  # no plan built under the other setting
    return request.param
