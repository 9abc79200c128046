"""Softcap and sliding windows against the one peer on our GPU that has both: torch's
flex_attention (compiled by torch.compile with Triton). bf16, head_dim 128 and 16 heads (or
--head-dim d and 2048 / d heads), batch 1 x 16k tokens, forward and backward, in TFLOP/s of useful
FLOPs, and each library's window ratio: its window time over its own full attention's, against the
FLOPs share (cuflash's target is at most 1.2x), and its softcap cost against its own causal
call without one.

    PYTHONPATH=. python benchmarks/flex_peers.py [--head-dim 64]

Counting and timing as varlen_window.py (b): each call runs alone for half a second before it is
timed. flex_attention takes a block mask (128 x 128 blocks, the ones a mask leaves empty skipped)
and a score_mod for the softcap. Without a GPU, or without flex_attention, it says so and exits 0.
"""

from __future__ import annotations

import argparse

from cuflash.bench.timing import tflops

from gpu_check import skipped_without_gpu
from varlen_window import DIM, DTYPE, HEADS, flops, pair_count, settled_ms

SEQLEN = 16384
SOFTCAP = 30.0
# (name, causal, window, softcap)
CASES = (
    ("full", False, (-1, -1), 0.0),
    ("causal", True, (-1, -1), 0.0),
    ("causal softcap 30", True, (-1, -1), SOFTCAP),
    ("window (1024, 1024)", False, (1024, 1024), 0.0),
    ("causal window (1024, 0)", True, (1024, 0), 0.0),
)


def cuflash_calls(q, k, v, dout, causal, window, softcap):
    """(forward, backward) of cuflash on CuPy (batch, seqlen, heads, dim) inputs."""
    import cuflash

    options = dict(causal=causal, window=window, softcap=softcap)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    return (lambda: cuflash.attention(q, k, v, **options),
            lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **options))


def flex_calls(q, k, v, dout, causal, window, softcap):
    """(forward, backward) of torch's compiled flex_attention on the same inputs as (batch, heads,
    seqlen, dim) tensors; the backward is autograd's over one retained forward graph."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    left, right = window
    conditions = []  # flash-attn's window semantics, causal folded in as right = 0
    if causal:
        conditions.append(lambda q_idx, kv_idx: kv_idx <= q_idx)
    if left >= 0:
        conditions.append(lambda q_idx, kv_idx: q_idx - kv_idx <= left)
    if right >= 0 and not causal:
        conditions.append(lambda q_idx, kv_idx: kv_idx - q_idx <= right)

    def visible(b, h, q_idx, kv_idx):
        keep = conditions[0](q_idx, kv_idx)
        for condition in conditions[1:]:
            keep = keep & condition(q_idx, kv_idx)
        return keep

    block_mask = create_block_mask(visible, None, None, SEQLEN, SEQLEN, device="cuda") if conditions else None
    score_mod = (lambda score, b, h, q_idx, kv_idx: softcap * torch.tanh(score / softcap)) if softcap else None
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v, dout = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v, dout))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = compiled(*leaves, score_mod=score_mod, block_mask=block_mask)
    return (lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask),
            lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=DIM)
    head_dim = parser.parse_args().head_dim
    heads = HEADS * DIM // head_dim
    if skipped_without_gpu("flex_peers"):
        return
    try:
        import torch.nn.attention.flex_attention
    except ImportError as error:
        print(f"flex_peers: skipped, torch's flex_attention is not available ({error})")
        return
    import cupy as cp

    from cuflash.bench.attention import random_normal

    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, torch {torch.__version__}")
    # Every case compiles flex_attention twice (with and without grad): past dynamo's default
    # limit of 8 recompiles it would fall back to the eager kernel that materialises the scores.
    torch._dynamo.config.recompile_limit = 64
    q, k, v, dout = (random_normal((1, SEQLEN, heads, head_dim), DTYPE, seed=s) for s in range(4))
    times = {}  # (library, case, mode) -> ms
    for name, causal, window, softcap in CASES:
        for library, calls in (("cuflash", cuflash_calls), ("flex", flex_calls)):
            try:
                forward, backward = calls(q, k, v, dout, causal, window, softcap)
                times[library, name, "fwd"] = settled_ms(forward)
                times[library, name, "bwd"] = settled_ms(backward)
            except Exception as error:  # a peer that cannot run a case is reported, not fatal
                print(f"  {library} {name}: failed ({type(error).__name__}: {str(error)[:200]})")

    print(f"\nTFLOP/s (useful FLOPs), seqlen {SEQLEN}, {heads} heads, head_dim {head_dim}, {DTYPE}")
    print(f"{'case':<26} {'cuflash fwd':>12} {'flex fwd':>10} {'cuflash bwd':>12} {'flex bwd':>10}")
    for name, causal, window, _ in CASES:
        pairs = pair_count(SEQLEN, SEQLEN, causal, window)
        cells = []
        for mode in ("fwd", "bwd"):
            for library in ("cuflash", "flex"):
                t = times.get((library, name, mode))
                cells.append(f"{tflops(flops(pairs, mode, heads, head_dim), t):.1f}" if t else "n/a")
        print(f"{name:<26} {cells[0]:>12} {cells[1]:>10} {cells[2]:>12} {cells[3]:>10}")

    print("\nwindow time / full time against the FLOPs share, and the softcap's cost")
    for library in ("cuflash", "flex"):
        for mode in ("fwd", "bwd"):
            parts = []
            for name, full, causal, window in (("window (1024, 1024)", "full", False, (1024, 1024)),
                                               ("causal window (1024, 0)", "causal", True, (1024, 0))):
                t, base = times.get((library, name, mode)), times.get((library, full, mode))
                if t and base:
                    share = pair_count(SEQLEN, SEQLEN, causal, window) / pair_count(SEQLEN, SEQLEN, causal)
                    parts.append(f"{name} {t / base / share:.2f}")
            capped, plain = times.get((library, "causal softcap 30", mode)), times.get((library, "causal", mode))
            if capped and plain:
                parts.append(f"softcap 30 {capped / plain:.2f}x causal")
            print(f"  {library:<8} {mode}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
