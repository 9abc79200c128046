"""The forward's kernels alone, cuflash's against torch SDPA's cuDNN backend, at the short and
medium lengths where a call's host time is close to its kernel's: device time per kernel from the
torch profiler, and each library's host time per call.

    PYTHONPATH=. python tools/kernel_times.py [--seqlens 1024 2048 4096]

The standard shapes (batch * seqlen = 16384, heads * head_dim = 2048), bf16, the same inputs back
to back (L2 warm for both). ``python -m cuflash bench`` times whole calls instead, as a user makes
them; where the host time of SDPA's call is near its kernel's, its cells there carry host time.
Without a GPU or torch it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gpu_check import skipped_without_gpu

CALLS = 10


def kernel_us(call, name_part: str) -> float:
    """Median device time in us of the kernels whose name holds ``name_part`` over CALLS calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    return statistics.median(e.device_time for e in prof.events() if name_part in e.name and e.device_time > 0)


def host_us(call) -> float:
    """Host time in us per call, measured while a queued matrix multiply keeps the GPU busy so that
    no call waits for it."""
    import torch

    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):
        a @ a
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    elapsed = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args()
    if skipped_without_gpu("kernel_times"):
        return
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        print("kernel_times: skipped, torch is not installed")
        return
    import cupy as cp

    import cuflash
    from cuflash._cpu.reference import attention_flops

    print("| head_dim | causal | seqlen | cuDNN kernel us | cuflash kernel us | cuflash / cuDNN (kernel) "
          "| cuDNN host us | cuflash host us |")
    print("|---|---|---|---|---|---|---|---|")
    for head_dim in (64, 128, 256):
        for causal in (True, False):
            for seqlen in args.seqlens:
                batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                views = [x.transpose(1, 2) for x in (q, k, v)]
                arrays = [cp.from_dlpack(x) for x in (q, k, v)]

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(*views, is_causal=causal)

                def ours():
                    return cuflash.attention(*arrays, causal=causal)

                theirs_us, ours_us = kernel_us(cudnn, "cudnn"), kernel_us(ours, "flash_fwd")
                flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
                ratio = (flops / ours_us) / (flops / theirs_us)
                print(f"| {head_dim} | {'yes' if causal else 'no'} | {seqlen} | {theirs_us:.1f} | {ours_us:.1f} | "
                      f"{ratio:.2f} | {host_us(cudnn):.0f} | {host_us(ours):.0f} |", flush=True)


if __name__ == "__main__":
    main()
