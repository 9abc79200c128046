"""cuflash forward next to its peers, in one run: TFLOP/s on DESIGN.md's standard shapes.

Peers: torch SDPA with the FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION backends, and
naive CuPy attention (S and P materialised). bf16, batch * seqlen = 16384, heads * head_dim =
2048. Run on a GPU machine:  PYTHONPATH=. python benchmarks/compare.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform

import cupy as cp
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from cuflash import dispatch
from cuflash.baseline import standard_attention
from cuflash.reference import attention_flops
from cuflash.timing import copies_to_defeat_l2, format_table, time_ms, tflops

TOTAL_TOKENS = 16384
HIDDEN = 2048


def _inputs(batch, seqlen, heads, head_dim, count):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [
        tuple(torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _ in range(3))
        for _ in range(count)
    ]


def _sdpa(backend, causal):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    parser.add_argument("--naive", action="store_true", help="also time naive CuPy attention")
    parser.add_argument("--tile", type=int, nargs=3, metavar=("BLOCK_M", "BLOCK_N", "WARPS"),
                        help="override cuflash's tile table (tuning)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    args = parser.parse_args()
    if args.tile:
        tile = dispatch.Tile(*args.tile)
        for bucket in dispatch.HEAD_DIM_BUCKETS:
            dispatch.SM80_FWD_TILES[bucket] = tile

    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    peers = {"SDPA flash (FA2)": SDPBackend.FLASH_ATTENTION, "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}
    header = ["head_dim", "causal", "seqlen", "cuflash", *peers] + (["naive CuPy"] if args.naive else []) + \
             [f"cuflash / {name}" for name in peers]
    rows = []
    for head_dim in args.head_dims:
        heads = HIDDEN // head_dim
        for causal in causals:
            for seqlen in args.seqlens:
                batch = max(1, TOTAL_TOKENS // seqlen)
                count = copies_to_defeat_l2(3 * batch * seqlen * heads * head_dim * 2)
                sets = _inputs(batch, seqlen, heads, head_dim, count)
                flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
                results = {"cuflash": tflops(flops, time_ms(lambda i: cuflash.attention(*sets[i], causal=causal), count))}
                for name, backend in peers.items():
                    run = _sdpa(backend, causal)
                    try:
                        results[name] = tflops(flops, time_ms(lambda i: run(*sets[i]), count))
                    except RuntimeError as error:
                        results[name] = float("nan")
                        print(f"{name} failed at d={head_dim} s={seqlen}: {error}")
                if args.naive:
                    results["naive"] = tflops(flops, time_ms(lambda i: standard_attention(*(cp.from_dlpack(x) for x in sets[i]), causal), count, repeats=5))
                row = [head_dim, "yes" if causal else "no", seqlen, results["cuflash"],
                       *(results[name] for name in peers)] + ([results["naive"]] if args.naive else []) + \
                      [f"{results['cuflash'] / results[name]:.2f}" for name in peers]
                rows.append(row)
                print(" ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in row), flush=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    title = (f"Forward TFLOP/s, bf16, batch*seqlen={TOTAL_TOKENS}, heads*head_dim={HIDDEN}. "
             f"{datetime.date.today()}, {props['name'].decode()}, driver {cp.cuda.runtime.driverGetVersion()}, "
             f"CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, CuPy {cp.__version__}, torch {torch.__version__}, "
             f"cuDNN {torch.backends.cudnn.version()}, Python {platform.python_version()}")
    table = title + "\n\n" + format_table(header, rows)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
