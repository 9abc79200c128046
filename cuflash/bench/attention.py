"""``python -m cuflash bench``: cuflash next to its peers in one run, and the IO/memory report.

The sweep times the forward pass (or with ``--mode`` the backward, or both) on the standard shapes
(bf16, batch·seqlen = 16384, heads·head_dim = 2048, seqlen 512 to 16384) for cuflash and every
peer that is installed: torch SDPA with its FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION
and EFFICIENT_ATTENTION backends, and standard attention in CuPy (S and P written to memory). It
writes one file set per GPU and mode, named ``<gpu>-<mode>`` (``h200-fwd.md``, ``.json`` and, with
matplotlib, ``.png``): the table with ratios under a header that gives the command that
regenerates it, the date, the GPU, the versions and the peers; every number, the shapes and the
environment; TFLOP/s against seqlen, one panel per head_dim and causal setting.

Honesty rules: every number comes from this run; inputs are random (never zeros) and rotated over
more than 3x the L2 cache; compilation is reported apart (cold NVRTC compile, warm load from
the disk cache) and never timed with the kernels.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from cuflash._cpu.reference import attention_flops

TOTAL_TOKENS = 16384
HIDDEN = 2048
STANDARD_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
STANDARD_HEAD_DIMS = (64, 128, 256)
QUICK_SEQLENS = (1024, 4096)
QUICK_HEAD_DIMS = (128,)
IMPLEMENTATIONS = ("cuflash", "cuflash-deterministic", "cuflash-bf16", "sdpa-flash", "sdpa-cudnn", "cudnn-fp8",
                   "sdpa-efficient", "standard")
# What an FP8 (``--dtype e4m3``) sweep times: cuflash on e4m3 inputs, cuflash on the bf16 values
# they were quantized from, and cuDNN's FP8 attention.
FP8_IMPLEMENTATIONS = ("cuflash", "cuflash-bf16", "cudnn-fp8")
# What a 16-bit sweep times.
SIXTEEN_BIT_IMPLEMENTATIONS = tuple(i for i in IMPLEMENTATIONS if i not in ("cuflash-bf16", "cudnn-fp8"))
DTYPES = ("bfloat16", "float16", "e4m3")
# Implementations that only differ from another in their backward: left out of forward sweeps.
BACKWARD_VARIANTS = ("cuflash-deterministic",)
# Implementations without a backward: left out of backward sweeps.
FORWARD_ONLY = ("standard",)
PEERS_FOR_RATIOS = ("sdpa-flash", "sdpa-cudnn", "cudnn-fp8", "cuflash-bf16")
DESCRIPTIONS = {
    "cuflash-deterministic": "cuflash with deterministic=True",
    "cuflash-bf16": "cuflash on the bf16 values the e4m3 inputs were quantized from",
    "cudnn-fp8": "cuDNN's FP8 attention (cuDNN frontend sdpa_fp8, per-tensor descales, e4m3 output)",
    "sdpa-flash": "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    "sdpa-cudnn": "torch SDPA, CUDNN_ATTENTION backend (cuDNN)",
    "sdpa-efficient": "torch SDPA, EFFICIENT_ATTENTION backend (memory-efficient)",
    "standard": "standard attention in CuPy (S and P written to memory)",
}


MODES = ("fwd", "bwd", "fwd_bwd")
MODE_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwd_bwd": "Forward + backward"}


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    seqlen: int
    causal: bool
    mode: str = "fwd"  # what one timed call does: the forward, the backward, or both
    head_dim_v: int | None = None  # v's (and out's) head dim where it differs from q's and k's

    @property
    def head_dims(self) -> str:
        """The table's head_dim cell: "128", or "192/128" (q and k / v)."""
        return str(self.head_dim) if self.head_dim_v is None else f"{self.head_dim}/{self.head_dim_v}"

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(q and k's shape, v and out's shape), BSHD."""
        qk = (self.batch, self.seqlen, self.heads, self.head_dim)
        return qk, (*qk[:3], self.head_dim_v or self.head_dim)

    @property
    def batch(self) -> int:
        return max(1, TOTAL_TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, HIDDEN // self.head_dim)

    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim,
                               causal=self.causal, mode=self.mode, head_dim_v=self.head_dim_v)


@dataclass
class Measurement:
    impl: str
    case: Case
    ms: float | None  # None: the implementation failed or does not support the case
    note: str = ""

    @property
    def tflops(self) -> float | None:
        return None if self.ms is None else self.case.flops() / (self.ms * 1e-3) / 1e12


@dataclass
class Report:
    measurements: list[Measurement]
    environment: dict = field(default_factory=dict)
    compile_times: list[dict] = field(default_factory=list)
    command: str = ""
    rates: dict = field(default_factory=dict)  # the GPU's matrix-multiply TFLOP/s, measured in the same run  # the command line that produced the report, written at the top of its file

    @property
    def mode(self) -> str:
        return self.measurements[0].case.mode if self.measurements else "fwd"


def cases(dtype: str, head_dims, seqlens, causal: str, mode: str = "fwd") -> list[Case]:
    """The sweep: every head_dim x causal setting x seqlen, in table order. A head_dims entry is
    an int, or a (head_dim, head_dim_v) pair."""
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[causal]
    pairs = [d if isinstance(d, tuple) else (d, None) for d in head_dims]
    return [Case(dtype, d, s, c, mode, dv) for d, dv in pairs for c in causals for s in seqlens]


# ----------------------------------------------------------------------------- report writing


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f}"


def markdown_table(report: Report) -> str:
    """Rows per (head_dim, causal, seqlen); TFLOP/s per implementation, then cuflash's ratio to
    each peer of PEERS_FOR_RATIOS that ran."""
    impls = [i for i in IMPLEMENTATIONS if any(m.impl == i for m in report.measurements)]
    peers = [p for p in PEERS_FOR_RATIOS if p in impls and "cuflash" in impls]
    by_key = {(m.impl, m.case): m for m in report.measurements}
    seen: list[Case] = []
    for m in report.measurements:
        if m.case not in seen:
            seen.append(m.case)
    header = ["dtype", "head_dim", "causal", "seqlen", *impls, *[f"cuflash / {p}" for p in peers]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in seen:
        values = {i: by_key[(i, case)].tflops if (i, case) in by_key else None for i in impls}
        ratios = []
        for p in peers:
            a, b = values["cuflash"], values[p]
            ratios.append("n/a" if a is None or b is None else f"{a / b:.2f}")
        cells = [case.dtype, case.head_dims, "yes" if case.causal else "no", str(case.seqlen),
                 *(_fmt(values[i]) for i in impls), *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    title = f"{MODE_TITLES[report.mode]} TFLOP/s, batch*seqlen={TOTAL_TOKENS}, heads*head_dim={HIDDEN}"
    notes = [f"- {m.impl} at {m.case}: {m.note}" for m in report.measurements if m.note]
    compile_lines = [f"- {c['kernel']}: cold NVRTC compile {c['cold_compile_s']:.2f} s, "
                     f"warm load from the disk cache {c['warm_load_ms']:.1f} ms" for c in report.compile_times]
    parts = [title, "", *lines]
    if report.rates:
        parts += ["", "Matrix-multiply rates of this GPU, same run: "
                  + "; ".join(f"{name}: {rate:.0f} TFLOP/s" for name, rate in report.rates.items()) + "."]
    if compile_lines:
        parts += ["", "Compilation (not part of any timing above):", *compile_lines]
    if notes:
        parts += ["", "Notes:", *notes]
    return "\n".join(parts) + "\n"


def report_json(report: Report) -> str:
    return json.dumps({
        "command": report.command,
        "environment": report.environment,
        "compile_times": report.compile_times,
        "rates": report.rates,
        "measurements": [
            {"impl": m.impl, **asdict(m.case), "batch": m.case.batch, "heads": m.case.heads,
             "ms": m.ms, "tflops": m.tflops, "note": m.note}
            for m in report.measurements
        ],
    }, indent=1)


def write_plot(report: Report, path: Path) -> str | None:
    """TFLOP/s against seqlen, a line per implementation, a panel per head_dim (columns) and
    causal setting (rows).
    Returns None when written, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    head_dims = sorted({(m.case.head_dim, m.case.head_dim_v or 0) for m in report.measurements})
    causals = sorted({m.case.causal for m in report.measurements})
    fig, axes = plt.subplots(len(causals), len(head_dims), squeeze=False,
                             figsize=(4.2 * len(head_dims), 3.4 * len(causals)))
    for row, causal in enumerate(causals):
        for col, head_dim in enumerate(head_dims):
            ax = axes[row][col]
            for impl in IMPLEMENTATIONS:
                points = sorted((m.case.seqlen, m.tflops) for m in report.measurements
                                if m.impl == impl and (m.case.head_dim, m.case.head_dim_v or 0) == head_dim
                                and m.case.causal == causal
                                and m.tflops is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            label = f"{head_dim[0]}/{head_dim[1]}" if head_dim[1] else str(head_dim[0])
            ax.set_title(f"head_dim {label}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(report.environment.get("device", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def gpu_slug(device_name: str) -> str:
    """The GPU part of a results file name: "NVIDIA H200" -> "h200"."""
    name = device_name.lower().removeprefix("nvidia ")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def file_stem(report: Report) -> str:
    """``<gpu>-<mode>``: one current file set per GPU and mode (``h200-fwd``, ``h200-bwd``), and
    ``-e4m3`` for an FP8 sweep."""
    fp8 = any(m.case.dtype == "e4m3" for m in report.measurements)
    return f"{gpu_slug(report.environment.get('device', ''))}-{report.mode}" + ("-e4m3" if fp8 else "")


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _cudnn_version(code: int) -> str:
    major, rest = divmod(code, 10000 if code >= 90000 else 1000)  # cuDNN 9 widened the minor field
    return f"{major}.{rest // 100}.{rest % 100}"


VERSION_LABELS = {"driver": ("CUDA driver", _cuda_version), "cuda runtime": ("CUDA runtime", _cuda_version),
                  "cuDNN": ("cuDNN", _cudnn_version)}


def document_header(title: str, environment: dict, command: str, peers=()) -> str:
    """The top of a results file: what it is, the command that regenerates it, date, GPU, versions
    and the peers timed beside cuflash."""
    versions = []
    for key, value in environment.items():
        if key not in ("date", "device"):
            label, fmt = VERSION_LABELS.get(key, (key, str))
            versions.append(f"{label} {fmt(value)}")
    lines = [f"# {title}", "", f"Regenerate: `{command}`", "",
             f"Measured {environment.get('date', 'n/a')} on {environment.get('device', 'n/a')}; "
             + ", ".join(versions) + "."]
    if peers:
        lines += ["", "Peers, timed in the same run: " + "; ".join(f"{p}: {DESCRIPTIONS[p]}" for p in peers) + "."]
    return "\n".join(lines) + "\n"


def markdown_document(report: Report, with_plot: bool = True) -> str:
    """The results file: header, table and, ``with_plot``, the plot beside it."""
    peers = [i for i in IMPLEMENTATIONS if i != "cuflash" and any(m.impl == i for m in report.measurements)]
    device = report.environment.get("device", "")
    title = f"cuflash {MODE_TITLES[report.mode].lower()}, {device}".rstrip(", ")
    plot = f"\n![TFLOP/s against seqlen]({file_stem(report)}.png)\n" if with_plot else ""
    return document_header(title, report.environment, report.command, peers) + "\n" + markdown_table(report) + plot


def write_outputs(report: Report, out_dir: Path) -> list[str]:
    """Writes ``<gpu>-<mode>.md``, ``.json`` and (with matplotlib) ``.png``; returns messages to print."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(report)
    why_not = write_plot(report, out_dir / f"{stem}.png")
    (out_dir / f"{stem}.md").write_text(markdown_document(report, with_plot=why_not is None))
    (out_dir / f"{stem}.json").write_text(report_json(report))
    written = [f"{stem}.md", f"{stem}.json"] + ([f"{stem}.png"] if why_not is None else [])
    return [f"wrote {', '.join(str(out_dir / f) for f in written)}"] + ([why_not] if why_not else [])


# ----------------------------------------------------------------------------- measuring (GPU)


def random_normal(shape, dtype_name: str, seed: int):
    """Standard-normal CuPy array of float16 or bfloat16 (bfloat16 rounded to nearest even from
    float32 bits, so no bfloat16 kernels of CuPy's are needed)."""
    import cupy as cp
    import numpy as np

    x = cp.random.default_rng(seed).standard_normal(shape, dtype=cp.float32)
    if dtype_name == "float16":
        return x.astype(cp.float16)
    import ml_dtypes

    bits = x.view(cp.uint32)
    rounded = (bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16
    return rounded.astype(cp.uint16).view(np.dtype(ml_dtypes.bfloat16))


def environment() -> dict:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    env = {"date": datetime.date.today().isoformat(), "device": props["name"].decode(),
           "driver": cp.cuda.runtime.driverGetVersion(), "cuda runtime": cp.cuda.runtime.runtimeGetVersion(),
           "CuPy": cp.__version__, "Python": platform.python_version()}
    from cuflash import __version__
    from cuflash._core import dispatch, nvrtc

    env["cuflash"] = __version__
    env["cuflash family"] = dispatch.device_target(cp.cuda.Device().id)[0]
    env["NVRTC"] = ".".join(map(str, nvrtc.version()))
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuDNN"] = torch.backends.cudnn.version()
    except ImportError:
        pass
    return env


def implementations(names, dtype: str = "bfloat16") -> dict[str, Callable]:
    """name -> run(q, k, v, causal) on CuPy inputs, for the peers that are installed. An ``e4m3``
    sweep's implementations (FP8_IMPLEMENTATIONS) instead take one Fp8Inputs and ``causal`` and
    return the zero-argument call to time (cuDNN builds its graph and buffers there, once)."""
    if dtype == "e4m3":
        return fp8_implementations(names)
    import cuflash
    from cuflash.bench.baseline import standard_attention

    found: dict[str, Callable] = {}
    for name in names:
        if name in ("cuflash", "cuflash-deterministic"):
            found[name] = lambda q, k, v, causal: cuflash.attention(q, k, v, causal=causal)
        elif name == "standard":
            found[name] = standard_attention
        elif name.startswith("sdpa-"):
            try:
                import torch
                from torch.nn.attention import SDPBackend, sdpa_kernel
            except ImportError:
                continue
            backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                       "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

            def run(q, k, v, causal, backend=backend):
                q, k, v = (x if isinstance(x, torch.Tensor) else sdpa_view(x) for x in (q, k, v))
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            found[name] = run
    return found


@dataclass
class Fp8Inputs:
    """One input set of an e4m3 sweep: the e4m3 bytes (CuPy uint8) and float32 (batch, heads)
    descales of quantize_fp8(..., "tensor"), and the bf16 values they were quantized from."""
    q: object
    k: object
    v: object
    descale_q: object
    descale_k: object
    descale_v: object
    bf16: tuple


def fp8_implementations(names) -> dict[str, Callable]:
    """FP8_IMPLEMENTATIONS among ``names`` that can run here: name -> prepare(Fp8Inputs, causal)."""
    import cuflash
    from cuflash.bench import cudnn_fp8

    def cuflash_fp8(s: Fp8Inputs, causal: bool):
        return lambda: cuflash.attention(s.q, s.k, s.v, causal=causal, dtype="e4m3", descale_q=s.descale_q,
                                         descale_k=s.descale_k, descale_v=s.descale_v)

    def cudnn(s: Fp8Inputs, causal: bool):
        scalars = [float(d[0, 0]) for d in (s.descale_q, s.descale_k, s.descale_v)]  # per tensor: all equal
        return cudnn_fp8.forward(s.q, s.k, s.v, *scalars, causal)

    found = {"cuflash": cuflash_fp8, "cuflash-bf16": lambda s, causal: lambda: cuflash.attention(*s.bf16, causal=causal)}
    if cudnn_fp8.available() is None:
        found["cudnn-fp8"] = cudnn
    return {name: found[name] for name in names if name in found}


def matmul_rates(size: int = 8192) -> dict[str, float]:
    """TFLOP/s of one size^3 matrix multiply in e4m3 (``torch._scaled_mm``, bf16 out) and in bf16
    (``torch.matmul``): the tensor-core rates an attention kernel is measured against. Empty
    without torch."""
    try:
        import torch
    except ImportError:
        return {}
    from cuflash.bench.timing import time_ms

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm wants B column-major
    one = torch.ones((), device="cuda")
    flops = 2 * size**3
    # torch's current stream is the legacy default stream, as CuPy's is: time_ms's events see both.
    e4m3 = time_ms(lambda i: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 1)
    bf16 = time_ms(lambda i: a @ b, 1)
    return {f"e4m3 matmul {size}^3 (torch._scaled_mm)": flops / (e4m3 * 1e-3) / 1e12,
            f"bf16 matmul {size}^3 (torch.matmul)": flops / (bf16 * 1e-3) / 1e12}


def gradient_call(name: str, case: Case, q, k, v, dout) -> Callable[[], object]:
    """One timed call of ``case.mode`` ("bwd" or "fwd_bwd") for implementation ``name`` on one
    input set. For "bwd" the forward runs here, once, outside the timing; the peers' backward
    goes through autograd. Standard attention in CuPy has no backward: NotImplementedError."""
    import cuflash

    causal = case.causal
    if name in ("cuflash", "cuflash-deterministic"):
        ordered = name == "cuflash-deterministic"
        if case.mode == "bwd":
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=ordered)

        def forward_backward():
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=ordered)

        return forward_backward
    if not name.startswith("sdpa-"):
        raise NotImplementedError(f"{name} has no backward")
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    leaves = [sdpa_view(x).detach().requires_grad_() for x in (q, k, v)]
    grad_out = sdpa_view(dout)

    def forward():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)

    if case.mode == "bwd":
        out = forward()
        return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), leaves, grad_out)


def input_sets(case: Case) -> list[tuple]:
    """Random q, k, v (and the upstream gradient for the backward modes) of ``case``, in as many
    copies as it takes to rotate through 3x the L2 cache."""
    from cuflash.bench.timing import copies_to_defeat_l2

    qk, vo = case.shapes()
    shapes = (qk, qk, vo, vo)[:3 if case.mode == "fwd" else 4]  # q, k, v[, dout]
    if case.dtype == "e4m3":
        import cuflash

        count = copies_to_defeat_l2(sum(map(math.prod, shapes)))  # the e4m3 bytes are what the FP8 calls read
        sets = []
        for i in range(count):
            bf16 = tuple(random_normal(shape, "bfloat16", seed=3 * i + j) for j, shape in enumerate(shapes))
            (q, dq), (k, dk), (v, dv) = (cuflash.quantize_fp8(x, "tensor") for x in bf16)
            sets.append((Fp8Inputs(q, k, v, dq, dk, dv, bf16),))
        return sets
    count = copies_to_defeat_l2(sum(map(math.prod, shapes)) * 2)
    return [tuple(random_normal(shape, case.dtype, seed=len(shapes) * i + j) for j, shape in enumerate(shapes))
            for i in range(count)]


def sdpa_view(x):
    """CuPy BSHD ``x`` as the (batch, heads, seqlen, head_dim) torch view SDPA takes."""
    import torch

    return torch.from_dlpack(x).transpose(1, 2)


def timed_calls(name: str, run: Callable, case: Case, sets) -> list[Callable[[], object]]:
    """One zero-argument call per input set: the forward ``run``, or ``gradient_call``; an e4m3
    implementation prepares its own (implementations). SDPA's inputs are torch views made here,
    once, so that a timed call is the call a torch user makes (at short lengths the conversion per
    call would add to the host time that bounds it)."""
    if case.dtype == "e4m3":
        return [run(*s, case.causal) for s in sets]
    if case.mode == "fwd":
        if name.startswith("sdpa-"):
            sets = [tuple(map(sdpa_view, s)) for s in sets]
        return [lambda s=s: run(*s, case.causal) for s in sets]
    return [gradient_call(name, case, *s) for s in sets]


def measure(name: str, run: Callable, case: Case, sets, repeats: int) -> float:
    """Median ms per call of implementation ``name`` (``run`` is its forward) over the rotated sets."""
    from cuflash.bench.timing import time_ms

    calls = timed_calls(name, run, case, sets)
    return time_ms(lambda i: calls[i](), len(calls), repeats=repeats)


def compile_times(dtype: str, head_dims, causals, mode: str = "fwd") -> list[dict]:
    """Cold NVRTC compile and warm disk-cache load of each instantiation the sweep used;
    ``head_dims`` (q's, v's) pairs."""
    import cupy as cp
    from cupy.cuda import function as cuda_function

    from cuflash._core import dispatch, kernels

    family, capability = dispatch.device_target(cp.cuda.Device().id)
    rows = []
    for head_dim, head_dim_v in head_dims:
        for causal in causals:
            mask = "causal" if causal else "none"
            inputs = {"dtype_name": "float8_e4m3fn", "out_dtype": "bfloat16"} if dtype == "e4m3" else {"dtype_name": dtype}
            wider = max(head_dim, head_dim_v)  # the forward's kernel head dim (dispatch.kernel_head_dim)
            choices = [dispatch.forward_kernel(family, wider, mask, **inputs)] if mode != "bwd" else []
            if mode != "fwd":
                choices.append(dispatch.backward_kernels(family, head_dim, mask, dtype, head_dim_v=head_dim_v)[1])
            for choice in choices:
                arch = dispatch.compile_arch(choice.family, capability)
                cold = kernels.compile_kernel(choice, arch, use_cache=False).seconds
                kernels.compile_kernel(choice, arch)  # make sure the disk cache holds it
                start = time.perf_counter()
                compiled = kernels.compile_kernel(choice, arch)
                cuda_function.Module().load(compiled.cubin)
                rows.append({"kernel": choice.name_expression, "arch": arch, "cold_compile_s": cold,
                             "warm_load_ms": (time.perf_counter() - start) * 1e3})
    return rows


def run_sweep(sweep: list[Case], impl_names, repeats: int = 10, command: str = "", progress=sys.stderr) -> Report:
    if sweep:
        skipped = BACKWARD_VARIANTS if sweep[0].mode == "fwd" else FORWARD_ONLY
        impl_names = [name for name in impl_names if name not in skipped]
        kept = FP8_IMPLEMENTATIONS if sweep[0].dtype == "e4m3" else SIXTEEN_BIT_IMPLEMENTATIONS
        impl_names = [name for name in impl_names if name in kept]
    dtype = sweep[0].dtype if sweep else "bfloat16"
    impls = implementations(impl_names, dtype)
    report = Report([], environment(), command=command, rates=matmul_rates() if dtype == "e4m3" else {})
    total = len(sweep) * len(impls)
    done = 0
    for case in sweep:
        sets = input_sets(case)
        for name, run in impls.items():
            done += 1
            print(f"\r[{done:>3}/{total}] {name:<15} d={case.head_dims:<7} causal={case.causal!s:<5} "
                  f"seqlen={case.seqlen:<6}", end="", file=progress, flush=True)
            try:
                ms = measure(name, run, case, sets, repeats if name != "standard" else 3)
                report.measurements.append(Measurement(name, case, ms))
            except Exception as error:  # a peer that refuses a case is reported, not fatal
                report.measurements.append(Measurement(name, case, None, f"{type(error).__name__}: {error}"[:160]))
        del sets
    print(file=progress)
    report.compile_times = compile_times(sweep[0].dtype, sorted({(c.head_dim, c.head_dim_v or c.head_dim) for c in sweep}),
                                         sorted({c.causal for c in sweep}), sweep[0].mode)
    return report


# ----------------------------------------------------------------------------- IO and memory

MEMORY_SEQLENS = tuple(1024 << i for i in range(8))  # 1k .. 128k
GPT2_MEDIUM = {"batch": 64, "seqlen": 1024, "heads": 16, "head_dim": 64}


def hbm_model_bytes(seqlen: int, head_dim: int, batch_heads: int, block_m: int, element_bytes: int = 2) -> dict:
    """HBM traffic of one forward pass, as the FlashAttention paper models it.

    standard: Q, K, V read, S written and read back, P written and read back, O written:
    (4·N·d + 4·N²) elements per head, Θ(N·d + N²).
    tiled (this kernel): Q read and O written once, K and V read once per query block of
    ``block_m`` rows: (2·N·d + 2·N·d·⌈N/block_m⌉) elements per head, the Θ(N²·d²/M) of the paper
    with block_m ~ M/d for M elements of on-chip memory.
    """
    n, d = seqlen, head_dim
    standard = (4 * n * d + 4 * n * n) * batch_heads * element_bytes
    tiled = (2 * n * d + 2 * n * d * -(-n // block_m)) * batch_heads * element_bytes
    return {"standard_bytes": standard, "tiled_bytes": tiled}


def _memory_row(label: str, batch: int, seqlen: int, heads: int, head_dim: int, dtype: str) -> dict:
    import cupy as cp

    import cuflash
    from cuflash._core import dispatch
    from cuflash.bench.baseline import standard_attention
    from cuflash.bench.timing import PeakMemory, time_ms

    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (random_normal(shape, dtype, seed=i) for i in range(3))
    block_m = dispatch.forward_kernel("sm80", head_dim, "none", dtype).tile.block_m
    row = {"case": label, "batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
           **hbm_model_bytes(seqlen, head_dim, batch * heads, block_m)}
    for name, run in (("cuflash", lambda: cuflash.attention(q, k, v)),
                      ("standard", lambda: standard_attention(q, k, v))):
        try:
            with PeakMemory() as memory:
                run()
            cp.cuda.Device().synchronize()
            row[f"{name}_peak_bytes"] = memory.peak
            row[f"{name}_ms"] = time_ms(lambda i: run(), 1, warmup=1, repeats=3)
        except cp.cuda.memory.OutOfMemoryError:
            row[f"{name}_peak_bytes"] = row[f"{name}_ms"] = None
        cp.get_default_memory_pool().free_all_blocks()
    return row


def memory_report(dtype: str = "bfloat16", seqlens=MEMORY_SEQLENS, progress=sys.stderr) -> list[dict]:
    """Peak memory, time and modelled HBM traffic of cuflash and standard attention: the GPT-2
    medium shape of the FlashAttention paper, then batch 1 x 8 heads x head_dim 128 from 1k to
    128k tokens, standard attention until it no longer fits."""
    rows = [_memory_row("GPT-2 medium", **GPT2_MEDIUM, dtype=dtype)]
    for seqlen in seqlens:
        print(f"\rmemory report: seqlen {seqlen}", end="", file=progress, flush=True)
        rows.append(_memory_row("scaling", 1, seqlen, 8, 128, dtype))
    print(file=progress)
    return rows


def write_memory_outputs(rows: list[dict], command: str, out_dir: Path) -> str:
    """Writes ``<gpu>-memory.md`` (header and table) and ``.json``; returns the message to print."""
    env = environment()
    title = f"cuflash memory and HBM traffic, {env['device']}"
    stem = f"{gpu_slug(env['device'])}-memory"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(document_header(title, env, command) + "\n" + memory_table(rows))
    (out_dir / f"{stem}.json").write_text(json.dumps({"command": command, "environment": env, "rows": rows}, indent=1))
    return f"wrote {out_dir / (stem + '.md')}, {out_dir / (stem + '.json')}"


def memory_table(rows: list[dict]) -> str:
    def gb(x):
        return "does not fit" if x is None else f"{x / 1e9:.2f}"

    def ms(x):
        return "-" if x is None else f"{x:.2f}"

    header = ["case", "batch x heads", "seqlen", "HBM model standard GB", "HBM model tiled GB",
              "standard ms", "cuflash ms", "standard peak GB", "cuflash peak GB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["case"], f"{r['batch']} x {r['heads']}", str(r["seqlen"]), gb(r["standard_bytes"]),
            gb(r["tiled_bytes"]), ms(r["standard_ms"]), ms(r["cuflash_ms"]),
            gb(r["standard_peak_bytes"]), gb(r["cuflash_peak_bytes"])]) + " |")
    fits = [r["seqlen"] for r in rows if r["case"] == "scaling" and r["standard_peak_bytes"] is None]
    limit = (f"Standard attention no longer fits from seqlen {min(fits)} on; cuflash's memory stays "
             f"linear in seqlen (only O and the LSE are written)." if fits
             else "Standard attention fit at every length measured.")
    return "\n".join(lines) + "\n\n" + limit + "\n"
