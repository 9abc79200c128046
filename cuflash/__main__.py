"""``python -m cuflash``: environment report, self-check, and cuflash next to standard attention.

``python -m cuflash compile-check --arch sm_80`` compiles every kernel instantiation for one
architecture with NVRTC (no GPU needed) and reports registers and spills.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cuflash
from cuflash import dispatch, kernels, nvrtc, reference


def compile_check(arch: str) -> int:
    """Compile all forward instantiations for ``arch``; return the number of failures."""
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))}, target {arch}, sources {kernels.source_root()}")
    failures = 0
    for choice in dispatch.all_forward_kernels("sm80"):
        try:
            compiled = kernels.compile_kernel(choice, arch, use_cache=False)
        except nvrtc.CompileError as error:
            failures += 1
            print(f"FAILED {choice.name_expression}\n{error}")
            continue
        r = compiled.resources()
        print(f"{choice.name_expression:<64} {r['registers']:>3} registers, "
              f"{r['spill_stores']:>3} B spill stores, {r['spill_loads']:>3} B spill loads, "
              f"{compiled.seconds:5.2f} s")
    print(f"{'all compiled' if not failures else f'{failures} failed'}")
    return failures


def cpu_check() -> float:
    """The CPU path (blockwise online softmax) against the naive float64 reference."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 157, 4, 64)) for _ in range(3))
    out = cuflash.attention(q, k, v, causal=True)
    expected, _ = reference.attention_reference(q, k, v, causal=True)
    return float(np.abs(out - expected).max())


def gpu_unavailable() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def gpu_report() -> None:
    import cupy as cp
    import ml_dtypes

    from cuflash.api import _device_plan
    from cuflash.baseline import standard_attention
    from cuflash.timing import PeakMemory, format_table, time_ms, tflops

    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    family, arch = _device_plan(device.id)
    print(f"device {device.id}: {props['name'].decode()}, compute capability "
          f"{device.compute_capability[:-1]}.{device.compute_capability[-1]}, family {family} ({arch}), "
          f"NVRTC {'.'.join(map(str, nvrtc.version()))}, cache {kernels.cache_dir()}")

    rng = np.random.default_rng()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    host = [rng.standard_normal((2, 300, 4, 128)).astype(bf16) for _ in range(3)]
    start = time.perf_counter()
    out = cuflash.attention(*(cp.asarray(x) for x in host), causal=True)
    cp.cuda.Device().synchronize()
    first_call = time.perf_counter() - start
    expected, _ = reference.attention_reference(*(x.astype(np.float64) for x in host), causal=True)
    lowp, _ = reference.attention_reference(*host, causal=True, dtype=bf16)
    ok, err, bound = reference.max_error_bound(cp.asnumpy(out).astype(np.float64), expected, lowp.astype(np.float64))
    print(f"self-check (bf16, causal, d=128, 300x300): max error {err:.2e}, bound {bound:.2e}: "
          f"{'ok' if ok else 'FAILED'}; first call incl. compile/load {first_call:.2f} s")
    if not ok:
        sys.exit(1)

    rows = []
    batch, heads, head_dim = 4, 16, 128
    for seqlen in (1024, 4096, 8192):
        q, k, v = (cp.asarray(rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32)).astype(bf16)
                   for _ in range(3))
        flops = reference.attention_flops(batch, heads, seqlen, seqlen, head_dim)
        row = [seqlen]
        for run in (lambda: cuflash.attention(q, k, v), lambda: standard_attention(q, k, v)):
            with PeakMemory() as memory:
                run()
            row += [tflops(flops, time_ms(lambda i: run(), 1, repeats=5)), memory.peak / 2**20]
        rows.append(row)
    print(f"\nforward, bf16, batch {batch}, heads {heads}, head_dim {head_dim}, non-causal "
          f"(memory: peak allocated during one call, outputs included)")
    print(format_table(["seqlen", "cuflash TFLOP/s", "cuflash MiB", "standard TFLOP/s", "standard MiB"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("compile-check", help="compile every kernel for one architecture (no GPU needed)")
    check.add_argument("--arch", default="sm_80", help="sm_80, sm_90, sm_90a, ...")
    args = parser.parse_args(argv)
    if args.command == "compile-check":
        return 1 if compile_check(args.arch) else 0

    print(f"cuflash {cuflash.__version__}")
    reason = gpu_unavailable()
    if reason is not None:
        print(f"No CUDA GPU ({reason}): running the CPU path check and the NVRTC compile check only.")
        print(f"CPU path (blockwise online softmax) vs float64 reference: max error {cpu_check():.2e}")
        return 1 if compile_check("sm_80") else 0
    gpu_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
