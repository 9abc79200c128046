"""``python -m cuflash``: the environment report and self-check, ``bench`` and ``compile-check``.

The help texts below are what a user reads in a terminal: plain sentences, no source paths. The
bench modes live in cuflash/bench/ (attention.py, decode.py, mla.py, ring.py, bias.py, serving.py), the compile
check in cuflash/cli/compile_check.py.
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
from cuflash.bench import attention as bench_module
from cuflash.bench import bias as bench_bias, decode as bench_decode, mla as bench_mla, ring as bench_ring
from cuflash.bench import serving as bench_serving
from cuflash.cli import compile_check
from cuflash._core import dispatch, kernels, nvrtc
from cuflash._cpu import reference
from cuflash._core.device import gpu_unavailable


def check_all_kernels(arch: str, jobs: int | None, details: bool) -> int:
    """Compile every instantiation (forward and backward) for ``arch``, the sm90 family's too for
    sm_90a; print the verdict (and each kernel's registers and spills with ``details``); 1 for a
    problem, else 0."""
    choices = [c for family in compile_check.families(arch) for c in dispatch.all_kernels(family)]
    print(f"NVRTC {nvrtc.version_text()}, target {arch}, {len(choices)} kernels, "
          f"sources {kernels.source_root()}")
    start = time.perf_counter()
    outcomes = compile_check.compile_all(choices, arch, jobs)
    if details:
        for o in (o for o in outcomes if o.compiled is not None):
            r = o.compiled.resources()
            print(f"{o.choice.name_expression:<72} {r['registers']:>3} registers, "
                  f"{r['spill_stores']:>3} B spill stores, {r['spill_loads']:>3} B spill loads "
                  f"(allowed {compile_check.spill_allowance(o.choice):>3} B), {o.compiled.seconds:5.2f} s")
    problems, notes, line = compile_check.verdict(outcomes, arch, nvrtc.version())
    for problem in problems + notes:
        print(problem)
    print(f"{line} ({time.perf_counter() - start:.0f} s)")
    return 1 if problems else 0


def check_front_end(arch: str, jobs: int | None) -> int:
    """Compile the representative kernels (compile_check.representative_kernels) for ``arch``; 1 if
    NVRTC rejects one, else 0. Spills are not judged (check_all_kernels judges them under
    compile_check.ALLOWANCE_NVRTC only): what an older NVRTC must do is take every source."""
    choices = [c for family in compile_check.families(arch) for c in compile_check.representative_kernels(family)]
    outcomes = compile_check.compile_all(choices, arch, jobs)
    failed = [o for o in outcomes if o.compiled is None]
    for o in failed:
        print(f"FAILED {o.choice.name_expression}\n{o.error}")
    print(f"NVRTC {nvrtc.version_text()}, target {arch}: {len(outcomes) - len(failed)} of {len(outcomes)} "
          f"representative kernels compiled")
    return 1 if failed else 0


def check_one_kernel() -> int:
    """Compile compile_check.representative_kernel() for sm_80; 1 if NVRTC fails, else 0."""
    choice = compile_check.representative_kernel()
    [outcome] = compile_check.compile_all([choice], "sm_80")
    if outcome.compiled is None:
        print(f"NVRTC {nvrtc.version_text()} failed to compile {choice.name_expression} "
              f"for sm_80:\n{outcome.error}")
        return 1
    print(f"NVRTC {nvrtc.version_text()} compiled {choice.name_expression} for sm_80 in "
          f"{outcome.compiled.seconds:.1f} s ({outcome.compiled.resources()['registers']} registers); "
          f"`python -m cuflash compile-check --arch sm_80` compiles all {len(dispatch.all_kernels('sm80'))}")
    return 0


def cpu_check() -> float:
    """The CPU path (blockwise online softmax) against the naive float64 reference."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 157, 4, 64)) for _ in range(3))
    out = cuflash.attention(q, k, v, causal=True)
    expected, _ = reference.attention_reference(q, k, v, causal=True)
    return float(np.abs(out - expected).max())


def gpu_report() -> None:
    import cupy as cp
    import ml_dtypes

    from cuflash._core.dispatch import device_target
    from cuflash.bench.baseline import standard_attention
    from cuflash.bench.timing import PeakMemory, format_table, time_ms, tflops

    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    family, capability = device_target(device.id)
    print(f"device {device.id}: {props['name'].decode()}, compute capability "
          f"{capability[0]}.{capability[1]}, family {family} "
          f"({dispatch.compile_arch(family, capability)}), "
          f"NVRTC {nvrtc.version_text()}, cache {kernels.cache_dir()}")

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


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive whole number, got {text!r}")
    return values[0]


def _arch(text: str) -> str:
    try:
        return compile_check.check_arch(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    except nvrtc.NvrtcNotFound:
        return text  # the targets are NVRTC's to list; main() says it is missing before any use


def _head_dims(text: str) -> list[int | tuple[int, int]]:
    """Head dims, each a number or a q/k and v pair written "192/128"."""
    values: list[int | tuple[int, int]] = []
    for token in text.replace(",", " ").split():
        parts = token.split("/")
        dims = tuple(int(part) for part in parts if part.isdigit())
        if len(dims) != len(parts) or len(dims) > 2 or any(d < 8 or d % 8 or d > 256 for d in dims):
            raise argparse.ArgumentTypeError(f"head dims must be multiples of 8 up to 256, alone or as a q/k and v "
                                             f"pair like 192/128, got {token!r}")
        values.append(dims if len(dims) == 2 else dims[0])
    if not values:
        raise argparse.ArgumentTypeError("expected at least one head dim")
    return values


DESCRIPTION = """\
cuflash: exact attention (FlashAttention) for CuPy, PyTorch and NumPy arrays, with CUDA kernels
compiled at run time by NVRTC.

Without a command: report the GPU, NVRTC and the kernel cache, check one call against the float64
reference and time cuflash next to standard attention. Without a GPU it says what is missing,
checks the CPU path and compiles one kernel, in seconds."""

EPILOG = """\
examples:
  python -m cuflash                               environment report and self-check
  python -m cuflash bench --quick                 forward, head_dim 128, 1k and 4k tokens
  python -m cuflash bench --out results           the standard forward sweep, tables into results/
  python -m cuflash bench --mode bwd              the backward (fwd_bwd: both)
  python -m cuflash bench --dtype e4m3            FP8 forward next to cuDNN's FP8 attention
  python -m cuflash bench --mode decode --quick   decoding against a KV cache, in GB/s
  python -m cuflash bench --mode mla --quick      MLA decoding, in GB/s and TFLOP/s
  python -m cuflash bench --mode ring             context parallelism over every GPU (2 or more)
  python -m cuflash bench --mode bias --quick     attention sinks and ALiBi on gpt-oss's shapes
  python -m cuflash bench --mode serving --quick  vLLM's mixed batch and a shared prefix (cascade)
  python -m cuflash bench --memory                peak memory and modelled memory traffic
  python -m cuflash compile-check --arch sm_90a   compile every kernel for Hopper, no GPU needed
  python -m cuflash compile-check --front-end     only whether NVRTC takes the sources

python -m cuflash bench --help and python -m cuflash compile-check --help list their options."""

BENCH_DESCRIPTION = """\
Time cuflash on this GPU next to its peers, in the same run: torch SDPA's backends
(FlashAttention-2, cuDNN, memory-efficient) and standard attention, cuDNN's FP8 attention for
--dtype e4m3 (each peer where it is installed); decoding next to SDPA and the copy rate, MLA next
to the copy and matmul rates, the ring next to one GPU, attention sinks and ALiBi next to cuflash
without them, SDPA and torch's eager gpt-oss formula, vLLM's mixed batch next to split calls and
SDPA per sequence, a shared prefix merged next to reading it per sequence. Prints the table and writes it, with every
number, to --out as <gpu>-<mode>.md and .json (and a .png plot where matplotlib is installed),
each headed by the command that regenerates it."""

BENCH_EPILOG = """\
examples:
  python -m cuflash bench --quick
  python -m cuflash bench --head-dims 128 --seqlens '1024 4096' --causal yes
  python -m cuflash bench --head-dims 192/128 --mode bwd
  python -m cuflash bench --dtype e4m3
  python -m cuflash bench --mode decode --batches '1 64' --contexts '8192 32768'
  python -m cuflash bench --mode mla --quick
  python -m cuflash bench --mode ring --ranks 2 --seqlens 131072
  python -m cuflash bench --mode bias --quick
  python -m cuflash bench --mode serving --quick
  python -m cuflash bench --memory"""

CHECK_DESCRIPTION = """\
Compile every kernel instantiation for one GPU architecture with NVRTC, in parallel processes (no
GPU needed), and end with one verdict: ok, or PROBLEM with each kernel that failed to compile,
spilled registers beyond its allowance, or had its wgmma serialised by ptxas. The exit status is 1
on a problem."""

CHECK_EPILOG = """\
examples:
  python -m cuflash compile-check                        every kernel for sm_80
  python -m cuflash compile-check --arch sm_90a          the sm90 family too (H100, H200)
  python -m cuflash compile-check --arch sm_80 --details registers and spills per kernel
  python -m cuflash compile-check --front-end            representative kernels, spills not judged"""


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"cuflash {cuflash.__version__}")
    sub = parser.add_subparsers(dest="command", title="commands")
    check = sub.add_parser("compile-check", help="compile every kernel for one architecture, in parallel "
                                                 "(no GPU needed), and a verdict on the spills",
                           description=CHECK_DESCRIPTION, epilog=CHECK_EPILOG, formatter_class=raw)
    check.add_argument("--arch", type=_arch, default="sm_80",
                       help="a target of compute capability 8.0 or newer that NVRTC knows: sm_80 (default), sm_86, "
                            "sm_89, sm_90, ...; sm_90a adds the sm90 family")
    check.add_argument("--jobs", type=_positive_int,
                       help="compiler processes (default: one per CPU)")
    check.add_argument("--details", action="store_true", help="each kernel's registers, spills and compile time")
    check.add_argument("--front-end", action="store_true",
                       help="only whether the representative kernels compile, spills not judged (for an older "
                            "NVRTC than the allowances were measured with)")
    bench = sub.add_parser("bench", help="cuflash next to its peers on a GPU (TFLOP/s or GB/s table, JSON, plot), "
                                         "or --memory",
                           description=BENCH_DESCRIPTION, epilog=BENCH_EPILOG, formatter_class=raw)
    bench.add_argument("--quick", action="store_true", help="head_dim 128, seqlen 1024 and 4096 only; decode: "
                                                                "batch 1 and 64, context 8k and 32k, 1 query token, "
                                                                "32/8 heads, contiguous and page 64; bias: 4k and "
                                                                "16k tokens")
    bench.add_argument("--dtype", choices=bench_module.DTYPES, default="bfloat16",
                       help="e4m3: the FP8 forward next to cuDNN's FP8 attention and cuflash's bf16")
    bench.add_argument("--head-dims", type=_head_dims,
                       help="e.g. '64,128,256', or q/k and v pairs like '192/128' (default: 64 128 256)")
    bench.add_argument("--seqlens", type=_positive_ints, help="e.g. '1024 4096' (default: 512 .. 16384)")
    bench.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    bench.add_argument("--mode", choices=[*bench_module.MODES, "decode", "mla", "ring", "bias", "serving"],
                       default="fwd",
                       help="what one timed call does: forward, backward (forward run untimed) or both; or decode: "
                            "a decoding step against a KV cache, in GB/s (its own sweep, --batches, --contexts); or "
                            "mla: an MLA decoding step (cuflash.mla_decode) over a paged latent cache, in GB/s and "
                            "TFLOP/s (its own sweep, --batches, --contexts); or ring: context parallelism over "
                            "--ranks GPUs next to one GPU, --seqlens the whole sequence's tokens; or bias: cuflash "
                            "with attention sinks and with ALiBi next to cuflash without them and the peers, on "
                            "gpt-oss's shapes (64/8 heads, head_dim 64, 4k to 32k tokens), forward, backward and "
                            "decode (its own sweep, needs torch); or serving: vLLM's mixed batch in one call next to "
                            "split calls and SDPA per sequence, and decodes over a shared prefix merged (cascade) "
                            "next to reading it per sequence (its own sweep, needs torch)")
    bench.add_argument("--family", choices=["auto", *dispatch.FAMILIES], default="auto",
                       help="cuflash kernel family (sm90 runs sm80's kernels for tensors no tensor map describes; "
                            "the compilation notes name each kernel)")
    bench.add_argument("--impls", nargs="+", choices=bench_module.IMPLEMENTATIONS,
                       default=list(bench_module.IMPLEMENTATIONS), help="what to time (peers that are not installed are skipped)")
    bench.add_argument("--batches", type=_positive_ints, help="decode: e.g. '1 64' (default: 1 8 64 256)")
    bench.add_argument("--contexts", type=_positive_ints,
                       help="decode: cached tokens per sequence, e.g. '8192 32768' (default: 1k 8k 32k 128k)")
    bench.add_argument("--eager", action="store_true",
                       help="decode, mla and bias's decode: time the steps launched back to back instead of as "
                            "CUDA graph replays (the host's cost per call then counts where the kernels are shorter)")
    bench.add_argument("--ranks", type=_positive_int,
                       help="ring: processes, one per GPU (default: every visible GPU; at least 2)")
    bench.add_argument("--repeats", type=int, default=10, help="timed samples per case (median reported)")
    bench.add_argument("--memory", action="store_true",
                       help="the IO and memory report instead of the sweep: peak memory, time and modelled "
                            "HBM traffic, 1k to 128k tokens and the FlashAttention paper's GPT-2 medium shape")
    bench.add_argument("--out", type=Path,
                       help="output folder (default: cuflash-bench-<date>-<time>); files are named <gpu>-<mode>, "
                            "e.g. h200-fwd.md, .json, .png, so --out benchmarks/results replaces the current ones")
    return parser


def mode_conflict(args: argparse.Namespace) -> str | None:
    """Why the options do not go together (decode and bias have their own sweeps), or None."""
    decode = args.mode in ("decode", "mla")
    given = [option for option, value in (("--memory", args.memory), ("--head-dims", args.head_dims),
                                          ("--seqlens", args.seqlens), ("--batches", args.batches),
                                          ("--contexts", args.contexts), ("--eager", args.eager)) if value]
    if args.mode in ("bias", "serving"):  # fixed shapes in bf16, every implementation: --quick and --eager only
        misplaced = [o for o in given if o != "--eager"] + [
            o for o, value in (("--dtype", args.dtype != "bfloat16"), ("--causal", args.causal != "both"),
                               ("--impls", args.impls != list(bench_module.IMPLEMENTATIONS)),
                               ("--ranks", args.ranks)) if value]
        return f"{', '.join(misplaced)} do not apply to --mode {args.mode}" if misplaced else None
    wrong = [o for o in given if (o in ("--batches", "--contexts", "--eager")) != decode]
    if wrong:
        return f"{', '.join(wrong)} {'do not apply to' if decode else 'only apply to'} --mode decode and mla"
    if args.dtype == "e4m3" and (args.mode != "fwd" or args.memory):
        return "--dtype e4m3 times the forward only (FP8 has no backward; decode times FP8 caches itself)"
    ring_only = [o for o, value in (("--ranks", args.ranks),) if value]
    if args.mode == "ring":
        misplaced = [o for o in given if o in ("--memory", "--head-dims")]
        if misplaced:
            return f"{', '.join(misplaced)} do not apply to --mode ring"
    elif ring_only:
        return "--ranks only applies to --mode ring"
    return None


def bench_decode_sweep(args: argparse.Namespace, command: str, out: Path) -> int:
    sweep = bench_decode.sweep(bench_decode.available_impls(args.impls), args.quick, args.batches, args.contexts)
    report = bench_decode.run_sweep(sweep, args.dtype, repeats=args.repeats, command=command, eager=args.eager)
    print(bench_decode.markdown_table(report))
    for line in bench_decode.write_outputs(report, out):
        print(line)
    return 0


def bench_torch_sweep(module, args: argparse.Namespace, command: str, out: Path) -> int:
    """The bias and serving modes: their own sweeps of torch inputs (SDPA among the peers)."""
    if not bench_decode.torch_gpu():
        print(f"python -m cuflash bench --mode {args.mode}: needs torch with CUDA (the inputs and peers are "
              f"torch's)", file=sys.stderr)
        return 2
    report = module.run_sweep(module.sweep(args.quick), args.repeats, command, eager=args.eager)
    print(module.markdown_document(report))
    for line in module.write_outputs(report, out):
        print(line)
    return 0


def bench_ring_sweep(args: argparse.Namespace, command: str, out: Path) -> int:
    import torch

    ranks = args.ranks or torch.cuda.device_count()
    if not 2 <= ranks <= torch.cuda.device_count():
        print(f"python -m cuflash bench --mode ring: needs 2 or more GPUs, {torch.cuda.device_count()} visible"
              + (f", --ranks {args.ranks}" if args.ranks else ""), file=sys.stderr)
        return 2
    cases = bench_ring.sweep(args.quick, args.seqlens, args.causal)
    report = bench_ring.run(cases, ranks, args.repeats, command, environment=bench_module.environment())
    print(bench_ring.markdown_table(report))
    for line in bench_ring.write_outputs(report, out):
        print(line)
    return 0


def bench(args: argparse.Namespace, argv: list[str]) -> int:
    conflict = mode_conflict(args)
    if conflict is not None:
        print(f"python -m cuflash bench: {conflict}", file=sys.stderr)
        return 2
    reason = gpu_unavailable()
    if reason is not None:
        print(f"python -m cuflash bench needs a CUDA GPU ({reason})", file=sys.stderr)
        return 2
    os.environ["CUFLASH_FAMILY"] = args.family
    command = f"python -m cuflash {shlex.join(argv)}"
    out = args.out or Path(f"cuflash-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "decode":
        return bench_decode_sweep(args, command, out)
    if args.mode == "ring":
        return bench_ring_sweep(args, command, out)
    if args.mode in ("bias", "serving"):
        return bench_torch_sweep(bench_bias if args.mode == "bias" else bench_serving, args, command, out)
    if args.mode == "mla":
        report = bench_mla.run_sweep(bench_mla.sweep(args.quick, args.batches, args.contexts), args.dtype,
                                     repeats=args.repeats, command=command, eager=args.eager)
        print(bench_mla.markdown_table(report))
        for line in bench_mla.write_outputs(report, out):
            print(line)
        return 0
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
        missing = nvrtc.unavailable()
        if missing is not None:
            print(f"python -m cuflash compile-check: {missing}", file=sys.stderr)
            return 1
        if args.front_end:
            return check_front_end(args.arch, args.jobs)
        return check_all_kernels(args.arch, args.jobs, args.details)
    if args.command == "bench":
        return bench(args, sys.argv[1:] if argv is None else argv)

    print(f"cuflash {cuflash.__version__}")
    reason = gpu_unavailable()
    if reason is not None:
        print(f"No CUDA GPU: {reason}.\nChecking the CPU path and one kernel compile; a GPU of compute "
              f"capability 8.0 or newer runs the kernels.")
        error = cpu_check()
        print(f"CPU path (blockwise online softmax) vs float64 reference: max error {error:.2e}")
        if error > 1e-12:  # both run in float64: anything above rounding is a wrong result
            print("FAILED: the CPU path disagrees with the reference")
            return 1
        missing = nvrtc.unavailable()
        if missing is not None:
            print(f"No kernel compiler: {missing}.")
            return 1
        if check_one_kernel():
            return 1
        print("ok: the CPU path and the kernel compiler work here")
        return 0
    gpu_report()
    return 0

