"""Forward, backward and both, pytest-benchmark: ``pytest benchmarks/ --benchmark-only`` on a GPU.

cuflash and its peers (cuflash.bench.attention.IMPLEMENTATIONS: torch SDPA's FlashAttention-2, cuDNN and
memory-efficient backends, standard attention in CuPy) on the standard shapes. Each round
runs one call per rotated input set (together over 3x the L2) and synchronises, so rounds time
queued kernels, not the cache or one launch's host cost; compilation happens in the warm-up
rounds. ``extra_info`` carries TFLOP/s (counted as docs/measuring.md says), the shape, the kernel family and the
device, so ``--benchmark-json`` output describes itself.
"""

from __future__ import annotations

import pytest

from cuflash.bench import attention as bench
from cuflash._core import dispatch


def timed_rounds(benchmark, impl, run, case: bench.Case, rounds: int, **info) -> None:
    """Times rounds of one call per rotated input set of ``case``, then records TFLOP/s, the shape
    and the device (and ``info``) in extra_info."""
    import cupy as cp

    calls = bench.timed_calls(impl, run, case, bench.input_sets(case))

    def round_():
        for call in calls:
            call()
        cp.cuda.Device().synchronize()

    benchmark.pedantic(round_, rounds=rounds, warmup_rounds=1)
    seconds = benchmark.stats.stats.median / len(calls)
    benchmark.extra_info.update(
        tflops=case.flops() / seconds / 1e12, batch=case.batch, seqlen=case.seqlen, heads=case.heads,
        head_dim=case.head_dim, causal=case.causal, mode=case.mode, dtype=case.dtype,
        device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), **info,
    )


@pytest.mark.parametrize("impl", bench.SIXTEEN_BIT_IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", bench.MODES)
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", dispatch.FAMILIES)
def test_attention(benchmark, family, dtype, head_dim, causal, seqlen, mode, impl, monkeypatch):
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
    timed_rounds(benchmark, impl, run, case, rounds=10 if impl != "standard" else 3,
                 family=dispatch.device_target(0)[0] if impl.startswith("cuflash") else None)
    dispatch.device_target.cache_clear()


@pytest.mark.parametrize("impl", bench.FP8_IMPLEMENTATIONS)
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_fp8(benchmark, head_dim, causal, seqlen, impl):
    """The FP8 forward (e4m3 inputs, per-tensor descales) next to cuDNN's FP8 attention and
    cuflash's bf16 on the values the inputs were quantized from, on the device's own family."""
    run = bench.implementations([impl], "e4m3").get(impl)
    if run is None:
        pytest.skip(f"{impl} is not installed")
    timed_rounds(benchmark, impl, run, bench.Case("e4m3", head_dim, seqlen, causal), rounds=10)
