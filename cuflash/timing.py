"""Timing on the device: CUDA events around many launches, median of repeats, inputs rotated.

Shared by ``python -m cuflash`` and benchmarks/. Inputs are rotated among several copies whose
total is larger than the L2 cache, so repeated runs do not time the cache.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence


def copies_to_defeat_l2(bytes_per_set: int, l2_bytes: int = 60 << 20) -> int:
    """How many input sets to rotate so that together they are 3x the L2 (at least 2, at most 8)."""
    return max(2, min(8, -(-3 * l2_bytes // max(bytes_per_set, 1))))


def time_ms(run: Callable[[int], object], rotations: int, warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``run(i)`` (i cycles over ``rotations`` input sets), by CUDA events.

    Warm-up calls (compilation, module load, allocator growth) are not timed.
    """
    import cupy as cp

    for i in range(warmup):
        run(i % rotations)
    cp.cuda.get_current_stream().synchronize()
    samples: list[float] = []
    for i in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run(i % rotations)
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(samples)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in row) + " |")
    return "\n".join(lines)
