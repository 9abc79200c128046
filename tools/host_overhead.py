"""Host cost per call of cuflash's entry points on a GPU: a tiny shape, so the kernels take a few
microseconds and the figure is the Python and driver work of one call (the target: < 20 us per
launch, and per decoding step of attention_with_kvcache; torch SDPA ~10-20 us per call). CuPy
inputs always; torch inputs and torch SDPA next to them when torch is installed.

    PYTHONPATH=. python tools/host_overhead.py [--calls N] [--profile NAME]

"host" is the time the calls take to return (launches queue, nothing waits); "with GPU" adds the
final synchronisation, so it exceeds "host" only where the GPU is the limit. ``--profile NAME``
prints cProfile's top entries for that row instead. Without a GPU it says so and exits 0;
tools/host_overhead_cpu.py times the Python part there.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from gpu_check import skipped_without_gpu


def _per_call_us(fn, calls: int, sync) -> tuple[float, float]:
    for _ in range(20):  # compilation, module load, allocator growth, plan cache
        fn()
    sync()
    best_host = best_wall = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - start
        sync()
        wall = time.perf_counter() - start
        best_host, best_wall = min(best_host, host), min(best_wall, wall)
    return best_host / calls * 1e6, best_wall / calls * 1e6


def _cases(cp, torch):
    import cuflash
    from cuflash.bench.attention import random_normal

    q, k, v, dout = (random_normal((1, 128, 1, 64), "bfloat16", seed) for seed in range(4))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    packed = q.reshape(128, 1, 64)
    cu = cp.asarray([0, 64, 128], dtype=cp.int32)
    out_p, lse_p = cuflash.attention_varlen(packed, packed, packed, cu, cu, 64, 64, return_lse=True)
    cases = {
        "attention, CuPy": lambda: cuflash.attention(q, k, v),
        "attention causal, return_lse, CuPy": lambda: cuflash.attention(q, k, v, causal=True, return_lse=True),
        "attention_backward, CuPy": lambda: cuflash.attention_backward(dout, q, k, v, out, lse),
        "attention_backward deterministic, CuPy": lambda: cuflash.attention_backward(dout, q, k, v, out, lse,
                                                                                     deterministic=True),
        "attention_varlen validate=False, CuPy": lambda: cuflash.attention_varlen(
            packed, packed, packed, cu, cu, 64, 64, validate=False),
        "attention_varlen validate=True, CuPy": lambda: cuflash.attention_varlen(packed, packed, packed, cu, cu,
                                                                                 64, 64),
        "attention_varlen_backward validate=False, CuPy": lambda: cuflash.attention_varlen_backward(
            dout.reshape(128, 1, 64), packed, packed, packed, out_p, lse_p, cu, cu, 64, 64, validate=False),
    }
    # A decoding step: one token of 32 query heads over 8 kv heads, d128, appended to a paged cache
    # of 4096 positions (pages of 16); num_splits derived from the capacity, as a serving loop calls it.
    q1, new = random_normal((1, 1, 32, 128), "bfloat16", 4), random_normal((1, 1, 8, 128), "bfloat16", 5)
    cache = random_normal((256, 16, 8, 128), "bfloat16", 6)
    table = cp.arange(256, dtype=cp.int32).reshape(1, 256)
    lengths = cp.asarray([4000], dtype=cp.int32)
    cases["attention_with_kvcache paged, append, CuPy"] = lambda: cuflash.attention_with_kvcache(
        q1, cache, cache, new, new, cache_seqlens=lengths, page_table=table, causal=True)
    if torch is not None:
        from cuflash.torch import flash_attn_with_kvcache

        tq1, tnew, tcache, ttable, tlengths = (torch.from_dlpack(x) for x in (q1, new, cache, table, lengths))
        cases["flash_attn_with_kvcache paged, append, torch"] = lambda: flash_attn_with_kvcache(
            tq1, tcache, tcache, tnew, tnew, cache_seqlens=tlengths, page_table=ttable, causal=True)
    if torch is not None:
        tq, tk, tv, tdout = (torch.from_dlpack(x) for x in (q, k, v, dout))
        tout, tlse = cuflash.attention(tq, tk, tv, return_lse=True)
        sdpa = [x.transpose(1, 2) for x in (tq, tk, tv)]
        cases |= {
            "attention, torch": lambda: cuflash.attention(tq, tk, tv),
            "attention_backward, torch": lambda: cuflash.attention_backward(tdout, tq, tk, tv, tout, tlse),
            "torch SDPA forward": lambda: torch.nn.functional.scaled_dot_product_attention(*sdpa),
        }
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", help="a row's name: print its cProfile instead of timing every row")
    args = parser.parse_args()
    if skipped_without_gpu("host_overhead"):
        return
    import cupy as cp

    try:
        import torch
    except ImportError:
        torch = None
    import cuflash

    def sync():
        cp.cuda.Device().synchronize()
        if torch is not None:
            torch.cuda.synchronize()

    cases = _cases(cp, torch)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"{props['name'].decode()}; cuflash {cuflash.__file__}; Python {sys.version.split()[0]}; "
          f"torch {torch.__version__ if torch else 'absent'}; tiny shape (1, 128, 1, 64) bf16, {args.calls} calls")
    if args.profile:
        fn = cases[args.profile]
        _per_call_us(fn, 10, sync)
        profile = cProfile.Profile()
        profile.runcall(lambda: [fn() for _ in range(args.calls)])
        sync()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
        return
    print(f"{'':48s} {'host':>8s} {'with GPU':>9s}  (us per call, best of 5)")
    for name, fn in cases.items():
        host, wall = _per_call_us(fn, args.calls, sync)
        print(f"{name:48s} {host:8.1f} {wall:9.1f}")


if __name__ == "__main__":
    main()
