"""The floor under the window bar (at most 1.2x the FLOPs share): what a query tile's short walk
over keys costs each library, with no mask and no band edge at all.

A 1024-key window over 16k tokens gives every 128-row query tile of the forward a walk of about
1024 + 128 + 1024 = 2,176 keys ((1024, 1024)) or 1024 + 128 = 1,152 keys (causal (1024, 0)), and
every 128-key block of the backward a walk of as many queries. A dense attention of that shape
(16k queries by 2,176 keys for the forward, 2,176 queries by 16k keys for the backward, unmasked)
does the same walks with none of a window's extra costs: no mask, no half-used edge blocks. Its
rate against the same library's full 16k x 16k attention is therefore a bound on how close any
kernel of that library's design can bring a window to its FLOPs-proportional share: a window
costs at least walk_penalty x (keys walked / keys used) of its share. The script times that for
cuflash (its default kernel, and its window kernel on the same dense shape), torch SDPA's cuDNN
and FlashAttention-2 backends, and cuflash's windows themselves, all settled (varlen_window.py).

    PYTHONPATH=. python tools/walk_floor.py

bf16, head_dim 128, 16 heads, batch 1, as varlen_window.py's table. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

from cuflash.bench.timing import tflops

from gpu_check import skipped_without_gpu
from varlen_window import BACKWARD_FLOPS, DIM, DTYPE, HEADS, flops, pair_count, settled_ms

SEQLEN = 16384
WINDOWS = ((False, (1024, 1024)), (True, (1024, 0)))  # (causal, window); causal folds in right = 0
TILE_ROWS = (128, 64)  # query rows per forward tile (keys per backward block) the walks assume


def window_walks(window: tuple[int, int]) -> list[int]:
    """Keys a forward tile of each TILE_ROWS size walks under ``window`` (queries a backward
    block walks), away from the sequence's ends."""
    return [rows + window[0] + window[1] for rows in TILE_ROWS]


# Walk lengths: full attention, 8k and 4k walks, then the windows' walks.
WALKS = (SEQLEN, 8320, 4224, *sorted({walk for _, window in WINDOWS for walk in window_walks(window)}, reverse=True))


def dense_shape(walk: int, mode: str) -> tuple[int, int]:
    """(seqlen_q, seqlen_k) of the dense problem whose tiles walk ``walk`` keys (forward: query
    tiles over keys) or queries (backward: key blocks over queries)."""
    return (SEQLEN, walk) if mode == "fwd" else (walk, SEQLEN)


def near_full_window(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A window that keeps the mask kernel (dispatch.make_mask would turn a window that bounds no
    row into the unmasked kernel) but hides one key from one row: the window kernel's own cost on
    the dense shape."""
    return (-1, seqlen_q - 2) if seqlen_q > seqlen_k else (seqlen_k - 2, -1)


def cuflash_call(mode, q, k, v, dout, **options):
    """One timed call of cuflash: the forward, or the backward after one untimed forward."""
    import cuflash

    if mode == "fwd":
        return lambda: cuflash.attention(q, k, v, **options)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **options)


def sdpa_call(name, mode, q, k, v, dout):
    """One timed call of the torch SDPA backend ``name`` (bench.py's peers, called as there)."""
    from cuflash.bench import attention as bench

    if mode == "fwd":
        run = bench.implementations([name])[name]
        return lambda: run(q, k, v, False)
    return bench.gradient_call(name, bench.Case("bfloat16", DIM, q.shape[1], False, mode), q, k, v, dout)


LIBRARIES = {
    "cuflash": lambda mode, q, k, v, dout: cuflash_call(mode, q, k, v, dout),
    "cuflash window kernel": lambda mode, q, k, v, dout: cuflash_call(
        mode, q, k, v, dout, window=near_full_window(q.shape[1], k.shape[1])),
    "SDPA cuDNN": lambda *args: sdpa_call("sdpa-cudnn", *args),
    "SDPA FA2": lambda *args: sdpa_call("sdpa-flash", *args),
}
# Whose full attention a library's walks are measured against (the window kernel has no full 16k
# row of its own: that is cuflash's default kernel).
FULL_ATTENTION_OF = {"cuflash window kernel": "cuflash"}


def penalty(rates: dict, library: str, walk: int) -> float | None:
    """The full 16k rate over ``library``'s rate on ``walk``-long walks."""
    full, rate = rates.get((FULL_ATTENTION_OF.get(library, library), SEQLEN)), rates.get((library, walk))
    return full / rate if full and rate else None


def main() -> None:
    if skipped_without_gpu("walk_floor"):
        return
    import cupy as cp
    import torch

    from cuflash.bench.attention import random_normal

    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}; bf16, d{DIM}, {HEADS} heads, batch 1, settled timing")
    for mode in ("fwd", "bwd"):
        flop_factor = BACKWARD_FLOPS if mode == "bwd" else 1.0
        rates = {}  # (library, walk) -> TFLOP/s
        for walk in WALKS:
            seqlen_q, seqlen_k = dense_shape(walk, mode)
            q, dout = (random_normal((1, seqlen_q, HEADS, DIM), DTYPE, seed=s) for s in (0, 3))
            k, v = (random_normal((1, seqlen_k, HEADS, DIM), DTYPE, seed=s) for s in (1, 2))
            useful = 4.0 * HEADS * DIM * seqlen_q * seqlen_k * flop_factor
            for library, make in LIBRARIES.items():
                if library in FULL_ATTENTION_OF and walk == SEQLEN:
                    continue
                try:
                    rates[library, walk] = tflops(useful, settled_ms(make(mode, q, k, v, dout)))
                except Exception as error:  # a peer that cannot run a shape is reported, not fatal
                    print(f"  {library} {mode} walk {walk}: failed ({type(error).__name__}: {str(error)[:160]})")
        print(f"\n{mode}: dense walks, TFLOP/s (walk penalty: the library's full 16k rate over this one)")
        print(f"| walk | {' | '.join(LIBRARIES)} |\n|---|{'---|' * len(LIBRARIES)}")
        for walk in WALKS:
            cells = []
            for library in LIBRARIES:
                factor = penalty(rates, library, walk)
                cells.append(f"{rates[library, walk]:.1f} ({factor:.2f})" if factor else "n/a")
            print(f"| {walk} | {' | '.join(cells)} |")

        q, k, v, dout = (random_normal((1, SEQLEN, HEADS, DIM), DTYPE, seed=s) for s in range(4))
        print(f"\n{mode}: cuflash's windows, and the floor under each (walk penalty x keys walked / keys used)")
        for causal, window in WINDOWS:
            full = settled_ms(cuflash_call(mode, q, k, v, dout, causal=causal))
            t = settled_ms(cuflash_call(mode, q, k, v, dout, causal=causal, window=window))
            pairs = pair_count(SEQLEN, SEQLEN, causal, window)
            ratio = t / full / (pairs / pair_count(SEQLEN, SEQLEN, causal))
            rate = tflops(flops(pairs, mode), t)
            print(f"  causal={causal} window {window}: ratio/share {ratio:.2f} ({rate:.1f} TFLOP/s)")
            for walk in window_walks(window):
                walked = walk / (window[0] + window[1] + 1)  # inside the sequence, away from its ends
                floors = [f"{library} {factor * walked:.2f}" for library in LIBRARIES
                          if (factor := penalty(rates, library, walk))]
                print(f"    floor on {walk}-key walks: {', '.join(floors)}")


if __name__ == "__main__":
    main()
