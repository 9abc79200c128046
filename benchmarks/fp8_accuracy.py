"""FP8 attention's error on FlashAttention-3's outlier distribution, on the CPU.

q, k, v are N(0, 1) plus, on 0.1% of the entries, an independent N(0, 10²) term (the FA3 paper's
test of FP8 accuracy). Each row quantizes q, k, v with cuflash.quantize_fp8 at one granularity,
q and k rotated or not (v never), and computes attention on the dequantized inputs with scores
and ``P @ v`` accumulated in float32 and the output rounded to bfloat16, P rounded to e4m3 in one
of two places:

* after normalising (``reference.attention_reference(..., p_dtype=e4m3)``, FlashAttention-3's
  test baseline): probabilities near 1/seqlen fall to e4m3's subnormals, so this overstates;
* before normalising, as the FP8 kernels do: ``exp(s - rowmax)`` in [0, 1] rounded to e4m3,
  the row sum taken in float32 before rounding.

With a GPU, a third column runs the FP8 kernel of the device's family itself on the same
quantized inputs (per-tensor and per-head descales: the granularities the kernels take).

The number is the RMSE against float64 attention on the unquantized inputs; the first row is
bfloat16 attention for scale. The attention kernels take per-tensor and per-head descales; block
quantization is here to measure what it would buy.

    PYTHONPATH=. python benchmarks/fp8_accuracy.py [--seqlen 1024 --heads 4 --head-dim 128 --seed 0]
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import cuflash
from cuflash._cpu import reference
from cuflash._core.device import gpu_unavailable


def outlier_inputs(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """q, k, v in float64: N(0, 1) + N(0, 100) * Bernoulli(0.001)."""
    return tuple(rng.standard_normal(shape) + rng.normal(0.0, 10.0, shape) * (rng.random(shape) < 1e-3)
                 for _ in range(3))


def dequantized(x: np.ndarray, granularity: str, rotate: bool, seed: int, block_size: int) -> np.ndarray:
    """``x`` quantized to e4m3 and multiplied back by its descales (float64)."""
    xq, descale = cuflash.quantize_fp8(x, granularity, block_size=block_size, rotate=rotate, seed=seed)
    if granularity == "block":
        per_row = np.repeat(descale.transpose(0, 2, 1), block_size, axis=1)[:, :x.shape[1]]
        return xq.astype(np.float64) * per_row[..., None]
    return reference.dequantize(xq, descale)


def attention_rounding_p_like_the_kernels(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Attention in float32 with the unnormalised ``exp(s - rowmax)`` rounded to e4m3 before
    ``P @ v`` and the row sum taken before rounding; (batch, seqlen, heads, head_dim), no mask."""
    qh, kh, vh = (x.astype(np.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    kh, vh = (np.repeat(x, qh.shape[1] // x.shape[1], axis=1) for x in (kh, vh))
    s = qh @ kh.transpose(0, 1, 3, 2) * np.float32(1 / np.sqrt(q.shape[3]))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out = (p.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) @ vh) / p.sum(axis=-1, keepdims=True)
    return out.transpose(0, 2, 1, 3)


def kernel_output(q: np.ndarray, k: np.ndarray, v: np.ndarray, granularity: str, rotate: bool, seed: int
                  ) -> np.ndarray:
    """The GPU FP8 forward on q, k, v quantized as ``dequantized`` quantizes them (bf16 output,
    float32 on the host)."""
    import cupy as cp

    def upload(x, rotate_x):
        xq, descale = cuflash.quantize_fp8(x, granularity, rotate=rotate_x, seed=seed)
        return cp.asarray(xq.view(np.uint8)), cp.asarray(descale)

    (q8, dq), (k8, dk), (v8, dv) = upload(q, rotate), upload(k, rotate), upload(v, False)
    out = cuflash.attention(q8, k8, v8, dtype="e4m3", descale_q=dq, descale_k=dk, descale_v=dv)
    return cp.asnumpy(out.view(cp.uint16)).view(ml_dtypes.bfloat16).astype(np.float32)


def rmse(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((out.astype(np.float64) - ref) ** 2)))


def study(seqlen: int, heads: int, head_dim: int, seed: int, block_size: int = 128, gpu: bool = False
          ) -> list[tuple[str, float, float, float | None]]:
    """(label, RMSE with P rounded after normalising, RMSE with P rounded as the kernels do, RMSE
    of the GPU kernel itself where ``gpu`` and the granularity is one the kernels take, else None)."""
    rng = np.random.default_rng(seed)
    q, k, v = outlier_inputs((1, seqlen, heads, head_dim), rng)
    exact = reference.attention_reference(q, k, v)[0]
    bf16 = rmse(reference.attention_reference(q, k, v, dtype=ml_dtypes.bfloat16)[0], exact)
    rows = [("bfloat16 inputs (no FP8)", bf16, bf16, None)]
    for granularity in ("tensor", "head", "block"):
        for rotate in (False, True):
            qd, kd = (dequantized(x, granularity, rotate, seed, block_size) for x in (q, k))
            vd = dequantized(v, granularity, False, seed, block_size)
            normalised = reference.attention_reference(qd, kd, vd, dtype=np.float32,
                                                       p_dtype=ml_dtypes.float8_e4m3fn)[0]
            kernel_like = attention_rounding_p_like_the_kernels(qd, kd, vd)
            label = f"FP8, per-{granularity}" + (", rotated q/k" if rotate else "")
            on_gpu = (rmse(kernel_output(q, k, v, granularity, rotate, seed), exact)
                      if gpu and granularity != "block" else None)
            rows.append((label, *(rmse(out.astype(ml_dtypes.bfloat16), exact) for out in (normalised, kernel_like)),
                         on_gpu))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"seqlen {args.seqlen}, heads {args.heads}, head_dim {args.head_dim}, block {args.block_size}, "
          f"seed {args.seed}\n")
    gpu = gpu_unavailable() is None
    print("| quantization | RMSE, P rounded after normalising | RMSE, P rounded as the kernels do | "
          "RMSE of the GPU kernel |\n|---|---|---|---|")
    for label, normalised, kernel_like, on_gpu in study(args.seqlen, args.heads, args.head_dim, args.seed,
                                                        args.block_size, gpu):
        print(f"| {label} | {normalised:.2e} | {kernel_like:.2e} | {'-' if on_gpu is None else f'{on_gpu:.2e}'} |")


if __name__ == "__main__":
    main()
