"""``python -m cuflash``: environment report, self-check, and cuflash next to standard attention.

``python -m cuflash bench [--quick | --memory]`` times cuflash next to its peers (see
cuflash/bench.py); ``python -m cuflash compile-check --arch sm_80`` compiles every kernel
instantiation for one architecture with NVRTC (no GPU needed) and reports registers and spills.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

import cuflash
from cuflash import bench as bench_module
from cuflash import dispatch, kernels, nvrtc, reference


def compile_check(arch: str) -> int:
    """Compile every instantiation (forward and backward) for ``arch``, the sm90 family's too for
    sm_90a; return the number of failures."""
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))}, target {arch}, sources {kernels.source_root()}")
    failures = 0
    families = ("sm80", "sm90") if arch == "sm_90a" else ("sm80",)
    for choice in (c for family in families for c in dispatch.all_kernels(family)):
        try:
            compiled = kernels.compile_kernel(choice, arch, use_cache=False)
        except nvrtc.CompileError as error:
            failures += 1
            print(f"FAILED {choice.name_expression}\n{error}")
            continue
        r = compiled.resources()
        print(f"{choice.name_expression:<72} {r['registers']:>3} registers, "
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

    from cuflash.dispatch import device_target
    from cuflash.baseline import standard_attention
    from cuflash.timing import PeakMemory, format_table, time_ms, tflops

    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    family, capability = device_target(device.id)
    print(f"device {device.id}: {props['name'].decode()}, compute capability "
          f"{device.compute_capability[:-1]}.{device.compute_capability[-1]}, family {family} "
          f"({dispatch.compile_arch(family, capability)}), "
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
    kernel = cuflash.explain(*(cp.asarray(x) for x in host), causal=True).name_expression
    print(f"self-check (bf16, causal, d=128, 300x300) with {kernel}: max error {err:.2e}, bound {bound:.2e}: "
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


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, got {text!r}")
    return values


def _head_dims(text: str) -> list[int]:
    values = _positive_ints(text)
    bad = [d for d in values if d % 8 or d > 256]
    if bad:
        raise argparse.ArgumentTypeError(f"head dims must be multiples of 8 up to 256, got {bad}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("compile-check", help="compile every kernel for one architecture (no GPU needed)")
    check.add_argument("--arch", default="sm_80", help="sm_80, sm_90, sm_90a, ...")
    bench = sub.add_parser("bench", help="cuflash next to its peers (TFLOP/s table, JSON, plot), or --memory")
    bench.add_argument("--quick", action="store_true", help="head_dim 128, seqlen 1024 and 4096 only")
    bench.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    bench.add_argument("--head-dims", type=_head_dims, help="e.g. '64,128,256' (default: 64 128 256)")
    bench.add_argument("--seqlens", type=_positive_ints, help="e.g. '1024 4096' (default: 512 .. 16384)")
    bench.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    bench.add_argument("--mode", choices=bench_module.MODES, default="fwd",
                       help="what one timed call does: forward, backward (forward run untimed) or both")
    bench.add_argument("--family", choices=["auto", *dispatch.FAMILIES], default="auto",
                       help="cuflash kernel family (sm90 runs sm80's forward for tensors no tensor map describes, "
                            "and sm80's backward for head dims above 128; the compilation notes name "
                            "each kernel)")
    bench.add_argument("--impls", nargs="+", choices=bench_module.IMPLEMENTATIONS,
                       default=list(bench_module.IMPLEMENTATIONS), help="what to time (peers that are not installed are skipped)")
    bench.add_argument("--repeats", type=int, default=10, help="timed samples per case (median reported)")
    bench.add_argument("--memory", action="store_true",
                       help="the IO and memory report instead of the sweep: peak memory, time and modelled "
                            "HBM traffic, 1k to 128k tokens and the FlashAttention paper's GPT-2 medium shape")
    bench.add_argument("--out", type=Path,
                       help="output folder (default: cuflash-bench-<date>-<time>); files are named <gpu>-<mode>, "
                            "e.g. h200-fwd.md, .json, .png, so --out benchmarks/results replaces the current ones")
    return parser


def bench(args: argparse.Namespace, argv: list[str]) -> int:
    reason = gpu_unavailable()
    if reason is not None:
        print(f"python -m cuflash bench needs a CUDA GPU ({reason})", file=sys.stderr)
        return 2
    os.environ["CUFLASH_FAMILY"] = args.family
    command = f"python -m cuflash {shlex.join(argv)}"
    out = args.out or Path(f"cuflash-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.memory:
        rows = bench_module.memory_report(args.dtype, args.seqlens or bench_module.MEMORY_SEQLENS)
        print(bench_module.memory_table(rows) + bench_module.write_memory_outputs(rows, command, out))
        return 0
    head_dims = args.head_dims or (bench_module.QUICK_HEAD_DIMS if args.quick else bench_module.STANDARD_HEAD_DIMS)
    seqlens = args.seqlens or (bench_module.QUICK_SEQLENS if args.quick else bench_module.STANDARD_SEQLENS)
    sweep = bench_module.cases(args.dtype, head_dims, seqlens, args.causal, args.mode)
    report = bench_module.run_sweep(sweep, args.impls, repeats=args.repeats, command=command)
    print(bench_module.markdown_table(report))
    for line in bench_module.write_outputs(report, out):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compile-check":
        return 1 if compile_check(args.arch) else 0
    if args.command == "bench":
        return bench(args, sys.argv[1:] if argv is None else argv)

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
