"""Launch plans: everything a launch needs that follows from the tensors' layouts and the options,
computed once per distinct call, cached, and launched.

A plan holds the kernels, grids, scratch layout and argument structs but for their pointers; a
repeated call fills in the pointers and launches. Every entry point runs the same pipeline,
``run``: its checks give a checked call (a checks record), the record's ``plan_key`` names the
plan (built on a miss), and the plan's ``launch`` runs it. A plan key is taken at that one moment,
after the checks, from the record alone, for every operation.

An entry point whose repeated calls would cost mostly their checks (the fixed-length forward and
backward, a decoding step against a KV cache) also gives ``run`` the call's signature: its
arguments as passed, every array's layout and every option, when its checks read nothing else.
A signature is not a second key chosen per field: it holds the whole call, so it decides the
checked call and therefore its plan key; ``run`` records it beside the plan that key named once the
checks have passed, and a later call of that signature launches that plan without checks. Errors
are never recorded, so a bad input always runs the full checks and raises as it would uncached.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from cuflash._core import checks, dispatch, interop, kernels
from cuflash._core.params import (BWD_POINTERS, COMBINE_POINTERS, CONVERT_POINTERS, DROPOUT_WORDS, FWD_CACHE_POINTERS,
                                  FWD_DESCALES, FWD_POINTERS, KV_POINTERS, MERGE_POINTERS, MLA_POINTERS,
                                  QUANTIZE_POINTERS, ArgumentBuffer, pack_bwd_params, pack_combine_params,
                                  pack_convert_params, pack_fwd_params, pack_fwd_params_fp8, pack_fwd_params_paged,
                                  pack_kv_params, pack_merge_params, pack_mla_params, pack_quantize_params,
                                  mla_tma_argument, sm90_backward_argument, sm90_forward_argument, tma_ready)

__all__ = ["PLANS", "SIGNATURE_SCALARS", "BackwardPlan", "CombinePlan", "ForwardPlan", "KvCachePlan", "MlaPlan",
           "PlanCache", "QuantizePlan", "aligned_pointers", "build_backward", "build_combine", "build_forward",
           "build_kvcache", "build_mla", "build_quantize", "fill_empty", "NO_LENGTHS", "run", "sinks_gradient", "zeros"]

# cu_seqlens of a fixed-length batch: none.
NO_LENGTHS = (None, None)
# Option types whose values alone decide validation: a signature holds a scalar only if its type is
# one of these, because True == 1 and hash(True) == hash(1), yet softmax_scale=True or
# window=(True, 0) must raise TypeError where 1 and (1, 0) pass. Other types run their checks on
# every call (and work).
SIGNATURE_SCALARS = frozenset({int, float, type(None)})
_SCRATCH_ALIGN = 512  # each scratch buffer starts where a separate pool allocation would


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    target: tuple[str, tuple[int, int]]  # (family, compute capability) it was built for
    kernel: kernels.Launch
    # FwdParams or FwdParamsFp8, or either inside FwdParamsSm90Of (maps encoded per fill); pointers in
    # FWD_POINTERS order, then FP8's FWD_DESCALES
    argument: ArgumentBuffer
    lse_shape: tuple[int, ...]  # of the float32 lse a call writes when the caller wants it
    head_dim_v: int  # of v and out
    out_dtype: str | None = None  # of an FP8 call's output; None: q's dtype

    def launch(self, framework: str, tensors: tuple, given: tuple, given_t: tuple, return_lse: bool,
               cu_seqlens=NO_LENGTHS, bias: checks.Bias = checks.NO_BIAS,
               dropout: tuple[int, int, int] = checks.NO_DROPOUT_WORDS) -> tuple[Any, Any]:
        """(out, lse) of one launch on ``tensors`` (q, k, v, and for FP8 inputs the three descales:
        DeviceTensors, or floats that the plan holds), into ``given`` (out, or None) whose
        DeviceTensor is ``given_t``; lse is None unless ``return_lse``: the kernels skip the lse
        stores for a null pointer, so nothing is allocated for it. ``bias``: the call's sinks and
        ALiBi slopes (the plan was built for slopes of their stride, or none). ``dropout``: the
        call's checks.Dropout.words (the plan was built for its dropout_p, or none). ``cu_seqlens``: a
        packed batch's (cu_seqlens_q, cu_seqlens_k[, seqused_q, seqused_k]). Each sequence ends where
        the kernel reads seq_end_q / seq_end_k: cu_seqlens + 1, or with seqused the rows
        cu_seqlens[b] + seqused[b] (seq_ends, framework arithmetic on the same stream); with
        seqused_q the kernel skips the rows past it, so out is zero-filled and lse set to -inf
        first (the framework's fills)."""
        qt, kt, vt = tensors[:3]
        out_t = given_t[0]
        with interop.on_device(qt.device):
            stream = interop.stream_handle(framework, qt.device)
            out, out_ptr = ((given[0], out_t.ptr) if out_t is not None
                            else interop.allocate(framework, qt, (*qt.shape[:-1], self.head_dim_v), self.out_dtype))
            lse, lse_ptr = (interop.allocate(framework, qt, self.lse_shape, "float32") if return_lse else (None, 0))
            cu_q, cu_k, used_q, used_k = cu_seqlens if len(cu_seqlens) == 4 else (*cu_seqlens, None, None)
            end_q, end_q_ptr = seq_ends(framework, cu_q, used_q)
            end_k, end_k_ptr = seq_ends(framework, cu_k, used_k)
            pointers = (qt.ptr, kt.ptr, vt.ptr, out_ptr, lse_ptr, cu_q.ptr if cu_q is not None else 0,
                        cu_k.ptr if cu_k is not None else 0, end_q_ptr, end_k_ptr, *bias.pointers)
            if used_q is not None:
                _fill(framework, out_t.native if out_t is not None else out, 0.0)
                if lse is not None:
                    _fill(framework, lse, -math.inf)
            if self.out_dtype is not None:
                pointers += tuple(d.ptr if isinstance(d, interop.DeviceTensor) else 0 for d in tensors[3:])
            else:
                pointers += dropout
            kernels.launch(self.kernel, stream, self.argument.fill(*pointers))
            del end_q, end_k  # referenced until the launch is queued
        return out, lse


def seq_ends(framework: str, cu, used) -> tuple[Any, int]:
    """(owner, pointer) of the (batch,) int32 rows where each packed sequence ends for the kernel
    (FwdParams.seq_end_*): ``cu`` (a DeviceTensor of cu_seqlens, or None: a fixed-length batch, 0)
    shifted by one entry, or with ``used`` (seqused, a DeviceTensor) ``cu[b] + clip(used[b], 0,
    cu[b + 1] - cu[b])``, computed by the framework on its current stream (the launch's)."""
    if cu is None:
        return None, 0
    if used is None:
        return None, cu.ptr + 4
    c, u = cu.native, used.native
    if framework == "torch":
        ends = c[:-1] + _torch_clip(u, c[1:] - c[:-1])
        return ends, ends.data_ptr()
    import cupy

    ends = c[:-1] + cupy.clip(u, 0, c[1:] - c[:-1]).astype(cupy.int32)
    return ends, ends.data.ptr


def _torch_clip(used, sizes):
    """``clip(used, 0, sizes)`` elementwise in torch, int32."""
    import torch

    return torch.minimum(used.clamp(min=0), sizes).to(torch.int32)


@dataclass(frozen=True, eq=False)
class BackwardPlan:
    target: tuple[str, tuple[int, int]]
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

    def launch(self, framework: str, tensors: tuple, given: tuple, given_t: tuple,
               cu_seqlens=NO_LENGTHS, bias: checks.Bias = checks.NO_BIAS,
               dropout: tuple[int, int, int] = checks.NO_DROPOUT_WORDS) -> tuple[Any, Any, Any, Any]:
        """(dq, dk, dv, dsinks) of one run on ``tensors`` (q, k, v, out, dout, lse), into ``given``
        (dq, dk, dv, each or None) whose DeviceTensors are ``given_t``: the scratch allocated and
        zeroed, then the preprocess, main and convert kernels. ``bias``: the forward's sinks and
        ALiBi slopes; dsinks (float32, from the preprocess's delta: sinks_gradient) is None
        without sinks. ``dropout``: the forward's checks.Dropout.words, as ForwardPlan.launch's."""
        qt, kt, vt, out_t, dout_t, lse_t = tensors
        dq, dk, dv = given
        dq_t, dk_t, dv_t = given_t
        with interop.on_device(qt.device):
            stream = interop.stream_handle(framework, qt.device)
            dq, dq_ptr = (dq, dq_t.ptr) if dq_t is not None else interop.allocate(framework, qt, qt.shape)
            dk, dk_ptr = (dk, dk_t.ptr) if dk_t is not None else interop.allocate(framework, qt, kt.shape)
            dv, dv_ptr = (dv, dv_t.ptr) if dv_t is not None else interop.allocate(framework, qt, vt.shape)
            owner, base = interop.scratch(framework, qt, self.scratch_bytes)  # referenced until the launches are queued
            interop.zero(base, self.zeroed_bytes, stream)
            delta, dq_accum, dk_accum, dv_accum, dq_turns = (base + offset if offset is not None else 0
                                                             for offset in self.offsets)
            cu_q, cu_k = cu_seqlens
            pointers = (qt.ptr, kt.ptr, vt.ptr, out_t.ptr, dout_t.ptr, lse_t.ptr, delta, dq_accum, dk_ptr, dv_ptr,
                        dk_accum, dv_accum, dq_turns, cu_q.ptr if cu_q is not None else 0,
                        cu_k.ptr if cu_k is not None else 0, bias.pointers[1], *dropout)
            argument = self.argument.fill(*pointers)
            kernels.launch(self.preprocess, stream, argument)
            kernels.launch(self.main, stream,
                           argument if self.main_argument is None else self.main_argument.fill(*pointers))
            grad_ptrs = (dq_ptr, dk_ptr, dv_ptr)
            for kernel, convert, src_offset, index in self.converts:
                kernels.launch(kernel, stream, convert.fill(base + src_offset, grad_ptrs[index]))
            dsinks = (None if bias.sinks is None
                      else sinks_gradient(framework, bias.sinks.native, lse_t.native,
                                          _scratch_view(framework, owner, self.offsets[0], lse_t.shape)))
            del owner
        return dq, dk, dv, dsinks


def sinks_gradient(framework: str, sinks, lse, delta):
    """``dsinks_h = -sum_{b,i} exp(sinks_h - lse_bhi) * delta_bhi`` in float32, from the forward's
    lse (which includes the sink) and the backward's delta = rowsum(dout * out), both (batch,
    heads, rows) or a packed batch's (heads, total_q): framework reductions on the launch's stream,
    whose order is fixed, so the result repeats bitwise. lse is clamped to float32's lowest finite
    value: a row of lse -inf (no key, and a sink of -inf) then adds exp(-inf) * 0 = 0, not NaN."""
    head_axis = lse.ndim - 2  # heads precede the rows in both layouts
    shape = [1] * lse.ndim
    shape[head_axis] = -1
    axes = tuple(axis for axis in range(lse.ndim) if axis != head_axis)
    if framework == "torch":
        import torch

        weight = torch.exp(sinks.reshape(shape) - lse.clamp(min=_FLOAT32_LOWEST))
    else:
        import cupy

        weight = cupy.exp(sinks.reshape(shape) - cupy.maximum(lse, _FLOAT32_LOWEST))
    return -(weight * delta).sum(axes)


_FLOAT32_LOWEST = -3.4028234663852886e38


def _scratch_view(framework: str, owner, offset: int, shape: tuple[int, ...]):
    """A contiguous float32 array of ``shape`` at byte ``offset`` of the scratch ``owner``
    (interop.scratch's), in its framework."""
    count = math.prod(shape)
    if framework == "torch":
        import torch

        return owner[offset:offset + 4 * count].view(torch.float32).view(shape)
    import cupy

    return cupy.ndarray(shape, cupy.float32, memptr=owner + offset)


class PlanCache:
    """Plans by key (a checked call's plan_key), and the plan each recorded signature names (run);
    oldest evicted first past ``max_size`` each: that bounds the memory when shapes keep changing
    (a growing KV cache makes a new key per step); 1024 plans are well under a megabyte. A plan is
    returned only if it was built for the family and arch the device has now
    (``dispatch.device_target.cache_clear()`` and a new CUFLASH_FAMILY must not run a stale
    kernel)."""

    def __init__(self, max_size: int = 1024):
        self.max_size = max_size
        self._plans: dict[tuple, Any] = {}
        self._signatures: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, device: int) -> Any:
        plan = self._plans.get(key)
        return plan if plan is not None and plan.target == dispatch.device_target(device) else None

    def recall(self, signature: tuple, device: int) -> Any:
        """The plan recorded for ``signature``, as ``get``."""
        plan = self._signatures.get(signature)
        return plan if plan is not None and plan.target == dispatch.device_target(device) else None

    def put(self, key: tuple, plan) -> None:
        self._store(self._plans, key, plan)

    def record(self, signature: tuple, plan) -> None:
        self._store(self._signatures, signature, plan)

    def _store(self, table: dict, key: tuple, plan) -> None:
        with self._lock:
            if len(table) >= self.max_size and key not in table:
                del table[next(iter(table))]
            table[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._signatures.clear()

    def items(self) -> list[tuple[tuple, Any]]:
        """(key, plan) pairs, oldest first."""
        return list(self._plans.items())

    def __len__(self) -> int:
        return len(self._plans)


PLANS = PlanCache()


def aligned_pointers(*tensors) -> bool:
    """The pointers of ``tensors`` (DeviceTensors or None) on 16-byte boundaries: a signature's
    condition, since its layouts hold their strides' alignment but not the pointers'."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.ptr
    return bits % 16 == 0


def run(signature: tuple | None, device: int, prepare: Callable, args: tuple, build: Callable, framework: str,
        tensors: tuple, given: tuple, given_t: tuple, *options) -> tuple:
    """The one pipeline of every entry point, after its tensors are described. ``signature``:
    None, or the call as passed (module docstring), formed only where its pointers are 16-byte
    aligned (its layouts hold the rest of what the checks and the plan read); a recorded one
    launches its plan on ``tensors``, unchecked. Otherwise
    ``prepare(*args)`` checks the call -> (checked call, the tensors to launch on, whether they are
    the ones given, nothing copied); the plan under the checked call's ``plan_key()``, or
    ``build(call)``, cached; the signature recorded for a call launched as given. Then the plan's
    launch on the tensors, into ``given`` (whose DeviceTensors are ``given_t``), with the plan's own
    ``options`` (ForwardPlan.launch's return_lse and cu_seqlens, ...)."""
    plan = PLANS.recall(signature, device) if signature is not None else None
    if plan is None:
        call, tensors, as_given = prepare(*args)
        key = call.plan_key()
        plan = PLANS.get(key, device)
        if plan is None:
            plan = build(call)
            PLANS.put(key, plan)
        if signature is not None and as_given:
            PLANS.record(signature, plan)
    return plan.launch(framework, tensors, given, given_t, *options)


def build_forward(qt, kt, vt, out_t, lse_t, scale: float, mask: dispatch.Mask, batch: int, max_seqlen_q: int,
                  cu_seqlens=NO_LENGTHS, descales: tuple | None = None, alibi: int | None = None,
                  dropout_p: float = 0.0) -> ForwardPlan:
    """The forward launch over a fixed-length batch (q, k, v, out BSHD) or a packed one
    (batch-of-one views, ``cu_seqlens`` the two int32 DeviceTensors), for validated tensors. out
    and lse may be interop.contiguous records. FP8 inputs take ``descales`` (q's, k's, v's: floats
    or float32 (batch, heads_kv) DeviceTensors, checks.Fp8) and write out's dtype. ``alibi``: the
    slopes' batch stride (checks.Bias.alibi_stride; ``mask`` made with alibi), None for none.
    ``dropout_p``: 16-bit inputs' dropout (``mask`` made with dropout), 0 for none."""
    family, capability = target = dispatch.device_target(qt.device)
    out_dtype = out_t.dtype if descales is not None else None
    launch = dispatch.forward_launch(family, qt, kt, vt, mask, batch, max_seqlen_q, cu_seqlens[0] is not None,
                                     qt.device, out_dtype)
    choice = launch.kernel
    if descales is not None:
        packed = pack_fwd_params_fp8(qt, kt, vt, out_t, lse_t, scale, mask.window, mask.softcap, *cu_seqlens,
                                     descales, alibi or 0)
    else:
        packed = pack_fwd_params(qt, kt, vt, out_t, lse_t, scale, mask.window, mask.softcap, *cu_seqlens, alibi or 0,
                                 dropout_p)
    if choice.family == "sm90":
        argument = sm90_forward_argument(packed, qt, kt, vt, choice.tile.block_m, choice.tile.block_n,
                                         (launch.m_blocks, qt.shape[2], batch))
    else:
        argument = ArgumentBuffer(packed, FWD_POINTERS,
                                  more_pointers=FWD_DESCALES if descales is not None else DROPOUT_WORDS)
    arch = dispatch.compile_arch(choice.family, capability)
    return ForwardPlan(target, kernels.prepare(choice, arch, qt.device, launch.grid), argument, lse_t.shape,
                       vt.shape[3], out_dtype)


def build_backward(qt, kt, vt, out_t, dout_t, lse_t, grads: tuple, scale: float, mask: dispatch.Mask,
                   deterministic: bool, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                   cu_seqlens=NO_LENGTHS, alibi: int | None = None, dropout_p: float = 0.0) -> BackwardPlan:
    """The backward's three kernels over a fixed-length batch (BSHD tensors) or a packed one
    (batch-of-one views, ``cu_seqlens`` the two int32 DeviceTensors), writing the 16-bit
    gradients ``grads`` (dq, dk, dv: DeviceTensors or interop.contiguous records); ``alibi`` and
    ``dropout_p`` as for build_forward."""
    _, rows_q, heads, head_dim = qt.shape
    head_dim_v = vt.shape[3]
    target = (family, capability) = dispatch.device_target(qt.device)
    launch = dispatch.backward_launch(family, qt, kt, vt, dout_t, mask, batch, max_seqlen_k, deterministic,
                                      qt.device)
    main, splits = launch.main, launch.splits
    walk, turns = launch.dq_order == "walk", launch.dq_order == "turns"
    arch = dispatch.compile_arch("sm80", capability)  # the preprocess and convert kernels
    group = heads // kt.shape[2]
    # Scratch, one allocation: fp32 dq_accum, [int32 dq_turns,] [fp32 dk_accum, dv_accum,] fp32
    # delta, the zeroed ones first. dq_accum rows are padded to the main kernel's head dim so the
    # kernel's reductions need no column checks (flash_bwd.cu), sm90's by a few columns more
    # (dispatch.SM90_BWD_DQ_ROW_PAD), the rows of one head contiguous. dq_turns: a counter per
    # (batch, head, query block). GQA: the walk and turns (the orders that repeat bitwise) keep
    # one dK/dV slice per query head, plainly stored and summed by the convert kernel; otherwise
    # heads_kv slices added to atomically, so zeroed.
    per_query_head = walk or turns
    dq_row = (dispatch.backward_kernel_dims(main.family, head_dim, head_dim_v)[0]
              + (dispatch.SM90_BWD_DQ_ROW_PAD if main.family == "sm90" else 0))
    arrays = [((splits, qt.shape[0], heads, rows_q, dq_row), "float32")]
    if turns:
        arrays.append(((batch, heads, -(-max_seqlen_q // main.tile.block_m)), "int32"))
    if group > 1:
        arrays += [((*kt.shape[:2], heads if per_query_head else kt.shape[2], dim), "float32")
                   for dim in (head_dim, head_dim_v)]
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

    packed = pack_bwd_params(qt, kt, vt, out_t, dout_t, lse_t, delta, dq_accum, grads[1], grads[2], dk_accum,
                             dv_accum, dq_turns, scale, mask.window, mask.softcap, *cu_seqlens,
                             turn_heads=launch.turn_heads, alibi_batch_stride=alibi or 0, dropout_p=dropout_p)
    argument = ArgumentBuffer(packed, BWD_POINTERS, more_pointers=DROPOUT_WORDS)
    main_argument = (sm90_backward_argument(packed, qt, kt, vt, dout_t, main.tile.stage_rows, main.tile.block_n)
                     if main.family == "sm90" else None)
    # (source, gradient, its (batch, row, head) strides in the source, summands, their stride,
    # scale): dQ sums its splits and takes the softmax scale; per-query-head GQA dK/dV sum the
    # group's adjacent query-head slices (dK already scaled by the main kernel).
    dq_strides = (heads * rows_q * dq_row, dq_row, rows_q * dq_row)
    converts = [(dq_accum, 0, dq_strides, splits, math.prod(dq_accum.shape[1:]), scale)]
    if group > 1:
        slices = dk_accum.shape[2]  # heads_kv, or heads
        for src, index in ((dk_accum, 1), (dv_accum, 2)):
            dim = src.shape[3]
            strides = (math.prod(src.shape[1:]), slices * dim, group * dim if per_query_head else dim)
            converts.append((src, index, strides, *((group, dim) if per_query_head else (1, 0)), 1.0))
    convert_launches = []
    for src, index, src_strides, summands, summand_stride, factor in converts:
        grad_batch, grad_rows, grad_heads, grad_dim = grads[index].shape
        convert_launches.append((
            kernels.prepare(launch.convert, arch, qt.device, dispatch.helper_grid(grad_rows, grad_heads, grad_batch,
                                                                                   grad_dim)),
            ArgumentBuffer(pack_convert_params(src, grads[index], src_strides, summands, summand_stride, factor),
                           CONVERT_POINTERS),
            src.ptr, index))
    return BackwardPlan(
        target, kernels.prepare(launch.preprocess, arch, qt.device,
                                dispatch.helper_grid(max_seqlen_q, heads, batch, head_dim_v)),
        kernels.prepare(main, dispatch.compile_arch(main.family, capability), qt.device, launch.grid), argument,
        main_argument,
        (delta.ptr, dq_accum.ptr, dk_accum.ptr if dk_accum else None, dv_accum.ptr if dv_accum else None,
         dq_turns.ptr if dq_turns else None),
        end, zeroed, tuple(convert_launches))


def fill_empty(framework: str, like, given: tuple, given_t: tuple, shapes: tuple, lse_shape: tuple | None = None,
               dtype: str | None = None, sinks=None) -> tuple:
    """Outputs of a call with no work (a packed batch of total length 0 on one side): each of
    ``given`` (or a new array of its entry in ``shapes``, of ``dtype``, default ``like``'s) filled
    with zeros, and, unless ``lse_shape`` is None, a float32 (heads, rows) lse of it filled with
    -inf, or with each head's sink (``sinks``, a float32 DeviceTensor): the LSE of a row that sees
    no key. No kernel of ours is launched; the framework's own fill writes the values, on its
    current stream."""
    results = []
    with interop.on_device(like.device):
        for out, out_t, shape in zip(given, given_t, shapes):
            if out_t is None:
                out = interop.allocate(framework, like, shape, dtype)[0]
            _fill(framework, out_t.native if out_t is not None else out, 0.0)
            results.append(out)
        if lse_shape is not None:
            lse = interop.allocate(framework, like, lse_shape, "float32")[0]
            if sinks is None:
                _fill(framework, lse, -math.inf)
            else:
                lse[...] = sinks.native.reshape(-1, 1)
            results.append(lse)
    return tuple(results)


def zeros(framework: str, like) -> Any:
    """A zero-filled array of DeviceTensor ``like``'s shape and dtype, in ``framework``."""
    with interop.on_device(like.device):
        array = interop.allocate(framework, like, like.shape)[0]
        _fill(framework, array, 0.0)
    return array


def _fill(framework: str, native: Any, value: float) -> None:
    if framework == "torch":
        native.fill_(value)
    else:
        native.fill(value)


@dataclass(frozen=True, eq=False)
class KvCachePlan:
    """attention_with_kvcache's launches (kv_append when there is something to append or rotate,
    then kv_decode and kv_combine when the keys are split, or the forward kernel over the cache:
    dispatch.kvcache_prefill) and their arguments but for pointers; the scratch (rotated q,
    partial out and lse) is one allocation per call."""

    target: tuple[str, tuple[int, int]]
    attention: str  # the name expression of the kernel that attends, kv_decode or the forward
    append: kernels.Launch | None
    decode: kernels.Launch | None  # None: no query rows, or the forward attends
    forward: tuple[kernels.Launch, ArgumentBuffer] | None  # FwdParamsPaged, FWD_POINTERS + FWD_CACHE_POINTERS
    combine: kernels.Launch | None
    argument: ArgumentBuffer  # KvParams, pointers in KV_POINTERS order
    combine_argument: ArgumentBuffer | None  # CombineParams, pointers in COMBINE_POINTERS order
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    scratch_offsets: tuple[int | None, int | None, int | None]  # q_rot, out_partial, lse_partial
    scratch_bytes: int
    out_dtype: str | None = None  # an e4m3 q's (checks.KV_FP8_Q_OUT); None: q's

    def launch(self, framework: str, operands: tuple, given: tuple, given_t: tuple, return_lse: bool,
               cu_seqlens=NO_LENGTHS, bias: checks.Bias = checks.NO_BIAS) -> tuple[Any, Any]:
        """(out, lse or None) of one call on ``operands``: q's DeviceTensor (the outputs are
        allocated like it) and the pointers (0 where not given) of q, k_cache, v_cache, k, v,
        cache_seqlens, page_table, cache_batch_idx, cache_leftpad, cu_seqlens_q, rotary_cos,
        rotary_sin, out, rotary_seqlens, cu_seqlens_k_new, descale_k, descale_v, descale_q (0 where
        scalar). ``given``: (the caller's out, or
        None: one is allocated). Pointers alone, because a repeated
        decoding call reads nothing else of its arrays (kvcache_gpu._signature). ``bias``: the
        call's sinks and ALiBi slopes (the plan was built for slopes of their stride, or none)."""
        (q, (q_ptr, kc, vc, k, v, seqlens, table, idx, pad, cu, cos, sin, out_given, rotary_starts, cu_new, dk,
             dv, dq)) = operands
        with interop.on_device(q.device):
            stream = interop.stream_handle(framework, q.device)
            out, out_ptr = ((given[0], out_given) if out_given
                            else interop.allocate(framework, q, self.out_shape, self.out_dtype))
            lse, lse_ptr = (interop.allocate(framework, q, self.lse_shape, "float32") if return_lse else (None, 0))
            owner, base = interop.scratch(framework, q, self.scratch_bytes) if self.scratch_bytes else (None, 0)
            q_rot, o_part, l_part = (base + offset if offset is not None else 0 for offset in self.scratch_offsets)
            split = self.combine is not None
            sinks, alibi = bias.pointers
            argument = self.argument.fill(q_ptr, kc, vc, k, v, out_ptr, 0 if split else lse_ptr, o_part, l_part,
                                          seqlens, table, idx, pad, cu, cos, sin, q_rot, dk, dv, sinks, alibi,
                                          rotary_starts, cu_new, dq)
            if self.append is not None:
                kernels.launch(self.append, stream, argument)
            if self.decode is not None:
                kernels.launch(self.decode, stream, argument)
            if self.forward is not None:
                kernel, forward_argument = self.forward
                kernels.launch(kernel, stream, forward_argument.fill(
                    q_rot or q_ptr, kc, vc, out_ptr, lse_ptr, cu, 0, cu + 4 if cu else 0, 0, sinks, alibi,
                    # cache_batch_idx: one page per sequence. A packed q appends its query counts.
                    table or idx, seqlens, cu_new or (cu if k else 0)))
            if split and self.decode is not None:
                kernels.launch(self.combine, stream, self.combine_argument.fill(o_part, l_part, out_ptr, lse_ptr, sinks))
            del owner
        return out, lse


def build_kvcache(call, tensors: tuple) -> KvCachePlan:
    """The plan of a checked GPU attention_with_kvcache call (checks.KvCall); ``tensors``: the
    DeviceTensors (or None) of KvCachePlan.launch's pointers."""
    q, kc, vc, k, v, seqlens, table, idx, pad, cu, cos, sin, _out, _rotary_starts, _cu_new, dk, dv, _dq = tensors
    target = family_capability = dispatch.device_target(q.device)
    arch = dispatch.compile_arch("sm80", family_capability[1])
    # An e4m3 q is widened by kv_append into the scratch and attended as bf16 (checks.KV_FP8_Q_OUT).
    q_fp8 = q.dtype == checks.FP8_DTYPE
    attended = checks.KV_FP8_Q_OUT if q_fp8 else q.dtype
    append_choice, decode_choice = dispatch.kvcache_kernels(attended, call.head_dim, kc.dtype)
    group = call.heads // call.heads_kv
    rows = q.shape[0] if call.varlen else call.batch * call.max_seqlen_q
    prefill = not q_fp8 and dispatch.kvcache_prefill(call, q, kc)
    # A packed batch with long query chunks may hold decodes too (vLLM's mixed batch): the forward
    # kernel takes the sequences of KV_PREFILL_ROWS rows or more, kv_decode (unsplit) the others,
    # each kernel leaving the other's on the device, where the lengths are.
    mixed = prefill and call.varlen
    decode_rows = dispatch.KV_PREFILL_ROWS - 1 if mixed else call.max_seqlen_q
    row_tiles = max(1, -(-(group * decode_rows) // dispatch.KV_ROWS))
    splits = 1 if prefill else dispatch.kvcache_splits(call.num_splits, call.batch, call.heads_kv, row_tiles,
                                                       call.capacity, dispatch.sm_count(q.device),
                                                       dispatch.kv_ctas_per_sm(dispatch.kv_bucket(call.head_dim)))

    def bsh(t, packed: bool) -> tuple[int, int, int]:
        if t is None:
            return (0, 0, 0)
        return (0, *t.strides[:2]) if packed else tuple(t.strides[:3])

    window = (call.window[0], 0 if call.causal else call.window[1])
    out_shape = tuple(q.shape)
    out_strides = tuple(math.prod(out_shape[i + 1:]) for i in range(len(out_shape)))
    new_packed = k is not None and k.ndim == 3  # sharing cu_seqlens_q, or by cu_seqlens_k_new
    strides = {"q": bsh(q, call.varlen), "kc": bsh(kc, False), "vc": bsh(vc, False), "kn": bsh(k, new_packed),
               "vn": bsh(v, new_packed), "o": (0, *out_strides[:2]) if call.varlen else out_strides[:3]}
    ints = dict(batch=call.batch, seqlen_q=call.max_seqlen_q, heads=call.heads, heads_kv=call.heads_kv,
                head_dim=call.head_dim, page_size=call.page_size, max_pages=table.shape[1] if table is not None else 0,
                capacity=call.capacity,
                cache_seqlens_scalar=call.cache_seqlens if type(call.cache_seqlens) is int else call.capacity,
                seqlen_new=call.seqlen_new, rotary_dim=call.rotary_dim, rotary_interleaved=int(call.rotary_interleaved),
                rotary_per_row=int(call.rotary_per_row), rotary_fp32=int(cos is not None and cos.dtype == "float32"),
                num_splits=splits, row_tiles=row_tiles, window_left=window[0], window_right=window[1],
                q_e4m3=int(q_fp8), max_decode_rows=decode_rows if mixed else 0)
    k_scale, v_scale, q_scale = (d if isinstance(d, float) else 1.0
                                 for d in (call.descale_k, call.descale_v, call.descale_q))
    argument = ArgumentBuffer(pack_kv_params(strides, ints, call.scale, call.softcap, k_scale, v_scale,
                                             alibi_batch_stride=call.alibi or 0, descale_q=q_scale), KV_POINTERS)

    # Scratch: rotated (or widened) q (rows, heads, head_dim) in the attended type, then fp32
    # partial out and lse.
    q_copy = call.rotary_dim or q_fp8
    sizes = [rows * call.heads * call.head_dim * (2 if q_fp8 else q.itemsize) if q_copy else 0]
    combine = combine_argument = None
    if splits > 1:
        batch, seqlen = (1, rows) if call.varlen else (call.batch, call.max_seqlen_q)
        combine, combine_argument, out_bytes, lse_bytes = _split_combine(attended, arch, q.device, splits, batch,
                                                                         seqlen, call.heads, call.head_dim, call.varlen)
        sizes += [out_bytes, lse_bytes]
    offsets, end = [], 0
    for size in sizes + [0] * (3 - len(sizes)):
        offsets.append(end if size else None)
        end += -(-size // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    append_rows = max(call.seqlen_new, call.max_seqlen_q if q_copy else 0)
    append = (kernels.prepare(append_choice, arch, q.device, (append_rows, call.batch, 1))
              if append_rows and (k is not None or q_copy) else None)
    decode = (kernels.prepare(decode_choice, arch, q.device, (splits * row_tiles, call.heads_kv, call.batch))
              if rows and (mixed or not prefill) else None)
    forward_choice, forward = (_kvcache_forward(call, tensors, ints, arch, decode_rows + 1 if mixed else 0) if prefill
                               else (decode_choice, None))
    lse_shape = (call.heads, rows) if call.varlen else (call.batch, call.heads, call.max_seqlen_q)
    return KvCachePlan(target, forward_choice.name_expression, append, decode, forward if rows else None, combine,
                       argument, combine_argument, out_shape, lse_shape, tuple(offsets), end,
                       checks.KV_FP8_Q_OUT if q_fp8 else None)


def _kvcache_forward(call, tensors: tuple, ints: dict, arch: str, min_rows: int) -> tuple:
    """(the forward kernel's KernelChoice, its launch and FwdParamsPaged argument) of a call that
    dispatch.kvcache_prefill sends to the forward kernel over the updated cache: q (or its rotated
    copy in the scratch, contiguous) against every cached and appended key of each sequence of
    ``min_rows`` query rows or more (0: every sequence)."""
    q, kc, vc, k, table, idx = tensors[0], tensors[1], tensors[2], tensors[3], tensors[6], tensors[7]
    mask = dispatch.make_mask(call.causal, call.window, call.softcap, call.max_seqlen_q, call.capacity,
                              call.alibi is not None)
    choice = dispatch.kvcache_prefill_kernel(q.dtype, call.head_dim, mask)
    batch = call.batch
    # A packed q is one sequence of all rows (batch stride 0), each found by cu_seqlens_q.
    shape = (1, *q.shape) if call.varlen else tuple(q.shape)
    dense = tuple(math.prod(shape[i + 1:]) if i or not call.varlen else 0 for i in range(4))
    own = (0, *q.strides) if call.varlen else tuple(q.strides)
    q4 = q._replace(shape=shape, strides=dense if call.rotary_dim else own)
    out4 = q4._replace(strides=dense)
    lse_shape = (call.heads, shape[1]) if call.varlen else (batch, call.heads, call.max_seqlen_q)
    lse = interop.contiguous(lse_shape, q, "float32")
    new_keys = 0 if k is None or call.varlen else call.seqlen_new  # packed appends: cu_seqlens_k_new
    # A contiguous cache with cache_batch_idx is a paged one of one page of `capacity` rows per
    # sequence, the indices its page table.
    pages = (table.strides[0], call.page_size) if table is not None else (1 if idx is not None else 0, call.capacity)
    cache = (*pages, ints["cache_seqlens_scalar"], new_keys, min_rows)
    packed = pack_fwd_params_paged(q4, kc, vc, out4, lse, call.scale, mask.window, call.softcap, call.varlen, cache,
                                   call.alibi or 0)
    argument = ArgumentBuffer(packed, FWD_POINTERS, more_pointers=FWD_CACHE_POINTERS)
    grid = dispatch.kvcache_prefill_grid(choice, call.heads, batch, call.max_seqlen_q)
    return choice, (kernels.prepare(choice, arch, q.device, grid), argument)


def _split_combine(dtype: str, arch: str, device: int, splits: int, batch: int, seqlen: int, heads: int, dim: int,
                   packed: bool = False) -> tuple[kernels.Launch, ArgumentBuffer, int, int]:
    """kv_combine over the fp32 partials of a decode split ``splits`` ways, as kv_decode and the MLA
    kernels write them: out (splits, heads, rows, dim) and lse (splits, heads, rows), rows being
    batch x seqlen, merged into a contiguous out (batch, seqlen, heads, dim) of ``dtype`` and lse
    (batch, heads, seqlen), or for a ``packed`` q (one sequence of ``seqlen`` rows) out (rows, heads,
    dim) and lse (heads, rows). Returns the combine's launch and argument and the two partials' sizes
    in bytes."""
    rows = batch * seqlen
    # Strides (split, batch, row, head) of the partials, (batch, row, head) of out and lse.
    out_partial = (heads * rows * dim, 0 if packed else seqlen * dim, dim, rows * dim)
    lse_partial = (heads * rows, 0 if packed else seqlen, 1, rows)
    out, lse = (0 if packed else seqlen * heads * dim, heads * dim, dim), (0 if packed else heads * seqlen, 1, seqlen)
    launch = kernels.prepare(dispatch.combine_kernel(dtype), arch, device, dispatch.kv_combine_grid(rows * heads))
    argument = ArgumentBuffer(pack_combine_params(out_partial, lse_partial, out, lse, splits, batch, seqlen, heads,
                                                  dim), COMBINE_POINTERS)
    return launch, argument, splits * heads * rows * dim * 4, splits * heads * rows * 4


@dataclass(frozen=True, eq=False)
class CombinePlan:
    target: tuple[str, tuple[int, int]]
    kernel: kernels.Launch | None
    argument: ArgumentBuffer
    out_shape: tuple[int, ...]
    out_dtype: str
    lse_shape: tuple[int, ...]

    def launch(self, framework: str, tensors: tuple, given: tuple, given_t: tuple, return_lse: bool,
               cu_seqlens=NO_LENGTHS) -> tuple[Any, Any]:
        o, l = tensors
        with interop.on_device(o.device):
            stream = interop.stream_handle(framework, o.device)
            out, out_ptr = interop.allocate(framework, o, self.out_shape, self.out_dtype)
            lse, lse_ptr = (interop.allocate(framework, o, self.lse_shape, "float32") if return_lse else (None, 0))
            if self.kernel is not None:
                kernels.launch(self.kernel, stream, self.argument.fill(o.ptr, l.ptr, out_ptr, lse_ptr, 0))
        return out, lse


def build_combine(call) -> CombinePlan:
    """cuflash.combine's plan for a checked GPU call (checks.CombineCall): out_partial (splits,
    [batch,] seqlen, heads, head_dim) and lse_partial."""
    o, l, out_dtype = call.out_partial, call.lse_partial, call.out_dtype
    target = dispatch.device_target(o.device)
    arch = dispatch.compile_arch("sm80", target[1])
    if o.ndim == 4:  # packed: a batch of one
        o_s, l_s = (o.strides[0], 0, *o.strides[1:3]), (l.strides[0], 0, *l.strides[1:])
        splits, batch, (seqlen, heads, d) = o.shape[0], 1, o.shape[1:]
    else:
        o_s, l_s = tuple(o.strides[:4]), tuple(l.strides)
        splits, batch, seqlen, heads, d = o.shape
    out_shape, lse_shape = tuple(o.shape[1:]), tuple(o.shape[1:-1])
    out_dense = tuple(math.prod(out_shape[i + 1:]) for i in range(len(out_shape)))
    lse_dense = tuple(math.prod(lse_shape[i + 1:]) for i in range(len(lse_shape)))
    if o.ndim == 4:
        out_dense, lse_dense = (0, *out_dense[:2]), (0, *lse_dense)
    rows = batch * seqlen * heads
    argument = ArgumentBuffer(pack_combine_params(o_s, l_s, out_dense[:3], lse_dense[:3], splits, batch, seqlen,
                                                  heads, d), COMBINE_POINTERS)
    kernel = (kernels.prepare(dispatch.combine_kernel(out_dtype), arch, o.device, dispatch.kv_combine_grid(rows))
              if rows and d else None)
    return CombinePlan(target, kernel, argument, out_shape, out_dtype, lse_shape)


@dataclass(frozen=True, eq=False)
class MergePlan:
    target: tuple[str, tuple[int, int]]
    kernel: kernels.Launch | None  # None: nothing to merge
    argument: ArgumentBuffer  # MergeParams, pointers in MERGE_POINTERS order
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]

    def launch(self, framework: str, tensors: tuple, given: tuple, given_t: tuple, return_lse: bool,
               cu_seqlens=NO_LENGTHS) -> tuple[Any, Any]:
        """(out, lse or None): ``tensors`` out_a, lse_a, out_b, lse_b; ``given`` (out, out_lse),
        each None where a new contiguous array is allocated (out_lse only with ``return_lse``)."""
        a = tensors[0]
        with interop.on_device(a.device):
            stream = interop.stream_handle(framework, a.device)
            out, out_ptr = ((given[0], given_t[0].ptr) if given_t[0] is not None
                            else interop.allocate(framework, a, self.out_shape))
            lse, lse_ptr = ((given[1], given_t[1].ptr) if given_t[1] is not None
                            else interop.allocate(framework, a, self.lse_shape, "float32") if return_lse else (None, 0))
            if self.kernel is not None:
                kernels.launch(self.kernel, stream, self.argument.fill(*(t.ptr for t in tensors), out_ptr, lse_ptr))
        return out, lse


def build_merge(call) -> MergePlan:
    """cuflash.merge_states's plan for a checked GPU call (checks.MergeCall): each tensor at its
    row and head strides (checks.merge_rows); outputs allocated contiguous where not given."""
    t = call.tensors
    a = t["out_a"]
    target = dispatch.device_target(a.device)
    arch = dispatch.compile_arch("sm80", target[1])
    dense_out = (call.inner_rows * call.heads * call.head_dim, call.heads * call.head_dim, call.head_dim)
    dense_lse = (call.inner_rows * call.heads, call.heads, 1)
    strides = {"oa": checks.merge_rows("out_a", a), "ob": checks.merge_rows("out_b", t["out_b"]),
               "o": checks.merge_rows("out", t["out"]) if "out" in t else dense_out,
               "la": checks.merge_rows("lse_a", t["lse_a"]), "lb": checks.merge_rows("lse_b", t["lse_b"]),
               "l": checks.merge_rows("out_lse", t["out_lse"]) if "out_lse" in t else dense_lse}
    argument = ArgumentBuffer(pack_merge_params(strides, call.rows, max(1, call.inner_rows), call.heads,
                                                call.head_dim), MERGE_POINTERS)
    items = call.rows * call.heads
    kernel = (kernels.prepare(dispatch.merge_kernel(a.dtype), arch, a.device, dispatch.merge_grid(items))
              if items and call.head_dim else None)
    return MergePlan(target, kernel, argument, tuple(a.shape), tuple(a.shape[:-1]))


@dataclass(frozen=True, eq=False)
class MlaPlan:
    """mla_decode's launches: the decode kernel, and kv_combine when the keys are split (the fp32
    partials in one scratch allocation per call)."""

    target: tuple[str, tuple[int, int]]
    decode: kernels.Launch
    combine: kernels.Launch | None
    argument: ArgumentBuffer  # MlaParams, pointers in MLA_POINTERS order
    combine_argument: ArgumentBuffer | None
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    scratch_bytes: int  # out_partial, then lse_partial at lse_offset; 0 without splits
    lse_offset: int

    def launch(self, framework: str, operands: tuple, given: tuple, given_t: tuple, return_lse: bool,
               cu_seqlens=NO_LENGTHS) -> tuple[Any, Any]:
        """(out, lse or None) on ``operands``: q's DeviceTensor and the pointers of q, kv_cache,
        cache_seqlens, page_table, descale_kv (0 where scalar), q_rope and kv_rope_cache (0 but
        in the split form)."""
        q, (q_ptr, kv, seqlens, table, descale, q_rope, kv_rope) = operands
        with interop.on_device(q.device):
            stream = interop.stream_handle(framework, q.device)
            out, out_ptr = interop.allocate(framework, q, self.out_shape)
            lse, lse_ptr = (interop.allocate(framework, q, self.lse_shape, "float32") if return_lse else (None, 0))
            owner, o_part = interop.scratch(framework, q, self.scratch_bytes) if self.scratch_bytes else (None, 0)
            l_part = o_part + self.lse_offset if o_part else 0
            kernels.launch(self.decode, stream, self.argument.fill(q_ptr, kv, out_ptr, 0 if o_part else lse_ptr, o_part,
                                                                   l_part, seqlens, table, descale, q_rope, kv_rope))
            if self.combine is not None:
                kernels.launch(self.combine, stream, self.combine_argument.fill(o_part, l_part, out_ptr, lse_ptr, 0))
            del owner
        return out, lse


def build_mla(call, tensors: tuple) -> MlaPlan:
    """The plan of a checked GPU mla_decode call (checks.MlaCall); ``tensors``: the DeviceTensors of
    q, kv_cache, cache_seqlens, page_table, descale_kv (None where scalar), q_rope and
    kv_rope_cache (None but in the split form); check_mla has required 16-byte-aligned pointers and
    strides, which the TMA-loaded kernel's tensor maps need."""
    q, kv, _, table, _, q_rope, kv_rope = tensors
    family, capability = target = dispatch.device_target(q.device)
    tma = (dispatch.mla_tma(family, q.dtype, kv.dtype, call.page_size, table.shape[1])
           and all(tma_ready(t) for t in (kv, kv_rope) if t is not None))
    rows = call.seqlen_q * call.heads
    row_tiles = -(-rows // dispatch.MLA_ROWS)
    splits = dispatch.mla_splits(call.num_splits, call.batch, row_tiles, call.capacity, family,
                                 dispatch.sm_count(q.device))
    narrow_rows = dispatch.mla_narrow_rows(tma, rows, -(-call.capacity // splits))
    choice = dispatch.mla_kernel(family, q.dtype, kv.dtype, tma, narrow_rows)
    out_shape = (call.batch, call.seqlen_q, call.heads, call.head_dim_v)
    lse_shape = (call.batch, call.heads, call.seqlen_q)
    dv, h, s = call.head_dim_v, call.heads, call.seqlen_q
    rope_strides = (*q_rope.strides[:3], *kv_rope.strides[:2]) if q_rope is not None else (0,) * 5
    strides = (*q.strides[:3], kv.strides[0], kv.strides[1], *rope_strides, s * h * dv, h * dv, dv)
    ints = dict(batch=call.batch, seqlen_q=s, heads=h, page_size=call.page_size, max_pages=table.shape[1],
                num_splits=splits, row_tiles=row_tiles, causal=int(call.causal))
    descale = call.descale_kv if isinstance(call.descale_kv, float) else 1.0
    packed = pack_mla_params(strides, ints, call.scale, descale)
    argument = (mla_tma_argument(packed, kv, kv_rope, dispatch.MLA_KEYS[family]) if tma
                else ArgumentBuffer(packed, MLA_POINTERS))
    arch = dispatch.compile_arch(family, capability)
    decode = kernels.prepare(choice, arch, q.device, (splits * row_tiles, call.batch, 1))
    combine = combine_argument = None
    scratch_bytes = lse_offset = 0
    if splits > 1:
        combine, combine_argument, out_bytes, lse_bytes = _split_combine(
            q.dtype, dispatch.compile_arch("sm80", capability), q.device, splits, call.batch, s, h, dv)
        lse_offset = -(-out_bytes // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        scratch_bytes = lse_offset + lse_bytes
    return MlaPlan(target, decode, combine, argument, combine_argument, out_shape, lse_shape, scratch_bytes,
                   lse_offset)


@dataclass(frozen=True, eq=False)
class QuantizePlan:
    """quantize_fp8's launch: one CTA per group (the whole tensor on one), none where there is no
    descale to write."""

    target: tuple[str, tuple[int, int]]
    kernel: kernels.Launch | None
    argument: ArgumentBuffer  # QuantizeArgs, pointers in QUANTIZE_POINTERS order
    out_shape: tuple[int, ...]
    descale_shape: tuple[int, ...]
    signs: Any  # the rotation's float32 signs along head_dim (NumPy), None without rotation

    def launch(self, framework: str, tensors: tuple, given: tuple, given_t: tuple) -> tuple[Any, Any]:
        """(e4m3 bytes, float32 descale) of ``tensors`` (x's DeviceTensor): float8_e4m3fn in torch,
        uint8 in CuPy, which has no float8 dtype (attention's dtype="e4m3" reads it)."""
        (x,) = tensors
        with interop.on_device(x.device):
            out, out_ptr = interop.allocate(framework, x, self.out_shape,
                                            "float8_e4m3fn" if framework == "torch" else "uint8")
            descale, descale_ptr = interop.allocate(framework, x, self.descale_shape, "float32")
            if self.kernel is not None:
                signs, signs_ptr = interop.upload(framework, x, self.signs) if self.signs is not None else (None, 0)
                kernels.launch(self.kernel, interop.stream_handle(framework, x.device),
                               self.argument.fill(x.ptr, out_ptr, descale_ptr, signs_ptr))
                del signs  # held until the launch is queued; the pool reuses it in stream order
        return out, descale


def build_quantize(call, signs, block: int, norm: float) -> QuantizePlan:
    """quantize_fp8's plan for a checked GPU call (checks.QuantizeCall); ``signs``, ``block`` and
    ``norm``: the rotation along head_dim (quantize.rotation), the signs and block read only with
    ``call.rotate``."""
    x, granularity = call.x, call.granularity
    batch, seqlen, heads = x.shape[:3]
    groups = (batch, heads // call.group_heads)
    descale_shape = groups + (-(-seqlen // call.block_size),) if granularity == "block" else groups
    descales = math.prod(descale_shape)
    argument = ArgumentBuffer(pack_quantize_params(x, granularity, call.group_heads, call.block_size,
                                                   descale_shape[2] if granularity == "block" else 1,
                                                   descales if granularity == "tensor" else 1,
                                                   block if call.rotate else 0, norm), QUANTIZE_POINTERS)
    target = dispatch.device_target(x.device)
    kernel = (kernels.prepare(dispatch.quantize_kernel(x.dtype), dispatch.compile_arch("sm80", target[1]), x.device,
                              (1 if granularity == "tensor" else descales, 1, 1)) if descales else None)
    return QuantizePlan(target, kernel, argument, tuple(x.shape), descale_shape, signs if call.rotate else None)
