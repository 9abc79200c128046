"""Packed batches, windows and softcap on one GPU (bf16, head_dim 128, 16 heads), in useful-FLOP TFLOP/s:

(a) a packed batch of random lengths (uniform 128..4096, about 16k tokens) against a fixed-length
    batch of equal work, the same sequences padded to the longest, and the sequences one by one;
(b) windows over seqlen 16k against full attention: the time ratio over the FLOPs-proportional
    share (the target is at most 1.2x), and the cost of a softcap.

    PYTHONPATH=. python benchmarks/varlen_window.py [--mode fwd|bwd|both]

Useful FLOPs count visible (query, key) pairs only: 4 * heads * head_dim per pair forward, 2.5x
that backward. Each sample queues ten calls back to back, so that the host cost of a call (checks,
allocation, launch) overlaps the previous kernel as in a model, not idle GPU time. In (b) each
kernel first runs alone for half a second: the H200 runs every kernel here at its power limit, and
its clock takes longer than a short sample to settle after the kernel before, so without this a
short window kernel timed right after full attention reads 5-15% slower than it runs
(docs/measuring.md). Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cuflash
from cuflash.bench.attention import random_normal
from cuflash._cpu.reference import key_bounds
from cuflash.bench.timing import tflops, time_ms

from gpu_check import skipped_without_gpu

HEADS, DIM, DTYPE = 16, 128, "bfloat16"
BACKWARD_FLOPS = 2.5  # the backward's five products against the forward's two


def pair_count(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1)) -> int:
    lo, hi = key_bounds(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window)
    return int(np.maximum(hi - lo, 0).sum())


def flops(pairs: int, mode: str, heads: int = HEADS, dim: int = DIM) -> float:
    return 4.0 * heads * dim * pairs * (BACKWARD_FLOPS if mode == "bwd" else 1.0)


def ms(run) -> float:
    return time_ms(lambda i: run(), 10, warmup=3, repeats=10)


def settled_ms(run, seconds: float = 0.5) -> float:
    """ms(run) once ``run`` alone has kept the GPU busy for ``seconds`` (its clock settled)."""
    import cupy as cp

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            run()
        cp.cuda.get_current_stream().synchronize()
    return ms(run)


def timed_call(mode: str, forward, backward):
    """What one timed call does: ``forward()``, or ``backward(out, lse)`` after one untimed forward
    (``forward(return_lse=True)``) and a fixed dout."""
    if mode == "fwd":
        return forward
    out, lse = forward(return_lse=True)
    return lambda: backward(out, lse)


def varlen_table(mode: str, rng) -> None:
    import cupy as cp

    lengths = []
    while sum(lengths) < 16384:
        lengths.append(int(rng.integers(128, 4097)))
    total, longest, batch = sum(lengths), max(lengths), len(lengths)
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    q, k, v, dout = (random_normal((total, HEADS, DIM), DTYPE, seed=s) for s in range(4))
    print(f"(a) {mode}: {batch} sequences, {total} tokens, longest {longest}: {lengths}")

    def fixed(shape, causal):
        fq, fk, fv, fdout = (random_normal(shape, DTYPE, seed=s) for s in range(4))
        return timed_call(mode, lambda **lse: cuflash.attention(fq, fk, fv, causal=causal, **lse),
                          lambda out, lse: cuflash.attention_backward(fdout, fq, fk, fv, out, lse, causal=causal))

    for causal in (False, True):
        useful = sum(pair_count(n, n, causal) for n in lengths)
        rows = []
        packed = timed_call(
            mode, lambda **lse: cuflash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                          validate=False, **lse),
            lambda out, lse: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest,
                                                               causal=causal, validate=False))
        rows.append(("varlen, one launch", ms(packed), useful))
        # A fixed-length batch doing as many (query, key) pairs, at the lengths' mean-square length.
        seqlen = int(round(np.sqrt(np.mean(np.square(lengths))) / 128)) * 128
        fixed_batch = max(1, round(useful / pair_count(seqlen, seqlen, causal)))
        rows.append((f"fixed {fixed_batch}x{seqlen} (equal work)", ms(fixed((fixed_batch, seqlen, HEADS, DIM), causal)),
                     fixed_batch * pair_count(seqlen, seqlen, causal)))
        rows.append((f"padded {batch}x{longest} (useful FLOPs)", ms(fixed((batch, longest, HEADS, DIM), causal)),
                     useful))
        if mode == "fwd":
            bounds = zip(np.cumsum([0] + lengths[:-1]), np.cumsum(lengths))
            views = [(q[a:b][None], k[a:b][None], v[a:b][None]) for a, b in bounds]
            rows.append(("one by one", ms(lambda: [cuflash.attention(*x, causal=causal) for x in views]), useful))
        base = tflops(flops(rows[1][2], mode), rows[1][1])
        print(f"  {'causal' if causal else 'non-causal'}:")
        for name, t, pairs in rows:
            rate = tflops(flops(pairs, mode), t)
            print(f"    {name:<38} {t:8.3f} ms {rate:7.1f} TFLOP/s  {rate / base:5.2f}x fixed")


def window_table(mode: str) -> None:
    seqlen = 16384
    q, k, v, dout = (random_normal((1, seqlen, HEADS, DIM), DTYPE, seed=s) for s in range(4))

    def call(**options):
        return timed_call(mode, lambda **lse: cuflash.attention(q, k, v, **options, **lse),
                          lambda out, lse: cuflash.attention_backward(dout, q, k, v, out, lse, **options))

    print(f"(b) {mode}: seqlen {seqlen}, batch 1: window time / full time against the FLOPs share (target: <= 1.2x)")
    for causal, window in ((False, (1024, 1024)), (True, (1024, 0)), (True, (1024, -1))):
        full = settled_ms(call(causal=causal))
        t = settled_ms(call(causal=causal, window=window))
        pairs = pair_count(seqlen, seqlen, causal, window)
        share = pairs / pair_count(seqlen, seqlen, causal)
        print(f"  {'causal' if causal else 'full'} window {window}: {t:.3f} ms vs {full:.3f} ms, time ratio "
              f"{t / full:.4f}, FLOPs share {share:.4f}, ratio/share {t / full / share:.2f}  "
              f"({tflops(flops(pairs, mode), t):.1f} TFLOP/s)")
    full = settled_ms(call(causal=True))
    t = settled_ms(call(causal=True, softcap=30.0))
    print(f"  causal softcap 30: {t:.3f} ms vs {full:.3f} ms without ({t / full:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("fwd", "bwd", "both"), default="both")
    args = parser.parse_args()
    if skipped_without_gpu("varlen_window"):
        return
    import cupy as cp

    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for mode in ("fwd", "bwd") if args.mode == "both" else (args.mode,):
        varlen_table(mode, np.random.default_rng(0))
        window_table(mode)


if __name__ == "__main__":
    main()
