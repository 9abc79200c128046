"""Forward, backward and both, pytest-benchmark: ``pytest benchmarks/ --benchmark-only`` on a GPU.

cuflash and its peers (cuflash.bench.IMPLEMENTATIONS: torch SDPA's FlashAttention-2, cuDNN and
memory-efficient backends, standard attention in CuPy) on the standard shapes. Each round
runs one call per rotated input set (together over 3x the L2) and synchronises, so rounds time
queued kernels, not the cache or one launch's host cost; compilation happens in the warm-up
rounds. ``extra_info`` carries TFLOP/s (counted as docs/measuring.md says), the shape, the kernel family and the
device, so ``--benchmark-json`` output describes itself.
"""

from __future__ import annotations

import pytest

from cuflash import bench, dispatch


@pytest.mark.parametrize("impl", bench.IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", bench.MODES)
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", dispatch.FAMILIES)
def test_attention(benchmark, family, dtype, head_dim, causal, seqlen, mode, impl, monkeypatch):
    import cupy as cp

    if impl == "standard" and (seqlen > 8192 or mode != "fwd"):
        pytest.skip("standard attention: forward only (CuPy has no autograd), and not at 16k (minutes)")
    if not impl.startswith("cuflash") and family != dispatch.FAMILIES[0]:
        pytest.skip("peers do not depend on cuflash's family")
    if impl in bench.BACKWARD_VARIANTS and mode == "fwd":
        pytest.skip(f"{impl} differs from cuflash only in the backward")
    monkeypatch.setenv("CUFLASH_FAMILY", family)
    dispatch.device_target.cache_clear()
    run = bench.implementations([impl]).get(impl)
    if run is None:
        pytest.skip(f"{impl} is not installed")
    case = bench.Case(dtype, head_dim, seqlen, causal, mode)
    calls = bench.timed_calls(impl, run, case, bench.input_sets(case))

    def round_():
        for call in calls:
            call()
        cp.cuda.Device().synchronize()

    benchmark.pedantic(round_, rounds=10 if impl != "standard" else 3, warmup_rounds=1)
    seconds = benchmark.stats.stats.median / len(calls)
    benchmark.extra_info.update(
        tflops=case.flops() / seconds / 1e12, batch=case.batch, seqlen=seqlen, heads=case.heads,
        head_dim=head_dim, causal=causal, mode=mode, dtype=dtype, family=dispatch.device_target(0)[0] if impl.startswith("cuflash") else None,
        device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    )
    dispatch.device_target.cache_clear()
