"""All launch policy: device -> family, head_dim -> bucket, the tile tables, and for one call the
kernels, grid, persistence and dQ order, answered from one ``Mask``.

Like vLLM's choice between FlashAttention versions, the family follows the compute capability:
9.x runs ``sm90``, other devices from 8.0 up run ``sm80``; anything older than 8.0 is refused.
``CUFLASH_FAMILY=sm80|sm90|auto`` overrides the choice. The sm90 family has forward kernels for
every head-dim bucket (forward_launch still runs sm80's for tensors that no tensor map can
describe, and the ``KernelChoice`` names the family that runs). So does its backward main
kernel (backward_kernel_dims); the preprocess and convert kernels that run around either family's
(generic/flash_bwd_helpers.cu) are built for the sm80 target on every device.
FP8 (e4m3) inputs run each family's forward: sm90's multiplies them in e4m3 (wgmma), sm80's
stages the bytes and widens them to the 16-bit output type in shared memory (half the bytes of a
bf16 call read, bf16's tensor-core rate); sm80's also serves sm90 devices where no tensor map can
describe a tensor. FP8 has no backward.
Everything that shapes generated code (family, head-dim bucket, tiles, causal, dtype) is in the
``KernelChoice``; shapes, strides and lengths are run-time arguments.

Words used below:

* persistent grid: one CTA per SM that walks the forward's query tiles round robin, instead of
  one CTA per tile.
* unequal tiles: query tiles whose key ranges differ in length (a causal mask, a one-sided
  window, a packed batch), which a static round robin cannot balance.
* walk: the backward's CTAs each take a fixed share of a head's key blocks, in order, adding dQ
  into a split of their own; the splits are summed in order, so the result repeats bitwise.
* turns: the backward's key blocks add their dQ terms to a query block one after the other,
  waited for through a counter per (batch, head, query block); also bitwise repeatable.
* short: sequences of at most SM90_SHORT_ROWS query rows, where some tile choices differ.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

from cuflash._core.params import tma_ready

__all__ = [
    "FAMILIES",
    "FP8_TYPES",
    "HEAD_DIM_BUCKETS",
    "MASKS",
    "BackwardLaunch",
    "ForwardLaunch",
    "KernelChoice",
    "Mask",
    "Tile",
    "all_kernels",
    "backward_kernels",
    "backward_launch",
    "device_target",
    "forward_choice",
    "forward_kernel",
    "forward_launch",
    "helper_grid",
    "kvcache_prefill",
    "kvcache_prefill_grid",
    "kvcache_prefill_kernel",
    "quantize_kernel",
    "head_dim_bucket",
    "make_mask",
    "mla_kernel",
    "mla_narrow_kernels",
    "mla_narrow_rows",
    "mla_narrow_smem_bytes",
    "mla_tma",
    "mla_tma_kernels",
    "mla_splits",
    "select_family",
]

FAMILIES = ("sm80", "sm90")
HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
ELEMENT_TYPES = {"float16": "cuflash::f16", "bfloat16": "cuflash::bf16"}
# FP8 input dtypes (the DeviceTensor names) and their kernel input types; their products and output
# run in one of ELEMENT_TYPES (the output dtype).
FP8_TYPES = {"float8_e4m3fn": "cuflash::e4m3"}
# Forward masks (cuda_src/common/mask.cuh): every key, the causal diagonal, or a window whose
# bounds are run-time arguments (causal folded in as right = 0), which serves any mask.
MASKS = ("none", "causal", "window")
# How the backward's key blocks add their dQ terms (cuda_src/sm90/flash_bwd.cu; the index is sm90's
# DQ_ORDER): in any order (atomic reductions), walking the ordered grid (per-CTA splits added in
# order), or taking turns per query block (sm90 only). The last two repeat bitwise.
DQ_ORDERS = ("any", "walk", "turns")


def _mask_flags(mask: str, softcap_in_window: bool) -> tuple[bool, bool]:
    """The CAUSAL and WINDOW template flags of the kernels for ``mask``; ``softcap_in_window``: a
    softcap runs every mask in the window kernel, from the run-time bounds. So run sm80's forward
    (one instantiation instead of three) and every backward: sm90's causal backward kernel with
    softcap is slower than the window kernel (docs/kernels.md, softcap). sm90's forward caps scores
    in each mask's own kernel, where causal keeps its grid order and unmasked steps (key blocks
    that no row's mask cuts, which skip the per-element mask), and d64 its third consumer
    (forward_kernel)."""
    return mask == "causal" and not softcap_in_window, mask == "window" or softcap_in_window


def dq_orders(family: str, mask: str, softcap: bool) -> tuple[str, ...]:
    """The DQ_ORDERS a family's backward main kernel has for ``mask`` and ``softcap``: sm80 no
    turns, and sm90 walks only in its causal kernel (dq_order takes the walk there for short
    sequences in deterministic mode, and nowhere else)."""
    if family != "sm90":
        return DQ_ORDERS[:2]
    return DQ_ORDERS if _mask_flags(mask, softcap)[0] else ("any", "turns")


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per CTA
    block_n: int  # keys per main-loop step
    warps: int
    ctas_per_sm: int = 1  # the register budget the compiler gets: 65536 / (ctas_per_sm * warps * 32)
    stages: int = 1  # sm90: depth of the TMA ring of K and V tiles (the backward's: of Q and dO)
    ring_rows: int = 0  # sm90 backward: query rows per stage of that ring (0: block_m)

    @property
    def stage_rows(self) -> int:
        """Query rows per stage of the sm90 backward's Q/dO ring."""
        return self.ring_rows or self.block_m


# sm80 forward tiles per head-dim bucket. Each warp owns block_m / warps query rows; 32 rows
# (two m16 tiles) let every K/V fragment loaded from shared memory feed two mma.sync, which keeps
# ldmatrix traffic under the 128 B/clock shared-memory port. That costs 4 fp32 registers per
# (row, column) of O per thread: affordable up to head_dim 128. Wider heads drop to 16 rows per
# warp with 8 warps, as FlashAttention-2 does, so O stays at 128 registers per thread.
SM80_FWD_TILES = {
    # head_dim 64: O is only 64 registers, so 128 keys per step fit; twice the work per barrier
    # pair and per softmax reduction.
    64: Tile(128, 128, 4),
    96: Tile(128, 64, 4),
    128: Tile(128, 64, 4),
    192: Tile(128, 64, 8),
    256: Tile(128, 64, 8),
}


# sm90 forward tiles (cuda_src/sm90/flash_fwd.cu), per kernel head dim (a bucket rounded up to
# whole 64-column panels: 96 runs the 128 kernel, TMA zero-filling the missing columns): 128 query
# rows per CTA, 64 per consumer warpgroup (one wgmma M each), 12 warps (a producer warpgroup and
# two consumers). 128 keys per step where they fit: S is then 64 fp32 registers per consumer
# thread and O 32 (d64) or 64 (d128), far inside the 240 that setmaxnreg gives the consumers.
# d64 runs three consumers (192 rows, 16 warps, 160 registers each): its softmax costs about as
# much as its two products, so a third warpgroup keeps the tensor cores fed while two compute it.
# d192 and d256 take 64 keys: O is 96 / 128 registers, and two stages of 128-key K and V tiles
# would not fit next to Q in 227 KB. The ring is as deep as shared memory allows. Unmasked calls
# from d128 up take wider key blocks (SM90_WIDE_TILES below).
SM90_FWD_TILES = {
    64: Tile(192, 128, 16, stages=4),  # Q 24 KB + 4 x (K 16 KB + V 16 KB) = 152 KB
    128: Tile(128, 128, 12, stages=2),  # Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB
    192: Tile(128, 64, 12, stages=3),  # Q 48 KB + 3 x (K 24 KB + V 24 KB) = 192 KB
    256: Tile(128, 64, 12, stages=2),  # Q 64 KB + 2 x (K 32 KB + V 32 KB) = 192 KB
}
# d64 with two consumers (128-row tiles) where a third does not pay: softcap in the window kernel,
# whose tanh and bounds push three consumers past their 160 registers (132 B of spills), and for
# causal masks over short sequences (``short``: at most SM90_SHORT_ROWS query rows), where the
# 192-row tiles waste more on the diagonal than the third warpgroup gains.
SM90_NARROW_TILES = {64: Tile(128, 128, 12, stages=4)}
SM90_SHORT_ROWS = 1024
# Unmasked kernels (mask "none", no softcap) at d128, d192 and d256 take wider key blocks: fewer
# main-loop steps, each a longer Q K^T and P V between the same barriers and softmax reductions.
# Two stages of them fit next to Q, three at none. Per consumer thread S is block_n / 2 fp32
# registers, its 16-bit copy for P V block_n / 4 and O head_dim / 2: 196, 168 and 188 of the 240,
# and ptxas spills nothing. d192 takes 96 keys, not 112: at 112 (216 KB) ptxas spills 28 B
# (offsets of the epilogue's stores kept on the stack). Masked
# kernels keep the tiles above: with these ptxas spills 4 B (d128 causal) to 132 B (d256 softcap),
# and with softcap some of it in the main loop. Short d128 calls (``short``) keep 128 keys: there
# the wide tile gains nothing (docs/kernels.md, the sm90 forward).
SM90_WIDE_LONG_ONLY = {128}
SM90_WIDE_TILES = {
    128: Tile(128, 176, 12, stages=2),  # Q 32 KB + 2 x (K 44 KB + V 44 KB) = 208 KB
    192: Tile(128, 96, 12, stages=2),  # Q 48 KB + 2 x (K 36 KB + V 36 KB) = 192 KB
    256: Tile(128, 80, 12, stages=2),  # Q 64 KB + 2 x (K 40 KB + V 40 KB) = 224 KB
}

# sm90 forward tiles of e4m3 inputs (the same kernel, Input = e4m3), chosen like the 16-bit ones
# above. One byte per element halves Q, K and V, and each stage adds V's transpose (block_n x
# head_dim bytes). Key blocks are whole 64-key panels of that transpose. The producer warpgroup
# keeps 56 registers for the transpose, so consumers get 224 (152 with three): per consumer thread
# S is block_n / 2 fp32 registers, P in e4m3 block_n / 8, O head_dim / 2. The ring is as deep as
# shared memory allows beside two Q buffers.
SM90_FP8_FWD_TILES = {
    64: Tile(192, 128, 16, stages=4),  # Q 12 KB + 4 x (K 8 + V 8 + Vt 8 KB) = 108 KB
    128: Tile(128, 128, 12, stages=3),  # Q 16 KB + 3 x (K 16 + V 16 + Vt 16 KB) = 160 KB
    192: Tile(128, 128, 12, stages=2),  # Q 24 KB + 2 x (K 24 + V 24 + Vt 24 KB) = 168 KB
    256: Tile(128, 64, 12, stages=3),  # Q 32 KB + 3 x (K 16 + V 16 + Vt 16 KB) = 176 KB; O is 128 registers
}
SM90_FP8_NARROW_TILES = {64: Tile(128, 128, 12, stages=4)}  # as SM90_NARROW_TILES
# Unmasked: 192 keys at d128 (S 96 + P 24 + O 64 registers of the 224), as the 16-bit wide tiles.
SM90_FP8_WIDE_TILES = {
    128: Tile(128, 192, 12, stages=2),  # Q 16 KB + 2 x (K 24 + V 24 + Vt 24 KB) = 160 KB
}


# Threads per block of the backward's preprocess and convert kernels (generic/flash_bwd_helpers.cu,
# their THREADS), which every family runs around its main kernel.
HELPER_THREADS = 256
HELPERS_SOURCE = "generic/flash_bwd_helpers.cu"


def helper_rows_per_block(head_dim: int) -> int:
    """Rows (of one head) that a block of the backward's preprocess and convert kernels covers:
    one thread per 8 columns, rounded up to a power of two and at least 8 per row, as
    helper_row_threads in generic/flash_bwd_helpers.cu."""
    row_threads = max(8, 1 << (-(-head_dim // 8) - 1).bit_length())
    return HELPER_THREADS // row_threads


@dataclass(frozen=True)
class KernelChoice:
    family: str
    source: str  # relative to cuda_src/
    name_expression: str
    threads: int
    smem_bytes: int  # dynamic shared memory per CTA
    tile: Tile | None = None  # attention kernels' tile; None for the small helper kernels
    # Forward grid: (heads, batch, blocks) with the longest blocks first (causal kernels), else
    # (blocks, heads, batch).
    blocks_slowest: bool = False


def _row_elems(bucket: int) -> int:
    """Shared-memory row pitch of a head-dim bucket: whole 128-byte swizzle groups (smem.cuh)."""
    return -(-bucket // 64) * 64


def head_dim_bucket(head_dim: int) -> int:
    """The smallest bucket that holds ``head_dim`` (a multiple of 8, at most 256)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim: expected at most {HEAD_DIM_BUCKETS[-1]}, got {head_dim}")


def select_family(capability: tuple[int, int], override: str | None = None) -> str:
    """Kernel family for a device of compute capability ``capability`` (major, minor).

    ``override`` (default: the ``CUFLASH_FAMILY`` environment variable) is ``sm80``, ``sm90`` or
    ``auto``. Raises ``RuntimeError`` for devices below 8.0 and ``ValueError`` for an unknown
    override or sm90 on a device that is not 9.x.
    """
    choice = (override if override is not None else os.environ.get("CUFLASH_FAMILY", "auto")).lower()
    if capability < (8, 0):
        raise RuntimeError(
            f"cuflash needs compute capability 8.0 or newer (Ampere, Ada, Hopper); this device "
            f"has {capability[0]}.{capability[1]}"
        )
    if choice == "auto":
        return "sm90" if capability[0] == 9 else "sm80"
    if choice not in FAMILIES:
        raise ValueError(f"CUFLASH_FAMILY: expected sm80, sm90 or auto, got {choice!r}")
    if choice == "sm90" and capability[0] != 9:
        raise ValueError(f"CUFLASH_FAMILY: sm90 kernels need compute capability 9.x, not {capability}")
    return choice


def compile_arch(family: str, capability: tuple[int, int]) -> str:
    """NVRTC target: the device's own SASS (sm80 code runs natively on any newer GPU); sm90a for
    the Hopper family, whose wgmma and setmaxnreg exist only there."""
    return "sm_90a" if family == "sm90" else f"sm_{capability[0]}{capability[1]}"


def _cpp(flag: bool) -> str:
    return "true" if flag else "false"


# Shared memory per CTA on sm90 (227 KB), and what the forward leaves of it for its static
# mbarriers when it chooses its Q buffers.
SM90_SMEM_BYTES = 227 * 1024
SM90_STATIC_SMEM_MARGIN = 1024
# Slack the sm90 kernels take to round their shared-memory window up to the 128-byte swizzle's
# 1024-byte period (kSmemAlignSlack in sm90/tiles.cuh; each kernel static_asserts the sum).
SM90_SMEM_ALIGN_SLACK = 1024


def _sm90_fwd_smem(tile: Tile, kernel_dim: int, q_buffers: int, fp8: bool = False) -> int:
    """Dynamic shared memory of the sm90 forward: ``q_buffers`` Q tiles, the K and V stages (for
    ``fp8``, one byte per element, and the stages of V's transpose) and alignment slack
    (flash_fwd.cu, FwdSmem)."""
    element = 1 if fp8 else 2
    transpose = tile.stages * tile.block_n * kernel_dim if fp8 else 0
    return ((q_buffers * tile.block_m + 2 * tile.stages * tile.block_n) * kernel_dim * element + transpose
            + SM90_SMEM_ALIGN_SLACK)


@functools.lru_cache(maxsize=None)
def forward_kernel(
    family: str, head_dim: int, mask: str, dtype_name: str, softcap: bool = False, tile: Tile | None = None,
    short: bool = False, out_dtype: str | None = None, paged: bool = False, alibi: bool = False,
    dropout: bool = False,
) -> KernelChoice:
    """The ``family`` forward kernel that serves these code-shaping switches: ``mask`` one of
    MASKS, ``softcap`` whether scores are capped (``tile`` overrides the tables, for tuning),
    ``short`` whether the sequences have at most SM90_SHORT_ROWS query rows (sm90's tile choice;
    sm90 also takes wider key blocks without a mask or softcap, SM90_WIDE_TILES). ``dtype_name``
    is the inputs' dtype; an FP8_TYPES one takes ``out_dtype``, float16 or bfloat16, for the
    output (and for sm80's products; sm90 multiplies in e4m3, SM90_FP8_FWD_TILES). ``paged``: the
    sm80 kernel that reads K and V from a KV cache (kvcache_prefill_kernel), 16-bit only.
    ``alibi``: the call has ALiBi slopes, which only window kernels read (make_mask gives such calls
    the window mask), and sm90's causal ones too (forward_choice), of sm90's only those of two
    consumers (flash_fwd.cu): d64 takes its narrow tile; sm90's e4m3 d192 kernel has none
    (forward_choice runs sm80's). ``dropout``: a call with dropout (common/philox.cuh), 16-bit
    only, in the window kernels (of two consumers on sm90) alone.

    Which kernel serves a softcap: _mask_flags.
    """
    if alibi and mask != "window" and not (family == "sm90" and mask == "causal"):
        raise ValueError(f"alibi: ALiBi runs the window kernel (or sm90's causal one), not the {mask!r} one")
    if dropout and (mask != "window" or dtype_name in FP8_TYPES or paged):
        raise ValueError(f"dropout: dropout runs the 16-bit window kernel, not the {mask!r} one for {dtype_name}")
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}")
    bucket = head_dim_bucket(head_dim)
    causal, window = _mask_flags(mask, softcap and family == "sm80")
    fp8 = dtype_name in FP8_TYPES
    if paged and (family != "sm80" or fp8):
        raise ValueError(f"paged: the KV-cache forward is sm80's 16-bit kernel, not {family}'s for {dtype_name}")
    if fp8 and out_dtype not in ELEMENT_TYPES:
        raise ValueError(f"out_dtype: expected one of {tuple(ELEMENT_TYPES)} for {dtype_name} inputs, "
                         f"got {out_dtype!r}")
    # The output's element type, then, for FP8, the input's (flash_fwd.cu's Elem and Input).
    types = f"{ELEMENT_TYPES[out_dtype]}, {FP8_TYPES[dtype_name]}" if fp8 else ELEMENT_TYPES[dtype_name]
    flags = f"{_cpp(causal)}, {_cpp(window)}, {_cpp(softcap)}, {types}"
    if paged:  # Input spelled out before PAGED
        flags += f", {types}, true"
    if family == "sm90":
        kernel_dim = _row_elems(bucket)
        narrow = (softcap and window) or (causal and short) or alibi or dropout
        wide = mask == "none" and not softcap and not (short and kernel_dim in SM90_WIDE_LONG_ONLY)
        tables = ((SM90_FP8_NARROW_TILES, SM90_FP8_WIDE_TILES, SM90_FP8_FWD_TILES) if fp8
                  else (SM90_NARROW_TILES, SM90_WIDE_TILES, SM90_FWD_TILES))
        special = tables[0] if narrow else tables[1] if wide else {}
        tile = tile or special.get(kernel_dim) or tables[2][kernel_dim]
        consumers = tile.block_m // 64  # one 64-row wgmma M per consumer warpgroup, plus the producer's
        assert tile.warps == 4 * (consumers + 1) and not ((alibi or dropout) and consumers != 2)
        if alibi and not sm90_alibi(kernel_dim, fp8):
            raise ValueError(f"alibi: sm90's e4m3 d{kernel_dim} forward has no ALiBi; sm80's runs it")
        # Two Q buffers where they fit, so that a persistent CTA loads the next tile's Q during
        # this one's main loop (flash_fwd.cu).
        fits = _sm90_fwd_smem(tile, kernel_dim, 2, fp8) <= SM90_SMEM_BYTES - SM90_STATIC_SMEM_MARGIN
        q_buffers = 2 if fits else 1
        smem = _sm90_fwd_smem(tile, kernel_dim, q_buffers, fp8)
        expr = (f"cuflash::sm90::flash_fwd_sm90<{kernel_dim}, {consumers}, {tile.block_n}, {tile.stages}, {q_buffers}, "
                f"{smem}, {flags}>")
        return KernelChoice(family, "sm90/flash_fwd.cu", expr, tile.warps * 32, smem, tile, blocks_slowest=causal)
    tile = tile or SM80_FWD_TILES[bucket]
    # Q tile plus one K and one V tile; FP8 also stages K's and V's bytes (flash_fwd.cu).
    row = _row_elems(bucket)
    smem = (tile.block_m + 2 * tile.block_n) * row * 2 + (2 * tile.block_n * row if fp8 else 0)
    expr = f"cuflash::flash_fwd_sm80<{bucket}, {tile.block_m}, {tile.block_n}, {tile.warps}, {smem}, {flags}>"
    return KernelChoice(family, "sm80/flash_fwd.cu", expr, tile.warps * 32, smem, tile, blocks_slowest=causal)


# sm80 backward, per head-dim bucket: BLOCK_N keys per CTA, BLOCK_M query rows per step, 8 warps
# (flash_bwd.cu derives its warp layouts from these). dK and dV stay in registers for the whole
# loop: 32 keys x head_dim / (8 / (BLOCK_N / 32)) columns each per warp, 128 fp32 registers per
# thread at head_dim 128 and 256. 128 keys per CTA halve the Q/dO loads and dQ reductions per
# FLOP against 64; heads wider than 128 drop to 64 keys to fit K, V and two Q/dO buffers in 227 KB.
# head_dim 64 runs two CTAs per SM (97 KB of shared memory each) at 128 registers: S, dP, dK and
# dV alone are 128 fp32 registers, so ~170 B spill, and yet two CTAs beat one at 241 registers:
# the second CTA's warps run while the first waits at its barriers.
SM80_BWD_TILES = {
    64: Tile(64, 128, 8, ctas_per_sm=2),
    96: Tile(64, 128, 8),
    128: Tile(64, 128, 8),
    192: Tile(64, 64, 8),
    256: Tile(64, 64, 8),
}


# sm90 backward main kernel (cuda_src/sm90/flash_bwd.cu), per kernel (head dim of q and k, of v):
# the one with the fewest columns that holds the call's (TMA zero-fills the missing ones). 64
# query rows per step, 12 warps; K, V, the Q/dO ring, two tiles of block_n keys x 64 queries (dS^T,
# or dS^T and P^T) and the fp32 dQ block in shared memory. Up to v's head dim 128, 128 keys per CTA
# (64 per consumer warpgroup); at d256 the consumers split the head dim over 64 keys, and one stage
# is all that fits beside the 65 KB dQ block.
SM90_BWD_TILES = {
    (64, 64): Tile(64, 128, 12, stages=4),  # K 16 + V 16 + 4 x (Q 8 + dO 8) + dS 2 x 16 + dQ 17 = 145 KB
    (128, 128): Tile(64, 128, 12, stages=2),  # K 32 + V 32 + 2 x (Q 16 + dO 16) + dS 2 x 16 + dQ 33 = 193 KB
    (192, 128): Tile(64, 128, 12, stages=3, ring_rows=32),  # K 48 + V 32 + 3 x (Q 12 + dO 8) + dS 2 x 16 + dQ 49 = 221 KB
    (256, 256): Tile(64, 64, 12, stages=1),  # K 32 + V 32 + Q 32 + dO 32 + dS 8 + P 8 + dQ 65 = 209 KB
}


# The sm90 backward's fp32 dQ rows are 4 columns wider than the bucket (kDqRowPad in
# cuda_src/sm90/flash_bwd.cu: bank skew for the block it stages in shared memory). The block is
# part of the shared memory the kernel checks against its template argument, so the compile check
# fails if the two pads differ.
SM90_BWD_DQ_ROW_PAD = 4


def backward_kernel_dims(family: str, head_dim: int, head_dim_v: int | None = None) -> tuple[int, int]:
    """The (q and k, v) head dims the backward main kernel of ``family`` is built for, for q's
    ``head_dim`` and v's ``head_dim_v`` (None: the same): on sm90 the kernel of SM90_BWD_TILES with
    the fewest columns that holds both, on sm80 the bucket of the wider twice (a v head dim of its
    own is a flag there). The fp32 dQ rows are the first wide, plus SM90_BWD_DQ_ROW_PAD on sm90."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if family != "sm90":
        bucket = head_dim_bucket(max(head_dim, head_dim_v))
        return bucket, bucket
    fits = [dims for dims in SM90_BWD_TILES if dims[0] >= head_dim and dims[1] >= head_dim_v]
    return min(fits, key=sum)


@functools.lru_cache(maxsize=None)
def backward_kernels(family: str, head_dim: int, mask: str, dtype_name: str, softcap: bool = False,
                     dq_order: str = "any", tile: Tile | None = None, head_dim_v: int | None = None
                     ) -> tuple[KernelChoice, ...]:
    """(preprocess, main, convert) kernels of the backward pass for q's ``head_dim`` and v's
    ``head_dim_v`` (None: the same; backward_kernel_dims); ``mask`` and ``softcap`` as for
    forward_kernel (softcap runs in the window kernel, _mask_flags), ``dq_order`` one of DQ_ORDERS,
    ``tile`` overrides the table, for tuning. A v head dim other than q's has a kernel of its own on
    sm80 (flash_bwd.cu's OWN_V_DIM); sm90's kernels read both from their argument. Each family has
    its own main kernel between the shared preprocess and convert kernels."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}")
    if dtype_name in FP8_TYPES:
        raise ValueError(f"dtype_name: {dtype_name} inputs have a forward only")
    if dq_order not in dq_orders(family, mask, softcap):
        raise ValueError(f"dq_order: expected one of {dq_orders(family, mask, softcap)} for {family}, mask "
                         f"{mask!r} and softcap {softcap}, got {dq_order!r}")
    kernel_dim, kernel_dim_v = backward_kernel_dims(family, head_dim, head_dim_v)
    own_v_dim = head_dim_v is not None and head_dim_v != head_dim
    elem = ELEMENT_TYPES[dtype_name]
    causal, window = _mask_flags(mask, softcap)
    helpers = tuple(KernelChoice("sm80", HELPERS_SOURCE, f"cuflash::flash_bwd_{step}<{HELPER_THREADS}, {elem}>",
                                 HELPER_THREADS, 0) for step in ("preprocess", "convert"))
    if family == "sm90":
        tile = tile or SM90_BWD_TILES[kernel_dim, kernel_dim_v]
        # K and V (block_n rows), the Q and dO stages (stage_rows each), two tiles of block_n rows of
        # 64 queries, the fp32 dQ block, and the alignment slack.
        smem = (((tile.block_n + tile.stages * tile.stage_rows) * (kernel_dim + kernel_dim_v) + 2 * tile.block_n * 64) * 2
                + tile.block_m * (kernel_dim + SM90_BWD_DQ_ROW_PAD) * 4 + SM90_SMEM_ALIGN_SLACK)
        main = (f"cuflash::sm90::flash_bwd_sm90<{kernel_dim}, {kernel_dim_v}, {tile.stages}, {smem}, {_cpp(causal)}, "
                f"{_cpp(window)}, {_cpp(softcap)}, {DQ_ORDERS.index(dq_order)}, {elem}>")
        # A causal head's key blocks run side by side (flash_bwd.cu), unlike sm80's.
        main_choice = KernelChoice("sm90", "sm90/flash_bwd.cu", main, tile.warps * 32, smem, tile)
        return helpers[0], main_choice, helpers[1]
    tile = tile or SM80_BWD_TILES[kernel_dim]
    # K, V, two buffers each of Q and dO, the P and dS tiles (rows of block_n elements), and two
    # buffers each of the rows' fp32 log-sum-exp and delta.
    smem = (((2 * tile.block_n + 4 * tile.block_m) * _row_elems(kernel_dim) + 2 * tile.block_m * tile.block_n) * 2
            + 4 * tile.block_m * 4)
    main = (f"cuflash::flash_bwd_sm80<{kernel_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, {tile.ctas_per_sm}, "
            f"{smem}, {_cpp(causal)}, {_cpp(window)}, {_cpp(softcap)}, {_cpp(dq_order == 'walk')}, "
            f"{_cpp(own_v_dim)}, {elem}>")
    return (helpers[0], KernelChoice(family, "sm80/flash_bwd.cu", main, tile.warps * 32, smem, tile,
                                     blocks_slowest=causal and dq_order != "walk"), helpers[1])


def all_kernels(family: str) -> list[KernelChoice]:
    """Every instantiation of a family, for the ahead-of-time compile check: its forward and
    backward kernels (sm90's devices also run the shared preprocess and convert kernels, built for
    the sm80 target, and sm80's main backward kernel where no tensor map describes the tensors:
    those are sm80's instantiations). Kernels added later come after the earlier ones, so that the
    lists of older trees pair by position: sm80's backward kernels for a v head dim of its own,
    sm80's KV cache kernels, each family's MLA kernels, then sm90's backward for q/k 192 with v 128,
    its TMA-loaded MLA kernels and its d64 ALiBi forwards."""
    found: dict[str, KernelChoice] = {}
    buckets = SM90_FWD_TILES if family == "sm90" else HEAD_DIM_BUCKETS
    for bucket in buckets:
        for dtype in ELEMENT_TYPES:
            for mask in MASKS:
                for softcap in (False, True):
                    for short in (False, True):  # sm90 picks some tiles by length
                        choice = forward_kernel(family, bucket, mask, dtype, softcap, short=short)
                        found.setdefault(choice.name_expression, choice)
                    for dq_order in dq_orders(family, mask, softcap):
                        for choice in backward_kernels(family, bucket, mask, dtype, softcap, dq_order):
                            if choice.family == family:
                                found.setdefault(choice.name_expression, choice)
    # FP8 after the 16-bit kernels, so that the lists of older trees pair by position.
    for bucket in buckets:
        for out_dtype in ELEMENT_TYPES:
            for mask in MASKS:
                for softcap in (False, True):
                    for short in (False, True):
                        choice = forward_kernel(family, bucket, mask, "float8_e4m3fn", softcap, short=short,
                                                out_dtype=out_dtype)
                        found.setdefault(choice.name_expression, choice)
    # The main backward kernels of (head_dim, head_dim_v) for every dtype, mask, softcap and dQ order.
    def backward_mains(head_dim: int, head_dim_v: int) -> list[KernelChoice]:
        return [backward_kernels(family, head_dim, mask, dtype, softcap, dq_order, head_dim_v=head_dim_v)[1]
                for dtype in ELEMENT_TYPES for mask in MASKS for softcap in (False, True)
                for dq_order in dq_orders(family, mask, softcap)]

    later = []
    if family == "sm80":  # its backward kernels for a v head dim of its own, then the KV cache ones
        later += [choice for bucket in buckets for choice in backward_mains(bucket, bucket // 2)]
        later += kvcache_all_kernels()
    later += mla_all_kernels(family)
    if family == "sm90":
        later += backward_mains(192, 128)
        later += mla_tma_kernels()
        later += mla_narrow_kernels()
        # ALiBi's d64 forward: two consumers (forward_kernel); other head dims' window kernels have it.
        later += [forward_kernel(family, 64, "window", dtype, softcap, alibi=True, out_dtype=out_dtype)
                  for dtype, out_dtype in [(dtype, None) for dtype in ELEMENT_TYPES]
                  + [(fp8, out) for fp8 in FP8_TYPES for out in ELEMENT_TYPES]
                  for softcap in (False, True)]
    for choice in later:
        found.setdefault(choice.name_expression, choice)
    return list(found.values())


# One call's launch policy.

# CUDA's limit on grid.y and grid.z, which index batches, heads, and query or key blocks.
MAX_GRID_YZ = 65535


class Mask(NamedTuple):
    """Which keys each query row sees, the one form every launch decision reads: ``kind`` one of
    MASKS, the kernels' run-time bounds ``left`` and ``right`` (cuda_src/common/mask.cuh; -1
    unbounded, causal is right = 0), ``softcap`` (0: none), whether the scores take ALiBi's
    bias (``alibi``, which runs the window kernel: common/bias.cuh) and whether P takes dropout
    (``dropout``, likewise: common/philox.cuh). A tuple, not a frozen
    dataclass (whose constructor sets each field through object.__setattr__): one is built per
    packed-batch call."""

    kind: str
    left: int
    right: int
    softcap: float
    alibi: bool = False
    dropout: bool = False

    @property
    def window(self) -> tuple[int, int]:
        return self.left, self.right


_MASK_KINDS = {(-1, -1): "none", (-1, 0): "causal"}  # other bounds: "window"
_new_tuple = tuple.__new__


def make_mask(causal: bool, window: tuple[int, int], softcap: float, seqlen_q: int, seqlen_k: int,
              alibi: bool = False, dropout: bool = False) -> Mask:
    """The Mask of resolved options over sequences of at most ``seqlen_q`` queries and ``seqlen_k``
    keys: causal folded in as right = 0, and a side that bounds no row made -1 (left >=
    seqlen_k - 1, right >= seqlen_q - 1), so that such windows run the plain or causal kernel and
    every bound fits an int32. With ``alibi`` or ``dropout`` every mask is the window kernel's
    (the others carry neither: common/bias.cuh, common/philox.cuh)."""
    left, right = window
    if causal:
        right = 0
    left, right = (-1 if left >= seqlen_k - 1 else left), (-1 if right >= seqlen_q - 1 else right)
    kind = "window" if alibi or dropout else _MASK_KINDS.get((left, right), "window")
    # tuple.__new__ skips the NamedTuple's Python-level constructor, on every packed-batch call.
    return _new_tuple(Mask, (kind, left, right, softcap, alibi, dropout))


@functools.lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def device_target(device_id: int) -> tuple[str, tuple[int, int]]:
    """(kernel family, compute capability) of a device; the family as CUFLASH_FAMILY was when
    first asked (cache_clear() to re-read it)."""
    import cupy

    capability = divmod(int(cupy.cuda.Device(device_id).compute_capability), 10)  # "90" -> (9, 0)
    return select_family(capability), capability


def kernel_head_dim(q, v) -> int:
    """The head dim a call's kernels are chosen for: the wider of q's (and k's) and v's. The narrower
    tensor's columns up to the kernel's bucket read as zeros (TMA's out-of-bounds fill, or the sm80
    loads' zero fill), which add nothing to Q K^T or P V, and its outputs (o, dv, or dq and dk)
    are stored up to its own head dim only."""
    return max(q.shape[3], v.shape[3])


def sm90_alibi(kernel_dim: int, fp8: bool) -> bool:
    """Whether sm90's forward kernels of ``kernel_dim`` (with e4m3 inputs if ``fp8``) read ALiBi
    slopes (sm90/flash_fwd.cu, ALIBI): all but e4m3's d192."""
    return not (fp8 and kernel_dim == 192)


def forward_choice(family: str, q, k, v, mask: Mask, max_seqlen_q: int, out_dtype: str | None = None
                   ) -> KernelChoice:
    """The forward kernel for DeviceTensors q, k, v on a device of ``family``: that family's, or
    sm80's where a tensor has a stride the sm90 kernel's tensor maps cannot describe (a broadcast
    or reversed dimension; the sm80 kernel reads any strides). FP8 inputs write ``out_dtype``."""
    for name, t in (("q", q), ("v", v)):
        if t.dtype in FP8_TYPES and t.shape[3] % 16:
            raise ValueError(f"{name}: FP8 inputs need a head_dim that is a multiple of 16 (the kernels copy rows "
                             f"in 16-byte chunks), got {t.shape[3]}")
    short = max_seqlen_q <= SM90_SHORT_ROWS
    head_dim = kernel_head_dim(q, v)
    if family == "sm90" and mask.alibi and not sm90_alibi(_row_elems(head_dim_bucket(head_dim)), q.dtype in FP8_TYPES):
        family = "sm80"
    # sm90's causal kernels read ALiBi too: a causal ALiBi call keeps their grid order and unmasked
    # steps (make_mask gave it the window mask, which every family's window kernel serves); not
    # with dropout, which the window kernels alone read.
    kind = ("causal" if family == "sm90" and mask.alibi and not mask.dropout and mask.window == (-1, 0)
            else mask.kind)
    choice = forward_kernel(family, head_dim, kind, q.dtype, bool(mask.softcap), short=short,
                            out_dtype=out_dtype, alibi=mask.alibi, dropout=mask.dropout)
    if choice.family == "sm90" and not all(tma_ready(t) for t in (q, k, v)):
        choice = forward_kernel("sm80", head_dim, mask.kind, q.dtype, bool(mask.softcap), out_dtype=out_dtype)
    return choice


# Keys per sequence up to which unequal tiles run persistent too (sm90_ctas).
PERSISTENT_UNEQUAL_KEYS = 1024
# Band width (left + right, in keys) up to which a band's tiles run persistent (sm90_tiles_unequal).
PERSISTENT_BAND_KEYS = 1024


def sm90_ctas(unequal: bool, max_seqlen_k: int, tiles: int, device: int) -> int:
    """CTAs of the sm90 forward's grid over ``tiles`` tiles. Persistent (the tile's shared memory
    allows no second CTA per SM) where the tiles are equal (sm90_tiles_unequal), and over
    sequences of at most PERSISTENT_UNEQUAL_KEYS keys, where the tiles are short and hiding each
    one's prologue and epilogue pays most. Longer unequal tiles get one CTA per tile, longest
    first: a static round robin cannot balance tiles of unequal length, the hardware's block
    scheduler can (docs/kernels.md, the sm90 forward)."""
    if unequal and max_seqlen_k > PERSISTENT_UNEQUAL_KEYS:
        return tiles
    return min(tiles, multiprocessors(device))


def sm90_tiles_unequal(mask: Mask, packed: bool) -> bool:
    """Whether the sm90 forward's tiles are unequal for sm90_ctas: under a causal mask or a
    one-sided window a tile's keys grow or shrink with its rows, and a packed batch's sequences
    differ. A narrow band (both sides bounded, at most PERSISTENT_BAND_KEYS wide) gives every tile
    the same few key blocks but near the sequence's ends, and runs persistent like an unmasked
    grid, which hides each tile's prologue and epilogue, worth most where walks are short; at
    (1024, 1024) the two grids are even (docs/kernels.md, windows).
    Softcap kernels keep one CTA per tile: the band's grid was chosen on kernels without softcap."""
    narrow_band = 0 <= mask.left and 0 <= mask.right and mask.left + mask.right <= PERSISTENT_BAND_KEYS
    return (mask.window != (-1, -1) and not narrow_band) or bool(mask.softcap) or packed


class ForwardLaunch(NamedTuple):
    kernel: KernelChoice
    grid: tuple[int, int, int]
    m_blocks: int  # query blocks per (sequence, head)


def forward_launch(family: str, q, k, v, mask: Mask, batch: int, max_seqlen_q: int, packed: bool,
                   device: int, out_dtype: str | None = None) -> ForwardLaunch:
    """The forward's kernel and grid over ``batch`` sequences of at most ``max_seqlen_q`` rows
    (q, k, v DeviceTensors, BSHD; a packed batch as batch-of-one views, whose total length then
    bounds the longest sequence's keys); ``out_dtype`` for FP8 inputs, as forward_choice."""
    choice = forward_choice(family, q, k, v, mask, max_seqlen_q, out_dtype)
    m_blocks = -(-max_seqlen_q // choice.tile.block_m)
    heads = q.shape[2]
    if choice.family == "sm90":
        tiles = m_blocks * heads * batch
        if tiles >= 2**31:
            raise ValueError(f"q: {tiles} query tiles exceed the sm90 forward's int32 tile index")
        # A packed batch may have no rows at all: still one CTA.
        grid = (max(1, sm90_ctas(sm90_tiles_unequal(mask, packed), k.shape[1], tiles, device)), 1, 1)
    else:
        grid = (heads, batch, m_blocks) if choice.blocks_slowest else (m_blocks, heads, batch)
    return ForwardLaunch(choice, grid, m_blocks)


# sm90's deterministic mode walks causal sequences up to this many keys, per kernel
# (SM90_BWD_TILES): the walk spreads each CTA's start over its blocks, which outweighs the
# side-by-side grid's shared L2 reads at d64 only; elsewhere one CTA per key block runs faster
# (flash_bwd.cu: a causal head's key blocks side by side; docs/kernels.md, the sm90 backward).
WALK_CAUSAL_KEYS = {(64, 64): 2048, (128, 128): 0, (192, 128): 0, (256, 256): 0}


def dq_order(family: str, head_dims: tuple[int, int], mask: Mask, max_seqlen_k: int, deterministic: bool) -> str:
    """DQ_ORDERS entry of a backward whose main kernel is ``family``'s, for (q's, v's) ``head_dims``.
    Default mode takes any order. Deterministic mode takes turns where the family has them, else walks; sm90 walks its
    causal sequences up to WALK_CAUSAL_KEYS keys, whose key blocks are few and of unequal length,
    so that walking them amortises each CTA's start and balances the work (a softcap runs the
    window kernel, which does not walk)."""
    orders = dq_orders(family, mask.kind, bool(mask.softcap))
    if not deterministic:
        return "any"
    if (family == "sm90" and "walk" in orders
            and max_seqlen_k <= WALK_CAUSAL_KEYS[backward_kernel_dims(family, *head_dims)]):
        return "walk"
    return "turns" if "turns" in orders else "walk"


class BackwardLaunch(NamedTuple):
    preprocess: KernelChoice
    main: KernelChoice
    convert: KernelChoice
    dq_order: str
    splits: int  # dQ splits: one per walking CTA of a (batch, head), else 1
    turn_heads: int  # heads whose key blocks one grid row interleaves when taking turns (params.cuh)
    grid: tuple[int, int, int]  # of the main kernel


def backward_launch(family: str, q, k, v, dout, mask: Mask, batch: int, max_seqlen_k: int, deterministic: bool,
                    device: int) -> BackwardLaunch:
    """The backward's kernels, dQ order and main grid (DeviceTensors as for forward_launch): sm90's
    main kernel where it serves the head dim and tensor maps can describe the tensors, and the call
    has not both dropout and a softcap (sm90's softcap kernels have no dropout: flash_bwd.cu)."""
    heads, head_dims = q.shape[2], (q.shape[3], v.shape[3])
    main_family = family
    if family == "sm90" and (not all(tma_ready(t) for t in (q, k, v, dout)) or (mask.dropout and mask.softcap)):
        main_family = "sm80"
    order = dq_order(main_family, head_dims, mask, max_seqlen_k, deterministic)
    preprocess, main, convert = backward_kernels(main_family, head_dims[0], mask.kind, q.dtype, bool(mask.softcap),
                                                 order, head_dim_v=head_dims[1])
    n_blocks = -(-max_seqlen_k // main.tile.block_n)
    if n_blocks > MAX_GRID_YZ:  # causal grids put the key blocks in grid.z
        raise ValueError(f"k: sequences must be at most {MAX_GRID_YZ * main.tile.block_n} keys long for the "
                         f"backward at head dims {head_dims}, got {max_seqlen_k}")
    # Walk: as many CTAs per (batch, head) as fill the resident slots in one wave (rounding up
    # would leave a second, nearly empty wave).
    slots = multiprocessors(device) * main.tile.ctas_per_sm
    splits = max(1, min(n_blocks, slots // (batch * heads))) if order == "walk" else 1
    # Turns without a causal mask: the key blocks of turn_heads heads interleaved (flash_bwd.cu),
    # as many heads as make one wave of their key blocks.
    grouped = order == "turns" and not _mask_flags(mask.kind, bool(mask.softcap))[0]
    turn_heads = max(1, min(heads, slots // n_blocks)) if grouped else 1
    # sm80's causal key blocks go slowest in the grid, longest first; sm90's run a head's side by
    # side (flash_bwd.cu).
    if order == "walk":
        grid = (splits, heads, batch)
    elif grouped:
        grid = (n_blocks * turn_heads, -(-heads // turn_heads), batch)
    else:
        grid = (heads, batch, n_blocks) if main.blocks_slowest else (n_blocks, heads, batch)
    return BackwardLaunch(preprocess, main, convert, order, splits, turn_heads, grid)


def helper_grid(rows: int, heads: int, batch: int, head_dim: int) -> tuple[int, int, int]:
    """Grid of the backward's preprocess or convert kernel over ``rows`` rows per (batch, head)."""
    return -(-rows // helper_rows_per_block(head_dim)), heads, batch


# cuflash.quantize_fp8's kernel (generic/quantize_fp8.cu): one CTA of QUANTIZE_THREADS per group.
QUANTIZE_THREADS = 256
_QUANTIZE_LOADS = {"float16": "cuflash::load_f16", "bfloat16": "cuflash::load_bf16", "float32": "cuflash::load_f32"}


def quantize_kernel(dtype_name: str) -> KernelChoice:
    """The FP8 quantizing kernel for inputs of ``dtype_name`` (float16, bfloat16 or float32),
    built for the sm80 target on every device (it needs no Hopper instruction)."""
    return KernelChoice("sm80", "generic/quantize_fp8.cu",
                        f"cuflash::quantize_fp8<{QUANTIZE_THREADS}, {HEAD_DIM_BUCKETS[-1]}, {_QUANTIZE_LOADS[dtype_name]}>",
                        QUANTIZE_THREADS, 0)


# Attention against a KV cache (cuda_src/common/kv_cache.cuh), built for the sm80 target on every
# device: kv_append writes the new tokens, kv_decode runs KV_ROWS packed query rows (the query
# heads of one kv head times the query tokens, one m16 tile of mma.sync) of one kv head over one
# split of the keys, and kv_combine merges the splits. Head dims run in the bucket above them
# among KV_BUCKETS (each warp holds 16 rows x bucket columns of O).
KV_APPEND_SOURCE, KV_DECODE_SOURCE, COMBINE_SOURCE = "generic/kv_append.cu", "sm80/kv_decode.cu", "generic/combine.cu"
KV_BUCKETS = (64, 128, 256)
# kv_decode's tile: 16 packed rows (one m16 tile), 64 keys a step over 4 warps of 16 keys each; the
# kernel takes them as template arguments and asserts what its layout needs.
KV_ROWS, KV_KEYS, KV_WARPS = 16, 64, 4
KV_APPEND_THREADS = 128
COMBINE_WARPS = 4
COMBINE_TYPES = {"float32": "cuflash::store_f32", "float16": "cuflash::store_16<cuflash::f16>",
                 "bfloat16": "cuflash::store_16<cuflash::bf16>"}
# Splits chosen for num_splits=0 where the CTAs make less than two waves of the resident slots
# (SMs x kv_ctas_per_sm): the fewest that fill them in waves at least KV_WAVE_EFFICIENCY full, each
# split at least KV_MIN_SPLIT_KEYS of the cache's capacity (the lengths themselves are on the
# device), at most KV_MAX_SPLITS.
KV_MIN_SPLIT_KEYS = 2 * KV_KEYS
KV_MAX_SPLITS = 64
KV_WAVE_EFFICIENCY = 0.9


def kv_bucket(head_dim: int) -> int:
    for bucket in KV_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim: at most {KV_BUCKETS[-1]}, got {head_dim}")


def kv_tile(bucket: int) -> Tile:
    """kv_decode's tile for head-dim bucket ``bucket``; its ctas_per_sm is the kernel's
    __launch_bounds__ minimum: 3 up to d128, where shared memory and registers allow exactly that
    on the A100 / H100 / H200, else 1."""
    return Tile(KV_ROWS, KV_KEYS, KV_WARPS, ctas_per_sm=3 if bucket <= 128 else 1)


def kv_smem_bytes(bucket: int) -> int:
    """sizeof(KvTiles<C, bucket, tile>), for a 16-bit or an e4m3 cache alike: the 16-bit Q tile,
    two stages of 16-bit K and V tiles (or four stages of e4m3 bytes: as many bytes), and the
    warps' row maxima and sums (kv_decode static_asserts it)."""
    tile = kv_tile(bucket)
    return (tile.block_m * bucket * 2 + 2 * 2 * tile.block_n * bucket * 2
            + 2 * tile.warps * tile.block_m * 4)


def kv_ctas_per_sm(bucket: int) -> int:
    """kv_decode CTAs resident per SM (kv_tile)."""
    return kv_tile(bucket).ctas_per_sm


def kvcache_kernels(dtype: str, head_dim: int, cache_dtype: str | None = None) -> tuple[KernelChoice, KernelChoice]:
    """(kv_append, kv_decode) for 16-bit ``dtype`` (q's) and ``head_dim``; ``cache_dtype`` the
    cache's, ``dtype`` (None) or float8_e4m3fn."""
    element = ELEMENT_TYPES[dtype]
    cache = element if cache_dtype in (None, dtype) else FP8_TYPES[cache_dtype]
    bucket = kv_bucket(head_dim)
    append = KernelChoice("sm80", KV_APPEND_SOURCE, f"cuflash::kv_append<{element}, {cache}>", KV_APPEND_THREADS, 0)
    tile, smem = kv_tile(bucket), kv_smem_bytes(bucket)
    decode = KernelChoice("sm80", KV_DECODE_SOURCE,
                          f"cuflash::kv_decode<{element}, {cache}, {bucket}, {tile.block_m}, {tile.block_n}, "
                          f"{tile.warps}, {tile.ctas_per_sm}, {smem}>", tile.warps * 32, smem, tile)
    return append, decode


def combine_kernel(out_dtype: str) -> KernelChoice:
    return KernelChoice("sm80", COMBINE_SOURCE, f"cuflash::kv_combine<{COMBINE_TYPES[out_dtype]}, {COMBINE_WARPS}>",
                        COMBINE_WARPS * 32, 0)


def kvcache_all_kernels() -> list[KernelChoice]:
    found = [k for dtype in ELEMENT_TYPES for cache in (dtype, *FP8_TYPES) for bucket in KV_BUCKETS
             for k in kvcache_kernels(dtype, bucket, cache)]
    found += [combine_kernel(out_dtype) for out_dtype in COMBINE_TYPES]
    found += [merge_kernel(dtype) for dtype in MERGE_ROWS]
    # The forward over the cache; sm80's softcap kernels take every mask (_mask_flags).
    found += [kvcache_prefill_kernel(dtype, bucket, Mask(mask, -1, -1, float(softcap))) for bucket in HEAD_DIM_BUCKETS
              for dtype in ELEMENT_TYPES for mask in MASKS for softcap in (False, True)]
    return list({k.name_expression: k for k in found}.values())


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def kvcache_splits(requested: int, batch: int, heads_kv: int, row_tiles: int, capacity: int, sms: int,
                   ctas_per_sm: int, min_split_keys: int = KV_MIN_SPLIT_KEYS) -> int:
    """Key splits per (sequence, kv head, row tile): ``requested`` if given (> 0); one where the
    CTAs already make two waves of the SMs' resident slots (the last wave idles a third at most,
    and the fp32 partials of many row tiles would cost more than it); else the fewest whose CTAs
    fill the slots in waves at least KV_WAVE_EFFICIENCY full (decoding is bound by memory, so a
    last wave of few CTAs leaves the bandwidth idle), or the most efficient count if none is; each
    split at least ``min_split_keys`` of the capacity, at most KV_MAX_SPLITS."""
    if requested > 0:
        return requested
    ctas, slots = batch * heads_kv * row_tiles, sms * ctas_per_sm
    if ctas >= 2 * slots:
        return 1

    def efficiency(splits: int) -> float:
        waves = ctas * splits / slots
        return waves / math.ceil(waves)

    candidates = range(1, max(1, min(capacity // min_split_keys, KV_MAX_SPLITS)) + 1)
    full = [s for s in candidates if efficiency(s) >= KV_WAVE_EFFICIENCY]
    return full[0] if full else max(candidates, key=efficiency)


# merge_states (generic/merge_states.cu): a warp per (row, head), MERGE_WARPS per CTA.
MERGE_SOURCE = "generic/merge_states.cu"
MERGE_WARPS = 4
MERGE_ROWS = {"float32": "cuflash::Row8F32", "float16": "cuflash::Row8<cuflash::f16>",
              "bfloat16": "cuflash::Row8<cuflash::bf16>"}


def merge_kernel(dtype: str) -> KernelChoice:
    return KernelChoice("sm80", MERGE_SOURCE, f"cuflash::merge_states<{MERGE_ROWS[dtype]}>", MERGE_WARPS * 32, 0)


def merge_grid(items: int) -> tuple[int, int, int]:
    """merge_states's grid over ``items`` (row, head) pairs."""
    return (max(1, -(-items // MERGE_WARPS)), 1, 1)


def kv_combine_grid(rows: int) -> tuple[int, int, int]:
    """kv_combine's grid: one CTA per (batch, row, head)."""
    return (max(1, rows), 1, 1)


# Chunked prefill. kv_decode reads a sequence's K and V once per kv head and 16 packed rows, the
# forward kernel once per query head and SM80_FWD_TILES' 128 rows: from a whole query block per
# sequence on, the forward reads the cache group x 128 / 16 = 8 x (GQA 4) fewer times and runs
# its mma.sync on full tiles. Below it, a forward CTA computes mostly padding and the grid has no
# key splits to fill the GPU with at small batches, where kv_decode's split-KV does.
KV_PREFILL_ROWS = 128


def kvcache_prefill(call, q, cache) -> bool:
    """Whether a checked attention_with_kvcache call (checks.KvCall; ``q`` and ``cache``, k_cache,
    its DeviceTensors) runs the forward kernel over the cache rather than kv_decode: long query
    chunks (KV_PREFILL_ROWS) of a 16-bit cache of q's dtype, no cache_leftpad (the forward kernel
    counts a sequence's keys from position 0), no explicit key split (num_splits > 1 asks for
    kv_decode's), not ALiBi with a softcap (that kernel has no ALiBi: sm80/flash_fwd.cu), and a q
    of 16-byte rows (the forward's cp.async; a rotated q is read from the aligned scratch copy)."""
    if call.max_seqlen_q < KV_PREFILL_ROWS or cache.dtype != q.dtype or call.num_splits > 1:
        return False
    if call.alibi is not None and call.softcap:
        return False
    if "cache_leftpad" in call.tensors:
        return False
    return bool(call.rotary_dim) or q.aligned_16


def kvcache_prefill_kernel(dtype: str, head_dim: int, mask: Mask) -> KernelChoice:
    """The sm80 forward that reads K and V from a KV cache (FwdParamsPaged), on every device: the
    sm90 forward's TMA loads take whole BLOCK_N-row boxes of one sequence, which a page table
    scatters."""
    return forward_kernel("sm80", head_dim, mask.kind, dtype, bool(mask.softcap), paged=True)


def kvcache_prefill_grid(choice: KernelChoice, heads: int, batch: int, max_seqlen_q: int) -> tuple[int, int, int]:
    """The forward's grid (forward_launch's sm80 order) over ``batch`` sequences of at most
    ``max_seqlen_q`` query rows."""
    m_blocks = -(-max_seqlen_q // choice.tile.block_m)
    grid = (heads, batch, m_blocks) if choice.blocks_slowest else (m_blocks, heads, batch)
    if max(grid[1:]) > MAX_GRID_YZ:
        raise ValueError(f"q: {batch} sequences of {max_seqlen_q} rows and {heads} heads exceed the forward's grid")
    return grid


# MLA decoding (common/mla_decode.cuh): one CTA of MLA_THREADS per (tile of MLA_ROWS packed query
# rows, key split, sequence), the latent head's MLA_HEAD_DIM dims the keys and its first
# MLA_HEAD_DIM_V the values. sm90 multiplies by wgmma in steps of 64 keys, and takes a 16-bit
# cache whose steps each lie in one page by TMA (mla_tma); the sm80 family by mma.sync in steps of
# 32, whose two stages fit an A100's shared memory.
MLA_SOURCES = {"sm80": "sm80/mla_decode.cu", "sm90": "sm90/mla_decode.cu"}
MLA_KERNELS = {"sm80": "cuflash::mla_decode_sm80", "sm90": "cuflash::sm90::mla_decode_sm90"}
MLA_TMA_KERNEL = "cuflash::sm90::mla_decode_alternating_sm90"
# At <= 32 packed query rows sm90's TMA-loaded decoding transposes its products, the rows wgmma's N
# (16 or 32): mla_decode_narrow_sm90. Each of its steps is one warpgroup's alone, so a step takes
# longer than the 64-row tile's, which two warpgroups share: it pays from MLA_NARROW_MIN_KEYS keys
# a split (docs/mla.md).
MLA_NARROW_KERNEL = "cuflash::sm90::mla_decode_narrow_sm90"
MLA_NARROW_ROWS = (16, 32)
MLA_NARROW_MIN_KEYS = {16: 1024, 32: 8192}
# The tile (MLA_ROWS packed rows, MLA_KEYS keys a step, MLA_THREADS) reaches the kernels as template
# arguments, which assert the rows and threads their body is written for.
MLA_KEYS = {"sm80": 32, "sm90": 64}
MLA_ROWS, MLA_THREADS = 64, 256
MLA_HEAD_DIM, MLA_HEAD_DIM_V = 576, 512


def mla_smem_bytes(family: str, tma: bool = False) -> int:
    """MlaSmem<D, KEYS>::BYTES (Q, two stages of cache rows, P, the warpgroups' row statistics),
    MlaAlternatingSmem's four mbarriers with TMA, plus sm90's alignment slack."""
    keys = MLA_KEYS[family]
    layout = MLA_ROWS * MLA_HEAD_DIM * 2 + 2 * keys * MLA_HEAD_DIM * 2 + MLA_ROWS * 128 + 2 * MLA_ROWS * 4
    return layout + (4 * 8 if tma else 0) + (SM90_SMEM_ALIGN_SLACK if family == "sm90" else 0)


def mla_narrow_smem_bytes(rows: int) -> int:
    """MlaNarrowSmem<D, DV, rows>::BYTES (Q, two stages, two P^T tiles, the row statistics, two
    mbarriers) plus sm90's alignment slack."""
    layout = (rows * MLA_HEAD_DIM * 2 + 2 * MLA_KEYS["sm90"] * MLA_HEAD_DIM * 2 + 2 * rows * 128 + 2 * 4 * rows * 4
              + 2 * 4 * rows * 4 + 2 * rows * 4 + 2 * 8)
    return layout + SM90_SMEM_ALIGN_SLACK


def mla_narrow_rows(tma: bool, rows: int, keys_per_split: int) -> int:
    """The transposed kernel's N for ``rows`` packed query rows (MLA_NARROW_ROWS), or 0 where the
    64-row tile serves: more rows, no TMA loads, or fewer keys a split than MLA_NARROW_MIN_KEYS."""
    n = next((n for n in MLA_NARROW_ROWS if rows <= n), 0) if tma else 0
    return n if n and keys_per_split >= MLA_NARROW_MIN_KEYS[n] else 0


def mla_tma(family: str, dtype: str, cache_dtype: str, page_size: int, max_pages: int) -> bool:
    """Whether sm90 loads the cache by TMA: a 16-bit cache whose steps of MLA_KEYS rows each lie in
    one page (pages of a multiple of them, or one page per sequence of at least a step); the
    caller also needs the cache's pointers 16-byte aligned (tensor maps)."""
    return (family == "sm90" and cache_dtype == dtype and page_size >= MLA_KEYS[family]
            and (page_size % MLA_KEYS[family] == 0 or max_pages == 1))


def mla_kernel(family: str, dtype: str, cache_dtype: str, tma: bool = False, narrow_rows: int = 0) -> KernelChoice:
    """MLA decoding for q's 16-bit ``dtype`` and the cache's (``dtype`` or float8_e4m3fn); ``tma``:
    sm90's TMA-loaded kernel (mla_tma); ``narrow_rows``: its transposed form (mla_narrow_rows)."""
    element = ELEMENT_TYPES[dtype]
    smem = mla_narrow_smem_bytes(narrow_rows) if narrow_rows else mla_smem_bytes(family, tma)
    tile = Tile(MLA_ROWS, MLA_KEYS[family], MLA_THREADS // 32)
    dims = f"{MLA_HEAD_DIM}, {MLA_HEAD_DIM_V}"
    if narrow_rows:
        name = f"{MLA_NARROW_KERNEL}<{element}, {dims}, {narrow_rows}, {tile.block_n}, {tile.warps}, {smem}>"
    else:
        tiled = f"{dims}, {tile.block_m}, {tile.block_n}, {tile.warps}, {smem}"
        cache = element if cache_dtype == dtype else FP8_TYPES[cache_dtype]
        name = f"{MLA_TMA_KERNEL}<{element}, {tiled}>" if tma else f"{MLA_KERNELS[family]}<{element}, {cache}, {tiled}>"
    return KernelChoice(family, MLA_SOURCES[family], name, MLA_THREADS, smem, tile)


def mla_all_kernels(family: str) -> list[KernelChoice]:
    return [mla_kernel(family, dtype, cache) for dtype in ELEMENT_TYPES for cache in (dtype, *FP8_TYPES)]


def mla_tma_kernels() -> list[KernelChoice]:
    """sm90's TMA-loaded MLA kernels (16-bit caches), listed apart: they came after the others."""
    return [mla_kernel("sm90", dtype, dtype, tma=True) for dtype in ELEMENT_TYPES]


def mla_narrow_kernels() -> list[KernelChoice]:
    """sm90's transposed MLA kernels for <= 32 query rows, listed after the TMA-loaded ones."""
    return [mla_kernel("sm90", dtype, dtype, tma=True, narrow_rows=n) for n in MLA_NARROW_ROWS
            for dtype in ELEMENT_TYPES]


def mla_splits(requested: int, batch: int, row_tiles: int, capacity: int, family: str, sms: int) -> int:
    """Key splits per (sequence, row tile): the KV cache's policy (kvcache_splits) for one CTA per
    SM and one latent head, each split at least two steps of the capacity."""
    return kvcache_splits(requested, batch, 1, row_tiles, capacity, sms, 1, 2 * MLA_KEYS[family])
