"""cuflash's FP8 (e4m3) forward next to its bf16 forward on the same values, at the standard shapes
(batch x seqlen 16k tokens, heads x head_dim 2048), in TFLOP/s, as a Markdown table.

    PYTHONPATH=. python benchmarks/fp8_forward.py [--head-dims 64 128 256] [--seqlens 1024 ... 16384]

The FP8 inputs are the bf16 ones quantized per (batch, head) by cuflash.quantize_fp8, with their
descales passed as arrays. Both run the device's own family: on Hopper the ratio compares the sm90
FP8 kernel (e4m3 products) with the sm90 bf16 kernel; CUFLASH_FAMILY=sm80 compares sm80's FP8 path
(bytes widened to bf16 in shared memory, bf16 tensor-core rate). Without a GPU it says so and exits
0.
"""

from __future__ import annotations

import argparse

import cuflash
from cuflash.bench import HIDDEN, TOTAL_TOKENS, random_normal
from cuflash.reference import attention_flops
from cuflash.timing import copies_to_defeat_l2, format_table, tflops, time_ms

from gpu_check import skipped_without_gpu


def rates(head_dim: int, seqlen: int, causal: bool) -> tuple[float, float]:
    """(FP8, bf16) TFLOP/s of the forward at one shape."""
    batch, heads = max(1, TOTAL_TOKENS // seqlen), HIDDEN // head_dim
    shape = (batch, seqlen, heads, head_dim)
    sets = [[random_normal(shape, "bfloat16", seed=3 * i + j) for j in range(3)]
            for i in range(copies_to_defeat_l2(3 * batch * seqlen * HIDDEN * 2))]
    quantized = [[cuflash.quantize_fp8(x, "head") for x in s] for s in sets]
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)

    def fp8(i):
        (q, dq), (k, dk), (v, dv) = quantized[i]
        return cuflash.attention(q, k, v, causal=causal, descale_q=dq, descale_k=dk, descale_v=dv, dtype="e4m3")

    def bf16(i):
        return cuflash.attention(*sets[i], causal=causal)

    return tuple(tflops(flops, time_ms(run, len(sets))) for run in (fp8, bf16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    args = parser.parse_args()
    if skipped_without_gpu("fp8_forward.py"):
        return
    rows = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            for seqlen in args.seqlens:
                fp8, bf16 = rates(head_dim, seqlen, causal)
                rows.append((head_dim, "yes" if causal else "no", seqlen, fp8, bf16, f"{fp8 / bf16:.2f}"))
    print(format_table(["head_dim", "causal", "seqlen", "FP8 TFLOP/s", "bf16 TFLOP/s", "FP8 / bf16"], rows))


if __name__ == "__main__":
    main()
