"""``python -m cuflash bench --mode mla``: MLA decoding (cuflash.mla_decode) in GB/s of the latent
cache read and TFLOP/s.

One timed call is one decoding step: ``seqlen_q`` query tokens of ``heads`` heads per sequence
(head dim 576, values the first 512) against ``context`` cached latent rows in pages of 64,
scattered by a random page table, causal. Its bytes are the cache rows in the cache's type (q and
out are under 1% of them); its FLOPs 2 x batch x seqlen_q x heads x context x (576 + 512). Beside
them, in the same run: the GPU's device-to-device copy bandwidth and its bf16 matmul rate, and
FlashMLA's published H800 figures (FLASHMLA_H800). Steps are timed as replays of a torch CUDA
graph (bench_decode.time_calls), without torch launched back to back. Files ``<gpu>-mla.md`` and
``.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from cuflash.bench import decode as bench_decode
from cuflash.bench.attention import document_header, gpu_slug

__all__ = ["MlaCase", "markdown_table", "run_sweep", "sweep", "write_outputs"]

HEAD_DIM, HEAD_DIM_V, PAGE_SIZE = 576, 512, 64
FULL = {"seqlens_q": (1, 2), "batches": (16, 64, 128), "contexts": (1024, 4096, 8192, 32768),
        "heads": (16, 64, 128), "caches": ("16-bit", "e4m3")}
QUICK = FULL | {"batches": (64, 128), "contexts": (4096, 32768), "heads": (16, 128), "caches": ("16-bit",)}
MAX_CASE_BYTES = 40 * 10**9  # the rotated copies of one case's cache
# FlashMLA's README: up to 3000 GB/s memory-bound and 660 TFLOP/s compute-bound (bf16) on an H800.
FLASHMLA_H800 = {"GB/s": 3000, "TFLOP/s": 660}


@dataclass(frozen=True)
class MlaCase:
    seqlen_q: int
    batch: int
    context: int
    heads: int
    cache: str  # "16-bit" or "e4m3"

    def cache_bytes(self) -> int:
        return self.batch * self.context * HEAD_DIM * (1 if self.cache == "e4m3" else 2)

    def flops(self) -> int:
        return 2 * self.batch * self.seqlen_q * self.heads * self.context * (HEAD_DIM + HEAD_DIM_V)


def sweep(quick: bool = False, batches=None, contexts=None) -> list[MlaCase]:
    axes = QUICK if quick else FULL
    cases = [MlaCase(s, b, c, h, cache) for cache in axes["caches"] for s in axes["seqlens_q"]
             for h in axes["heads"] for b in batches or axes["batches"] for c in contexts or axes["contexts"]]
    return [c for c in cases if 2 * c.cache_bytes() <= MAX_CASE_BYTES]


def _call(case: MlaCase, q_dtype: str, seed: int, through_torch: bool):
    """One step of ``case`` on fresh random inputs (torch tensors when ``through_torch``, which a
    graph captures: they launch on torch's stream)."""
    import cupy as cp
    import numpy as np

    import cuflash
    from cuflash.bench.attention import random_normal

    pages = case.batch * -(-case.context // PAGE_SIZE)
    q = random_normal((case.batch, case.seqlen_q, case.heads, HEAD_DIM), q_dtype, seed)
    kv = bench_decode.random_cache((pages, PAGE_SIZE, 1, HEAD_DIM), case.cache, q_dtype, seed + 1)
    table = cp.asarray(np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(case.batch, -1))
    lengths = cp.full((case.batch,), case.context, dtype=cp.int32)
    options = {"dtype": "e4m3"} if case.cache == "e4m3" else {}
    if through_torch:
        import torch

        q, kv, table, lengths = (torch.from_dlpack(x) for x in (q, kv, table, lengths))
        if case.cache == "e4m3":
            kv, options = kv.view(torch.float8_e4m3fn), {}
    return lambda: cuflash.mla_decode(q, kv, table, lengths, causal=True, **options)


def run_sweep(cases: list[MlaCase], q_dtype: str = "bfloat16", repeats: int = 10, command: str = "",
              progress=sys.stderr, eager: bool = False) -> dict:
    import cupy as cp

    from cuflash.bench.attention import environment, matmul_rates
    from cuflash.bench.timing import copies_to_defeat_l2

    pool = cp.get_default_memory_pool()
    graph = not eager and bench_decode.torch_gpu()
    timing = bench_decode.TIMING_GRAPH if graph else bench_decode.TIMING_EAGER
    report = {"environment": environment(), "command": command, "timing": timing, "q_dtype": q_dtype,
              "copy_GB/s": bench_decode.copy_bandwidth(), "matmul_TFLOP/s": matmul_rates(),
              "flashmla_h800": FLASHMLA_H800, "measurements": []}
    pool.free_all_blocks()
    for done, case in enumerate(cases, 1):
        print(f"\r[{done:>3}/{len(cases)}] {case}", end="", file=progress, flush=True)
        row = asdict(case)
        try:
            calls = [_call(case, q_dtype, 16 * i, graph) for i in range(copies_to_defeat_l2(case.cache_bytes()))]
            ms = bench_decode.time_calls(calls, repeats, timing)
            row |= {"ms": ms, "GB/s": case.cache_bytes() / ms / 1e6, "TFLOP/s": case.flops() / ms / 1e9}
        except Exception as error:  # reported, not fatal
            row["error"] = f"{type(error).__name__}: {error}"[:160]
        report["measurements"].append(row)
        pool.free_all_blocks()
    print(file=progress)
    return report


def markdown_table(report: dict) -> str:
    lines = ["| cache | seqlen_q | heads | batch | context | us | GB/s | TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for m in report["measurements"]:
        cells = (f"{m['ms'] * 1e3:.1f} | {m['GB/s']:.0f} | {m['TFLOP/s']:.0f}" if "ms" in m else
                 f"{m['error']} | | ")
        lines.append(f"| {m['cache']} | {m['seqlen_q']} | {m['heads']} | {m['batch']} | {m['context']} | {cells} |")
    rates = "; ".join(f"{name}: {value:.0f} TFLOP/s" for name, value in report["matmul_TFLOP/s"].items())
    flashmla = report["flashmla_h800"]
    lines += ["", f"Same run: device-to-device copy {report['copy_GB/s']:.0f} GB/s (read + written); {rates or 'no torch'}. "
              f"FlashMLA's published H800 figures: {flashmla['GB/s']} GB/s, {flashmla['TFLOP/s']} TFLOP/s. "
              f"Timing: {report['timing']}."]
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out_dir: Path) -> list[str]:
    stem = out_dir / f"{gpu_slug(report['environment'].get('device', ''))}-mla"
    title = f"cuflash MLA decoding, {report['environment'].get('device', '')}"
    md = stem.with_suffix(".md")
    md.write_text(document_header(title, report["environment"], report["command"]) + "\n" + markdown_table(report))
    js = stem.with_suffix(".json")
    js.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return [f"wrote {md}", f"wrote {js}"]
