"""The public entry points: validate -> plan -> launch."""

from __future__ import annotations

import functools
import math
import numbers
import operator
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuflash import dispatch, interop, kernels, reference
from cuflash.params import (BWD_POINTERS, CONVERT_POINTERS, FWD_POINTERS, ArgumentBuffer, pack_bwd_params,
                            pack_convert_params, pack_fwd_params, sm90_backward_argument, sm90_forward_argument,
                            tma_ready)

__all__ = ["attention", "attention_backward", "explain"]

_DEVICE_DTYPES = ("float16", "bfloat16")
_HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")
_MAX_GRID_YZ = 65535


def _dtype_name(x: Any) -> str:
    return x.dtype if isinstance(x, interop.DeviceTensor) else x.dtype.name


def _strides(x: Any) -> tuple[int, ...]:
    return x.strides if isinstance(x, interop.DeviceTensor) else tuple(s // x.itemsize for s in x.strides)


def _check_dtype(name: str, x: Any, allowed: tuple[str, ...], on_device: bool) -> str:
    dtype = _dtype_name(x)
    if dtype not in allowed:
        hint = (
            "; cast to float16 or bfloat16 first (x.astype(ml_dtypes.bfloat16) in CuPy, "
            "x.to(torch.bfloat16) in torch)"
            if on_device and dtype in ("float32", "float64")
            else ""
        )
        raise TypeError(f"{name}: dtype {dtype} is not supported (expected one of {', '.join(allowed)}){hint}")
    return dtype


def _check_qkv(q, k, v, on_device: bool) -> None:
    """Shapes, dtypes, strides and devices of q, k, v (DeviceTensors, or NumPy arrays)."""
    allowed = _DEVICE_DTYPES if on_device else _HOST_DTYPES
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    dtype = _check_dtype("q", q, allowed, on_device)
    for name, x in (("k", k), ("v", v)):
        if _check_dtype(name, x, allowed, on_device) != dtype:
            raise TypeError(f"{name}: dtype {_dtype_name(x)} does not match q's {dtype}")
    batch, seqlen_q, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k, v: batch must match q's {batch}, got {k.shape[0]} and {v.shape[0]}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k: head_dim {k.shape[3]} must equal q's {head_dim}")
    for name, size in (("batch", batch), ("seqlen_q", seqlen_q), ("seqlen_k", k.shape[1]),
                       ("heads", heads), ("heads_kv", k.shape[2])):
        if size < 1:
            raise ValueError(f"q, k: {name} must be at least 1, got {size}")
    if heads % k.shape[2] != 0:
        raise ValueError(f"k: heads_kv ({k.shape[2]}) must divide q's heads ({heads}) for GQA/MQA")
    if head_dim < 8 or head_dim % 8 != 0 or head_dim > 256:
        raise ValueError(f"q: head_dim must be a positive multiple of 8 and at most 256, got {head_dim}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if _strides(x)[3] != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, stride is "
                             f"{_strides(x)[3]} elements")
    if on_device:
        if batch > _MAX_GRID_YZ or heads > _MAX_GRID_YZ:
            raise ValueError(f"q: batch and heads must be at most {_MAX_GRID_YZ}, got {batch} and {heads}")
        if seqlen_q > _MAX_GRID_YZ * 128:  # causal grids put the 128-row query blocks in grid.z
            raise ValueError(f"q: seqlen_q must be at most {_MAX_GRID_YZ * 128}, got {seqlen_q}")
        for name, x in (("k", k), ("v", v)):
            if x.device != q.device:
                raise ValueError(f"{name}: on device {x.device}, but q is on device {q.device}")


def _resolve_flag(name: str, value: Any) -> bool:
    """A switch (``causal``, ``deterministic``): a bool, NumPy's included, or the integer 0 or 1.
    Anything else is refused rather than read by its truth value, which would make
    ``causal="false"`` causal."""
    if type(value) is bool:
        return value
    if isinstance(value, (np.bool_, numbers.Integral)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {value!r}")


def _resolve_scale(softmax_scale: Any, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale: expected a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale: must be finite and positive, got {softmax_scale}")
    return scale


def _resolve_window(window: Any) -> tuple[int, int]:
    """``(left, right)``: two integers >= -1 (-1 unbounded)."""
    # Plain int pairs skip the numbers.Integral checks (ABC instance checks, ~1 us each per call).
    if _plain_window(window) and window[0] >= -1 and window[1] >= -1:
        return window
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window: expected a pair (left, right) of integers, got {window!r}")
    for side in window:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window: expected integers, got {window!r}")
    left, right = (int(side) for side in window)
    if left < -1 or right < -1:
        raise ValueError(f"window: values must be -1 (unbounded) or >= 0, got {window!r}")
    return left, right


def _resolve_softcap(softcap: Any) -> float:
    if type(softcap) is float and 0.0 <= softcap < math.inf:  # the common case, without ABC checks
        return softcap
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap: must be finite and >= 0 (0 disables it), got {softcap}")
    return value


def _kernel_window(causal: bool, window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(left, right) as the kernels take them (common/mask.cuh): causal folded in as right = 0, and
    a side that bounds no row made -1 (left >= seqlen_k - 1, right >= seqlen_q - 1, with the
    longest lengths any sequence may have), so that such windows run the plain or causal kernel
    and every bound fits an int32."""
    left, right = window
    if causal:
        right = 0
    return (-1 if left >= seqlen_k - 1 else left), (-1 if right >= seqlen_q - 1 else right)


def _mask_kind(window: tuple[int, int]) -> str:
    """dispatch.MASKS entry for a kernel window."""
    return {(-1, -1): "none", (-1, 0): "causal"}.get(window, "window")


# Launch plans. Everything a launch needs that follows from the tensors' layouts (shapes,
# strides, dtypes, device) and the options -- the kernels, grids, scratch layout and the argument
# structs but for their pointers -- is computed once per distinct call and kept in _PLANS; a
# repeated call fills in the pointers and launches. For attention() and attention_backward() the
# key is taken before validation, so a hit also skips the checks that call passed before: each
# check reads only what the key holds (see _forward_key), and errors are never cached, so a bad
# input always runs the full checks and raises as it would without the cache.


@dataclass(frozen=True, eq=False)
class _ForwardPlan:
    device_plan: tuple[str, tuple[int, int]]  # (family, compute capability) it was built for
    kernel: kernels.Launch
    argument: ArgumentBuffer  # FwdParams, or FwdParamsSm90 (maps encoded per fill); pointers in FWD_POINTERS order
    lse_shape: tuple[int, ...]  # of the float32 lse a call writes when the caller wants it


@dataclass(frozen=True, eq=False)
class _BackwardPlan:
    device_plan: tuple[str, tuple[int, int]]
    preprocess: kernels.Launch
    main: kernels.Launch
    argument: ArgumentBuffer  # BwdParams, shared by preprocess and main; pointers in BWD_POINTERS order
    main_argument: ArgumentBuffer | None  # an sm90 main kernel's BwdParamsSm90 (same pointers), else None
    # Scratch carved from one allocation: offsets of delta, dq_accum, dk_accum and dv_accum (None
    # without GQA) and dq_turns (None unless taking turns), its size, and the length of its prefix
    # to zero (the accumulators that are added to, and the turn counters).
    offsets: tuple[int, int, int | None, int | None, int | None]
    scratch_bytes: int
    zeroed_bytes: int
    # (kernel, ConvertParams, source offset in the scratch, index of the gradient in (dq, dk, dv))
    converts: tuple[tuple[kernels.Launch, ArgumentBuffer, int, int], ...]


_PLANS: dict[tuple, _ForwardPlan | _BackwardPlan] = {}
# Oldest-first eviction bounds the memory when shapes keep changing (a growing KV cache makes a
# new key per step); 1024 plans are well under a megabyte.
_PLANS_MAX = 1024
_plans_lock = threading.Lock()


def _cached_plan(key: tuple | None, device: int):
    """The plan stored under ``key``, if it was built for the family and arch the device has now
    (``_device_plan.cache_clear()`` and a new CUFLASH_FAMILY must not run a stale kernel)."""
    plan = _PLANS.get(key)
    return plan if plan is not None and plan.device_plan == _device_plan(device) else None


def _remember(key: tuple | None, plan) -> None:
    if key is None:
        return
    with _plans_lock:
        if len(_PLANS) >= _PLANS_MAX and key not in _PLANS:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = plan


# Option types whose values alone decide validation: a key holds a scalar only if its type is one
# of these, because True == 1 and hash(True) == hash(1), yet softmax_scale=True or window=(True, 0)
# must raise TypeError where 1 and (1, 0) pass. Other types run uncached (and work).
_KEY_SCALARS = frozenset({int, float, type(None)})


def _plain_window(window: Any) -> bool:
    return type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int


def _aligned_pointers(*tensors) -> bool:
    """The pointers of ``tensors`` (DeviceTensors or None) on 16-byte boundaries; their strides'
    alignment is part of a plan key."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.ptr
    return bits % 16 == 0


def _forward_choice(family: str, qt, kt, vt, window: tuple[int, int], softcap: float,
                    max_seqlen_q: int) -> dispatch.KernelChoice:
    """The forward kernel for these tensors on a device of ``family``: that family's, or sm80's
    where a tensor has a stride the sm90 kernel's tensor maps cannot describe (a broadcast or
    reversed dimension; the sm80 kernel reads any strides)."""
    short = max_seqlen_q <= dispatch.SM90_SHORT_ROWS
    choice = dispatch.forward_kernel(family, qt.shape[3], _mask_kind(window), qt.dtype, bool(softcap), short=short)
    if choice.family == "sm90" and not all(tma_ready(t) for t in (qt, kt, vt)):
        choice = dispatch.forward_kernel("sm80", qt.shape[3], _mask_kind(window), qt.dtype, bool(softcap))
    return choice


# Keys per sequence up to which unequal tiles run persistent too (see _sm90_ctas).
_PERSISTENT_UNEQUAL_KEYS = 1024


def _sm90_ctas(unequal: bool, max_seqlen_k: int, tiles: int, device: int) -> int:
    """CTAs of the sm90 forward's grid over ``tiles`` tiles. Persistent, one CTA per SM (the
    tile's shared memory allows no second) walking the tiles round robin: where the tiles are
    equal (a fixed-length batch without a mask or with a narrow band, _sm90_tiles_unequal), and
    over sequences of at most _PERSISTENT_UNEQUAL_KEYS keys, where the tiles are short and hiding
    each one's prologue and epilogue pays most (causal 1k: +3% at d128, +11% at d64). Longer
    ``unequal`` tiles (a causal mask, or a packed batch's sequences of different lengths) differ
    in length more than a static round robin can balance: one CTA per tile, longest first, lets
    the hardware's block scheduler balance them (measured 5-9% faster at 4k-16k causal;
    benchmarks/NOTES.md, sm90 v4)."""
    if unequal and max_seqlen_k > _PERSISTENT_UNEQUAL_KEYS:
        return tiles
    return min(tiles, _multiprocessors(device))


# Band width (left + right, in keys) up to which a band's tiles run persistent (_sm90_tiles_unequal).
_PERSISTENT_BAND_KEYS = 1024


def _sm90_tiles_unequal(window: tuple[int, int], softcap: float, packed: bool) -> bool:
    """Whether the sm90 forward's tiles (``window`` from _kernel_window) are to be treated as
    unequal by _sm90_ctas: under a causal mask or a one-sided window a tile's keys grow or shrink
    with its rows, and a packed batch's sequences differ. A narrow band (both sides bounded, at
    most _PERSISTENT_BAND_KEYS wide) gives every tile the same few key blocks but near the
    sequence's ends, and runs persistent like an unmasked grid: measured at 16k keys, 4-10% less
    time than one CTA per tile for widths 256-1024 at head_dim 64-256, while (1024, 1024) was even
    and (4096, 0) 1-6% slower (benchmarks/NOTES.md, session 11). Softcap kernels keep one CTA per
    tile, as measured when the policy was set."""
    left, right = window
    narrow_band = 0 <= left and 0 <= right and left + right <= _PERSISTENT_BAND_KEYS
    return (_mask_kind(window) != "none" and not narrow_band) or bool(softcap) or packed


def _forward_plan(qt, kt, vt, out_t, lse_t, scale: float, window: tuple[int, int], softcap: float, batch: int,
                  max_seqlen_q: int, cu_seqlens=(None, None)) -> _ForwardPlan:
    """The forward launch over a fixed-length batch (q, k, v, out BSHD) or a packed one
    (batch-of-one views, ``cu_seqlens`` the two int32 DeviceTensors), for validated tensors;
    ``window`` from _kernel_window. out and lse may be interop.contiguous records."""
    family, capability = device_plan = _device_plan(qt.device)
    choice = _forward_choice(family, qt, kt, vt, window, softcap, max_seqlen_q)
    m_blocks = -(-max_seqlen_q // choice.tile.block_m)
    heads = qt.shape[2]
    packed = pack_fwd_params(qt, kt, vt, out_t, lse_t, scale, window, softcap, *cu_seqlens)
    if choice.family == "sm90":
        tiles = m_blocks * heads * batch
        if tiles >= 2**31:
            raise ValueError(f"q: {tiles} query tiles exceed the sm90 forward's int32 tile index")
        unequal = _sm90_tiles_unequal(window, softcap, cu_seqlens[0] is not None)
        # A packed batch's longest sequence is not known here: its total bounds it. A packed batch
        # may have no rows at all: still one CTA.
        grid = (max(1, _sm90_ctas(unequal, kt.shape[1], tiles, qt.device)), 1, 1)
        argument = sm90_forward_argument(packed, qt, kt, vt, choice.tile.block_m, choice.tile.block_n,
                                         (m_blocks, heads, batch))
    else:
        grid = (heads, batch, m_blocks) if choice.blocks_slowest else (m_blocks, heads, batch)
        argument = ArgumentBuffer(packed, FWD_POINTERS)
    arch = dispatch.compile_arch(choice.family, capability)
    return _ForwardPlan(device_plan, kernels.prepare(choice, arch, qt.device, grid), argument, lse_t.shape)


def _allocate_lse(plan: _ForwardPlan, framework: str, qt, return_lse: bool) -> tuple[Any, int]:
    """(array, pointer) of the lse ``plan`` writes (inside interop.on_device) when the caller gets
    it back; else (None, 0): the kernels skip the lse stores for a null pointer, so nothing is
    allocated for it."""
    if return_lse:
        return interop.allocate(framework, qt, plan.lse_shape, "float32")
    return None, 0


def _run_forward(plan: _ForwardPlan, stream: int, qt, kt, vt, out_ptr: int, lse_ptr: int,
                 cu_seqlens=(None, None)) -> None:
    """Launch ``plan`` (inside interop.on_device)."""
    cu_q, cu_k = cu_seqlens
    argument = plan.argument.fill(qt.ptr, kt.ptr, vt.ptr, out_ptr, lse_ptr, cu_q.ptr if cu_q is not None else 0,
                                  cu_k.ptr if cu_k is not None else 0)
    kernels.launch(plan.kernel, stream, argument)


_SCRATCH_ALIGN = 512  # each scratch buffer starts where a separate pool allocation would


# sm90 walks the ordered grid for causal backwards over at most this many keys, in either mode.
_WALK_CAUSAL_KEYS = 2048


def _dq_order(family: str, mask: str, softcap: bool, max_seqlen_k: int, deterministic: bool) -> str:
    """dispatch.DQ_ORDERS entry of a backward. sm90 walks the ordered grid (CTAs walking their key
    blocks in order, dQ into per-CTA splits) rather than running one CTA per key block, in either
    mode, for causal sequences up to _WALK_CAUSAL_KEYS keys, whose key blocks are few and of
    unequal length, so that walking them amortises each CTA's start and balances the work (causal
    512 and 1k: +4-10% at d64 and d128, 2k even; benchmarks/NOTES.md, sm90 backward v5; measured
    again in session 13). A softcap runs the window kernel, which does not walk.
    Otherwise default mode takes any order, and deterministic mode takes turns per query block on
    the default grid (flash_bwd.cu) where the family has it, else walks."""
    orders = dispatch.dq_orders(family, mask, softcap)
    if family == "sm90" and "walk" in orders and max_seqlen_k <= _WALK_CAUSAL_KEYS:
        return "walk"
    if not deterministic:
        return "any"
    return "turns" if "turns" in orders else "walk"


def _backward_plan(qt, kt, vt, out_t, dout_t, lse_t, grads: tuple, scale: float, window: tuple[int, int],
                   softcap: float, deterministic: bool, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                   cu_seqlens=(None, None)) -> _BackwardPlan:
    """The backward's three kernels over a fixed-length batch (BSHD tensors) or a packed one
    (batch-of-one views, ``cu_seqlens`` the two int32 DeviceTensors), writing the 16-bit
    gradients ``grads`` (dq, dk, dv: DeviceTensors or interop.contiguous records); ``window`` from
    _kernel_window."""
    _, rows_q, heads, head_dim = qt.shape
    device_plan = (family, capability) = _device_plan(qt.device)
    mask = _mask_kind(window)
    # sm90's main kernel where it serves the head dim and tensor maps can describe the tensors.
    main_family = dispatch.backward_family(family, head_dim)
    if main_family == "sm90" and not all(tma_ready(t) for t in (qt, kt, vt, dout_t)):
        main_family = "sm80"
    dq_order = _dq_order(main_family, mask, bool(softcap), max_seqlen_k, deterministic)
    walk, turns = dq_order == "walk", dq_order == "turns"
    preprocess, main, convert = dispatch.backward_kernels(main_family, head_dim, mask, qt.dtype, bool(softcap),
                                                          dq_order)
    arch = dispatch.compile_arch("sm80", capability)  # the preprocess and convert kernels
    n_blocks = -(-max_seqlen_k // main.tile.block_n)
    if n_blocks > _MAX_GRID_YZ:  # causal grids put the key blocks in grid.z
        raise ValueError(f"k: sequences must be at most {_MAX_GRID_YZ * main.tile.block_n} keys long for the "
                         f"backward at head_dim {head_dim}, got {max_seqlen_k}")
    group = heads // kt.shape[2]
    # Walk: as many CTAs per (batch, head) as fill the resident slots in one wave
    # (rounding up would leave a second, nearly empty wave: measured 147 vs 271 TFLOP/s), each
    # walking its share of the key blocks in order into its own fp32 dQ split (flash_bwd.cu);
    # splits added in order.
    slots = _multiprocessors(qt.device) * main.tile.ctas_per_sm
    splits = max(1, min(n_blocks, slots // (batch * heads))) if walk else 1
    # Scratch, one allocation: fp32 dq_accum, [int32 dq_turns,] [fp32 dk_accum, dv_accum,] fp32
    # delta, the zeroed ones first. dq_accum rows are padded to the head-dim bucket so the
    # kernel's reductions need no column checks (flash_bwd.cu), sm90's by a few columns more
    # (dispatch.SM90_BWD_DQ_ROW_PAD), the rows of one head contiguous. dq_turns: a counter per
    # (batch, head, query block). GQA: the walk and turns (the orders that repeat bitwise) keep
    # one dK/dV slice per query head, plainly stored and summed by the convert kernel; otherwise
    # heads_kv slices added to atomically, so zeroed.
    per_query_head = walk or turns
    bucket = dispatch.head_dim_bucket(head_dim)
    dq_row = bucket + (dispatch.SM90_BWD_DQ_ROW_PAD if main.family == "sm90" else 0)
    arrays = [((splits, qt.shape[0], heads, rows_q, dq_row), "float32")]
    if turns:
        arrays.append(((batch, heads, -(-max_seqlen_q // main.tile.block_m)), "int32"))
    if group > 1:
        arrays += [((*kt.shape[:2], heads if per_query_head else kt.shape[2], head_dim), "float32")] * 2
    arrays.append((lse_t.shape, "float32"))  # delta
    records, end = [], 0
    for shape, dtype in arrays:
        record = interop.contiguous(shape, qt, dtype)._replace(ptr=end)
        records.append(record)
        end += -(-record.itemsize * math.prod(shape) // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    dq_accum, delta = records[0], records[-1]
    dq_turns = records[1] if turns else None
    dk_accum, dv_accum = records[1 + turns:3 + turns] if group > 1 else (None, None)
    zeroed = records[1 + turns + (2 if group > 1 and not per_query_head else 0)].ptr

    # Turns without a causal mask: the key blocks of turn_heads heads interleaved (flash_bwd.cu),
    # as many heads as make one wave of their key blocks.
    grouped = turns and not main.blocks_slowest
    turn_heads = max(1, min(heads, slots // n_blocks)) if grouped else 1
    packed = pack_bwd_params(qt, kt, vt, out_t, dout_t, lse_t, delta, dq_accum, grads[1], grads[2], dk_accum,
                             dv_accum, dq_turns, scale, window, softcap, *cu_seqlens, turn_heads=turn_heads)
    argument = ArgumentBuffer(packed, BWD_POINTERS)
    main_argument = (sm90_backward_argument(packed, qt, kt, vt, dout_t, main.tile.block_m, main.tile.block_n)
                     if main.family == "sm90" else None)
    # Causal key blocks go slowest in the grid, longest first (flash_bwd.cu).
    if walk:
        grid = (splits, heads, batch)
    elif grouped:
        grid = (n_blocks * turn_heads, -(-heads // turn_heads), batch)
    else:
        grid = (heads, batch, n_blocks) if main.blocks_slowest else (n_blocks, heads, batch)
    # (source, gradient, its (batch, row, head) strides in the source, summands, their stride,
    # scale): dQ sums its splits and takes the softmax scale; per-query-head GQA dK/dV sum the
    # group's adjacent query-head slices (dK already scaled by the main kernel).
    dq_strides = (heads * rows_q * dq_row, dq_row, rows_q * dq_row)
    converts = [(dq_accum, 0, dq_strides, splits, math.prod(dq_accum.shape[1:]), scale)]
    if group > 1:
        slices = dk_accum.shape[2]  # heads_kv, or heads
        kv_strides = (math.prod(dk_accum.shape[1:]), slices * head_dim,
                      group * head_dim if per_query_head else head_dim)
        summands = (group, head_dim) if per_query_head else (1, 0)
        converts += [(src, index, kv_strides, *summands, 1.0) for src, index in ((dk_accum, 1), (dv_accum, 2))]
    rows_per_block = dispatch.helper_rows_per_block(head_dim)
    convert_launches = []
    for src, index, src_strides, summands, summand_stride, factor in converts:
        grad_batch, grad_rows, grad_heads = grads[index].shape[:3]
        convert_launches.append((
            kernels.prepare(convert, arch, qt.device, (-(-grad_rows // rows_per_block), grad_heads, grad_batch)),
            ArgumentBuffer(pack_convert_params(src, grads[index], src_strides, summands, summand_stride, factor),
                           CONVERT_POINTERS),
            src.ptr, index))
    return _BackwardPlan(
        device_plan, kernels.prepare(preprocess, arch, qt.device, (-(-max_seqlen_q // rows_per_block), heads, batch)),
        kernels.prepare(main, dispatch.compile_arch(main.family, capability), qt.device, grid), argument, main_argument,
        (delta.ptr, dq_accum.ptr, dk_accum.ptr if dk_accum else None, dv_accum.ptr if dv_accum else None,
         dq_turns.ptr if dq_turns else None),
        end, zeroed, tuple(convert_launches))


def _run_backward(plan: _BackwardPlan, framework: str, stream: int, qt, kt, vt, out_t, dout_t, lse_t,
                  grad_ptrs: tuple[int, int, int], cu_seqlens=(None, None)) -> None:
    """Allocate and zero the scratch, launch ``plan`` (inside interop.on_device)."""
    owner, base = interop.scratch(framework, qt, plan.scratch_bytes)  # referenced until the launches are queued
    interop.zero(base, plan.zeroed_bytes, stream)
    delta, dq_accum, dk_accum, dv_accum, dq_turns = (base + offset if offset is not None else 0
                                                     for offset in plan.offsets)
    cu_q, cu_k = cu_seqlens
    pointers = (qt.ptr, kt.ptr, vt.ptr, out_t.ptr, dout_t.ptr, lse_t.ptr, delta, dq_accum, grad_ptrs[1], grad_ptrs[2],
                dk_accum, dv_accum, dq_turns, cu_q.ptr if cu_q is not None else 0, cu_k.ptr if cu_k is not None else 0)
    argument = plan.argument.fill(*pointers)
    kernels.launch(plan.preprocess, stream, argument)
    kernels.launch(plan.main, stream, argument if plan.main_argument is None else plan.main_argument.fill(*pointers))
    for kernel, convert, src_offset, index in plan.converts:
        kernels.launch(kernel, stream, convert.fill(base + src_offset, grad_ptrs[index]))
    del owner


def _framework(arrays: dict[str, Any]) -> str:
    """The framework of ``arrays["q"]``; every array (by argument name) must be on the same side
    (NumPy vs device) as q."""
    q = arrays["q"]
    kind, cls = interop.framework_of(q, "q"), type(q)
    # Arrays of q's own type are on q's side, except torch tensors, whose type holds CPU and CUDA.
    # A loop: all() over a generator costs ~0.25 us more per call.
    if kind != "torch":
        for x in arrays.values():
            if type(x) is not cls:
                break
        else:
            return kind
    found = {name: interop.framework_of(x, name) for name, x in arrays.items()}
    q_side = found["q"] == "numpy"
    for name, framework in found.items():
        if (framework == "numpy") != q_side:
            sides = ("on the CPU (NumPy)", "on the GPU")
            raise TypeError(f"{name}: is {sides[framework != 'numpy']}, but q is {sides[not q_side]}; "
                            f"pass q, k, v (and out) on the same side")
    return found["q"]


def _check_like(name: str, t, expected_shape: tuple[int, ...], like, on_device: bool) -> None:
    """``t`` (an output or a forward tensor) must have ``expected_shape``, ``like``'s dtype and
    device, and a contiguous last dimension."""
    if tuple(t.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {tuple(expected_shape)}, got {tuple(t.shape)}")
    if _dtype_name(t) != _dtype_name(like):
        raise TypeError(f"{name}: expected dtype {_dtype_name(like)} like q, got {_dtype_name(t)}")
    if _strides(t)[-1] != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
    if on_device and t.device != like.device:
        raise ValueError(f"{name}: on device {t.device}, but q is on device {like.device}")


def _check_out(name: str, t, expected_shape: tuple[int, ...], like, on_device: bool) -> None:
    """An output the kernels write with 16-byte stores."""
    _check_like(name, t, expected_shape, like, on_device)
    if on_device and not t.aligned_16:
        raise ValueError(f"{name}: data pointer and strides must be 16-byte aligned (the kernel "
                         f"writes 16-byte vectors)")


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def _device_plan(device_id: int) -> tuple[str, tuple[int, int]]:
    """(kernel family, compute capability) of a device; the family as CUFLASH_FAMILY was when
    first asked (cache_clear() to re-read it)."""
    import cupy

    capability = divmod(int(cupy.cuda.Device(device_id).compute_capability), 10)  # "90" -> (9, 0)
    return dispatch.select_family(capability), capability


def explain(q: Any, k: Any, v: Any, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
            softcap: float = 0.0) -> dispatch.KernelChoice:
    """The forward kernel ``attention(q, k, v, causal=..., window=..., softcap=...)`` runs for
    these GPU arrays on their device: its family (``sm90``, or ``sm80`` where no tensor map can
    describe a tensor's strides), instantiation name, threads, shared memory and tile. Launches
    nothing."""
    framework = _framework({"q": q, "k": k, "v": v})
    if framework == "numpy":
        raise TypeError("q: explain describes GPU kernels; NumPy arrays run the CPU reference")
    qt, kt, vt = (interop.describe(x, framework, name) for name, x in (("q", q), ("k", k), ("v", v)))
    _check_qkv(qt, kt, vt, on_device=True)
    qt, kt, vt = (t if t.aligned_16 else interop.realign(t, framework) for t in (qt, kt, vt))
    kernel_window = _kernel_window(_resolve_flag("causal", causal), _resolve_window(window), qt.shape[1], kt.shape[1])
    return _forward_choice(_device_plan(qt.device)[0], qt, kt, vt, kernel_window, _resolve_softcap(softcap),
                           qt.shape[1])


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    out: Any = None,
) -> Any:
    """Exact attention ``softmax(q kᵀ · softmax_scale) v``, computed tile by tile.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads, head_dim)
        CuPy array, torch CUDA tensor, other DLPack tensor (float16 or bfloat16), or NumPy array
        (float16, bfloat16, float32 or float64: the CPU reference path).
    k, v : array, shape (batch, seqlen_k, heads_kv, head_dim)
        Same dtype and device as q; ``heads % heads_kv == 0`` (GQA; MQA when heads_kv is 1).
    causal : bool
        Query i sees key j only if ``j <= i + seqlen_k - seqlen_q`` (aligned bottom-right).
    softmax_scale : float, optional
        Finite and positive; default ``1 / sqrt(head_dim)``.
    window : (left, right)
        Sliding window as flash-attn's ``window_size``: query i sees key j only if
        ``i + d - left <= j <= i + d + right`` with ``d = seqlen_k - seqlen_q``; -1 leaves a side
        unbounded; ``causal`` sets right to 0. Key blocks outside every row's window are skipped,
        so the cost follows the window.
    softcap : float
        ``> 0``: scaled scores s become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2,
        Grok); 0 disables it.
    return_lse : bool
        Also return the log-sum-exp of the scaled scores, float32 (batch, heads, seqlen_q),
        natural log; ``-inf`` for a row that sees no key (its output row is 0).
    out : array, optional
        Where to write the output, shape and dtype of q, same framework and device.

    Returns
    -------
    out or (out, lse)
        In the caller's framework: torch in, torch out (on torch's current stream); CuPy or
        another DLPack producer in, CuPy out; NumPy in, NumPy out.

    Raises
    ------
    TypeError
        Unsupported array type or dtype (float32/float64 on the GPU: cast first), mixed dtypes,
        CPU and GPU arrays mixed, a softmax_scale that is not a real number, a causal that is not
        a bool (or 0 / 1).
    ValueError
        Wrong rank, mismatched shapes, heads not a multiple of heads_kv, head_dim not a positive
        multiple of 8 or above 256, a non-contiguous last dimension, arrays on different devices, a bad
        ``out``, a non-finite or non-positive softmax_scale.

    Notes
    -----
    head_dim is served from a bucket of 64, 96, 128, 192 or 256. q, k and v may have any
    strides with a contiguous last dimension; a tensor whose pointer or strides are not 16-byte
    aligned is copied once, because the kernel loads 16-byte vectors.
    """
    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    framework = _framework(arrays)
    causal = _resolve_flag("causal", causal)
    window, softcap = _resolve_window(window), _resolve_softcap(softcap)
    if framework == "numpy":
        return _attention_host(q, k, v, causal, softmax_scale, window, softcap, return_lse, out)

    # One call each: a generator over the three costs ~0.4 us more.
    qt, kt = interop.describe(q, framework, "q"), interop.describe(k, framework, "k")
    vt = interop.describe(v, framework, "v")
    out_t = interop.describe(out, interop.framework_of(out, "out"), "out") if out is not None else None
    # Everything _check_qkv, _resolve_scale, _check_out and _forward_plan read, but pointers; the
    # window and softcap are already resolved.
    key = (("attention", qt.layout, kt.layout, vt.layout, out_t and out_t.layout, causal, softmax_scale, window,
            softcap) if type(softmax_scale) in _KEY_SCALARS else None)
    plan = _cached_plan(key, qt.device)
    if plan is None or not _aligned_pointers(qt, kt, vt, out_t):
        _check_qkv(qt, kt, vt, on_device=True)
        scale = _resolve_scale(softmax_scale, qt.shape[3])
        if out_t is not None:
            _check_out("out", out_t, qt.shape, qt, on_device=True)
        aligned = qt.aligned_16 and kt.aligned_16 and vt.aligned_16
        if not aligned:  # copied once; such a call is not cached
            qt, kt, vt = (t if t.aligned_16 else interop.realign(t, framework) for t in (qt, kt, vt))
        batch, seqlen_q, heads = qt.shape[:3]
        plan = _forward_plan(qt, kt, vt, out_t or interop.contiguous(qt.shape, qt),
                             interop.contiguous((batch, heads, seqlen_q), qt, "float32"), scale,
                             _kernel_window(causal, window, seqlen_q, kt.shape[1]), softcap, batch, seqlen_q)
        if aligned:
            _remember(key, plan)
    with interop.on_device(qt.device):
        stream = interop.stream_handle(framework, qt.device)
        result, out_ptr = (out, out_t.ptr) if out_t is not None else interop.allocate(framework, qt, qt.shape)
        lse, lse_ptr = _allocate_lse(plan, framework, qt, return_lse)
        _run_forward(plan, stream, qt, kt, vt, out_ptr, lse_ptr)
    return (result, lse) if return_lse else result


def _attention_host(q, k, v, causal, softmax_scale, window, softcap, return_lse, out):
    """NumPy in, NumPy out: the blockwise online-softmax algorithm in float64."""
    _check_qkv(q, k, v, on_device=False)
    scale = _resolve_scale(softmax_scale, q.shape[3])
    if out is not None:
        _check_out("out", out, tuple(q.shape), q, on_device=False)
    result, lse = reference.attention_blockwise(q, k, v, causal=causal, softmax_scale=scale, window=window,
                                                softcap=softcap)
    return _host_output(result, lse, q.dtype, out, return_lse)


# attention_backward's described inputs by name.
_BACKWARD_INPUTS = operator.itemgetter("q", "k", "v", "dout", "out", "lse")


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
) -> tuple[Any, Any, Any]:
    """Gradients of ``out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale)``.

    P is recomputed from ``lse`` block by block (FlashAttention-2): nothing of size
    seqlen_q x seqlen_k is stored; the extra device memory is O(batch x heads x seqlen) plus fp32
    accumulators the size of dq (and of dk, dv under GQA/MQA).

    Parameters
    ----------
    dout : array, shape and dtype of q
        Upstream gradient of ``out``.
    q, k, v, out : arrays
        The forward's inputs and output, as for :func:`attention`.
    lse : array, float32 (batch, heads, seqlen_q), contiguous
        The forward's log-sum-exp (``attention(..., return_lse=True)``).
    causal, softmax_scale, window, softcap
        As in the forward call.
    deterministic : bool
        False (default): dq, and under GQA/MQA dk and dv, are summed with fp32 atomic adds (on
        sm90, bulk reductions of whole dq blocks) whose order varies between runs, so results can
        differ in the last bits from run to run.
        True: bitwise-identical gradients on every run; GQA/MQA dk, dv are stored per query head
        and summed in head order. On sm90 (Hopper) each block of 64 query rows takes the key
        blocks' dq terms in key-block order: a counter per (batch, head, query block) says whose
        turn it is, and a CTA waits for its turn before adding its block (so CTAs do wait for
        each other; the grid is ordered so that they rarely do). Short causal sequences walk as in
        default mode (below). Elsewhere each (batch, head) gets max(1, resident CTA slots //
        (batch * heads)) CTAs (at most one per key block) that walk their key blocks in a fixed
        order, each summing dq into its own fp32 buffer, the buffers added in index order.
        Costs: the counters (4 bytes per 64 query rows and head) on sm90, the walk's dq-sized fp32
        buffers (one when batch * heads fills the GPU) elsewhere, and under GQA/MQA 2 x (batch,
        seqlen_k, heads, head_dim) fp32 instead of heads_kv; time on the H200: within 17% of
        default mode at every standard shape, 1k to 16k tokens, causal or not
        (benchmarks/results/2026-12-01-h200-softcap-tanh-flex-session14.md).
    dq, dk, dv : arrays, optional
        Where to write the gradients (shapes of q, k, v; dtype of q).

    Returns
    -------
    (dq, dk, dv)
        In the caller's framework, as for :func:`attention`; dk and dv summed over each group of
        query heads for GQA/MQA.

    Raises
    ------
    TypeError, ValueError
        As for :func:`attention`, and for a deterministic that is not a bool (or 0 / 1), dout/out
        not matching q, an lse that is not float32 or not (batch, heads, seqlen_q), or gradients
        passed in dq/dk/dv of the wrong shape or dtype.
    """
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        if x is not None:
            arrays[name] = x
    framework = _framework(arrays)
    causal, deterministic = _resolve_flag("causal", causal), _resolve_flag("deterministic", deterministic)
    if framework == "numpy":
        return _backward_host_checked(arrays, causal, softmax_scale, window, softcap)
    tensors = {name: interop.describe(x, framework, name) for name, x in arrays.items()}
    # Item getters, not generators over the names (~0.5 us).
    qt, kt, vt, dout_t, out_t, lse_t = _BACKWARD_INPUTS(tensors)
    given_t = dq_t, dk_t, dv_t = tensors.get("dq"), tensors.get("dk"), tensors.get("dv")
    batch, seqlen_q, heads = qt.shape[:3]
    # Everything _check_qkv, _check_backward_inputs, the option checks and _backward_plan read,
    # but pointers.
    key = (("attention_backward", qt.layout, kt.layout, vt.layout, dout_t.layout, out_t.layout, lse_t.layout,
            dq_t and dq_t.layout, dk_t and dk_t.layout, dv_t and dv_t.layout, causal, softmax_scale, window, softcap,
            deterministic)
           if (type(softmax_scale) in _KEY_SCALARS
               and _plain_window(window) and type(softcap) in _KEY_SCALARS) else None)
    plan = _cached_plan(key, qt.device)
    if plan is None or not _aligned_pointers(qt, kt, vt, dout_t, out_t, dq_t, dk_t, dv_t):
        _check_qkv(qt, kt, vt, on_device=True)
        scale = _resolve_scale(softmax_scale, qt.shape[3])
        _check_backward_inputs(tensors, (batch, heads, seqlen_q), on_device=True)
        window, softcap = _resolve_window(window), _resolve_softcap(softcap)
        aligned = all(t.aligned_16 for t in (qt, kt, vt, dout_t, out_t))
        if not aligned:  # copied once; such a call is not cached
            qt, kt, vt, dout_t, out_t = (t if t.aligned_16 else interop.realign(t, framework)
                                         for t in (qt, kt, vt, dout_t, out_t))
        grads = tuple(t or interop.contiguous(like.shape, qt) for t, like in zip(given_t, (qt, kt, kt)))
        plan = _backward_plan(qt, kt, vt, out_t, dout_t, lse_t, grads, scale,
                              _kernel_window(causal, window, seqlen_q, kt.shape[1]), softcap,
                              deterministic, batch, seqlen_q, kt.shape[1])
        if aligned:
            _remember(key, plan)
    with interop.on_device(qt.device):
        stream = interop.stream_handle(framework, qt.device)
        dq, dq_ptr = (dq, dq_t.ptr) if dq_t is not None else interop.allocate(framework, qt, qt.shape)
        dk, dk_ptr = (dk, dk_t.ptr) if dk_t is not None else interop.allocate(framework, qt, kt.shape)
        dv, dv_ptr = (dv, dv_t.ptr) if dv_t is not None else interop.allocate(framework, qt, kt.shape)
        _run_backward(plan, framework, stream, qt, kt, vt, out_t, dout_t, lse_t, (dq_ptr, dk_ptr, dv_ptr))
    return dq, dk, dv


def _backward_host_checked(arrays: dict, causal, softmax_scale, window, softcap):
    """attention_backward on NumPy arrays: the checks, then the float64 reference."""
    qt, kt, vt = arrays["q"], arrays["k"], arrays["v"]
    _check_qkv(qt, kt, vt, on_device=False)
    scale = _resolve_scale(softmax_scale, qt.shape[3])
    batch, seqlen_q, heads, _ = qt.shape
    _check_backward_inputs(arrays, (batch, heads, seqlen_q), on_device=False)
    window, softcap = _resolve_window(window), _resolve_softcap(softcap)
    return _backward_host(arrays, causal, scale, window, softcap)


def _check_backward_inputs(tensors: dict, lse_shape: tuple[int, ...], on_device: bool) -> None:
    """dout and out like q; lse float32, contiguous, of ``lse_shape``, on q's device; gradients
    passed in dq, dk, dv shaped like q, k, v."""
    qt, kt = tensors["q"], tensors["k"]
    _check_like("dout", tensors["dout"], qt.shape, qt, on_device)
    _check_like("out", tensors["out"], qt.shape, qt, on_device)
    lse_t = tensors["lse"]
    if _dtype_name(lse_t) != "float32":
        raise TypeError(f"lse: expected float32 (as the forward's return_lse=True gives it), got {_dtype_name(lse_t)}")
    if tuple(lse_t.shape) != tuple(lse_shape):
        raise ValueError(f"lse: expected shape {tuple(lse_shape)}, got {tuple(lse_t.shape)}")
    if _strides(lse_t) != tuple(math.prod(lse_shape[i + 1:]) for i in range(len(lse_shape))):
        raise ValueError("lse: must be contiguous")
    if on_device and lse_t.device != qt.device:
        raise ValueError(f"lse: on device {lse_t.device}, but q is on device {qt.device}")
    for name, like_shape in (("dq", qt.shape), ("dk", kt.shape), ("dv", kt.shape)):
        if name in tensors:
            _check_out(name, tensors[name], like_shape, qt, on_device)


def _host_output(result: np.ndarray, lse: np.ndarray, dtype, out, return_lse: bool):
    """The CPU path's float64 result cast to the inputs' dtype, into ``out`` when given."""
    if out is None:
        out = result.astype(dtype)
    else:
        out[...] = result.astype(dtype)
    return (out, lse.astype(np.float32)) if return_lse else out


def _host_gradients(result, given: dict, dtype) -> tuple:
    """The CPU path's float64 (dq, dk, dv) cast to the inputs' dtype, into the arrays given."""
    grads = []
    for name, value in zip(("dq", "dk", "dv"), result):
        if given.get(name) is not None:
            given[name][...] = value.astype(dtype)
            grads.append(given[name])
        else:
            grads.append(value.astype(dtype))
    return tuple(grads)


def _backward_host(tensors: dict, causal: bool, scale: float, window: tuple[int, int], softcap: float):
    """NumPy in, NumPy out: the float64 reference gradients, cast to the inputs' dtype."""
    q = tensors["q"]
    result = reference.attention_backward_reference(tensors["dout"], q, tensors["k"], tensors["v"],
                                                    causal=causal, softmax_scale=scale, window=window,
                                                    softcap=softcap)
    return _host_gradients(result, tensors, q.dtype)
