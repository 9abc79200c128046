"""Quick device smoke check: one call per head-dim bucket, error vs the float64 GPU reference."""
import math, sys, traceback
import cupy as cp, numpy as np
import cuflash
from tests import gpu_reference as ref

rng = np.random.default_rng(0)
for dtype in ["bfloat16", "float16"]:
    for d in [64, 128, 32, 96, 192, 256]:
        for causal in [False, True]:
            for sq, sk in [(128, 128), (300, 517), (17, 1)]:
                try:
                    q = ref.random_bshd((2, sq, 4, d), dtype, rng)
                    k = ref.random_bshd((2, sk, 2, d), dtype, rng)
                    v = ref.random_bshd((2, sk, 2, d), dtype, rng)
                    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                    cp.cuda.Device().synchronize()
                    q64, k64, v64 = (ref.as_float64(x) for x in (q, k, v))
                    o_ref, l_ref = ref.attention(q64, k64, v64, causal=causal, scale=1 / math.sqrt(d))
                    err = float(cp.nan_to_num(cp.abs(ref.as_float64(out) - o_ref), nan=1e9).max())
                    lerr = float(cp.abs(cp.where(cp.isneginf(l_ref), 0, lse - l_ref)).max())
                    print(dtype, d, causal, sq, sk, f"out err {err:.2e} lse err {lerr:.2e}", flush=True)
                except Exception:
                    traceback.print_exc()
                    sys.exit(1)
