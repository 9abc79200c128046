"""``python -m cuflash bench --mode serving``: what a serving engine runs, next to the ways it could
run it, in one run.

Two passes, 32 query / 8 KV heads, head_dim 128, bf16, a paged cache of 16-token blocks (vLLM's
layout: scattered blocks, one block table row per sequence):

- mixed: vLLM's mixed batch of MIXED_PREFILLS prefill chunks of PREFILL_CHUNK tokens and
  MIXED_DECODES single-token decodes, every sequence with ``context`` cached tokens (the step's
  included), causal. ``cuflash vllm``: one ``cuflash.torch.vllm.flash_attn_varlen_func`` call;
  ``cuflash split``: the same work as two ``attention_with_kvcache`` calls, the prefill chunks
  and the decodes apart; ``sdpa per sequence``: torch SDPA (its own backend choice) once per
  sequence over that sequence's keys, contiguous, the chunks with the lower-right causal mask.
- prefix: PREFIX_BATCH decodes that share a PREFIX_TOKENS-token prompt, each with its own
  SUFFIX_TOKENS-token suffix. ``per sequence``: one decode call whose block tables all start with
  the shared blocks, so every sequence reads the prefix; ``cascade``: the prefix once for all
  queries (one sequence of PREFIX_BATCH x heads rows, no mask), the suffixes by one decode call,
  then ``cuflash.merge_states`` of the two through their LSEs (vLLM's cascade attention,
  FlashInfer's shared-prefix decoding).

Each implementation's steps are timed as torch CUDA graph replays (bench/decode.py's time_calls),
its inputs rotated over 3x the L2 cache; ``eager`` launches them back to back instead. The derived
numbers: mixed, cuflash vllm's time over cuflash split's (target <= 1) and SDPA's over cuflash
vllm's; prefix, per sequence over cascade (target >= 10). Files ``<gpu>-serving.md`` and ``.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cuflash.bench import decode as bench_decode
from cuflash.bench.attention import document_header, gpu_slug
from cuflash.bench.timing import copies_to_defeat_l2

__all__ = ["MixedSet", "PrefixSet", "ServingCase", "ServingMeasurement", "ServingReport", "make_mixed", "make_prefix",
           "markdown_document", "measure_case", "mixed_call", "prefix_call", "report_json", "run_sweep", "sweep",
           "verdicts", "write_outputs"]

HEADS, HEADS_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
PREFILL_CHUNK, MIXED_PREFILLS, MIXED_DECODES = 512, 4, 60
CONTEXTS = (4096, 16384, 32768)
QUICK_CONTEXTS = (4096, 32768)
PREFIX_TOKENS, SUFFIX_TOKENS, PREFIX_BATCH = 32768, 512, 64
MIXED_IMPLS = ("cuflash vllm", "cuflash split", "sdpa per sequence")
PREFIX_IMPLS = ("per sequence", "cascade")
IMPLS = {"mixed": MIXED_IMPLS, "prefix": PREFIX_IMPLS}
# The targets of the derived numbers: the mixed batch's one call over the split calls (at most),
# reading the prefix per sequence over the cascade (at least).
TARGETS = {"mixed": 1.0, "prefix": 10.0}


@dataclass(frozen=True)
class ServingCase:
    mode: str  # "mixed" or "prefix"
    context: int  # cached tokens per sequence (mixed), or the shared prefix's (prefix)


def sweep(quick: bool = False) -> list[ServingCase]:
    contexts = QUICK_CONTEXTS if quick else CONTEXTS
    return [ServingCase("mixed", c) for c in contexts] + [ServingCase("prefix", PREFIX_TOKENS)]


@dataclass
class ServingMeasurement:
    impl: str
    case: ServingCase
    ms: float | None
    note: str = ""


@dataclass
class ServingReport:
    measurements: list[ServingMeasurement]
    environment: dict = field(default_factory=dict)
    command: str = ""
    timing: str = bench_decode.TIMING_GRAPH

    def ms(self, impl: str, case: ServingCase) -> float | None:
        return next((m.ms for m in self.measurements if m.impl == impl and m.case == case), None)

    def ratio(self, case: ServingCase) -> float | None:
        """mixed: cuflash vllm over cuflash split (lower is better); prefix: per sequence over
        cascade (higher is better)."""
        a, b = (("cuflash vllm", "cuflash split") if case.mode == "mixed" else ("per sequence", "cascade"))
        a, b = self.ms(a, case), self.ms(b, case)
        return None if a is None or b is None else a / b


def _met(case: ServingCase, ratio: float) -> bool:
    return ratio <= TARGETS["mixed"] if case.mode == "mixed" else ratio >= TARGETS["prefix"]


def verdicts(report: ServingReport) -> list[str]:
    lines = []
    for mode, words in (("mixed", "cuflash vllm / cuflash split"), ("prefix", "per sequence / cascade")):
        cases = [m.case for m in report.measurements if m.case.mode == mode]
        ratios = [r for r in (report.ratio(c) for c in dict.fromkeys(cases)) if r is not None]
        if not cases:
            continue
        if not ratios:
            lines.append(f"- {mode}: not measured")
            continue
        worst = max(ratios) if mode == "mixed" else min(ratios)
        sign = "<=" if mode == "mixed" else ">="
        verdict = "met" if all(_met(c, r) for c, r in ((c, report.ratio(c)) for c in dict.fromkeys(cases))
                               if r is not None) else "NOT met"
        lines.append(f"- {mode}: {words} worst {worst:.2f}, target {sign} {TARGETS[mode]:g}: {verdict}")
    return lines


def markdown_document(report: ServingReport) -> str:
    device = report.environment.get("device", "")
    parts = [document_header(f"cuflash serving steps, {device}".rstrip(", "), report.environment,
                             report.command).rstrip("\n")]
    parts.append(f"{HEADS} query / {HEADS_KV} KV heads, head_dim {HEAD_DIM}, bf16, paged cache of {BLOCK}-token "
                 f"blocks. Mixed: {MIXED_PREFILLS} prefill chunks of {PREFILL_CHUNK} tokens and {MIXED_DECODES} "
                 f"decodes, each sequence with `context` cached tokens. Prefix: {PREFIX_BATCH} decodes sharing a "
                 f"{PREFIX_TOKENS}-token prompt, each with a {SUFFIX_TOKENS}-token suffix. Steps timed as "
                 f"{report.timing}; medians over rotated input sets.")
    parts.append("\n".join(verdicts(report)))
    for mode, title in (("mixed", "Mixed batch, ms per step"), ("prefix", "Shared prefix, ms per step")):
        cases = list(dict.fromkeys(m.case for m in report.measurements if m.case.mode == mode))
        if not cases:
            continue
        derived = "vllm / split" if mode == "mixed" else "per sequence / cascade"
        header = ["context", *IMPLS[mode], derived]
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for case in cases:
            cells = [str(case.context)]
            for impl in IMPLS[mode]:
                m = next((m for m in report.measurements if m.impl == impl and m.case == case), None)
                cells.append(f"{m.ms:.3f}" if m is not None and m.ms is not None else
                             f"— ({m.note})" if m is not None and m.note else "—")
            ratio = report.ratio(case)
            cells.append("—" if ratio is None else f"{ratio:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def report_json(report: ServingReport) -> str:
    return json.dumps({"command": report.command, "environment": report.environment, "timing": report.timing,
                       "targets": TARGETS,
                       "measurements": [{"impl": m.impl, "mode": m.case.mode, "context": m.case.context, "ms": m.ms,
                                         "note": m.note} for m in report.measurements]}, indent=1)


def write_outputs(report: ServingReport, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{gpu_slug(report.environment.get('device', ''))}-serving"
    (out_dir / f"{stem}.md").write_text(markdown_document(report))
    (out_dir / f"{stem}.json").write_text(report_json(report))
    return [f"wrote {out_dir / (stem + '.md')}, {out_dir / (stem + '.json')}"]


# ----------------------------------------------------------------------------- inputs (torch)


def _blocks(generator, count: int, device):
    """``count`` distinct block indices of a pool of ``count`` blocks, scattered (int32)."""
    import torch

    return torch.randperm(count, generator=generator, device="cpu").to(device=device, dtype=torch.int32)


@dataclass
class MixedSet:
    """One input set of the mixed pass: packed q, the pools, the block table, cu_seqlens_q,
    seqused_k; and for SDPA each sequence's keys and values, contiguous (batch, heads, tokens, d)."""
    q: object
    k_cache: object
    v_cache: object
    table: object
    cu_seqlens_q: object
    seqused_k: object
    keys: list
    values: list
    context: int


def make_mixed(case: ServingCase, seed: int, device="cuda") -> MixedSet:
    import torch

    generator = torch.Generator().manual_seed(seed)
    sequences = MIXED_PREFILLS + MIXED_DECODES
    query_lens = [PREFILL_CHUNK] * MIXED_PREFILLS + [1] * MIXED_DECODES
    blocks = -(-case.context // BLOCK)
    table = _blocks(generator, sequences * blocks, device).view(sequences, blocks)
    pools = torch.randn((2, sequences * blocks, BLOCK, HEADS_KV, HEAD_DIM), generator=generator,
                        dtype=torch.bfloat16).to(device)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn((int(cu[-1]), HEADS, HEAD_DIM), generator=generator, dtype=torch.bfloat16).to(device)
    used = torch.full((sequences,), case.context, dtype=torch.int32, device=device)
    rows = table.long()
    keys, values = ([pool[rows[b]].reshape(-1, HEADS_KV, HEAD_DIM)[:case.context].transpose(0, 1)[None].contiguous()
                     for b in range(sequences)] for pool in pools)
    return MixedSet(q, pools[0], pools[1], table, cu, used, keys, values, case.context)


def mixed_call(impl: str, s: MixedSet) -> Callable[[], object]:
    """One timed step of ``impl`` (one of MIXED_IMPLS) on input set ``s``."""
    import torch

    import cuflash
    from cuflash.torch import vllm

    if impl == "cuflash vllm":
        out = torch.empty_like(s.q)
        return lambda: vllm.flash_attn_varlen_func(s.q, s.k_cache, s.v_cache, PREFILL_CHUNK, s.cu_seqlens_q,
                                                   s.context, seqused_k=s.seqused_k, block_table=s.table,
                                                   causal=True, out=out)
    if impl == "cuflash split":
        chunk_rows = MIXED_PREFILLS * PREFILL_CHUNK
        chunk_q, decode_q = s.q[:chunk_rows], s.q[chunk_rows:].unsqueeze(1)
        chunk_cu = s.cu_seqlens_q[:MIXED_PREFILLS + 1]
        chunk_table, decode_table = s.table[:MIXED_PREFILLS], s.table[MIXED_PREFILLS:]
        chunk_used, decode_used = s.seqused_k[:MIXED_PREFILLS], s.seqused_k[MIXED_PREFILLS:]

        def split():
            chunks = cuflash.attention_with_kvcache(chunk_q, s.k_cache, s.v_cache, cache_seqlens=chunk_used,
                                                    page_table=chunk_table, cu_seqlens_q=chunk_cu,
                                                    max_seqlen_q=PREFILL_CHUNK, causal=True)
            return chunks, cuflash.attention_with_kvcache(decode_q, s.k_cache, s.v_cache, cache_seqlens=decode_used,
                                                          page_table=decode_table, causal=True)
        return split
    from torch.nn.attention.bias import causal_lower_right

    cu = s.cu_seqlens_q.tolist()
    queries = [s.q[cu[b]:cu[b + 1]].transpose(0, 1)[None] for b in range(len(s.keys))]
    masks = [causal_lower_right(q.shape[2], k.shape[2]) if q.shape[2] > 1 else None for q, k in zip(queries, s.keys)]

    def per_sequence():
        return [torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
                for q, k, v, m in zip(queries, s.keys, s.values, masks)]
    return per_sequence


@dataclass
class PrefixSet:
    """One input set of the prefix pass: the decode queries (batch, 1, heads, d); the pools and the
    whole block tables (shared prefix blocks, then each sequence's suffix blocks); the prefix's
    keys and values contiguous (1, tokens, heads_kv, d) and the suffix tables."""
    q: object
    k_cache: object
    v_cache: object
    table: object
    suffix_table: object
    prefix_k: object
    prefix_v: object


def make_prefix(case: ServingCase, seed: int, device="cuda") -> PrefixSet:
    import torch

    generator = torch.Generator().manual_seed(seed)
    prefix_blocks, suffix_blocks = case.context // BLOCK, SUFFIX_TOKENS // BLOCK
    count = prefix_blocks + PREFIX_BATCH * suffix_blocks
    order = _blocks(generator, count, device)
    shared = order[:prefix_blocks]
    suffixes = order[prefix_blocks:].view(PREFIX_BATCH, suffix_blocks)
    table = torch.cat([shared.expand(PREFIX_BATCH, -1), suffixes], dim=1).contiguous()
    pools = torch.randn((2, count, BLOCK, HEADS_KV, HEAD_DIM), generator=generator, dtype=torch.bfloat16).to(device)
    q = torch.randn((PREFIX_BATCH, 1, HEADS, HEAD_DIM), generator=generator, dtype=torch.bfloat16).to(device)
    prefix_k, prefix_v = (pool[shared.long()].reshape(1, -1, HEADS_KV, HEAD_DIM).contiguous() for pool in pools)
    return PrefixSet(q, pools[0], pools[1], table, suffixes.contiguous(), prefix_k, prefix_v)


def prefix_call(impl: str, s: PrefixSet) -> Callable[[], object]:
    """One timed step of ``impl`` (one of PREFIX_IMPLS) on input set ``s``."""
    import torch

    import cuflash

    total = s.prefix_k.shape[1] + SUFFIX_TOKENS
    if impl == "per sequence":
        lengths = torch.full((PREFIX_BATCH,), total, dtype=torch.int32, device=s.q.device)
        return lambda: cuflash.attention_with_kvcache(s.q, s.k_cache, s.v_cache, cache_seqlens=lengths,
                                                      page_table=s.table, causal=True)
    suffix_lengths = torch.full((PREFIX_BATCH,), SUFFIX_TOKENS, dtype=torch.int32, device=s.q.device)
    # The decode queries as the rows of one sequence: every row sees the whole prefix.
    rows = s.q.view(1, PREFIX_BATCH, HEADS, HEAD_DIM)

    def cascade():
        prefix_out, prefix_lse = cuflash.attention(rows, s.prefix_k, s.prefix_v, return_lse=True)
        suffix_out, suffix_lse = cuflash.attention_with_kvcache(s.q, s.k_cache, s.v_cache, cache_seqlens=suffix_lengths,
                                                                page_table=s.suffix_table, causal=True,
                                                                return_lse=True)
        # lse views in out's (batch, 1, heads) layout: (1, heads, batch) and (batch, heads, 1) transposed.
        return cuflash.merge_states(prefix_out.view(PREFIX_BATCH, 1, HEADS, HEAD_DIM),
                                    prefix_lse[0].transpose(0, 1).unsqueeze(1), suffix_out,
                                    suffix_lse.transpose(1, 2))
    return cascade


# ----------------------------------------------------------------------------- measuring


def _set_bytes(case: ServingCase) -> int:
    sequences = MIXED_PREFILLS + MIXED_DECODES if case.mode == "mixed" else 1
    return 2 * sequences * case.context * HEADS_KV * HEAD_DIM * 2


def measure_case(case: ServingCase, repeats: int = 10, timing: str = bench_decode.TIMING_GRAPH,
                 timer: Callable = bench_decode.time_calls, device="cuda", progress=None) -> list[ServingMeasurement]:
    """Every implementation of IMPLS[case.mode] on ``case``: its median ms, or None and why (a
    peer that refuses or fails is reported, not fatal)."""
    make, call = (make_mixed, mixed_call) if case.mode == "mixed" else (make_prefix, prefix_call)
    sets = [make(case, 7 * i, device) for i in range(min(2, copies_to_defeat_l2(_set_bytes(case))))]
    found = []
    for impl in IMPLS[case.mode]:
        if progress is not None:
            print(f"\r{case.mode:<7} {case.context:>6}  {impl:<20}", end="", file=progress, flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                found.append(ServingMeasurement(impl, case, timer([call(impl, s) for s in sets], repeats, timing)))
            except Exception as error:
                found.append(ServingMeasurement(impl, case, None, " ".join(f"{type(error).__name__}: {error}"
                                                                         .split())[:200]))
    return found


def run_sweep(cases: list[ServingCase], repeats: int = 10, command: str = "", eager: bool = False,
              progress=sys.stderr) -> ServingReport:
    from cuflash.bench.attention import environment

    timing = bench_decode.TIMING_EAGER if eager else bench_decode.TIMING_GRAPH
    report = ServingReport([], environment(), command, timing)
    for case in cases:
        report.measurements += measure_case(case, repeats, timing, progress=progress)
    print(file=progress)
    return report
