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


def time_ms(run: Callable[[int], object], rotations: int, warmup: int = 3, repeats: int = 15,
            stream=None) -> float:
    """Median milliseconds per call of ``run(i)``, i cycling over ``rotations`` input sets.

    Each sample brackets one call per input set with CUDA events on ``stream`` (default: CuPy's
    current stream; pass torch's for torch work), so launches queue back to back as in a real
    model and the host's launch cost is hidden wherever the kernel outlasts it. Warm-up calls
    (compilation, module load, allocator growth) are not timed.
    """
    import cupy as cp

    stream = stream or cp.cuda.get_current_stream()
    for i in range(warmup):
        run(i % rotations)
    stream.synchronize()
    samples: list[float] = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for i in range(rotations):
            run(i)
        stop.record(stream)
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / rotations)
    return statistics.median(samples)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in row) + " |")
    return "\n".join(lines)


class PeakMemory:
    """Peak bytes allocated through CuPy's memory pool inside a ``with`` block.

    Wraps the pool's allocator; sizes are what callers asked for, so the peak is the working set
    of the code in the block, independent of what the pool kept cached before it.
    """

    def __enter__(self) -> "PeakMemory":
        import cupy as cp

        self.peak = 0
        pool = cp.get_default_memory_pool()
        cp.get_default_memory_pool().free_all_blocks()
        self._base = pool.used_bytes()

        def allocate(size: int):
            memory = pool.malloc(size)
            self.peak = max(self.peak, pool.used_bytes() - self._base)
            return memory

        self._previous = cp.cuda.get_allocator()
        cp.cuda.set_allocator(allocate)
        return self

    def __exit__(self, *exc) -> None:
        import cupy as cp

        cp.cuda.set_allocator(self._previous)
