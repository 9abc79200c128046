"""Forward pass, pytest-benchmark: ``pytest benchmarks/ --benchmark-only`` on a GPU machine.

Each round runs one call per rotated input set (together over 3x the L2) and synchronises, so
rounds time queued kernels, not the cache or one launch's host cost; compile and module load
happen in the warm-up rounds. ``extra_info`` carries TFLOP/s (DESIGN.md's count), the shape,
the kernel family and the device, so ``--benchmark-json`` output describes itself.
"""

from __future__ import annotations

import pytest

from cuflash.reference import attention_flops
from cuflash.timing import copies_to_defeat_l2

TOTAL_TOKENS, HIDDEN = 16384, 2048


def _implementations():
    import cuflash

    impls = {"cuflash": lambda q, k, v, causal: cuflash.attention(q, k, v, causal=causal)}
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return impls

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return run

    impls["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return impls


@pytest.mark.parametrize("impl", ["cuflash", "sdpa-flash", "sdpa-cudnn"])
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward(benchmark, impl, seqlen, causal, head_dim):
    torch = pytest.importorskip("torch")
    import cupy as cp

    from cuflash.api import _device_plan

    run = _implementations().get(impl)
    if run is None:
        pytest.skip(f"{impl} is not installed")
    batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // head_dim
    shape = (batch, seqlen, heads, head_dim)
    count = copies_to_defeat_l2(3 * batch * seqlen * heads * head_dim * 2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            for _ in range(count)]

    def round_():
        for q, k, v in sets:
            run(q, k, v, causal)
        torch.cuda.synchronize()

    benchmark.pedantic(round_, rounds=10, warmup_rounds=2)
    seconds = benchmark.stats.stats.median / count
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
    benchmark.extra_info.update(
        tflops=flops / seconds / 1e12, batch=batch, seqlen=seqlen, heads=heads, head_dim=head_dim,
        causal=causal, dtype="bfloat16", family=_device_plan(0)[0] if impl == "cuflash" else impl,
        device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    )
