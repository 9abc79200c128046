"""``python -m cuflash bench --mode bias``: attention sinks, ALiBi and dropout on gpt-oss's attention
shapes, next to cuflash without them and next to the peers, in one run.

The shapes: 64 query heads, 8 KV heads (GQA), head_dim 64, bf16, batch 1, causal, either over all
earlier keys or in a sliding window of 128 keys (window=(128, 0); gpt-oss alternates the two per
layer), 4k to 32k tokens. Four passes:

- forward: one ``cuflash.attention`` call;
- backward: one ``cuflash.attention_backward`` call on the out and lse of a forward run once,
  untimed (the peers: ``torch.autograd.grad`` of an output computed once), as the bwd mode times it;
- decode: one step of ``cuflash.attention_with_kvcache``, one query token per sequence appended to
  a contiguous bf16 cache at context - 1 and attended causally over the context, batch 1 and 64,
  timed as bench/decode.py times it (CUDA graph replays, or with ``eager`` launched back to back);
- train: a training step's attention, forward and backward through autograd
  (``cuflash.torch.attention`` and SDPA's FlashAttention-2 backend), without dropout and with
  dropout 0.1, causal over all earlier keys.

Per case, cuflash without bias, with sinks (float32, random normal, a logit per query head) and
with ALiBi (float32 slopes 2^(-8(h+1)/64), BLOOM's for 64 heads) (in the train pass: without and
with dropout); then torch SDPA's cuDNN and
FlashAttention-2 backends (enable_gqa=True; they have no sinks and no sliding window) and, for the
forward and backward, torch's eager gpt-oss formula with the sink as a concatenated score column,
where its score matrix fits. The derived numbers are cuflash with sinks, ALiBi or dropout over
cuflash without, held to the targets of TARGETS. Files ``<gpu>-bias.md`` and ``.json``.

Inputs are torch tensors (cuflash answers in torch, on torch's stream), rotated over 3x the L2
cache; warm-up calls (compilation included) are not timed; times are medians. Forward and backward
calls are launched back to back (bench/timing.py's time_ms, as the fwd and bwd modes time them), so
that a call whose kernels are shorter than its host cost times the host cost.
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

__all__ = ["BiasCase", "BiasMeasurement", "BiasReport", "Inputs", "alibi_slopes", "backward_call", "bias_arguments",
           "decode_call", "eager_sinks_attention", "forward_call", "hidden_keys", "make_inputs", "markdown_document",
           "markdown_table", "measure_case", "release_memory", "report_json", "run_sweep", "set_bytes",
           "skip_reason", "sweep", "train_call", "verdicts", "write_outputs"]

HEADS, HEADS_KV, HEAD_DIM = 64, 8, 64
WINDOW = (128, 0)  # cuflash's (left, right): query i sees keys i - 128 .. i
SEQLENS = (4096, 8192, 16384, 32768)
QUICK_SEQLENS = (4096, 16384)
DECODE_BATCHES = (1, 64)
DECODE_CONTEXTS = (8192, 32768)
MODES = ("fwd", "bwd", "decode", "train")
DROPOUT_P = 0.1
MODE_TITLES = {
    "fwd": "Forward, ms per call",
    "bwd": "Backward, ms per call (the forward run once, untimed; the backward call timed alone)",
    "decode": "Decode, ms per step (one query token per sequence, its k and v appended to a contiguous bf16 cache, "
              "full causal; the SDPA peers read the same cache without the append)",
    "train": f"Forward and backward through autograd, ms per step (causal; dropout {DROPOUT_P})",
}

CUFLASH_IMPLS = ("cuflash", "cuflash+sinks", "cuflash+alibi")
SDPA_BACKENDS = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION"}
EAGER = "torch eager (sinks)"
TRAIN_IMPLS = ("cuflash", "cuflash+dropout", "sdpa-flash", "sdpa-flash+dropout")
IMPLS = {"fwd": (*CUFLASH_IMPLS, *SDPA_BACKENDS, EAGER), "bwd": (*CUFLASH_IMPLS, *SDPA_BACKENDS, EAGER),
         "decode": (*CUFLASH_IMPLS, *SDPA_BACKENDS), "train": TRAIN_IMPLS}
DESCRIPTIONS = {
    "sdpa-cudnn": "torch SDPA, CUDNN_ATTENTION backend (cuDNN), enable_gqa=True, no sinks",
    "sdpa-flash": "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2), enable_gqa=True, no sinks",
    "sdpa-flash+dropout": f"the same with dropout_p={DROPOUT_P}",
    EAGER: "gpt-oss's reference formula in torch: q·kᵀ·scale in bf16, masked, the sink concatenated as a last "
           "score column, softmax in float32, the column dropped, ·v",
}
# The targets: cuflash with the bias over cuflash without, per pass (ALiBi's decode has
# none: its ratio is shown unjudged).
TARGETS = {"sinks": {"fwd": 1.02, "bwd": 1.03, "decode": 1.02}, "alibi": {"fwd": 1.05, "bwd": 1.05},
           "dropout": {"train": 1.15}}
# The ratio columns of each pass's table.
RATIOS = {"fwd": ("sinks", "alibi"), "bwd": ("sinks", "alibi"), "decode": ("sinks", "alibi"), "train": ("dropout",)}
# The eager formula materialises float32 scores of heads x seqlen² (17 GB at 8k tokens, two such
# at once); its backward keeps the probabilities of every rotated input set and makes more.
EAGER_MAX_TOKENS = {"fwd": 8192, "bwd": 4096}
EAGER_REPEATS = 3  # it takes tens of ms a call at 8k; fewer samples keep the run short


@dataclass(frozen=True)
class BiasCase:
    mode: str  # "fwd", "bwd", "decode" or "train"
    seqlen: int  # tokens of the sequence (fwd, bwd), or cached tokens per sequence (decode)
    batch: int = 1
    windowed: bool = False  # the 128-key sliding window

    @property
    def window(self) -> tuple[int, int]:
        """The ``window`` argument of cuflash's calls."""
        return WINDOW if self.windowed else (-1, -1)

    @property
    def mask(self) -> str:
        return f"causal, window {WINDOW[0]}" if self.windowed else "causal"

    def decode_shape(self) -> bench_decode.DecodeShape:
        return bench_decode.DecodeShape(1, self.batch, self.seqlen, HEADS, HEADS_KV, HEAD_DIM)


def sweep(quick: bool = False) -> list[BiasCase]:
    """The cases in table order: forward, then backward, each per mask and length; then decode per
    batch and context (the same with ``quick``); then train per length, causal without window."""
    seqlens = QUICK_SEQLENS if quick else SEQLENS
    found = [BiasCase(mode, s, 1, windowed) for mode in ("fwd", "bwd") for windowed in (False, True) for s in seqlens]
    found += [BiasCase("decode", c, b) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    return found + [BiasCase("train", s) for s in seqlens]


def alibi_slopes(heads: int = HEADS) -> list[float]:
    """BLOOM's ALiBi slopes for a power-of-two head count: 2^(-8(h+1)/heads) for head h."""
    return [2.0 ** (-8 * (h + 1) / heads) for h in range(heads)]


def skip_reason(impl: str, case: BiasCase) -> str | None:
    """Why ``impl`` is not run on ``case`` (shown as a footnote), or None."""
    if impl in SDPA_BACKENDS and case.windowed:
        return "SDPA has no sliding-window argument"
    if impl == EAGER and case.seqlen > EAGER_MAX_TOKENS[case.mode]:
        return (f"not run above {EAGER_MAX_TOKENS[case.mode]} tokens in the {case.mode} pass: the float32 "
                f"scores alone take heads x seqlen² x 4 bytes")
    return None


@dataclass
class BiasMeasurement:
    impl: str
    case: BiasCase
    ms: float | None  # None: skipped, refused or failed (``note`` says which)
    note: str = ""


@dataclass
class BiasReport:
    measurements: list[BiasMeasurement]
    environment: dict = field(default_factory=dict)
    command: str = ""
    decode_timing: str = bench_decode.TIMING_GRAPH

    def ms(self, impl: str, case: BiasCase) -> float | None:
        for m in self.measurements:
            if m.impl == impl and m.case == case:
                return m.ms
        return None

    def ratio(self, bias: str, case: BiasCase) -> float | None:
        """cuflash with ``bias`` ("sinks", "alibi" or "dropout") over cuflash without, on ``case``."""
        biased, plain = self.ms(f"cuflash+{bias}", case), self.ms("cuflash", case)
        return None if biased is None or plain is None else biased / plain


# ----------------------------------------------------------------------------- report writing


def _cases(report: BiasReport, mode: str) -> list[BiasCase]:
    return list(dict.fromkeys(m.case for m in report.measurements if m.case.mode == mode))


def _footnotes(report: BiasReport) -> dict[str, int]:
    """Each distinct note, numbered in order of appearance (a table cell cites its number)."""
    notes: dict[str, int] = {}
    for m in report.measurements:
        if m.ms is None and m.note:
            notes.setdefault(m.note, len(notes) + 1)
    return notes


def _ratio_cell(ratio: float | None, target: float | None) -> str:
    if ratio is None:
        return "—"
    return f"{ratio:.3f}" + (" (over)" if target is not None and ratio > target else "")


def markdown_table(report: BiasReport, mode: str) -> str:
    """One pass's table: a row per case, ms per implementation, then the two ratios to cuflash."""
    cases = _cases(report, mode)
    impls = [i for i in IMPLS[mode] if any(m.impl == i and m.case in cases for m in report.measurements)]
    notes = _footnotes(report)
    by_key = {(m.impl, m.case): m for m in report.measurements}
    keys = ["batch", "context"] if mode == "decode" else ["mask", "tokens"]
    header = [*keys, *impls, *(f"{bias} / no {'dropout' if bias == 'dropout' else 'bias'}" for bias in RATIOS[mode])]
    lines = [f"### {MODE_TITLES[mode]}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in cases:
        cells = [str(case.batch), str(case.seqlen)] if mode == "decode" else [case.mask, str(case.seqlen)]
        for impl in impls:
            m = by_key.get((impl, case))
            if m is not None and m.ms is not None:
                cells.append(f"{m.ms:.3f}")
            else:
                cells.append(f"— [{notes[m.note]}]" if m is not None and m.note in notes else "—")
        cells += [_ratio_cell(report.ratio(bias, case), TARGETS[bias].get(mode)) for bias in RATIOS[mode]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdicts(report: BiasReport) -> list[str]:
    """A line per bias and pass: its worst ratio over the cases measured, against the target."""
    lines = []
    for bias, targets in TARGETS.items():
        for mode, target in targets.items():
            cases = _cases(report, mode)
            if not cases:
                continue
            ratios = [r for r in (report.ratio(bias, c) for c in cases) if r is not None]
            if not ratios:
                lines.append(f"- {bias}, {mode}: not measured (target {target:.2f})")
                continue
            worst = max(ratios)
            verdict = "met" if worst <= target else "NOT met"
            lines.append(f"- {bias}, {mode}: worst {worst:.3f} over {len(ratios)} cases, target {target:.2f}: "
                         f"{verdict}")
    return lines


def markdown_document(report: BiasReport) -> str:
    """The results file: header (command, date, versions, peers, shapes, targets), the verdicts,
    a table per pass, the footnotes."""
    device = report.environment.get("device", "")
    title = f"cuflash with attention sinks, ALiBi and dropout, gpt-oss's shapes, {device}".rstrip(", ")
    peers = [p for p in DESCRIPTIONS if any(m.impl == p for m in report.measurements)]
    parts = [document_header(title, report.environment, report.command).rstrip("\n")]
    if peers:
        parts.append("Peers, timed in the same run: " + "; ".join(f"{p}: {DESCRIPTIONS[p]}" for p in peers) + ".")
    parts.append(
        f"Shapes: {HEADS} query heads, {HEADS_KV} KV heads, head_dim {HEAD_DIM}, bf16, causal; batch 1 for the "
        f"forward and backward, over all earlier keys or in a sliding window of {WINDOW[0]} keys (window="
        f"{WINDOW}). cuflash+sinks: sinks float32 ({HEADS},), random normal; cuflash+alibi: float32 slopes "
        f"2^(-8(h+1)/{HEADS}); cuflash+dropout: cuflash.torch.attention with dropout_p={DROPOUT_P}, its seed and "
        f"offset drawn from torch's generator. Times are medians over rotated input sets, compilation excluded. Decode steps are "
        f"timed as {report.decode_timing}; forward and backward calls are launched back to back, as the fwd and "
        f"bwd modes time them, so that where a call's kernels take less than its host cost (the window at short "
        f"lengths) the host cost is timed, and cuflash checks a call with sinks or ALiBi in full each time.")
    target_text = "; ".join(f"{bias} within {', '.join(f'{(t - 1) * 100:.0f}% {m}' for m, t in targets.items())}"
                            for bias, targets in TARGETS.items())
    parts.append(f"Targets, cuflash with the bias or dropout over cuflash without (the ratio columns): {target_text}; "
                 f"a ratio over its target is marked (over).")
    lines = verdicts(report)
    if lines:
        parts.append("\n".join(lines))
    for mode in MODES:
        if _cases(report, mode):
            parts.append(markdown_table(report, mode).rstrip("\n"))
    notes = _footnotes(report)
    if notes:
        # A note per line (a trailing double space breaks the line in Markdown), its own lines joined.
        lines = [f"[{n}] {' '.join(text.split())}  " for text, n in notes.items()]
        parts.append("Notes:\n\n" + "\n".join(lines).rstrip())
    return "\n\n".join(parts) + "\n"


def report_json(report: BiasReport) -> str:
    def entry(m: BiasMeasurement) -> dict:
        c = m.case
        bias = m.impl.removeprefix("cuflash+") if m.impl.startswith("cuflash+") else None
        return {"impl": m.impl, "mode": c.mode, "seqlen": c.seqlen, "batch": c.batch, "window": list(c.window),
                "ms": m.ms, "ratio_to_cuflash": report.ratio(bias, c) if bias else None, "note": m.note}

    return json.dumps({
        "command": report.command,
        "environment": report.environment,
        "shapes": {"heads": HEADS, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtype": "bfloat16", "causal": True},
        "decode_timing": report.decode_timing,
        "targets": TARGETS,
        "measurements": [entry(m) for m in report.measurements],
    }, indent=1)


def write_outputs(report: BiasReport, out_dir: Path) -> list[str]:
    """Writes ``<gpu>-bias.md`` and ``.json``; returns the message to print."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{gpu_slug(report.environment.get('device', ''))}-bias"
    (out_dir / f"{stem}.md").write_text(markdown_document(report))
    (out_dir / f"{stem}.json").write_text(report_json(report))
    return [f"wrote {out_dir / (stem + '.md')}, {out_dir / (stem + '.json')}"]


# ----------------------------------------------------------------------------- the calls (torch)


def hidden_keys(seqlen: int, windowed: bool, device="cuda"):
    """Bool (seqlen, seqlen): True where query i does not see key j (j > i, or with the window
    j < i - WINDOW[0]), cuflash's causal mask and window on a square attention."""
    import torch

    i = torch.arange(seqlen, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    hidden = j > i
    return hidden | (j < i - WINDOW[0]) if windowed else hidden


def eager_sinks_attention(q, k, v, sinks, hidden):
    """gpt-oss's attention with sinks in torch, BSHD in and out: scores = q·kᵀ·scale, the hidden
    keys masked, the sink as a last score column, softmax in float32, the column dropped, ·v.
    KV heads are repeated for their query heads. Each intermediate is released once the next is
    made, so that at most two float32 score matrices are alive."""
    import torch

    group = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)).float()
    scores.mul_(q.shape[-1] ** -0.5).masked_fill_(hidden, float("-inf"))
    column = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    scores = torch.cat([scores, column], dim=-1)
    scores = torch.softmax(scores, dim=-1)
    return torch.matmul(scores[..., :-1].to(v.dtype), v).transpose(1, 2)


def bias_arguments(impl: str, sinks, slopes) -> dict:
    """The keyword arguments that make a cuflash call ``impl``'s (one of CUFLASH_IMPLS)."""
    return {"cuflash": {}, "cuflash+sinks": {"sinks": sinks}, "cuflash+alibi": {"alibi_slopes": slopes}}[impl]


@dataclass
class Inputs:
    """One input set of a forward or backward case, torch tensors: q, k, v BSHD, the upstream
    gradient (backward only), the sinks and the ALiBi slopes."""
    q: object
    k: object
    v: object
    dout: object
    sinks: object
    slopes: object


def set_bytes(case: BiasCase) -> int:
    """Bytes one forward or backward call reads and writes in bf16: q, k, v and out; the backward
    (and a train step) also dout, dq, dk and dv."""
    per_token = (HEADS + HEADS_KV) * HEAD_DIM * 2
    return case.batch * case.seqlen * per_token * (2 if case.mode == "fwd" else 4)


def make_inputs(case: BiasCase, seed: int, device="cuda") -> Inputs:
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    q = normal(case.batch, case.seqlen, HEADS, HEAD_DIM)
    k, v = (normal(case.batch, case.seqlen, HEADS_KV, HEAD_DIM) for _ in range(2))
    dout = normal(*q.shape) if case.mode in ("bwd", "train") else None
    slopes = torch.tensor(alibi_slopes(), dtype=torch.float32, device=device)
    return Inputs(q, k, v, dout, normal(HEADS, dtype=torch.float32), slopes)


def _sdpa(backend_name: str) -> Callable:
    """SDPA under one backend, causal, GQA, on (batch, heads, seqlen, head_dim) tensors."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def forward_call(impl: str, case: BiasCase, s: Inputs, device="cuda") -> Callable[[], object]:
    """One timed forward call of ``impl`` on input set ``s``; what it needs besides (SDPA's
    (batch, heads, seqlen, head_dim) views, the eager formula's mask) is made here, untimed."""
    import cuflash

    if impl in CUFLASH_IMPLS:
        bias = bias_arguments(impl, s.sinks, s.slopes)
        return lambda: cuflash.attention(s.q, s.k, s.v, causal=True, window=case.window, **bias)
    if impl in SDPA_BACKENDS:
        run = _sdpa(SDPA_BACKENDS[impl])
        q, k, v = (x.transpose(1, 2) for x in (s.q, s.k, s.v))
        return lambda: run(q, k, v)
    hidden = hidden_keys(case.seqlen, case.windowed, device)
    return lambda: eager_sinks_attention(s.q, s.k, s.v, s.sinks, hidden)


def backward_call(impl: str, case: BiasCase, s: Inputs, device="cuda") -> Callable[[], object]:
    """One timed backward call of ``impl`` on input set ``s``: the forward runs here, once. cuflash:
    attention_backward given out and lse (and the same bias); the peers: autograd from the output
    (their graph retained, so that the call can repeat)."""
    import torch

    import cuflash

    if impl in CUFLASH_IMPLS:
        bias = bias_arguments(impl, s.sinks, s.slopes)
        out, lse = cuflash.attention(s.q, s.k, s.v, causal=True, window=case.window, return_lse=True, **bias)
        return lambda: cuflash.attention_backward(s.dout, s.q, s.k, s.v, out, lse, causal=True, window=case.window,
                                                  **bias)
    if impl in SDPA_BACKENDS:
        run = _sdpa(SDPA_BACKENDS[impl])
        leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (s.q, s.k, s.v)]
        out, grad_out = run(*leaves), s.dout.transpose(1, 2)
    else:
        leaves = [x.detach().requires_grad_() for x in (s.q, s.k, s.v, s.sinks)]
        out, grad_out = eager_sinks_attention(*leaves, hidden_keys(case.seqlen, case.windowed, device)), s.dout
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def train_call(impl: str, case: BiasCase, s: Inputs) -> Callable[[], object]:
    """One timed training step's attention of ``impl`` (one of TRAIN_IMPLS) on input set ``s``: the
    forward and, through autograd, the backward to q, k and v."""
    import torch

    import cuflash.torch as cuflash_torch

    dropout_p = DROPOUT_P if impl.endswith("+dropout") else 0.0
    if impl.startswith("cuflash"):
        leaves = [x.detach().requires_grad_() for x in (s.q, s.k, s.v)]
        grad_out = s.dout

        def forward():
            return cuflash_torch.attention(*leaves, causal=True, dropout_p=dropout_p)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (s.q, s.k, s.v)]
        grad_out = s.dout.transpose(1, 2)

        def forward():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(*leaves, dropout_p=dropout_p, is_causal=True,
                                                                        enable_gqa=True)
    return lambda: torch.autograd.grad(forward(), leaves, grad_out)


def decode_call(impl: str, case: BiasCase, seed: int, device="cuda") -> Callable[[], object]:
    """One decoding step of a cuflash implementation: a query token and its k, v per sequence,
    appended to a contiguous bf16 cache at context - 1 and attended causally over the context.
    Torch tensors, so that cuflash launches on torch's stream (which a CUDA graph captures)."""
    import torch

    import cuflash

    shape = case.decode_shape()
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*dims, dtype=torch.bfloat16):
        return torch.randn(dims, generator=generator, device=device, dtype=dtype)

    q = normal(shape.batch, 1, HEADS, HEAD_DIM)
    k, v = (normal(shape.batch, 1, HEADS_KV, HEAD_DIM) for _ in range(2))
    k_cache, v_cache = (normal(shape.batch, shape.context, HEADS_KV, HEAD_DIM) for _ in range(2))
    lengths = torch.full((shape.batch,), shape.context - 1, dtype=torch.int32, device=device)
    bias = bias_arguments(impl, normal(HEADS, dtype=torch.float32),
                          torch.tensor(alibi_slopes(), dtype=torch.float32, device=device))
    return lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                                  **bias)


# ----------------------------------------------------------------------------- measuring


def _timed_ms(impl: str, case: BiasCase, repeats: int, decode_timing: str, timer: Callable, device) -> float:
    """Median ms of ``impl`` on ``case``, its inputs rotated over 3x the L2 cache."""
    if case.mode == "decode":
        if impl in SDPA_BACKENDS:  # bench/decode.py's peer, over a contiguous cache of the context
            return bench_decode.measure(bench_decode.DecodeCase(impl, case.decode_shape()), "bfloat16", repeats,
                                        decode_timing)
        count = copies_to_defeat_l2(bench_decode.DecodeCase("cuflash", case.decode_shape()).bytes_read())
        return timer([decode_call(impl, case, 16 * i, device) for i in range(count)], repeats, decode_timing)
    sets = [make_inputs(case, 8 * i, device) for i in range(copies_to_defeat_l2(set_bytes(case)))]
    if case.mode == "train":
        calls = [train_call(impl, case, s) for s in sets]
    else:
        build = forward_call if case.mode == "fwd" else backward_call
        calls = [build(impl, case, s, device) for s in sets]
    return timer(calls, EAGER_REPEATS if impl == EAGER else repeats, bench_decode.TIMING_EAGER)


def _failure(error: Exception, caught) -> str:
    """A footnote for a call that raised: the error, and the first warnings torch gave with it (SDPA
    says there why a backend refused), on one line."""
    text = "; ".join([f"{type(error).__name__}: {error}", *(str(w.message) for w in caught[:2])])
    return " ".join(text.split())[:300]


def release_memory() -> None:
    """Give the GPU memory of the last implementation's inputs back (the next one's may need it all):
    torch's cache, and CuPy's pool (bench/decode.py's peers allocate there)."""
    import gc

    import cupy as cp
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()


def measure_case(case: BiasCase, repeats: int = 10, decode_timing: str = bench_decode.TIMING_GRAPH,
                 timer: Callable = bench_decode.time_calls, device="cuda", progress=None) -> list[BiasMeasurement]:
    """Every implementation of IMPLS[case.mode] on ``case``: its median ms, or None and why (skipped
    by skip_reason, or it raised: a peer that refuses a case is reported, not fatal)."""
    found = []
    for impl in IMPLS[case.mode]:
        if progress is not None:
            print(f"\r{case.mode:<6} {case.mask:<17} batch {case.batch:<3} {case.seqlen:>6} tokens  {impl:<20}",
                  end="", file=progress, flush=True)
        reason = skip_reason(impl, case)
        if reason is not None:
            found.append(BiasMeasurement(impl, case, None, reason))
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                found.append(BiasMeasurement(impl, case, _timed_ms(impl, case, repeats, decode_timing, timer, device)))
            except Exception as error:
                found.append(BiasMeasurement(impl, case, None, _failure(error, caught)))
        if device != "cpu":
            release_memory()
    return found


def run_sweep(cases: list[BiasCase], repeats: int = 10, command: str = "", eager: bool = False,
              progress=sys.stderr) -> BiasReport:
    """Every case of ``cases`` on the GPU (torch with CUDA required); decode steps as CUDA graph
    replays, or launched back to back with ``eager``."""
    from cuflash.bench.attention import environment

    timing = bench_decode.TIMING_EAGER if eager else bench_decode.TIMING_GRAPH
    report = BiasReport([], environment(), command, timing)
    for case in cases:
        report.measurements += measure_case(case, repeats, timing, progress=progress)
    print(file=progress)
    return report
