"""Interleaved A/B timing of two versions of the CUDA sources in one process.

    git archive main cuda_src | tar -x -C /tmp/main
    PYTHONPATH=. python tools/ab_trees.py /tmp/main/cuda_src [--mode bwd] [--cases SPEC ...]

A is the given cuda_src tree, B this checkout's; the Python side (dispatch, plans, launch) is this
checkout's for both, so a change to dispatch.py applies to both versions, and both trees must
take the template arguments this checkout's name expressions give (where they differ,
tools/sass_diff.py compares the generated code instead). Each version keeps its
own compiled modules and launch plans, swapped in before each of its rounds. Under the H200's
power cap a kernel's clock depends on what ran before it and takes hundreds of milliseconds to
settle (docs/measuring.md), so two versions are compared alternately in one
process, each round first running its call alone for ``--settle`` seconds, the order of A and B
reversed every round; the table gives the median over the rounds and each version's range.

A case is ``fwd|bwd:head_dim:seqlen:causal|full:left:right[:det][:capN][:gqaN]``: bf16, batch *
seqlen = 16384 and heads * head_dim = 2048 (the standard shapes), a window (left, right)
(-1 unbounded), deterministic mode, softcap N, N query heads per K/V head. The last column says
whether the two versions' results on the same inputs are bitwise equal, else their largest
difference over the largest value (for dq in default mode the order of the sums differs between
runs anyway). Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from gpu_check import skipped_without_gpu

TOTAL_TOKENS, MODEL_WIDTH = 16384, 2048

DEFAULT_CASES = {
    "fwd": ["fwd:128:16384:full:-1:-1", "fwd:128:4096:causal:-1:-1", "fwd:128:1024:causal:-1:-1",
            "fwd:128:16384:full:1024:1024", "fwd:128:16384:causal:1024:0", "fwd:64:16384:causal:-1:-1",
            "fwd:256:16384:causal:-1:-1", "fwd:128:16384:causal:-1:-1:cap30"],
    "bwd": ["bwd:128:4096:full:-1:-1", "bwd:128:16384:full:-1:-1", "bwd:128:1024:causal:-1:-1",
            "bwd:128:16384:causal:-1:-1", "bwd:128:16384:full:1024:1024", "bwd:128:16384:causal:1024:0",
            "bwd:128:4096:causal:-1:-1:gqa4", "bwd:128:4096:causal:-1:-1:det", "bwd:64:512:full:-1:-1",
            "bwd:64:16384:causal:-1:-1"],
}


@dataclass(frozen=True)
class Case:
    mode: str
    head_dim: int
    seqlen: int
    causal: bool
    window: tuple[int, int]
    deterministic: bool = False
    softcap: float = 0.0
    group: int = 1

    @classmethod
    def parse(cls, spec: str) -> "Case":
        mode, head_dim, seqlen, mask, left, right, *extras = spec.split(":")
        if mode not in ("fwd", "bwd") or mask not in ("causal", "full"):
            raise ValueError(f"--cases: {spec!r} is not fwd|bwd:head_dim:seqlen:causal|full:left:right[:...]")
        options = {}
        for extra in extras:
            if extra == "det":
                options["deterministic"] = True
            elif extra.startswith("cap"):
                options["softcap"] = float(extra[3:])
            elif extra.startswith("gqa"):
                options["group"] = int(extra[3:])
            else:
                raise ValueError(f"--cases: unknown option {extra!r} in {spec!r} (det, capN, gqaN)")
        return cls(mode, int(head_dim), int(seqlen), mask == "causal", (int(left), int(right)), **options)

    def call(self):
        """The timed call on fresh random inputs, and a function giving its results."""
        import cuflash
        from cuflash.bench.attention import random_normal

        batch, heads = max(1, TOTAL_TOKENS // self.seqlen), MODEL_WIDTH // self.head_dim
        shape_q = (batch, self.seqlen, heads, self.head_dim)
        shape_kv = (batch, self.seqlen, heads // self.group, self.head_dim)
        q, dout = (random_normal(shape_q, "bfloat16", seed) for seed in (0, 3))
        k, v = (random_normal(shape_kv, "bfloat16", seed) for seed in (1, 2))
        options = dict(causal=self.causal, window=self.window, softcap=self.softcap)
        if self.mode == "fwd":
            def forward():
                return cuflash.attention(q, k, v, **options)

            return forward, lambda: (forward(),)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)

        def backward():
            return cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=self.deterministic, **options)

        return backward, backward


class Versions:
    """Each cuda_src tree with its own loaded modules and launch plans."""

    def __init__(self, trees: dict[str, Path]):
        from cuflash._core import plan

        self.trees = trees
        self.state = {name: ({}, plan.PlanCache()) for name in trees}

    def use(self, name: str) -> None:
        from cuflash._core import kernels, plan

        root = self.trees[name]
        kernels.source_root = lambda: root
        kernels.sources_fingerprint.cache_clear()
        kernels.LOADED, plan.PLANS = self.state[name]


def compare_results(a: tuple, b: tuple) -> str:
    """Per result: ``=`` where the two are bitwise equal, else max |a - b| / max |a| (on the host:
    CuPy has no bfloat16 arithmetic)."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    words = []
    for index, (x, y) in enumerate(zip(a, b)):
        x, y = (cp.asnumpy(t.view(cp.uint16)) for t in (x, y))
        if np.array_equal(x, y):
            words.append(f"{index}:=")
            continue
        xf, yf = (t.view(ml_dtypes.bfloat16).astype(np.float32) for t in (x, y))
        words.append(f"{index}:{np.abs(xf - yf).max() / max(np.abs(xf).max(), 1e-30):.1e}")
    return " ".join(words)


def measure(versions: Versions, case: Case, rounds: int, settle_s: float) -> str:
    from varlen_window import settled_ms

    results, times = {}, {name: [] for name in versions.trees}
    for name in versions.trees:
        versions.use(name)
        _, outputs = case.call()
        results[name] = outputs()
    for index in range(rounds):
        for name in list(versions.trees)[:: 1 if index % 2 == 0 else -1]:
            versions.use(name)
            run, _ = case.call()
            times[name].append(settled_ms(run, settle_s))
    a, b = (statistics.median(times[name]) for name in ("A", "B"))
    spans = " | ".join(f"{min(times[name]):.3f}-{max(times[name]):.3f}" for name in ("A", "B"))
    return (f"| {case.mode} d{case.head_dim} {case.seqlen} {'causal' if case.causal else 'full'} {case.window}"
            f"{' det' if case.deterministic else ''}{f' cap{case.softcap:g}' if case.softcap else ''}"
            f"{f' gqa{case.group}' if case.group > 1 else ''} | {a:.3f} | {b:.3f} | {100 * (b / a - 1):+.1f}% | "
            f"{spans} | {compare_results(results['A'], results['B'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree_a", type=Path, help="the cuda_src directory of version A")
    parser.add_argument("--mode", choices=("fwd", "bwd"), default="bwd", help="the default case list")
    parser.add_argument("--cases", nargs="+", help="case specs (see the module docstring)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--settle", type=float, default=0.3, help="seconds each round runs its call first")
    args = parser.parse_args()
    try:
        cases = [Case.parse(spec) for spec in (args.cases or DEFAULT_CASES[args.mode])]
    except ValueError as error:
        parser.error(str(error))
    tree_a = args.tree_a.resolve()
    if not (tree_a / "common").is_dir():
        parser.error(f"tree_a: {tree_a} is not a cuda_src directory (no common/ in it)")
    if skipped_without_gpu("ab_trees"):
        return
    import cupy as cp

    from cuflash._core import kernels

    versions = Versions({"A": tree_a, "B": kernels.source_root()})
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), f"A = {tree_a}, B = {versions.trees['B']}")
    print("| case | A ms | B ms | B/A | A range | B range | A vs B bits |\n|---|---|---|---|---|---|---|")
    for case in cases:
        print(measure(versions, case, args.rounds, args.settle), flush=True)


if __name__ == "__main__":
    main()
