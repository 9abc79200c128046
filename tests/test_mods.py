"""score_mod and mask_mod (cuflash/_core/expressions.py): the language's checks, its CUDA and NumPy
forms, and the CPU path's attention and backward with them: each example equal to the built-in
where there is one (ALiBi, causal, softcap, window), the others against a float64 formula, the
backward against the built-in and against central differences."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cuflash
from cuflash._core.expressions import parse_mod
from cuflash._cpu import reference
from tests.test_launch_plans import FakeCupyArray

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)


def _qkv(seed=0, batch=2, sq=7, sk=9, heads=4, heads_kv=2, d=16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, sq, heads, d)), rng.standard_normal((batch, sk, heads_kv, d)),
            rng.standard_normal((batch, sk, heads_kv, d)))


# ----------------------------------------------------------------------------- the language


def test_cuda_and_numpy_forms():
    alibi = parse_mod("score_mod", "score - slopes[h] * abs(q_idx - kv_idx)", {"slopes": SLOPES})
    assert alibi.cuda == "(score - (mod_slopes(h) * float(abs((q_idx - kv_idx)))))"
    assert alibi.arrays == (("slopes", "float", 1),) and alibi.key()[1] == alibi.text
    env = {"score": np.zeros((2, 3)), "b": 0, "h": 1, "q_idx": np.arange(2)[:, None], "kv_idx": np.arange(3)[None],
           "slopes": SLOPES}
    np.testing.assert_allclose(alibi.evaluate(env), -0.25 * np.abs(np.arange(2)[:, None] - np.arange(3)[None]))
    np.testing.assert_allclose(alibi.derivative(env), 1.0)
    blocks = parse_mod("mask_mod", "(q_idx // 4) >= (kv_idx // 4) or not (kv_idx % 2 == 1)")
    assert blocks.cuda == ("((cuflash_floordiv(q_idx, 4) >= cuflash_floordiv(kv_idx, 4)) || "
                           "(!(cuflash_floormod(kv_idx, 2) == 1)))")
    # Floored as in Python, for negative operands too (the CUDA helpers floor the same way).
    floor = parse_mod("score_mod", "float((q_idx - 5) // 2) + float((q_idx - 5) % 3)")
    np.testing.assert_array_equal(floor.evaluate({"q_idx": np.arange(3)}), [(i - 5) // 2 + (i - 5) % 3 for i in range(3)])
    assert parse_mod("score_mod", "1.5").cuda == "1.5f" and parse_mod("score_mod", "2").cuda == "float(2)"


@pytest.mark.parametrize("text, d", [
    ("score * score", lambda s: 2 * s), ("exp(score / 4.0)", lambda s: np.exp(s / 4) / 4),
    ("log(score * score + 1.0)", lambda s: 2 * s / (s * s + 1)), ("10.0 * tanh(score / 10.0)",
                                                                   lambda s: 1 - np.tanh(s / 10) ** 2),
    ("sqrt(score * score + 4.0)", lambda s: s / np.sqrt(s * s + 4)), ("abs(score)", lambda s: np.where(s < 0, -1, 1)),
    ("min(score, 0.5) + max(score, -0.5)", lambda s: (s <= 0.5).astype(int) + (s >= -0.5)),
    ("where(score > 0.0, score, 0.1 * score)", lambda s: np.where(s > 0, 1, 0.1)),
    ("1.0 / (score + 3.0) - score", lambda s: -1 / (s + 3) ** 2 - 1)])
def test_derivative_of_each_rule(text, d):
    s = np.linspace(-2.5, 2.5, 11)
    np.testing.assert_allclose(parse_mod("score_mod", text).derivative({"score": s}), d(s), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind, text, error, words", [
    ("score_mod", "score +", ValueError, "is not an expression"),
    ("score_mod", "score + bias", ValueError, "unknown name 'bias'"),
    ("score_mod", "softplus(score)", ValueError, "unknown function 'softplus'"),
    ("score_mod", "exp(score, 2.0)", ValueError, "exp takes 1 positional argument"),
    ("score_mod", "q_idx < kv_idx < 3", ValueError, "chained comparison"),
    ("score_mod", "score if q_idx > 0 else 0.0", ValueError, "IfExp is not part of the language"),
    ("score_mod", "score ** 2", ValueError, "Pow is not part of the language"),
    ("score_mod", "score > 0", TypeError, "must be float-valued"),
    ("score_mod", "slopes[q_idx / 2]", TypeError, "an index of slopes is float-valued"),
    ("score_mod", "slopes[h][h]", ValueError, "slopes has 1 dimensions, indexed 2 times"),
    ("score_mod", "slopes", ValueError, "index it, as slopes[h]"),
    ("score_mod", "score // 2", TypeError, "// takes ints"),
    ("score_mod", 3, TypeError, "expected an expression as a str"),
    ("mask_mod", "score > 0.0", ValueError, "score is a score_mod's name"),
    ("mask_mod", "q_idx - kv_idx", TypeError, "must be bool-valued"),
    ("mask_mod", "q_idx and kv_idx", TypeError, "and / or take bools"),
])
def test_bad_expressions_name_what_is_wrong(kind, text, error, words):
    with pytest.raises(error, match=re.escape(words)):
        parse_mod(kind, text, {"slopes": SLOPES})


def test_bad_mod_args():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="mod_args: given without score_mod or mask_mod"):
        cuflash.attention(q, k, v, mod_args={"slopes": SLOPES})
    with pytest.raises(TypeError, match="mod_args: expected a dict"):
        cuflash.attention(q, k, v, score_mod="score", mod_args=[SLOPES])
    with pytest.raises(ValueError, match="mod_args: 'q_idx' is not a name"):
        cuflash.attention(q, k, v, score_mod="score", mod_args={"q_idx": SLOPES})
    with pytest.raises(TypeError, match="mod_args: dtype complex128"):
        cuflash.attention(q, k, v, score_mod="score", mod_args={"z": np.zeros(3, complex)})
    with pytest.raises(ValueError, match="an index of slopes is outside its shape"):
        cuflash.attention(q, k, v, score_mod="score + slopes[kv_idx]", mod_args={"slopes": SLOPES})


def test_gpu_arrays_are_refused_after_the_checks():
    q, kv = FakeCupyArray((1, 8, 4, 64), ptr=1 << 30), FakeCupyArray((1, 8, 2, 64), ptr=2 << 30)
    with pytest.raises(ValueError, match="unknown name"):
        cuflash.attention(q, kv, kv, score_mod="score + nothing")
    with pytest.raises(NotImplementedError, match="score_mod, mask_mod: the GPU kernels do not take them yet"):
        cuflash.attention(q, kv, kv, mask_mod="kv_idx <= q_idx")
    with pytest.raises(TypeError, match=r"mod_args\['slopes'\]: must be on the same side as q"):
        cuflash.attention(q, kv, kv, score_mod="score", mod_args={"slopes": SLOPES})


# ----------------------------------------------------------------------------- the CPU path


@pytest.mark.parametrize("score_mod, mask_mod, builtin", [
    ("score - slopes[h] * abs(q_idx + 2 - kv_idx)", None, {"alibi_slopes": SLOPES, "causal": True}),
    (None, "kv_idx <= q_idx + 2", {"causal": True}),
    ("20.0 * tanh(score / 20.0)", None, {"softcap": 20.0}),
    (None, "(kv_idx >= q_idx + 2 - 3) and (kv_idx <= q_idx + 2 + 1)", {"window": (3, 1)}),
], ids=["alibi", "causal", "softcap", "window"])
def test_equal_to_the_builtin_forward_and_backward(score_mod, mask_mod, builtin):
    q, k, v = _qkv(1)
    mods = {"score_mod": score_mod, "mask_mod": mask_mod, "mod_args": {"slopes": SLOPES} if score_mod and "slopes"
            in score_mod else None}
    if mods["score_mod"] and "slopes" in mods["score_mod"]:
        mods["mask_mod"] = "kv_idx <= q_idx + 2"  # ALiBi's causal mask, as the built-in's call has it
    out, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
    want, want_lse = cuflash.attention(q, k, v, return_lse=True, **builtin)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    dout = np.random.default_rng(2).standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **mods)
    for got, expected in zip(grads, cuflash.attention_backward(dout, q, k, v, want, want_lse, **builtin)):
        np.testing.assert_allclose(got, expected, atol=1e-10)


def _direct(q, k, v, score=lambda s, b, h, i, j: s, seen=lambda b, h, i, j: True):
    """softmax(score(q k^T / sqrt(d))) v in float64 with the hidden keys removed, straight from the
    formula (GQA by repeating k and v)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None]
    for bi in range(b):
        for h in range(hq):
            s = score(q[bi, :, h] @ k[bi, :, h // (hq // hkv)].T / np.sqrt(d), bi, h, i, j)
            s = np.where(np.broadcast_to(seen(bi, h, i, j), s.shape), s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[bi, :, h] = p / p.sum(axis=-1, keepdims=True) @ v[bi, :, h // (hq // hkv)]
    return out


def test_document_mask_prefix_lm_global_token_and_a_bias_table():
    q, k, v = _qkv(3, sq=9, sk=9)
    doc = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 3]], np.int32)
    got = cuflash.attention(q, k, v, mask_mod="doc[b][q_idx] == doc[b][kv_idx] and kv_idx <= q_idx",
                            mod_args={"doc": doc})
    want = _direct(q, k, v, seen=lambda b, h, i, j: (doc[b][i] == doc[b][j]) & (j <= i))
    np.testing.assert_allclose(got, want, atol=1e-12)
    prefix = np.array([3, 5], np.int32)
    got = cuflash.attention(q, k, v, mask_mod="kv_idx < prefix[b] or kv_idx <= q_idx", mod_args={"prefix": prefix})
    np.testing.assert_allclose(got, _direct(q, k, v, seen=lambda b, h, i, j: (j < prefix[b]) | (j <= i)), atol=1e-12)
    got = cuflash.attention(q, k, v, mask_mod="(kv_idx == 0 or q_idx == 0) or (kv_idx >= q_idx - 2 and kv_idx <= q_idx)")
    want = _direct(q, k, v, seen=lambda b, h, i, j: (j == 0) | (i == 0) | ((j >= i - 2) & (j <= i)))
    np.testing.assert_allclose(got, want, atol=1e-12)
    # T5's relative position buckets from a table (heads, buckets): the bucket of |i - j| clipped.
    table = np.random.default_rng(4).standard_normal((4, 6)).astype(np.float32)
    got = cuflash.attention(q, k, v, score_mod="score + table[h][min(abs(q_idx - kv_idx), 5)]",
                            mod_args={"table": table})
    want = _direct(q, k, v, score=lambda s, b, h, i, j: s + table[h][np.minimum(np.abs(i - j), 5)])
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_backward_of_a_score_mod_against_central_differences():
    """The gradient through the expression's derivative, checked by central differences of
    sum(out * dout) in each of a few entries of q and k."""
    q, k, v = _qkv(5, batch=1, sq=4, sk=5, heads=2, heads_kv=1, d=8)
    text = "where(score > 0.0, score * score * 0.3, 0.5 * exp(score)) - 0.1 * float(q_idx)"
    dout = np.random.default_rng(6).standard_normal((1, 4, 2, 8))

    def loss(q, k):
        return float((cuflash.attention(q, k, v, score_mod=text) * dout).sum())

    out, lse = cuflash.attention(q, k, v, score_mod=text, return_lse=True)
    dq, dk, _ = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=text)
    eps = 1e-6
    for grad, array, which in ((dq, q, 0), (dk, k, 1)):
        for index in [(0, 0, 0, 0), (0, 2, 1, 3), (0, 3, 0, 7)] if which == 0 else [(0, 0, 0, 1), (0, 4, 0, 5)]:
            plus, minus = array.copy(), array.copy()
            plus[index] += eps
            minus[index] -= eps
            args_plus = (plus, k) if which == 0 else (q, plus)
            args_minus = (minus, k) if which == 0 else (q, minus)
            numeric = (loss(*args_plus) - loss(*args_minus)) / (2 * eps)
            assert abs(grad[index] - numeric) < 1e-6 * max(1.0, abs(numeric)), (which, index, grad[index], numeric)


def test_reference_takes_the_callables():
    q, k, v = _qkv(7)
    out, _ = reference.attention_reference(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5,
                                           mask_mod=lambda b, h, i, j: j <= i + 2)
    want = _direct(q, k, v, score=lambda s, b, h, i, j: s * 0.5, seen=lambda b, h, i, j: j <= i + 2)
    np.testing.assert_allclose(out, want, atol=1e-12)


def test_varlen_sees_the_sequence_index_and_its_own_positions():
    """A packed batch: b is the sequence's index and q_idx, kv_idx positions within it, so each
    sequence equals a fixed-length call of its own; the backward likewise."""
    rng = np.random.default_rng(8)
    lengths_q, lengths_k = [3, 0, 6], [5, 2, 6]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 4, 16))
    k, v = (rng.standard_normal((cu_k[-1], 2, 16)) for _ in range(2))
    bias = np.array([0.1, -0.2, 0.3], np.float32)  # one per sequence
    mods = dict(score_mod="score * 0.5 + bias[b] * float(q_idx - kv_idx)", mask_mod="kv_idx <= q_idx + 1",
                mod_args={"bias": bias})
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **mods)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **mods)
    for i in (0, 2):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        one = dict(mods, mod_args={"bias": bias[i:i + 1]})  # the sequence as batch entry 0
        want = cuflash.attention(q[None, rows], k[None, keys], v[None, keys], **one)
        np.testing.assert_allclose(out[rows], want[0], atol=1e-12)
        # The backward against the float64 reference with the same variant written as Python.
        grads = reference.attention_backward_reference(
            dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
            score_mod=lambda s, b, h, qi, ki, c=float(bias[i]): s * 0.5 + c * (qi - ki),
            score_mod_derivative=lambda s, b, h, qi, ki: 0.5, mask_mod=lambda b, h, qi, ki: ki <= qi + 1)
        for got, expected, part in zip((dq, dk, dv), grads, (rows, keys, keys)):
            np.testing.assert_allclose(got[part], expected[0], atol=1e-10)
