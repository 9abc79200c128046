"""attention(window=, softcap=) and attention_varlen on the CPU reference path, and their bad
inputs: each a TypeError or ValueError naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash._cpu import reference


def _packed(lengths_q=(5, 0, 9), lengths_k=(7, 3, 2), heads=4, heads_kv=2, head_dim=16, dtype=np.float32):
    rng = np.random.default_rng(2)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], heads, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], heads_kv, head_dim)).astype(dtype) for _ in range(2))
    return q, k, v, cu_q, cu_k


def test_attention_window_and_softcap_on_the_host_path():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 70, 2, 16)) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, causal=True, window=(9, 0), softcap=3.0, return_lse=True)
    ref_out, ref_lse = reference.attention_reference(q, k, v, causal=True, window=(9, 0), softcap=3.0)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    dout = rng.standard_normal(q.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, window=(9, 0), softcap=3.0)
    # The host path recomputes P from the given (float32) lse, as the kernels do.
    expected = reference.attention_backward_from_lse(dout, q, k, v, out, lse, causal=True, window=(9, 0),
                                                     softcap=3.0)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_attention_varlen_host_path_matches_reference():
    q, k, v, cu_q, cu_k = _packed(dtype=np.float64)
    out_given = np.full(q.shape, np.nan)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, window=(3, -1), return_lse=True,
                                        out=out_given)
    assert out is out_given and lse.dtype == np.float32 and lse.shape == (4, q.shape[0])
    ref_out, ref_lse = reference.attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, window=(3, -1))
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse.astype(np.float32))
    dout = np.random.default_rng(9).standard_normal(q.shape)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, window=(3, -1))
    expected = reference.attention_varlen_backward_reference(dout, q, k, v, cu_q, cu_k, causal=True, window=(3, -1))
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"cu_seqlens_q": np.array([0, 5, 5, 14], np.int64)}, TypeError, "cu_seqlens_q: expected int32"),
        ({"cu_seqlens_k": np.array([0, 7, 10, 12], np.float32)}, TypeError, "cu_seqlens_k: expected int32"),
        ({"cu_seqlens_q": np.array([1, 5, 5, 14], np.int32)}, ValueError, "cu_seqlens_q: must start at 0"),
        ({"cu_seqlens_q": np.array([0, 5, 4, 14], np.int32)}, ValueError, "cu_seqlens_q: must not decrease"),
        ({"cu_seqlens_k": np.array([0, 7, 10, 11], np.int32)}, ValueError, "cu_seqlens_k: last entry 11"),
        ({"cu_seqlens_k": np.array([0, 12], np.int32)}, ValueError, "cu_seqlens_k: 1 sequences"),
        ({"cu_seqlens_q": np.array([0], np.int32)}, ValueError, "cu_seqlens_q: expected shape"),
        ({"max_seqlen_q": 8}, ValueError, "max_seqlen_q: 8 is smaller than sequence 2's length 9"),
        ({"max_seqlen_k": 2.5}, TypeError, "max_seqlen_k: expected an int"),
        ({"window": (-2, 0)}, ValueError, "window: values must be -1"),
        ({"window": (1.5, 0)}, TypeError, "window: expected integers"),
        ({"window": 3}, TypeError, "window: expected a pair"),
        ({"softcap": -1.0}, ValueError, "softcap: must be finite and >= 0"),
        ({"softcap": "30"}, TypeError, "softcap: expected a real number"),
        ({"causal": "false"}, TypeError, "causal: expected a bool"),
        ({"validate": "no"}, TypeError, "validate: expected a bool"),
        ({"return_lse": "no"}, TypeError, "return_lse: expected a bool"),
        ({"q": np.zeros((0, 4, 16), np.float32), "cu_seqlens_q": np.array([0, 0, 0, 0], np.int32),
          "max_seqlen_q": -1}, ValueError, "max_seqlen_q: must be at least 0"),
        ({"q": np.zeros((14, 4), np.float32)}, ValueError, "q: expected 3 dims"),
        ({"k": np.zeros((12, 3, 16), np.float32), "v": np.zeros((12, 3, 16), np.float32)}, ValueError,
         "heads_kv \\(3\\) must divide"),
    ],
)
def test_attention_varlen_bad_inputs(change, error, words):
    q, k, v, cu_q, cu_k = _packed()
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k} | change
    with pytest.raises(error, match=words):
        cuflash.attention_varlen(**args)


def test_attention_varlen_backward_flags_must_be_bools():
    q, k, v, cu_q, cu_k = _packed()
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    for flags, name in (({"causal": "no"}, "causal"), ({"deterministic": "yes"}, "deterministic")):
        with pytest.raises(TypeError, match=f"{name}: expected a bool"):
            cuflash.attention_varlen_backward(q, q, k, v, out, lse, cu_q, cu_k, **flags)


def test_attention_varlen_validate_false_skips_value_checks():
    q, k, v, cu_q, cu_k = _packed()
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=1)
    out = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=1, validate=False)
    assert out.shape == q.shape


@pytest.mark.parametrize("window, softcap, error, words", [((-3, -1), 0.0, ValueError, "window"),
                                                          ((-1, -1), float("inf"), ValueError, "softcap"),
                                                          ((0, True), 0.0, TypeError, "window")])
def test_attention_window_softcap_bad_values(window, softcap, error, words):
    q = np.zeros((1, 8, 2, 16), np.float32)
    with pytest.raises(error, match=words):
        cuflash.attention(q, q, q, window=window, softcap=softcap)


def test_attention_varlen_backward_bad_lse():
    q, k, v, cu_q, cu_k = _packed()
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(ValueError, match="lse: expected shape"):
        cuflash.attention_varlen_backward(q, q, k, v, out, lse[:, :3], cu_q, cu_k)
    with pytest.raises(TypeError, match="lse: expected float32"):
        cuflash.attention_varlen_backward(q, q, k, v, out, lse.astype(np.float64), cu_q, cu_k)


@pytest.mark.parametrize("lengths_q, lengths_k", [((0, 0, 0), (7, 3, 2)), ((5, 0, 9), (0, 0, 0))])
def test_packed_batch_of_total_length_zero(lengths_q, lengths_k):
    """All sequences empty on one side: empty outputs, or zeros with lse -inf (flash-attn's
    answer), and gradients empty or zero, as the reference gives them row by row."""
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, dtype=np.float64)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dout = np.random.default_rng(5).standard_normal(q.shape)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not (dq.any() or dk.any() or dv.any())


def test_return_lse_must_be_a_bool():
    q = np.zeros((1, 8, 2, 16), np.float32)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        cuflash.attention(q, q, q, return_lse="no")


@pytest.mark.parametrize("name, shape", [("out", (1, 7, 2, 16)), ("lse", (1, 2, 7))])
def test_cpu_backward_checks_out_and_lse_shapes(name, shape):
    """The CPU backward refuses the out and lse shapes the GPU path refuses."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 2, 16))
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    arrays = {"out": out, "lse": lse, name: np.zeros(shape, out.dtype if name == "out" else np.float32)}
    with pytest.raises(ValueError, match=f"{name}: expected shape"):
        cuflash.attention_backward(q, q, q, q, arrays["out"], arrays["lse"])


def test_seqused_host_path_uses_the_prefixes():
    q, k, v, cu_q, cu_k = _packed(dtype=np.float64)  # lengths q (5, 0, 9), k (7, 3, 2)
    used_q, used_k = np.array([3, 0, 9], np.int32), np.array([7, 1, 0], np.int32)
    out_given = np.full(q.shape, np.nan)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, out=out_given,
                                        seqused_q=used_q, seqused_k=used_k)
    # Sequence 0: its first 3 queries against its 7 keys, causal aligned against (3, 7).
    o, l = reference.attention_reference(q[None, :3], k[None, :7], v[None, :7], causal=True)
    np.testing.assert_allclose(out[:3], o[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[:, :3], l[0].astype(np.float32))
    # Its rows past seqused_q, and sequence 2 (no used key), are 0 with lse -inf.
    assert (out[3:5] == 0).all() and np.isneginf(lse[:, 3:5]).all()
    assert (out[5:] == 0).all() and np.isneginf(lse[:, 5:]).all()
    ref_out, ref_lse = reference.attention_varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, causal=True)
    np.testing.assert_array_equal(out, ref_out)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"seqused_q": np.array([1, 0, 2], np.int64)}, TypeError, "seqused_q: expected int32"),
        ({"seqused_k": np.array([1, 0], np.int32)}, ValueError, r"seqused_k: expected shape \(3,\)"),
        ({"seqused_q": np.array([6, 0, 2], np.int32)}, ValueError, "seqused_q: entry 0 \\(6\\) is outside 0..5"),
        ({"seqused_k": np.array([1, -1, 2], np.int32)}, ValueError, "seqused_k: entry 1 \\(-1\\) is outside 0..3"),
        ({"seqused_k": np.zeros((3, 2), np.int32)[:, 0]}, ValueError, "seqused_k: must be contiguous"),
    ],
)
def test_seqused_bad_inputs(change, error, words):
    q, k, v, cu_q, cu_k = _packed()
    with pytest.raises(error, match=words):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, **change)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_seqused_backward_on_the_host_path(causal, window):
    """The backward with seqused_q / seqused_k: each sequence's used rows and keys get the
    gradients of attention over its used prefixes alone (masks aligned against them), 0 past
    them."""
    q, k, v, cu_q, cu_k = _packed(dtype=np.float64)  # lengths q (5, 0, 9), k (7, 3, 2)
    used_q, used_k = np.array([3, 0, 9], np.int32), np.array([6, 1, 2], np.int32)
    dout = np.random.default_rng(3).standard_normal(q.shape)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True,
                                        seqused_q=used_q, seqused_k=used_k, validate=False)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, window=window,
                                                   seqused_q=used_q, seqused_k=used_k, validate=False)
    expected = [np.zeros_like(x) for x in (q, k, v)]
    for rows, keys in ((slice(0, 3), slice(0, 6)), (slice(5, 5), slice(7, 8)), (slice(5, 14), slice(10, 12))):
        if rows.stop > rows.start and keys.stop > keys.start:
            grads = reference.attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys],
                                                           v[None, keys], causal=causal, window=window)
            for e, g, part in zip(expected, grads, (rows, keys, keys)):
                e[part] = g[0]
    for got, want in zip((dq, dk, dv), expected):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="sinks: not taken with seqused_q"):
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, seqused_q=used_q,
                                          sinks=np.zeros(4, np.float32))


def test_seqused_torch_cpu_forward_and_backward():
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_varlen_func

    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in _packed(dtype=np.float64))
    used_q, used_k = torch.tensor([2, 0, 9], dtype=torch.int32), torch.tensor([7, 3, 1], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, 9, 7, causal=True, seqused_q=used_q, seqused_k=used_k)
    ref_out, _ = reference.attention_varlen_reference(*(x.numpy() for x in (q, k, v, cu_q, cu_k)), used_q.numpy(),
                                                      used_k.numpy(), causal=True)
    np.testing.assert_allclose(out.detach().numpy(), ref_out, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, dout)
    # Against autograd through the reference of the used prefixes, sequence by sequence.
    for rows, keys in ((slice(0, 2), slice(0, 7)), (slice(5, 5), slice(7, 10)), (slice(5, 14), slice(10, 11))):
        if rows.stop > rows.start and keys.stop > keys.start:
            want = reference.attention_backward_reference(dout[None, rows].numpy(), q[None, rows].numpy(),
                                                          k[None, keys].numpy(), v[None, keys].numpy(), causal=True)
            for got, w, part in zip(grads, want, (rows, keys, keys)):
                np.testing.assert_allclose(got[part].numpy(), w[0], rtol=1e-10, atol=1e-10)
    assert (grads[0][2:5] == 0).all() and (grads[1][11:] == 0).all()
