"""Host cost of one cuflash.attention call: wall time per call on a problem too small to matter
on the GPU, with CuPy and with torch inputs, next to torch SDPA. PYTHONPATH=. python benchmarks/launch_overhead.py"""

import time

import cupy as cp
import torch

import cuflash


def per_call_us(fn, calls=2000):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
qc = cp.from_dlpack(q)
qt = q.transpose(1, 2)
print(f"cuflash, torch inputs: {per_call_us(lambda: cuflash.attention(q, q, q)):.1f} us/call")
print(f"cuflash, CuPy inputs:  {per_call_us(lambda: cuflash.attention(qc, qc, qc)):.1f} us/call")
print(f"torch SDPA:            {per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt)):.1f} us/call")
