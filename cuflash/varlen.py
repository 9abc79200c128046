"""Variable-length batches: packed ``(total_tokens, heads, head_dim)`` tensors and int32
cumulative sequence lengths, flash-attn's ``*_varlen`` layout.

Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows
``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` and attends only to its own keys (causal and window
alignment per sequence). Either length may be 0, and so may all of one side's (a packed total
of 0 rows): then nothing runs and the outputs are empty, or zero with lse -inf, as in
flash-attn. NumPy inputs run the float64 reference on the CPU; GPU inputs run the forward
kernel, and the backward's kernels, over all sequences in one launch each.
"""

from __future__ import annotations

from typing import Any

from cuflash._core import checks, dispatch, interop, plan
from cuflash._cpu import numpy_path

__all__ = ["attention_varlen", "attention_varlen_backward"]


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
    descale_q: Any = None,
    descale_k: Any = None,
    descale_v: Any = None,
    out_dtype: Any = None,
    dtype: str | None = None,
    seqused_q: Any = None,
    seqused_k: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    offset: int = 0,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_args: dict | None = None,
) -> Any:
    """Attention over a packed batch of sequences of different lengths.

    Parameters
    ----------
    q : array, (total_q, heads, head_dim)
    k : array, (total_k, heads_kv, head_dim)
    v : array, (total_k, heads_kv, head_dim_v)
        dtypes, devices and head rules as for :func:`cuflash.attention` (head_dim_v may differ
        from head_dim).
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
        Where to write the output ((total_q, heads, head_dim_v), dtype of q; ``out_dtype`` for
        FP8 inputs).
    validate : bool
        Check that the cumulative lengths start at 0, do not decrease and end at the packed length,
        and that max_seqlen_* are not smaller than a real sequence: a device-to-host copy and
        synchronisation for GPU arrays. False skips the checks (wrong lengths then give wrong
        results); with max_seqlen_q given, the call then never waits for the GPU.
    descale_q, descale_k, descale_v, out_dtype, dtype
        FP8 (e4m3) inputs, as for :func:`cuflash.attention`; a descale array has shape
        (num_sequences, heads_kv).
    seqused_q, seqused_k : int32 arrays (batch,), optional
        The used prefix of each packed sequence (FlashAttention-3's): sequence i computes only its
        first seqused_q[i] query rows against its first seqused_k[i] keys, causal masks and
        windows aligned against those lengths; its rows past seqused_q[i] are 0 with lse -inf.
        Values within 0..the sequence's length, checked with ``validate`` (GPU) or always (NumPy);
        on the GPU a larger value counts as the whole sequence.
    sinks, alibi_slopes : arrays, optional
        As for :func:`cuflash.attention` (the lse includes the sink; a row of no key has out 0 and
        lse = sink); alibi_slopes is (heads,) or (num_sequences, heads).
    dropout_p, seed, offset
        As for :func:`cuflash.attention`, sequence i's mask being the one a fixed-length batch
        draws for its entry i (positions within the sequence); a fresh mask's offset is
        ``offset + num_sequences * heads``.
    score_mod, mask_mod, mod_args
        As for :func:`cuflash.attention`, ``b`` the sequence's index and ``q_idx``, ``kv_idx``
        positions within it (NumPy arrays only for now).

    Returns
    -------
    out or (out, lse)
        In the caller's framework, as for :func:`cuflash.attention`. Where every key sequence is
        empty, out is zero and lse -inf.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, each naming the argument.
    NotImplementedError
        dropout_p > 0 with FP8 GPU inputs.
    """
    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    if type(validate) is not bool or type(return_lse) is not bool:  # plain bools skip two calls
        validate, return_lse = checks.resolve_flag("validate", validate), checks.resolve_flag("return_lse", return_lse)
    framework, tensors, lengths = checks.check_varlen(arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                      validate, dtype=dtype)
    if seqused_q is not None or seqused_k is not None:
        lengths = checks.check_seqused(lengths, seqused_q, seqused_k, framework != "numpy",
                                       tensors["q"].device if framework != "numpy" else None, validate)
    causal = checks.resolve_flag("causal", causal)
    scale = checks.resolve_scale(softmax_scale, tensors["q"].shape[2])
    window, softcap = checks.resolve_window(window), checks.resolve_softcap(softcap)
    on_device = framework != "numpy"
    fp8 = checks.resolve_fp8(tensors["q"], tensors["k"], tensors["v"], descale_q, descale_k, descale_v, out_dtype,
                             on_device, lengths.batch)
    if out is not None:
        checks.check_out("out", tensors["out"], checks.output_shape(tensors["q"], tensors["v"]), tensors["q"],
                         on_device, fp8 and fp8.out_dtype)
    bias = checks.NO_BIAS
    if sinks is not None or alibi_slopes is not None:
        checked = checks.check_sinks_alibi(sinks, alibi_slopes, framework, tensors["q"], tensors["q"].shape[1],
                                           lengths.batch, "num_sequences")
        if on_device:
            bias = checked
        else:
            sinks, alibi_slopes = checked
    dropout = (checks.check_dropout(dropout_p, seed, offset, framework, tensors["q"])
               if dropout_p != 0.0 or seed is not None or offset != 0 else None)
    mods = (checks.check_mods(score_mod, mask_mod, mod_args, framework)
            if score_mod is not None or mask_mod is not None or mod_args is not None else None)
    if not on_device:
        return numpy_path.attention_varlen(tensors["q"], tensors["k"], tensors["v"], lengths.host_q, lengths.host_k, causal,
                                     scale, window, softcap, return_lse, out, fp8, lengths.used_q, lengths.used_k,
                                     sinks, alibi_slopes, dropout, mods)
    if dropout is not None and fp8:
        raise NotImplementedError("dropout_p: not taken with FP8 inputs (the FP8 forward is for inference)")
    checks.check_varlen_grid(lengths)
    qt, kt, vt = (t if t.aligned_16 else interop.realign(t, framework)
                  for t in (tensors["q"], tensors["k"], tensors["v"]))
    out_t = tensors.get("out")
    total_q, heads, _ = qt.shape
    if total_q == 0 or kt.shape[0] == 0:  # no work: out is empty, or zero with lse -inf (or the sinks)
        filled = plan.fill_empty(framework, qt, (out,), (out_t,), (checks.output_shape(qt, vt),),
                                 (heads, total_q) if return_lse else None, fp8 and fp8.out_dtype, bias.sinks)
        return filled if return_lse else filled[0]
    # The checks above run on every call (they read the lengths' values); the plan is cached.
    call = checks.ForwardCall(qt, kt, vt, out_t, scale, causal, window, softcap, fp8, lengths, bias.alibi_stride,
                              dropout.p if dropout else 0.0)
    tensors = (qt, kt, vt, *fp8.descales) if fp8 else (qt, kt, vt)
    # The used prefixes travel with the lengths to the launch, which fills them in per call.
    cu_seqlens = lengths.device_q, lengths.device_k
    launch_lengths = (cu_seqlens if lengths.device_used_q is None and lengths.device_used_k is None
                      else (*cu_seqlens, lengths.device_used_q, lengths.device_used_k))
    out, lse = plan.run(None, qt.device, _checked, (call, tensors), _build_forward, framework, tensors, (out,),
                        (out_t,), return_lse, launch_lengths, bias,
                        dropout.words if dropout else checks.NO_DROPOUT_WORDS)
    return (out, lse) if return_lse else out


def _checked(call, tensors: tuple):
    """plan.run's prepare of a call checked already, launched on ``tensors``."""
    return call, tensors, True


def _build_forward(call: checks.ForwardCall) -> plan.ForwardPlan:
    q, k, v, fp8, lengths = call.q, call.k, call.v, call.fp8, call.lengths
    heads, total_q = q.shape[1], q.shape[0]
    # Windows normalised against the packed lengths, which bound every sequence's.
    mask = dispatch.make_mask(call.causal, call.window, call.softcap, total_q, k.shape[0], call.alibi is not None,
                              call.dropout != 0.0)
    out = call.out or interop.contiguous(checks.output_shape(q, v), q, fp8 and fp8.out_dtype)
    return plan.build_forward(*(checks.as_batch_of_one(t) for t in (q, k, v, out)),
                              interop.contiguous((heads, total_q), q, "float32"), call.scale, mask, lengths.batch,
                              int(lengths.max_seqlen_q), (lengths.device_q, lengths.device_k), fp8 and fp8.descales,
                              call.alibi, call.dropout)


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
    sinks: Any = None,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    offset: int = 0,
    seqused_q: Any = None,
    seqused_k: Any = None,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_args: dict | None = None,
) -> tuple[Any, ...]:
    """Gradients (dq, dk, dv) of :func:`attention_varlen`, arguments as there and as for
    :func:`cuflash.attention_backward`; lse is the forward's float32 (heads, total_q). The CPU
    reference path is deterministic whatever ``deterministic`` says. Where one side's sequences
    are all empty, the gradients are zero (or empty). With ``sinks``, also dsinks, float32
    (heads,), summed over the sequences. dropout_p, seed and offset those of the forward.
    ``seqused_q`` / ``seqused_k`` those of the forward (FlashAttention-3's used prefixes): the
    gradients of the used rows and keys, 0 past them; not with sinks, dropout or per-sequence
    ALiBi slopes. score_mod, mask_mod and mod_args those of the forward.
    """
    given = dq, dk, dv
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    arrays |= {name: x for name, x in zip(("dq", "dk", "dv"), given) if x is not None}
    validate = checks.resolve_flag("validate", validate)
    framework, tensors, lengths = checks.check_varlen(arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                      validate, need_max_k=True)
    on_device = framework != "numpy"
    qt = tensors["q"]
    causal = checks.resolve_flag("causal", causal)
    deterministic = checks.resolve_flag("deterministic", deterministic)
    scale = checks.resolve_scale(softmax_scale, qt.shape[2])
    window, softcap = checks.resolve_window(window), checks.resolve_softcap(softcap)
    checks.check_backward_inputs(tensors, (qt.shape[1], qt.shape[0]), on_device)
    if seqused_q is not None or seqused_k is not None:
        lengths = checks.check_seqused(lengths, seqused_q, seqused_k, on_device, qt.device if on_device else None,
                                       validate)
        refused = {"sinks": sinks is not None, "dropout_p": dropout_p != 0.0,
                   "alibi_slopes of shape (num_sequences, heads)": alibi_slopes is not None
                   and len(getattr(alibi_slopes, "shape", ())) == 2}
        for name, taken in refused.items():
            if taken:
                raise NotImplementedError(f"{name}: not taken with seqused_q / seqused_k in the backward")
        # The used prefixes as sequences of their own (checks.used_prefix_sequences), after the
        # checks of the call's own lengths.
        lengths = checks.used_prefix_sequences(lengths, framework)
    bias = checks.NO_BIAS
    if sinks is not None or alibi_slopes is not None:
        checked = checks.check_sinks_alibi(sinks, alibi_slopes, framework, qt, qt.shape[1], lengths.batch,
                                           "num_sequences")
        if on_device:
            bias = checked
        else:
            sinks, alibi_slopes = checked
    dropout = (checks.check_dropout(dropout_p, seed, offset, framework, qt)
               if dropout_p != 0.0 or seed is not None or offset != 0 else None)
    mods = (checks.check_mods(score_mod, mask_mod, mod_args, framework)
            if score_mod is not None or mask_mod is not None or mod_args is not None else None)
    if mods is not None and (seqused_q is not None or seqused_k is not None):
        raise NotImplementedError("score_mod, mask_mod: not taken with seqused_q / seqused_k in the backward")
    if not on_device:
        return numpy_path.attention_varlen_backward(arrays, lengths.host_q, lengths.host_k, causal, scale, window,
                                                    softcap, sinks, alibi_slopes, dropout, mods)
    checks.check_varlen_grid(lengths)
    qt, kt, vt, dout_t, out_t = (t if t.aligned_16 else interop.realign(t, framework)
                                 for t in (tensors[name] for name in ("q", "k", "v", "dout", "out")))
    lse_t = tensors["lse"]
    given_t = tuple(tensors.get(name) for name in ("dq", "dk", "dv"))
    if qt.shape[0] == 0 or kt.shape[0] == 0:  # no work: the gradients are empty or zero
        grads = plan.fill_empty(framework, qt, given, given_t, (qt.shape, kt.shape, vt.shape))
        # Every output row is 0, so each row's rowsum(dout * out), and with it dsinks, is 0.
        return grads if sinks is None else (*grads, plan.zeros(framework, bias.sinks))
    call = checks.BackwardCall(qt, kt, vt, out_t, dout_t, lse_t, *given_t, scale, causal, window, softcap,
                               deterministic, lengths, bias.alibi_stride, dropout.p if dropout else 0.0)
    tensors = qt, kt, vt, out_t, dout_t, lse_t
    *grads, dsinks = plan.run(None, qt.device, _checked, (call, tensors), _build_backward, framework, tensors, given,
                              given_t, (lengths.device_q, lengths.device_k), bias,
                              dropout.words if dropout else checks.NO_DROPOUT_WORDS)
    return (*grads, dsinks) if sinks is not None else tuple(grads)


def _build_backward(call: checks.BackwardCall) -> plan.BackwardPlan:
    q, k, v, lengths = call.q, call.k, call.v, call.lengths
    grads = tuple(checks.as_batch_of_one(t or interop.contiguous(like.shape, q))
                  for t, like in ((call.dq, q), (call.dk, k), (call.dv, v)))
    mask = dispatch.make_mask(call.causal, call.window, call.softcap, q.shape[0], k.shape[0], call.alibi is not None,
                              call.dropout != 0.0)
    return plan.build_backward(*(checks.as_batch_of_one(t) for t in (q, k, v, call.out, call.dout)), call.lse, grads,
                               call.scale, mask, call.deterministic, lengths.batch, int(lengths.max_seqlen_q),
                               int(lengths.max_seqlen_k), (lengths.device_q, lengths.device_k), call.alibi,
                               call.dropout)
