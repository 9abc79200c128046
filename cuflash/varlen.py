"""Variable-length batches: packed ``(total_tokens, heads, head_dim)`` tensors and int32
cumulative sequence lengths, flash-attn's ``*_varlen`` layout.

Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows
``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` and attends only to its own keys (causal and window
alignment per sequence). Either length may be 0. NumPy inputs run the float64 reference on the
CPU; GPU inputs run the forward kernel, and the backward's kernels, over all sequences in one
launch each.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from cuflash import api, interop, reference

__all__ = ["attention_varlen", "attention_varlen_backward"]


def _as_batch_of_one(x: Any) -> Any:
    """A packed (total, heads, head_dim) tensor seen as (1, total, heads, head_dim)."""
    if isinstance(x, interop.DeviceTensor):
        return interop.DeviceTensor(x.native, x.ptr, (1, *x.shape), (0, *x.strides), x.dtype, x.itemsize, x.device)
    return x[None]


class _Lengths(NamedTuple):
    """The checked cumulative lengths: host copies (int64; None where a GPU array was not copied),
    the DeviceTensors (None for NumPy), the batch size and the longest lengths (None if not
    known). A tuple, not a frozen dataclass, because one is built per call (0.25 vs 0.8 us)."""

    host_q: np.ndarray | None
    host_k: np.ndarray | None
    device_q: Any
    device_k: Any
    batch: int
    max_seqlen_q: int | None
    max_seqlen_k: int | None = None


def _lengths(name: str, cu: Any, on_device: bool, device: int | None, copy: bool) -> tuple[Any, Any, int]:
    """(host int64 copy or None, DeviceTensor or None, batch) of a cu_seqlens argument after its
    type and shape checks. GPU arrays are copied to the host (a synchronisation) only if ``copy``."""
    framework = interop.framework_of(cu, name)
    if (framework == "numpy") == on_device:
        raise TypeError(f"{name}: must be on the same side as q ({'GPU' if on_device else 'NumPy'})")
    t = interop.describe(cu, framework, name) if on_device else None
    dtype, shape = (t.dtype, t.shape) if on_device else (str(cu.dtype), cu.shape)
    if dtype != "int32":
        raise TypeError(f"{name}: expected int32, got {dtype}")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name}: expected shape (batch + 1,) with batch >= 1, got {tuple(shape)}")
    if not on_device:
        return cu.astype(np.int64), None, shape[0] - 1
    if t.device != device:
        raise ValueError(f"{name}: on device {t.device}, but q is on device {device}")
    if t.strides != (1,):
        raise ValueError(f"{name}: must be contiguous (the kernel indexes it directly), stride is {t.strides[0]}")
    if not copy:
        return None, t, shape[0] - 1
    host = t.native.cpu().numpy() if framework == "torch" else t.native.get()
    return host.astype(np.int64), t, shape[0] - 1


def _check_lengths(name: str, cu: np.ndarray | None, total: int, max_seqlen: Any, max_name: str,
                   validate: bool) -> None:
    """Values of a cu_seqlens (None: not copied, so not checked) and its max_seqlen (the values
    behind ``validate``)."""
    if validate:
        lengths = np.diff(cu)
        if cu[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {cu[0]}")
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise ValueError(f"{name}: must not decrease, but entry {i + 1} ({cu[i + 1]}) < entry {i} ({cu[i]})")
        if cu[-1] != total:
            raise ValueError(f"{name}: last entry {cu[-1]} must equal the packed length {total}")
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)):
        raise TypeError(f"{max_name}: expected an int or None, got {type(max_seqlen).__name__}")
    if max_seqlen < 1:  # the packed length is at least 1, so some sequence is
        raise ValueError(f"{max_name}: must be at least 1, got {max_seqlen}")
    if validate and max_seqlen < lengths.max(initial=0):
        i = int(np.argmax(lengths))
        raise ValueError(f"{max_name}: {max_seqlen} is smaller than sequence {i}'s length {lengths[i]}")


def _check_varlen(arrays: dict, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  validate: bool, need_max_k: bool = False) -> tuple[str, dict, _Lengths]:
    """Framework, validated tensors (packed, checked as a batch of one) and the lengths. GPU
    lengths reach the host only to be validated or to find an omitted max_seqlen_q (which every
    kernel needs) or, with ``need_max_k`` (the backward), an omitted max_seqlen_k."""
    framework = api._framework(arrays)
    on_device = framework != "numpy"
    tensors = {name: interop.describe(x, framework, name) if on_device else x for name, x in arrays.items()}
    for name in ("q", "k", "v"):
        if tensors[name].ndim != 3:
            raise ValueError(f"{name}: expected 3 dims (total_tokens, heads, head_dim), got shape "
                             f"{tuple(tensors[name].shape)}")
    for name in ("q", "k"):
        if tensors[name].shape[0] < 1:  # else _check_qkv would name a seqlen the caller never gave
            raise ValueError(f"{name}: the packed batch must hold at least one token (its sequences may be "
                             f"empty, not all of them), got shape {tuple(tensors[name].shape)}")
    qt, kt, vt = (_as_batch_of_one(tensors[name]) for name in ("q", "k", "v"))
    api._check_qkv(qt, kt, vt, on_device=on_device)
    device = tensors["q"].device if on_device else None
    cu_q, cu_q_t, batch = _lengths("cu_seqlens_q", cu_seqlens_q, on_device, device, validate or max_seqlen_q is None)
    cu_k, cu_k_t, batch_k = _lengths("cu_seqlens_k", cu_seqlens_k, on_device, device,
                                     validate or (need_max_k and max_seqlen_k is None))
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_k: {batch_k} sequences, but cu_seqlens_q has {batch}")
    _check_lengths("cu_seqlens_q", cu_q, tensors["q"].shape[0], max_seqlen_q, "max_seqlen_q", validate)
    _check_lengths("cu_seqlens_k", cu_k, tensors["k"].shape[0], max_seqlen_k, "max_seqlen_k", validate)
    if max_seqlen_q is None:  # cu_q was copied for it
        max_seqlen_q = int(np.diff(cu_q).max())
    if max_seqlen_k is None and cu_k is not None:
        max_seqlen_k = int(np.diff(cu_k).max())
    return framework, tensors, _Lengths(cu_q, cu_k, cu_q_t, cu_k_t, batch, max_seqlen_q, max_seqlen_k)


def _check_grid(lengths: _Lengths) -> None:
    """The sequences index grid.y or grid.z, and causal grids put the 128-row query blocks in grid.z."""
    if lengths.batch > api._MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: at most {api._MAX_GRID_YZ} sequences, got {lengths.batch}")
    if lengths.max_seqlen_q > api._MAX_GRID_YZ * 128:
        raise ValueError(f"max_seqlen_q: must be at most {api._MAX_GRID_YZ * 128}, got {lengths.max_seqlen_q}")


def _forward_on_device(framework: str, tensors: dict, lengths: _Lengths, causal: bool, scale: float,
                       window: tuple[int, int], softcap: float, return_lse: bool) -> tuple:
    """One forward launch over the packed batch of validated tensors: (out, lse) in the caller's
    framework, lse an array only if ``return_lse`` (else none is written, api._allocate_lse)."""
    qt, kt, vt = (t if t.aligned_16 else interop.realign(t, framework)
                  for t in (tensors["q"], tensors["k"], tensors["v"]))
    out_t = tensors.get("out")
    total_q, heads, _ = qt.shape
    _check_grid(lengths)
    # Windows normalised against the packed lengths, which bound every sequence's.
    kernel_window = api._kernel_window(causal, window, total_q, kt.shape[0])
    max_seqlen_q = int(lengths.max_seqlen_q)
    # The plan is cached, the checks above run every call (they read the lengths' values).
    key = ("attention_varlen", qt.layout, kt.layout, vt.layout, out_t and out_t.layout, scale, kernel_window,
           softcap, lengths.batch, max_seqlen_q)
    plan = api._cached_plan(key, qt.device)
    if plan is None:
        plan = api._forward_plan(*(_as_batch_of_one(t) for t in (qt, kt, vt, out_t or interop.contiguous(qt.shape, qt))),
                                 interop.contiguous((heads, total_q), qt, "float32"), scale, kernel_window, softcap,
                                 lengths.batch, max_seqlen_q, (lengths.device_q, lengths.device_k))
        api._remember(key, plan)
    with interop.on_device(qt.device):
        stream = interop.stream_handle(framework, qt.device)
        out, out_ptr = (out_t.native, out_t.ptr) if out_t is not None else interop.allocate(framework, qt, qt.shape)
        lse, lse_ptr = api._allocate_lse(plan, framework, qt, return_lse)
        api._run_forward(plan, stream, qt, kt, vt, out_ptr, lse_ptr, (lengths.device_q, lengths.device_k))
    return out, lse


def _backward_on_device(framework: str, tensors: dict, lengths: _Lengths, causal: bool, scale: float,
                        window: tuple[int, int], softcap: float, deterministic: bool) -> tuple:
    """The backward's launches over the packed batch of validated tensors: (dq, dk, dv) in the
    caller's framework (the arrays given where given)."""
    qt, kt, vt, dout_t, out_t = (t if t.aligned_16 else interop.realign(t, framework)
                                 for t in (tensors[name] for name in ("q", "k", "v", "dout", "out")))
    lse_t = tensors["lse"]
    given_t = tuple(tensors.get(name) for name in ("dq", "dk", "dv"))
    _check_grid(lengths)
    kernel_window = api._kernel_window(causal, window, qt.shape[0], kt.shape[0])
    max_seqlen_q, max_seqlen_k = int(lengths.max_seqlen_q), int(lengths.max_seqlen_k)
    key = ("attention_varlen_backward", *(t.layout for t in (qt, kt, vt, dout_t, out_t, lse_t)),
           *(t and t.layout for t in given_t), scale, kernel_window, softcap, deterministic, lengths.batch,
           max_seqlen_q, max_seqlen_k)
    plan = api._cached_plan(key, qt.device)
    if plan is None:
        grads = tuple(_as_batch_of_one(t or interop.contiguous(like.shape, qt))
                      for t, like in zip(given_t, (qt, kt, kt)))
        plan = api._backward_plan(*(_as_batch_of_one(t) for t in (qt, kt, vt, out_t, dout_t)), lse_t, grads, scale,
                                  kernel_window, softcap, deterministic, lengths.batch, max_seqlen_q, max_seqlen_k,
                                  (lengths.device_q, lengths.device_k))
        api._remember(key, plan)
    with interop.on_device(qt.device):
        stream = interop.stream_handle(framework, qt.device)
        results, ptrs = zip(*((t.native, t.ptr) if t is not None else interop.allocate(framework, qt, like.shape)
                              for t, like in zip(given_t, (qt, kt, kt))))
        api._run_backward(plan, framework, stream, qt, kt, vt, out_t, dout_t, lse_t, ptrs,
                          (lengths.device_q, lengths.device_k))
    return results


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    out: Any = None,
    validate: bool = True,
) -> Any:
    """Attention over a packed batch of sequences of different lengths.

    Parameters
    ----------
    q : array, (total_q, heads, head_dim)
    k, v : arrays, (total_k, heads_kv, head_dim)
        dtypes, devices and head rules as for :func:`cuflash.attention`.
    cu_seqlens_q, cu_seqlens_k : int32 arrays, (batch + 1,)
        Cumulative lengths starting at 0, on q's side (device or NumPy).
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence. The GPU grid covers max_seqlen_q query rows per sequence: omitted,
        it is computed on the host (a device-to-host copy and synchronisation for GPU arrays).
        The forward only checks max_seqlen_k; the backward's grid covers it (computed the same
        way when omitted).
    causal, softmax_scale, window, softcap
        As for :func:`cuflash.attention`, per sequence.
    return_lse : bool
        Also return lse, float32 (heads, total_q); -inf for rows that see no key.
    out : array, optional
        Where to write the output (shape and dtype of q).
    validate : bool
        Check that the cumulative lengths start at 0, do not decrease and end at the packed length,
        and that max_seqlen_* are not smaller than a real sequence: a device-to-host copy and
        synchronisation for GPU arrays. False skips the checks (wrong lengths then give wrong
        results); with max_seqlen_q given, the call then never waits for the GPU.

    Returns
    -------
    out or (out, lse)
        In the caller's framework, as for :func:`cuflash.attention`.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, each naming the argument.
    """
    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    framework, tensors, lengths = _check_varlen(arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                validate)
    causal = api._resolve_flag("causal", causal)
    scale = api._resolve_scale(softmax_scale, tensors["q"].shape[2])
    window, softcap = api._resolve_window(window), api._resolve_softcap(softcap)
    if out is not None:
        api._check_out("out", tensors["out"], tuple(tensors["q"].shape), tensors["q"], framework != "numpy")
    if framework != "numpy":
        result, lse = _forward_on_device(framework, tensors, lengths, causal, scale, window, softcap,
                                         return_lse)
        result = out if out is not None else result
        return (result, lse) if return_lse else result
    result, lse = reference.attention_varlen_reference(q, k, v, lengths.host_q, lengths.host_k, causal=causal, softmax_scale=scale,
                                                       window=window, softcap=softcap)
    return api._host_output(result, lse, q.dtype, out, return_lse)


def attention_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    validate: bool = True,
) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of :func:`attention_varlen`, arguments as there and as for
    :func:`cuflash.attention_backward`; lse is the forward's float32 (heads, total_q). The CPU
    reference path is deterministic whatever ``deterministic`` says.
    """
    given = {"dq": dq, "dk": dk, "dv": dv}
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    arrays |= {name: x for name, x in given.items() if x is not None}
    framework, tensors, lengths = _check_varlen(arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                validate, need_max_k=True)
    on_device = framework != "numpy"
    qt = tensors["q"]
    causal, deterministic = api._resolve_flag("causal", causal), api._resolve_flag("deterministic", deterministic)
    scale = api._resolve_scale(softmax_scale, qt.shape[2])
    window, softcap = api._resolve_window(window), api._resolve_softcap(softcap)
    api._check_backward_inputs(tensors, (qt.shape[1], qt.shape[0]), on_device)
    if on_device:
        grads = _backward_on_device(framework, tensors, lengths, causal, scale, window, softcap, deterministic)
        return tuple(given[name] if given[name] is not None else grad for name, grad in zip(("dq", "dk", "dv"), grads))
    result = reference.attention_varlen_backward_reference(dout, q, k, v, lengths.host_q, lengths.host_k,
                                                           causal=causal, softmax_scale=scale, window=window,
                                                           softcap=softcap)
    return api._host_gradients(result, given, q.dtype)
