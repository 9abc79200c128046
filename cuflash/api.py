"""The public entry points on fixed-length batches: check the options, then the CPU path
(numpy_path.py) for NumPy arrays or the launch pipeline (plan.py) for GPU arrays."""

from __future__ import annotations

import operator
from typing import Any

from cuflash._core import checks, dispatch, interop, plan
from cuflash._cpu import numpy_path

__all__ = ["attention", "attention_backward", "explain"]

# attention_backward's described inputs by name.
_BACKWARD_INPUTS = operator.itemgetter("q", "k", "v", "dout", "out", "lse")


def explain(q: Any, k: Any, v: Any, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
            softcap: float = 0.0, out_dtype: Any = None, dtype: str | None = None) -> dispatch.KernelChoice:
    """The forward kernel ``attention(q, k, v, causal=..., window=..., softcap=...)`` runs for
    these GPU arrays on their device: its family (``sm90``, or ``sm80`` where no tensor map can
    describe a tensor's strides), instantiation name, threads, shared memory and tile. FP8 inputs
    (``out_dtype`` and ``dtype`` as for attention) run their family's FP8 kernel. Launches
    nothing."""
    framework = checks.framework({"q": q, "k": k, "v": v})
    if framework == "numpy":
        raise TypeError("q: explain describes GPU kernels; NumPy arrays run the CPU reference")
    qt, kt, vt = (checks.declared_dtype(name, interop.describe(x, framework, name), dtype)
                  for name, x in (("q", q), ("k", k), ("v", v)))
    checks.check_qkv(qt, kt, vt, on_device=True, fp8=True)
    fp8 = checks.resolve_fp8(qt, kt, vt, None, None, None, out_dtype, True)
    qt, kt, vt = (t if t.aligned_16 else interop.realign(t, framework) for t in (qt, kt, vt))
    mask = dispatch.make_mask(checks.resolve_flag("causal", causal), checks.resolve_window(window),
                              checks.resolve_softcap(softcap), qt.shape[1], kt.shape[1])
    return dispatch.forward_choice(dispatch.device_target(qt.device)[0], qt, kt, vt, mask, qt.shape[1],
                                   fp8 and fp8.out_dtype)


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
    descale_q: Any = None,
    descale_k: Any = None,
    descale_v: Any = None,
    out_dtype: Any = None,
    dtype: str | None = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    offset: int = 0,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_args: dict | None = None,
) -> Any:
    """Exact attention ``softmax(q kᵀ · softmax_scale) v``, computed tile by tile.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads, head_dim)
        CuPy array, torch CUDA tensor, other DLPack tensor (float16 or bfloat16), or NumPy array
        (float16, bfloat16, float32 or float64: the CPU reference path). FP8 (e4m3): torch
        ``float8_e4m3fn``, NumPy ``ml_dtypes.float8_e4m3fn``, or uint8 bytes with
        ``dtype="e4m3"`` (CuPy cannot hold a float8 dtype); see docs/fp8.md.
    k : array, shape (batch, seqlen_k, heads_kv, head_dim)
    v : array, shape (batch, seqlen_k, heads_kv, head_dim_v)
        Same dtype and device as q; ``heads % heads_kv == 0`` (GQA; MQA when heads_kv is 1).
        head_dim_v, like head_dim a multiple of 8 up to 256, may differ from head_dim (DeepSeek's
        192 / 128); the kernels run at the wider of the two (docs/kernels.md).
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
        natural log; ``-inf`` for a row that sees no key (its output row is 0). With ``sinks``
        the LSE includes the sink (so split-KV, ring and cascade merges stay exact, the sink
        entering once; FlashMLA's LSE excludes it), and a row that sees no key has lse = sink.
    out : array, optional
        Where to write the output: (batch, seqlen_q, heads, head_dim_v), dtype of q
        (``out_dtype`` for FP8 inputs), same framework and device.
    descale_q, descale_k, descale_v : float or array, optional
        FP8 inputs only: the factors that turn the stored e4m3 values into the values they
        stand for (``x * descale``): None (1), a positive number, or float32 of shape
        (batch, heads_kv), on q's side and device, entry [b, h] for kv head h of batch b (and
        for the query heads of its group), as FlashAttention-3 takes them.
    out_dtype : optional
        FP8 inputs only: the output's dtype, bfloat16 (default) or float16.
    dtype : str, optional
        ``"e4m3"``: q, k, v are uint8 arrays holding e4m3 bytes. None: their own dtype.
    sinks : array, optional
        Attention sinks (gpt-oss): a logit per query head, float32, bfloat16 or float16 (float64
        too on NumPy), shape (heads,), q's framework and device, that joins each row's softmax
        denominator, ``out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sinks[h]))``, not
        multiplied by softmax_scale. ``-inf`` is no sink. It costs each row's epilogue only. On
        the GPU its values are not checked (that would wait for the device): a NaN or +inf sink
        gives its head NaN rows.
    alibi_slopes : array, optional
        float32 (heads,) or (batch, heads): flash-attn's ALiBi bias
        ``-slope * |i + seqlen_k - seqlen_q - j|`` added to the (softcapped) score of query i and
        key j (a row per batch entry for (batch, heads)). It runs the kernels of a window mask
        (any mask is one), where it costs an add and a multiply-add per score.
    dropout_p : float
        Dropout of the attention probabilities, in [0, 1): ``out = (P * M / (1 - dropout_p)) v``
        with P the softmax and M a keep mask; the lse is of the undropped P. On the GPU it runs
        the kernels of a window mask (any mask is one), 16-bit inputs only.
    seed, offset : int
        The keep mask's counter-based stream (Philox4x32-10; docs/dropout.md), integers in
        [0, 2**64): element (b, h, i, j) depends on (seed, offset, b, h, i, j) alone, so the
        backward with the same seed and offset regenerates it. A seed is required with
        dropout_p > 0; a later call that needs a fresh mask takes a new seed, or the offset
        ``offset + batch * heads``. ``cuflash.torch`` draws both from torch's generator. GPU
        inputs may give seed as an int64 array (seed, offset) of shape (2,) on q's device (offset
        then 0), read by the kernels at run time: no wait for the device, and a captured CUDA
        graph draws each replay's values.

    score_mod, mask_mod, mod_args
        A user's attention variant as expressions (docs/guide.md, "Your own variant"):
        ``score_mod`` a float expression of ``score`` (the scaled score, after softcap and ALiBi),
        ``b``, ``h``, ``q_idx``, ``kv_idx`` and the arrays of ``mod_args`` (name -> array,
        indexed as ``slopes[h]``); ``mask_mod`` a bool expression of the same but score, True
        where the key is seen (with causal and window). NumPy arrays only for now (the CPU
        path); GPU arrays raise NotImplementedError.

    Returns
    -------
    out or (out, lse)
        out is (batch, seqlen_q, heads, head_dim_v). In the caller's framework: torch in, torch
        out (on torch's current stream); CuPy or another DLPack producer in, CuPy out; NumPy in,
        NumPy out.

    Raises
    ------
    TypeError
        Unsupported array type or dtype (float32/float64 on the GPU: cast first; FP8 e5m2), mixed
        dtypes (FP8 with 16-bit included), a descale that is not float32, an out_dtype that is not
        bfloat16 or float16, CPU and GPU arrays mixed, a softmax_scale that is not a real number,
        a causal or return_lse that is not a bool (or 0 / 1).
    ValueError
        Wrong rank, mismatched shapes, heads not a multiple of heads_kv, head_dim not a positive
        multiple of 8 or above 256, a non-contiguous last dimension, arrays on different devices, a bad
        ``out``, a non-finite or non-positive softmax_scale or descale, a descale array of the
        wrong shape or device, a descale or out_dtype given with inputs that are not FP8, FP8
        GPU inputs whose head_dim or head_dim_v is not a multiple of 16; sinks or alibi_slopes of
        the wrong shape, dtype, side or device; on NumPy, a NaN or +inf sink, a non-finite slope; a
        dropout_p outside [0, 1), a seed or offset outside [0, 2**64), dropout_p > 0 without a
        seed (a TypeError for any of them that is not a number of the right kind).
    NotImplementedError
        dropout_p > 0 with FP8 GPU inputs (the FP8 forward is for inference).

    Notes
    -----
    head_dim is served from a bucket of 64, 96, 128, 192 or 256. q, k and v may have any
    strides with a contiguous last dimension; a tensor whose pointer or strides are not 16-byte
    aligned is copied once, because the kernel loads 16-byte vectors. FP8 GPU inputs run the
    device family's forward: on Hopper e4m3 tensor-core products (V transposed in shared memory,
    the probabilities rounded to e4m3), elsewhere the e4m3 bytes widened exactly to ``out_dtype``
    for bf16/fp16 products; there is no FP8 backward.
    """
    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    framework = checks.framework(arrays)
    causal, return_lse = checks.resolve_flag("causal", causal), checks.resolve_flag("return_lse", return_lse)
    window, softcap = checks.resolve_window(window), checks.resolve_softcap(softcap)
    descales = descale_q, descale_k, descale_v
    if framework == "numpy":
        q, k, v = (checks.declared_dtype(name, x, dtype) for name, x in (("q", q), ("k", k), ("v", v)))
        scale, fp8 = checks.check_forward(q, k, v, out, softmax_scale, False, descales, out_dtype)
        sinks, alibi_slopes = checks.check_sinks_alibi(sinks, alibi_slopes, framework, q, q.shape[2], q.shape[0])
        dropout = checks.check_dropout(dropout_p, seed, offset, framework)
        mods = checks.check_mods(score_mod, mask_mod, mod_args, framework)
        return numpy_path.attention(q, k, v, causal, scale, window, softcap, return_lse, out, fp8, sinks,
                                    alibi_slopes, dropout, mods)
    if score_mod is not None or mask_mod is not None or mod_args is not None:
        checks.check_mods(score_mod, mask_mod, mod_args, framework)

    # One call each, not a generator over the three: no generator object per call.
    qt, kt = interop.describe(q, framework, "q"), interop.describe(k, framework, "k")
    vt = interop.describe(v, framework, "v")
    out_t = interop.describe(out, interop.framework_of(out, "out"), "out") if out is not None else None
    fp8_call = (qt.dtype == checks.FP8_DTYPE or dtype is not None or out_dtype is not None or descale_q is not None
                or descale_k is not None or descale_v is not None)
    if fp8_call:
        qt, kt, vt = (checks.declared_dtype(name, t, dtype) for name, t in (("q", qt), ("k", kt), ("v", vt)))
    bias, bias_layouts = _bias(sinks, alibi_slopes, framework)
    if bias_layouts is None:  # sinks to copy to float32, or the checks to speak: every call checked
        checks.check_forward(qt, kt, vt, out_t, softmax_scale, True, descales, out_dtype)  # q's shape first
        bias = checks.check_sinks_alibi(sinks, alibi_slopes, framework, qt, qt.shape[2], qt.shape[0])
    dropout = None
    if dropout_p != 0.0 or seed is not None or offset != 0:  # q's checks first, as above
        checks.check_forward(qt, kt, vt, out_t, softmax_scale, True, descales, out_dtype)
        dropout = checks.check_dropout(dropout_p, seed, offset, framework, qt)
        if dropout is not None and fp8_call:
            raise NotImplementedError("dropout_p: not taken with FP8 inputs (the FP8 forward is for inference)")
    # FP8 calls run their checks every time (a signature would have to hold the descales), and so
    # do calls with dropout (it would have to hold its seed).
    signature = (("attention", qt.layout, kt.layout, vt.layout, out_t and out_t.layout, causal, softmax_scale, window,
                  softcap, bias_layouts)
                 if (not fp8_call and bias_layouts is not None and dropout is None
                     and type(softmax_scale) in plan.SIGNATURE_SCALARS and plan.aligned_pointers(qt, kt, vt, out_t))
                 else None)
    result, lse = plan.run(signature, qt.device, _checked_forward,
                           (framework, qt, kt, vt, out_t, causal, softmax_scale, window, softcap, descales, out_dtype,
                            sinks, alibi_slopes, dropout.p if dropout else 0.0),
                           _build_forward, framework, (qt, kt, vt), (out,), (out_t,), return_lse, plan.NO_LENGTHS, bias,
                           dropout.words if dropout else checks.NO_DROPOUT_WORDS)
    return (result, lse) if return_lse else result


def _bias(sinks, alibi_slopes, framework: str) -> tuple[checks.Bias, tuple | None]:
    """(the Bias a launch reads, what a signature holds of it): NO_BIAS and () without sinks or
    slopes; float32 ones described as they are (checks.described_bias) and their layouts; None
    for the layouts where the full checks must run (they may copy, or refuse)."""
    if sinks is None and alibi_slopes is None:
        return checks.NO_BIAS, ()
    bias = checks.described_bias(sinks, alibi_slopes, framework)
    return (bias, checks.bias_layouts(bias)) if bias is not None else (checks.NO_BIAS, None)


def _checked_forward(framework: str, qt, kt, vt, out_t, causal: bool, softmax_scale, window, softcap: float,
                     descales: tuple, out_dtype, sinks, alibi_slopes, dropout_p: float):
    """attention's checks, for plan.run: (checks.ForwardCall, the tensors to launch on, whether they
    are the given ones). A tensor whose pointer or strides are not 16-byte aligned is copied."""
    scale, fp8 = checks.check_forward(qt, kt, vt, out_t, softmax_scale, True, descales, out_dtype)
    alibi = None
    if sinks is not None or alibi_slopes is not None:
        alibi = checks.check_sinks_alibi(sinks, alibi_slopes, framework, qt, qt.shape[2], qt.shape[0]).alibi_stride
    as_given = qt.aligned_16 and kt.aligned_16 and vt.aligned_16
    if not as_given:
        qt, kt, vt = (t if t.aligned_16 else interop.realign(t, framework) for t in (qt, kt, vt))
    call = checks.ForwardCall(qt, kt, vt, out_t, scale, causal, window, softcap, fp8, alibi=alibi, dropout=dropout_p)
    return call, (qt, kt, vt, *fp8.descales) if fp8 else (qt, kt, vt), as_given


def _build_forward(call: checks.ForwardCall) -> plan.ForwardPlan:
    q, k, v, fp8 = call.q, call.k, call.v, call.fp8
    batch, seqlen_q, heads = q.shape[:3]
    mask = dispatch.make_mask(call.causal, call.window, call.softcap, seqlen_q, k.shape[1], call.alibi is not None,
                              call.dropout != 0.0)
    out = call.out or interop.contiguous(checks.output_shape(q, v), q, fp8 and fp8.out_dtype)
    return plan.build_forward(q, k, v, out, interop.contiguous((batch, heads, seqlen_q), q, "float32"), call.scale,
                              mask, batch, seqlen_q, descales=fp8 and fp8.descales, alibi=call.alibi,
                              dropout_p=call.dropout)


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
    sinks: Any = None,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    offset: int = 0,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_args: dict | None = None,
) -> tuple[Any, ...]:
    """Gradients of ``out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale)``.

    P is recomputed from ``lse`` block by block (FlashAttention-2): nothing of size
    seqlen_q x seqlen_k is stored; the extra device memory is O(batch x heads x seqlen) plus fp32
    accumulators the size of dq (and of dk, dv under GQA/MQA).

    Parameters
    ----------
    dout : array, shape of out, dtype of q
        Upstream gradient of ``out``.
    q, k, v, out : arrays
        The forward's inputs and output, as for :func:`attention`.
    lse : array, float32 (batch, heads, seqlen_q), contiguous
        The forward's log-sum-exp (``attention(..., return_lse=True)``).
    causal, softmax_scale, window, softcap, sinks, alibi_slopes, dropout_p, seed, offset,
    score_mod, mask_mod, mod_args
        As in the forward call (whose lse, with sinks, includes the sink; with dropout, the same
        seed and offset regenerate its mask). The gradient goes through score_mod by its
        derivative with respect to score, formed from the expression; mod_args get none.
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
        seqlen_k, heads, head_dim) fp32 instead of heads_kv; time: docs/kernels.md, determinism.
    dq, dk, dv : arrays, optional
        Where to write the gradients (shapes of q, k, v, so dv has head_dim_v; dtype of q).

    Returns
    -------
    (dq, dk, dv), or (dq, dk, dv, dsinks) with ``sinks``
        In the caller's framework, as for :func:`attention`; dk and dv summed over each group of
        query heads for GQA/MQA. dsinks is float32 (heads,):
        ``dsinks_h = -sum_{b,i} exp(sinks_h - lse_bhi) * rowsum(dout * out)_bhi``, summed in a
        fixed order (bitwise repeatable in either mode).

    Raises
    ------
    TypeError, ValueError
        As for :func:`attention`, and for a deterministic that is not a bool (or 0 / 1), dout/out
        not of out's shape and q's dtype, an lse that is not float32 or not (batch, heads, seqlen_q), or gradients
        passed in dq/dk/dv of the wrong shape or dtype.
    """
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        if x is not None:
            arrays[name] = x
    framework = checks.framework(arrays)
    causal, deterministic = checks.resolve_flag("causal", causal), checks.resolve_flag("deterministic", deterministic)
    if framework == "numpy":
        scale, window, softcap = checks.check_backward(arrays, softmax_scale, window, softcap, on_device=False)
        sinks, alibi_slopes = checks.check_sinks_alibi(sinks, alibi_slopes, framework, q, q.shape[2], q.shape[0])
        dropout = checks.check_dropout(dropout_p, seed, offset, framework)
        mods = checks.check_mods(score_mod, mask_mod, mod_args, framework)
        return numpy_path.attention_backward(arrays, causal, scale, window, softcap, sinks, alibi_slopes, dropout,
                                             mods)
    if score_mod is not None or mask_mod is not None or mod_args is not None:
        checks.check_mods(score_mod, mask_mod, mod_args, framework)
    tensors = {name: interop.describe(x, framework, name) for name, x in arrays.items()}
    bias, bias_layouts = _bias(sinks, alibi_slopes, framework)
    if bias_layouts is None:  # as in attention
        checks.check_backward(tensors, softmax_scale, window, softcap, on_device=True)  # q's shape first
        qt = tensors["q"]
        bias = checks.check_sinks_alibi(sinks, alibi_slopes, framework, qt, qt.shape[2], qt.shape[0])
    dropout = None
    if dropout_p != 0.0 or seed is not None or offset != 0:  # q's checks first, as above
        checks.check_backward(tensors, softmax_scale, window, softcap, on_device=True)
        dropout = checks.check_dropout(dropout_p, seed, offset, framework, tensors["q"])
    # Item getters, not generators over the names: no generator object per call.
    qt, kt, vt, dout_t, out_t, lse_t = _BACKWARD_INPUTS(tensors)
    given_t = dq_t, dk_t, dv_t = tensors.get("dq"), tensors.get("dk"), tensors.get("dv")
    signature = (("attention_backward", qt.layout, kt.layout, vt.layout, dout_t.layout, out_t.layout, lse_t.layout,
                  dq_t and dq_t.layout, dk_t and dk_t.layout, dv_t and dv_t.layout, causal, softmax_scale, window,
                  softcap, deterministic, bias_layouts)
                 if (bias_layouts is not None and dropout is None and type(softmax_scale) in plan.SIGNATURE_SCALARS
                     and checks.plain_window(window) and type(softcap) in plan.SIGNATURE_SCALARS
                     and plan.aligned_pointers(qt, kt, vt, dout_t, out_t, dq_t, dk_t, dv_t)) else None)
    *grads, dsinks = plan.run(signature, qt.device, _checked_backward,
                              (framework, tensors, given_t, causal, softmax_scale, window, softcap, deterministic,
                               sinks, alibi_slopes, dropout.p if dropout else 0.0),
                              _build_backward, framework, (qt, kt, vt, out_t, dout_t, lse_t), (dq, dk, dv), given_t,
                              plan.NO_LENGTHS, bias, dropout.words if dropout else checks.NO_DROPOUT_WORDS)
    return (*grads, dsinks) if sinks is not None else tuple(grads)


def _checked_backward(framework: str, tensors: dict, given_t: tuple, causal: bool, softmax_scale, window, softcap,
                      deterministic: bool, sinks, alibi_slopes, dropout_p: float):
    """attention_backward's checks, as _checked_forward's."""
    scale, window, softcap = checks.check_backward(tensors, softmax_scale, window, softcap, on_device=True)
    qt, kt, vt, dout_t, out_t, lse_t = _BACKWARD_INPUTS(tensors)
    alibi = None
    if sinks is not None or alibi_slopes is not None:
        alibi = checks.check_sinks_alibi(sinks, alibi_slopes, framework, qt, qt.shape[2], qt.shape[0]).alibi_stride
    as_given = all(t.aligned_16 for t in (qt, kt, vt, dout_t, out_t))
    if not as_given:
        qt, kt, vt, dout_t, out_t = (t if t.aligned_16 else interop.realign(t, framework)
                                     for t in (qt, kt, vt, dout_t, out_t))
    call = checks.BackwardCall(qt, kt, vt, out_t, dout_t, lse_t, *given_t, scale, causal, window, softcap,
                               deterministic, alibi=alibi, dropout=dropout_p)
    return call, (qt, kt, vt, out_t, dout_t, lse_t), as_given


def _build_backward(call: checks.BackwardCall) -> plan.BackwardPlan:
    q, k = call.q, call.k
    batch, seqlen_q = q.shape[:2]
    grads = tuple(t or interop.contiguous(like.shape, q) for t, like in ((call.dq, q), (call.dk, k), (call.dv, call.v)))
    mask = dispatch.make_mask(call.causal, call.window, call.softcap, seqlen_q, k.shape[1], call.alibi is not None,
                              call.dropout != 0.0)
    return plan.build_backward(q, k, call.v, call.out, call.dout, call.lse, grads, call.scale, mask,
                               call.deterministic, batch, seqlen_q, k.shape[1], alibi=call.alibi,
                               dropout_p=call.dropout)
