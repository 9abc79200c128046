"""The forward at 512-2k against torch SDPA's cuDNN backend, each cell measured alternately five
times in one process (the target is >= 0.9x cuDNN there). At these lengths a single pass of
``python -m cuflash bench`` moves 5-15% between runs, cuDNN's side most, so one pass can put a cell
either side of the bar; the median over alternating rounds and the per-round range say where it is.

    PYTHONPATH=. python tools/short_repeated.py [--rounds N]

The standard shapes (batch * seqlen = 16384, heads * head_dim = 2048), bf16; each
measurement is bench.measure's (median of 5 samples of ten calls). Without a GPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import statistics

from gpu_check import skipped_without_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if skipped_without_gpu("short_repeated"):
        return
    from cuflash.bench import attention as bench

    runs = bench.implementations(["cuflash", "sdpa-cudnn"])
    print(f"| head_dim | causal | seqlen | cuflash (median of {args.rounds}) | sdpa-cudnn (median of {args.rounds}) "
          "| ratio of medians | min..max ratio per round |")
    print("|---|---|---|---|---|---|---|")
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for seqlen in (512, 1024, 2048):
                case = bench.Case("bfloat16", head_dim, seqlen, causal, "fwd")
                inputs = bench.input_sets(case)
                rates = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        rates[name].append(case.flops() / bench.measure(name, run, case, inputs, 5) / 1e9)
                ours, peer = (statistics.median(rates[name]) for name in runs)
                ratios = [a / b for a, b in zip(*rates.values())]
                print(f"| {head_dim} | {'yes' if causal else 'no'} | {seqlen} | {ours:.1f} | {peer:.1f} | "
                      f"{ours / peer:.2f} | {min(ratios):.2f}..{max(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
