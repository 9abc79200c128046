"""Forward pass, pytest-benchmark: ``pytest benchmarks/ --benchmark-only`` on a GPU machine.

cuflash and its peers (cuflash.bench.IMPLEMENTATIONS: torch SDPA's FlashAttention-2, cuDNN and
memory-efficient backends, standard attention in CuPy) on DESIGN.md's standard shapes. Each round
runs one call per rotated input set (together over 3x the L2) and synchronises, so rounds time
queued kernels, not the cache or one launch's host cost; compilation happens in the warm-up
rounds. ``extra_info`` carries TFLOP/s (DESIGN.md's count), the shape, the kernel family and the
device, so ``--benchmark-json`` output describes itself.
"""

from __future__ import annotations

import math

import pytest

from cuflash import bench, dispatch
from cuflash.timing import copies_to_defeat_l2


@pytest.mark.parametrize("impl", bench.IMPLEMENTATIONS)
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", dispatch.FAMILIES)
def test_forward(benchmark, family, dtype, head_dim, causal, seqlen, impl, monkeypatch):
    import cupy as cp

    from cuflash.api import _device_plan

    if impl == "standard" and seqlen > 8192:
        pytest.skip("standard attention at 16k: minutes per case, and the sweep's table has it")
    if impl != "cuflash" and family != dispatch.FAMILIES[0]:
        pytest.skip("peers do not depend on cuflash's family")
    monkeypatch.setenv("CUFLASH_FAMILY", family)
    _device_plan.cache_clear()
    run = bench.implementations([impl]).get(impl)
    if run is None:
        pytest.skip(f"{impl} is not installed")
    case = bench.Case(dtype, head_dim, seqlen, causal)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    count = copies_to_defeat_l2(3 * math.prod(shape) * 2)
    sets = [tuple(bench.random_normal(shape, dtype, seed=3 * i + j) for j in range(3)) for i in range(count)]

    def round_():
        for q, k, v in sets:
            run(q, k, v, causal)
        cp.cuda.Device().synchronize()

    benchmark.pedantic(round_, rounds=10 if impl != "standard" else 3, warmup_rounds=1)
    seconds = benchmark.stats.stats.median / count
    benchmark.extra_info.update(
        tflops=case.flops() / seconds / 1e12, batch=case.batch, seqlen=seqlen, heads=case.heads,
        head_dim=head_dim, causal=causal, dtype=dtype, family=_device_plan(0)[0] if impl == "cuflash" else None,
        device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    )
    _device_plan.cache_clear()
