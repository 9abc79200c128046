"""``python -m cuflash bench --mode decode``: decoding against a KV cache, in GB/s of the cache read.

One timed call is one decoding step of attention_with_kvcache: ``seqlen_q`` new tokens per
sequence appended to the cache (written at cache_seqlens = context - seqlen_q) and attended with
the causal mask over the ``context`` cached positions. Its bytes are the K and V of those
positions in the cache's type plus the new tokens' k and v in q's type; GB/s is those bytes over
the median time. The sweep: 1 and 4 query tokens, batch 1, 8, 64, 256, context 1k to 128k (cases
that need more than MAX_CASE_BYTES are left out), query/kv heads 32/8 and 64/8, head_dim 128, a
16-bit and an FP8 (e4m3) cache, contiguous and paged (pages of 16 and 64, scattered by a random
page table). Beside them, in the same run: torch SDPA's CUDNN_ATTENTION and FLASH_ATTENTION
backends over the contiguous 16-bit cache (enable_gqa=True, no append, no mask: SDPA aligns
is_causal top-left, and the bytes read are the same), and the GPU's device-to-device copy
bandwidth. Files ``<gpu>-decode.md``, ``.json`` and ``.png`` as the other modes write them.

Each implementation's steps are timed as replays of a torch CUDA graph that holds GRAPH_STEPS steps,
the rotated input sets in turn (TIMING_GRAPH), as a serving loop that captures its decoding step runs them: the
figure is the kernels' time, the host's cost per call is tools/host_overhead.py's. Without
torch, or with ``eager=True``, the steps are launched back to back (TIMING_EAGER), and at small
batches the host's cost per call is then what is timed.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cuflash.bench.attention import document_header, gpu_slug

__all__ = ["DecodeCase", "DecodeMeasurement", "DecodeReport", "DecodeShape", "available_impls", "copy_bandwidth",
           "markdown_table", "random_cache", "report_json", "run_sweep", "sweep", "time_calls", "torch_gpu",
           "write_outputs"]

HEAD_DIM = 128
# The sweep's axes; --quick's subset (under a minute on an H200 once the kernels are compiled).
FULL = {"seqlens_q": (1, 4), "batches": (1, 8, 64, 256), "contexts": (1024, 8192, 32768, 131072),
        "heads": ((32, 8), (64, 8)), "caches": ("16-bit", "e4m3"), "page_sizes": (0, 16, 64)}  # page 0: contiguous
QUICK = FULL | {"seqlens_q": (1,), "batches": (1, 64), "contexts": (8192, 32768), "heads": ((32, 8),),
                "page_sizes": (0, 64)}
# Device memory a case may take: its two rotated copies of the 16-bit K and V (batch 256 x 128k
# tokens x 8 kv heads x d128 is 137 GB a copy, left out; 64 x 128k is 34 GB).
MAX_CASE_BYTES = 100 * 10**9
PEERS = ("sdpa-cudnn", "sdpa-flash")
COPY_BYTES = 2 << 30  # the device-to-device copy of the bandwidth line
CHUNK_ELEMENTS = 1 << 28  # random caches are made this many elements at a time
TIMING_GRAPH = "CUDA graph replays (kernel time)"
# Steps per captured graph, the input sets taken in turn: a replay's own launch (~10 us) then
# weighs under 1 us a step even at batch 1, where a step takes ~15 us.
GRAPH_STEPS = 24
TIMING_EAGER = "launched back to back (host cost included where the kernels are shorter)"


@dataclass(frozen=True)
class DecodeShape:
    """The attention shape of one decoding step, shared by cuflash and the peers."""

    seqlen_q: int
    batch: int
    context: int
    heads: int
    heads_kv: int
    head_dim: int = HEAD_DIM

    def cache_bytes(self, itemsize: int) -> int:
        """K and V of ``context`` positions per sequence, ``itemsize`` bytes an element."""
        return 2 * self.batch * self.context * self.heads_kv * self.head_dim * itemsize


@dataclass(frozen=True)
class DecodeCase:
    """One timed configuration: cuflash with ``cache`` ("16-bit" or "e4m3") and ``page_size`` (0:
    contiguous), or a peer (``impl``) over the contiguous 16-bit cache."""

    impl: str  # "cuflash", "sdpa-cudnn", "sdpa-flash"
    shape: DecodeShape
    cache: str = "16-bit"
    page_size: int = 0

    @property
    def label(self) -> str:
        """The table column: ``cuflash bf16 page 16``, ``cuflash e4m3 contiguous``, ``sdpa-cudnn``."""
        if self.impl != "cuflash":
            return self.impl
        return f"cuflash {self.cache} " + (f"page {self.page_size}" if self.page_size else "contiguous")

    def bytes_read(self, q_itemsize: int = 2) -> int:
        """The cache's K and V over the context, plus the appended tokens' k and v (cuflash only)
        in q's type."""
        itemsize = 1 if self.cache == "e4m3" else q_itemsize
        s = self.shape
        new = 0 if self.impl != "cuflash" else 2 * s.batch * s.seqlen_q * s.heads_kv * s.head_dim * q_itemsize
        return s.cache_bytes(itemsize) + new


def sweep(impls, quick: bool = False, batches=None, contexts=None,
          max_case_bytes: int = MAX_CASE_BYTES) -> list[DecodeCase]:
    """The cases of a run in table order: per shape of FULL's (or QUICK's) axes, ``batches`` and
    ``contexts`` replacing theirs when given, cuflash's cache variants (if "cuflash" is in
    ``impls``), then the peers of PEERS in ``impls``; shapes whose two copies of the 16-bit cache
    pass ``max_case_bytes`` are left out."""
    axes = (QUICK if quick else FULL) | {name: value for name, value in (("batches", batches),
                                                                        ("contexts", contexts)) if value}
    found = []
    for heads, heads_kv in axes["heads"]:
        for seqlen_q in axes["seqlens_q"]:
            for batch in axes["batches"]:
                for context in axes["contexts"]:
                    shape = DecodeShape(seqlen_q, batch, context, heads, heads_kv)
                    if 2 * shape.cache_bytes(2) > max_case_bytes:
                        continue
                    if "cuflash" in impls:
                        found += [DecodeCase("cuflash", shape, cache, page) for cache in axes["caches"]
                                  for page in axes["page_sizes"]]
                    found += [DecodeCase(peer, shape) for peer in PEERS if peer in impls]
    return found


@dataclass
class DecodeMeasurement:
    case: DecodeCase
    ms: float | None  # None: it failed or does not support the case
    note: str = ""

    @property
    def gbps(self) -> float | None:
        return None if self.ms is None else self.case.bytes_read() / (self.ms * 1e-3) / 1e9


@dataclass
class DecodeReport:
    measurements: list[DecodeMeasurement]
    copy_gbps: float | None = None  # device-to-device copy, bytes read + written per second
    environment: dict = field(default_factory=dict)
    command: str = ""
    timing: str = TIMING_GRAPH


# ----------------------------------------------------------------------------- report writing


def _columns(report: DecodeReport) -> list[str]:
    labels = []
    for m in report.measurements:
        if m.case.label not in labels:
            labels.append(m.case.label)
    return labels


def markdown_table(report: DecodeReport) -> str:
    """Rows per shape; GB/s per column (cuflash's cache variants, the peers), then the contiguous
    16-bit cuflash over each peer that ran."""
    columns = _columns(report)
    base = "cuflash 16-bit contiguous"
    peers = [p for p in PEERS if p in columns and base in columns]
    values: dict[DecodeShape, dict[str, DecodeMeasurement]] = {}
    for m in report.measurements:
        values.setdefault(m.case.shape, {})[m.case.label] = m
    header = ["q heads / kv", "seqlen_q", "batch", "context", *columns, *[f"cuflash / {p}" for p in peers]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape, row in values.items():
        gbps = {c: row[c].gbps if c in row else None for c in columns}
        ratios = ["n/a" if gbps[base] is None or gbps[p] is None else f"{gbps[base] / gbps[p]:.2f}" for p in peers]
        cells = [f"{shape.heads} / {shape.heads_kv}", str(shape.seqlen_q), str(shape.batch), str(shape.context),
                 *("n/a" if gbps[c] is None else f"{gbps[c]:,.0f}" for c in columns), *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    copy = "n/a" if report.copy_gbps is None else f"{report.copy_gbps:,.0f}"
    title = (f"Decode GB/s of the KV cache read (+ appended tokens), head_dim {HEAD_DIM}, each step timed as "
             f"{report.timing}; device-to-device copy in the same run: {copy} GB/s (read + written)")
    notes = [f"- {m.case.label} at {m.case.shape}: {m.note}" for m in report.measurements if m.note]
    return "\n".join([title, "", *lines] + (["", "Notes:", *notes] if notes else [])) + "\n"


def report_json(report: DecodeReport) -> str:
    return json.dumps({
        "command": report.command,
        "environment": report.environment,
        "copy_gbps": report.copy_gbps,
        "timing": report.timing,
        "measurements": [{"impl": m.case.impl, "label": m.case.label, **asdict(m.case.shape), "cache": m.case.cache,
                          "page_size": m.case.page_size, "bytes": m.case.bytes_read(), "ms": m.ms, "gbps": m.gbps,
                          "note": m.note} for m in report.measurements],
    }, indent=1)


def write_plot(report: DecodeReport, path: Path) -> str | None:
    """GB/s against context, a line per column, a panel per batch (columns) and heads x seqlen_q
    (rows), the copy bandwidth dashed. Returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    batches = sorted({m.case.shape.batch for m in report.measurements})
    groups = sorted({(m.case.shape.heads, m.case.shape.seqlen_q) for m in report.measurements})
    fig, axes = plt.subplots(len(groups), len(batches), squeeze=False, sharey=True,
                             figsize=(3.6 * len(batches), 3.2 * len(groups)))
    for row, (heads, seqlen_q) in enumerate(groups):
        for col, batch in enumerate(batches):
            ax = axes[row][col]
            for label in _columns(report):
                points = sorted((m.case.shape.context, m.gbps) for m in report.measurements
                                if m.case.label == label and m.gbps is not None and m.case.shape.batch == batch
                                and (m.case.shape.heads, m.case.shape.seqlen_q) == (heads, seqlen_q))
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            if report.copy_gbps is not None:
                ax.axhline(report.copy_gbps, color="gray", linestyle="--", label="device-to-device copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"batch {batch}, {heads} q heads, seqlen_q {seqlen_q}", fontsize=9)
            ax.set_xlabel("context")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(report.environment.get("device", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(report: DecodeReport, out_dir: Path) -> list[str]:
    """Writes ``<gpu>-decode.md``, ``.json`` and (with matplotlib) ``.png``; returns messages to print."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = report.environment.get("device", "")
    stem = f"{gpu_slug(device)}-decode"
    why_not = write_plot(report, out_dir / f"{stem}.png")
    peers = [p for p in PEERS if p in _columns(report)]
    plot = f"\n![GB/s against context]({stem}.png)\n" if why_not is None else ""
    title = f"cuflash decode against a KV cache, {device}".rstrip(", ")
    (out_dir / f"{stem}.md").write_text(document_header(title, report.environment, report.command, peers) + "\n"
                                        + markdown_table(report) + plot)
    (out_dir / f"{stem}.json").write_text(report_json(report))
    written = [f"{stem}.md", f"{stem}.json"] + ([f"{stem}.png"] if why_not is None else [])
    return [f"wrote {', '.join(str(out_dir / f) for f in written)}"] + ([why_not] if why_not else [])


# ----------------------------------------------------------------------------- measuring (GPU)


def random_cache(shape: tuple[int, ...], cache: str, q_dtype: str, seed: int):
    """Random K or V of ``shape``: standard normals in ``q_dtype``, or for "e4m3" uint8 bytes of
    finite e4m3 values below 8 in magnitude. Made a slice of dimension 0 at a time, so that the
    32-bit temporaries stay near CHUNK_ELEMENTS at 128k contexts."""
    import cupy as cp

    from cuflash.bench.attention import random_normal

    rows = max(1, CHUNK_ELEMENTS // math.prod(shape[1:]))
    out = cp.empty(shape, cp.uint8 if cache == "e4m3" else cp.uint16)
    dtype = None
    for i, start in enumerate(range(0, shape[0], rows)):
        part = out[start:start + rows]
        if cache == "e4m3":
            n = cp.random.default_rng(seed * 4096 + i).integers(0, 0xA0, part.shape, dtype=cp.int32)
            part[...] = (n + (n >= 0x50) * 0x30).astype(cp.uint8)  # 0x50.. become the negatives 0x80..
        else:
            chunk = random_normal(part.shape, q_dtype, seed * 4096 + i)
            part[...], dtype = chunk.view(cp.uint16), chunk.dtype
    return out if dtype is None else out.view(dtype)


def _cuflash_call(case: DecodeCase, q_dtype: str, seed: int, through_torch: bool):
    """One decoding step of ``case`` on fresh random inputs: append seqlen_q tokens at
    context - seqlen_q, attend causally over the context (a scattered page table when paged).
    ``through_torch``: torch tensors into cuflash.torch.flash_attn_with_kvcache (what a graph
    captures: it launches on torch's stream), else CuPy arrays into cuflash.attention_with_kvcache."""
    import cupy as cp
    import numpy as np

    import cuflash
    from cuflash.bench.attention import random_normal

    s = case.shape
    q = random_normal((s.batch, s.seqlen_q, s.heads, s.head_dim), q_dtype, seed)
    k, v = (random_normal((s.batch, s.seqlen_q, s.heads_kv, s.head_dim), q_dtype, seed + j) for j in (1, 2))
    lengths = cp.full((s.batch,), s.context - s.seqlen_q, dtype=cp.int32)
    options = {"dtype": "e4m3"} if case.cache == "e4m3" else {}
    if case.page_size:
        pages = s.batch * -(-s.context // case.page_size)
        table = np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(s.batch, -1)
        options["page_table"] = cp.asarray(table)
        cache_shape = (pages, case.page_size, s.heads_kv, s.head_dim)
    else:
        cache_shape = (s.batch, s.context, s.heads_kv, s.head_dim)
    kc, vc = (random_cache(cache_shape, case.cache, q_dtype, seed + j) for j in (3, 4))
    if not through_torch:
        return lambda: cuflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, causal=True, **options)
    import torch

    from cuflash.torch import flash_attn_with_kvcache

    q, k, v, lengths, kc, vc = (torch.from_dlpack(x) for x in (q, k, v, lengths, kc, vc))
    if case.cache == "e4m3":
        kc, vc = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn)
    table = torch.from_dlpack(options["page_table"]) if case.page_size else None
    return lambda: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, page_table=table, causal=True)


def _sdpa_call(case: DecodeCase, q_dtype: str, seed: int):
    """torch SDPA with ``case.impl``'s backend over a contiguous cache of the context, GQA."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cuflash.bench.attention import random_normal

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[case.impl]
    s = case.shape
    q = random_normal((s.batch, s.seqlen_q, s.heads, s.head_dim), q_dtype, seed)
    k, v = (random_cache((s.batch, s.context, s.heads_kv, s.head_dim), "16-bit", q_dtype, seed + j) for j in (1, 2))
    q, k, v = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def measure(case: DecodeCase, q_dtype: str, repeats: int, timing: str = TIMING_GRAPH) -> float:
    """Median ms of one decoding step, the inputs rotated over 3x the L2 cache (torch SDPA runs on
    torch's default stream, the legacy one CuPy's default shares)."""
    from cuflash.bench.timing import copies_to_defeat_l2

    graph = timing == TIMING_GRAPH
    calls = [_cuflash_call(case, q_dtype, 16 * i, graph) if case.impl == "cuflash" else _sdpa_call(case, q_dtype, 16 * i)
             for i in range(copies_to_defeat_l2(case.bytes_read()))]
    return time_calls(calls, repeats, timing)


def time_calls(calls: list, repeats: int, timing: str) -> float:
    """Median ms of one of ``calls`` (each one step on its own input set, taken in turn): launched
    back to back (TIMING_EAGER), or replayed from one torch CUDA graph of GRAPH_STEPS or more
    steps (TIMING_GRAPH: the calls then launch on torch's current stream)."""
    from cuflash.bench.timing import time_ms

    rotations = len(calls)
    if timing != TIMING_GRAPH:
        return time_ms(lambda i: calls[i](), rotations, repeats=repeats)
    import cupy as cp
    import torch

    side = torch.cuda.Stream()  # the first calls compile and cache their plans outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    count = max(rotations, GRAPH_STEPS)
    steps = torch.cuda.CUDAGraph()
    with torch.cuda.graph(steps):
        for i in range(count):
            calls[i % rotations]()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return time_ms(lambda i: steps.replay(), 1, repeats=repeats, stream=stream) / count


def copy_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """GB/s (bytes read + written) of a device-to-device copy of ``nbytes``."""
    import cupy as cp

    from cuflash.bench.timing import time_ms

    src = cp.random.default_rng(0).integers(0, 255, nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    ms = time_ms(lambda i: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                                      cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr), 1)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def torch_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def available_impls(impls) -> list[str]:
    """``impls`` less the SDPA peers when torch (with CUDA) is not installed."""
    has_torch = torch_gpu()
    return [i for i in impls if i == "cuflash" or (i in PEERS and has_torch)]


def run_sweep(sweep: list[DecodeCase], q_dtype: str = "bfloat16", repeats: int = 10, command: str = "",
              progress=sys.stderr, eager: bool = False) -> DecodeReport:
    import cupy as cp

    from cuflash.bench.attention import environment

    # Each case's inputs are freed before the next case allocates (the largest take tens of GB).
    pool = cp.get_default_memory_pool()
    timing = TIMING_EAGER if eager or not torch_gpu() else TIMING_GRAPH
    report = DecodeReport([], copy_bandwidth(), environment(), command, timing)
    pool.free_all_blocks()
    for done, case in enumerate(sweep, 1):
        s = case.shape
        print(f"\r[{done:>3}/{len(sweep)}] {case.label:<28} q {s.seqlen_q} batch {s.batch:<3} context {s.context:<6} "
              f"heads {s.heads}/{s.heads_kv}", end="", file=progress, flush=True)
        try:
            report.measurements.append(DecodeMeasurement(case, measure(case, q_dtype, repeats, timing)))
        except Exception as error:  # a peer that refuses a case is reported, not fatal
            report.measurements.append(DecodeMeasurement(case, None, f"{type(error).__name__}: {error}"[:160]))
        pool.free_all_blocks()
    print(file=progress)
    return report

