"""``python -m cuflash bench --mode ring``: context parallelism (cuflash.torch.distributed) across the
GPUs of one machine, next to one GPU.

One process per GPU (NCCL). For each total sequence length (batch 1, bf16, heads x head_dim =
bench.HIDDEN with head_dim 128, zigzag shards) and causal setting, every rank times
``ring_attention`` and ``ulysses_attention``, forward and forward + backward, as CUDA events
around a call after a barrier, median of the repeats, the slowest rank's; then the ring again with
its transfers replaced by a local copy (the same kernels, no communication), so that the ring's
time minus that one is the communication left exposed. Rank 0 alone times
``cuflash.torch.attention`` on the whole sequence where it fits. FLOPs are counted over the whole
sequence as the other benchmarks count them (reference.attention_flops); TFLOP/s are per GPU, and
the speedup is one GPU's time over the ring's. Files ``<gpu>-ring.md`` and ``.json``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cuflash.bench.attention import HIDDEN, document_header, gpu_slug
from cuflash._cpu.reference import attention_flops

__all__ = ["RingCase", "markdown_table", "run", "sweep", "write_outputs"]

HEAD_DIM = 128
FULL_TOTALS = (131072, 262144, 524288)  # 1M tokens by --seqlens: one GPU then takes ~45 s a step
QUICK_TOTALS = (131072,)
METHODS = ("ring", "ulysses")


@dataclass(frozen=True)
class RingCase:
    total: int  # tokens of the whole sequence
    causal: bool
    heads: int = HIDDEN // HEAD_DIM
    head_dim: int = HEAD_DIM

    def flops(self, mode: str) -> float:
        return attention_flops(1, self.heads, self.total, self.total, self.head_dim, causal=self.causal, mode=mode)


def sweep(quick: bool = False, totals=None, causal: str = "both") -> list[RingCase]:
    settings = {"both": (False, True), "no": (False,), "yes": (True,)}[causal]
    return [RingCase(t, c) for t in totals or (QUICK_TOTALS if quick else FULL_TOTALS) for c in settings]


def _timed(call, repeats: int, device, group) -> float:
    """Median ms of ``call`` over ``repeats`` runs after one warm-up, each started together on every
    rank; the slowest rank's median."""
    import torch
    import torch.distributed as dist

    samples = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            call()
            samples.append((time.perf_counter() - begin) * 1e3)
    median = torch.tensor([statistics.median(samples[1:])], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


@contextlib.contextmanager
def _local_transfers():
    """The ring passing nothing: each rank computes on its own K/V block at every step (the same
    blocks' kernels as the ring's, no communication)."""
    from cuflash._core.ring import Ring, Transfer

    original = Ring.pass_on
    Ring.pass_on = lambda self, tensor, tag: Transfer(tensor.clone(), [])
    try:
        yield
    finally:
        Ring.pass_on = original


def _step(function, mode: str, q, k, v, dout, causal: bool):
    """One timed call of ``function(q, k, v, causal=...)``: its forward, or ("fwd_bwd") its forward
    and backward from fresh leaves."""
    def call():
        if mode == "fwd":
            function(q, k, v, causal=causal)
        else:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            function(*leaves, causal=causal).backward(dout)
    return call


def _case_rows(case: RingCase, rank: int, world_size: int, device, repeats: int, first_only) -> list[dict]:
    import torch
    import torch.distributed as dist

    from cuflash.torch import attention
    from cuflash.torch.distributed import ring_attention, ulysses_attention

    functions = {"ring": ring_attention, "ulysses": ulysses_attention}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(rank)
    shard = [torch.randn((1, case.total // world_size, case.heads, case.head_dim), generator=generator,
                         device=device, dtype=dtype) for _ in range(4)]  # q, k, v, dout
    rows = []
    for mode in ("fwd", "fwd_bwd"):
        row = {**asdict(case), "mode": mode, "ranks": world_size}
        for method in METHODS:
            try:
                row[f"{method} ms"] = _timed(_step(functions[method], mode, *shard, case.causal), repeats, device, None)
            except ValueError as error:  # raised alike on every rank before any exchange: heads the ranks do not divide
                row[f"{method} error"] = f"{error}"[:120]
        with _local_transfers():
            row["ring without transfers ms"] = _timed(_step(ring_attention, mode, *shard, case.causal), repeats,
                                                      device, None)
        rows.append(row)
    # One GPU: rank 0 on the whole sequence (its own group), the others waiting.
    for row in rows:
        result = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
        if rank == 0:
            try:
                whole = [torch.randn((1, case.total, case.heads, case.head_dim), device=device, dtype=dtype)
                         for _ in range(4)]
                result[0] = _timed(_step(attention, row["mode"], *whole, case.causal), repeats, device, first_only)
                del whole
            except (RuntimeError, MemoryError):  # it does not fit on one GPU
                pass
        dist.broadcast(result, 0)
        if not math.isnan(result.item()):
            row["one GPU ms"] = result.item()
    return rows


def _worker(rank: int, world_size: int, port: int, backend: str, cases: list, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=10))
    try:
        first_only = dist.new_group([0])  # every process takes part in creating it
        rows = [row for case in cases for row in _case_rows(case, rank, world_size, device, repeats, first_only)]
        if rank == 0:
            results.put(rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(cases: list[RingCase], ranks: int, repeats: int = 5, command: str = "", device: str = "cuda",
        environment: dict | None = None) -> dict:
    """Every case on ``ranks`` processes (GPUs 0 .. ranks - 1 over NCCL, or CPU processes over gloo
    with ``device="cpu"``); the report rank 0 gathered."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    workers = mp.start_processes(_worker, args=(ranks, port, "nccl" if device == "cuda" else "gloo", cases, repeats,
                                                results), nprocs=ranks, start_method="spawn", join=False)
    rows = results.get()  # before joining: a worker may wait for its rows to be read
    while not workers.join():
        pass
    for row in rows:
        case = RingCase(row["total"], row["causal"], row["heads"], row["head_dim"])
        for method in METHODS:
            if f"{method} ms" in row:
                row[f"{method} TFLOP/s per GPU"] = case.flops(row["mode"]) / row[f"{method} ms"] / 1e9 / ranks
        if "one GPU ms" in row and "ring ms" in row:
            row["ring speedup"] = row["one GPU ms"] / row["ring ms"]
        if "ring ms" in row:
            row["exposed transfer ms"] = max(0.0, row["ring ms"] - row["ring without transfers ms"])
    return {"environment": environment or {}, "command": command, "ranks": ranks, "measurements": rows}


def markdown_table(report: dict) -> str:
    lines = ["| tokens | causal | mode | ring ms | ring TFLOP/s/GPU | ulysses ms | ulysses TFLOP/s/GPU | one GPU ms "
             "| ring speedup | exposed transfers ms |", "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(row, key, fmt):
        if key in row:
            return format(row[key], fmt)
        return "error" if f"{key.split()[0]} error" in row else "-"
    for row in report["measurements"]:
        tokens = f"{row['total'] // 1024}k" if row["total"] % 1024 == 0 else str(row["total"])
        cells = [tokens, "yes" if row["causal"] else "no", row["mode"],
                 cell(row, "ring ms", ".1f"), cell(row, "ring TFLOP/s per GPU", ".0f"),
                 cell(row, "ulysses ms", ".1f"), cell(row, "ulysses TFLOP/s per GPU", ".0f"),
                 cell(row, "one GPU ms", ".1f"), cell(row, "ring speedup", ".2f"),
                 cell(row, "exposed transfer ms", ".1f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", f"{report['ranks']} ranks, batch 1, bf16, head_dim {HEAD_DIM}, zigzag shards; one GPU: "
              "cuflash.torch.attention on the whole sequence, '-' where it does not fit. Exposed transfers: the "
              "ring's time minus the same ring's with its transfers replaced by local copies."]
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out_dir: Path) -> list[str]:
    device = report["environment"].get("device", "")
    stem = out_dir / f"{gpu_slug(device)}-ring"
    title = f"cuflash context parallelism, {report['ranks']} x {device}".rstrip(", ")
    md = stem.with_suffix(".md")
    md.write_text(document_header(title, report["environment"], report["command"]) + "\n" + markdown_table(report))
    js = stem.with_suffix(".json")
    js.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return [f"wrote {md}", f"wrote {js}"]
