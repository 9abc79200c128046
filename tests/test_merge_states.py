"""cuflash.merge_states and vLLM's merge_attn_states on the CPU path: the merge of attention over two
disjoint key sets equals attention over all of them (the float64 reference), with the LSE layouts
cuflash returns passed as views; a part that saw no key ignored (its output NaN-poisoned); +inf
LSEs; out= and out_lse= written in place; bad arguments refused, each naming itself."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash


def _parts(rng, split: int, batch=2, seqlen=5, heads=4, heads_kv=2, keys=30, head_dim=16):
    q = rng.standard_normal((batch, seqlen, heads, head_dim))
    k, v = (rng.standard_normal((batch, keys, heads_kv, head_dim)) for _ in range(2))
    a = cuflash.attention(q, k[:, :split], v[:, :split], return_lse=True)
    b = cuflash.attention(q, k[:, split:], v[:, split:], return_lse=True)
    return a, b, cuflash.attention(q, k, v, return_lse=True)


@pytest.mark.parametrize("split", [1, 12, 29])
def test_merge_of_two_key_sets_is_attention_over_both(split):
    (oa, la), (ob, lb), (whole, lse) = _parts(np.random.default_rng(split), split)
    # attention's lse is (batch, heads, seqlen): (batch, seqlen, heads) views of it, as they are.
    out, merged = cuflash.merge_states(oa, la.transpose(0, 2, 1), ob, lb.transpose(0, 2, 1), return_lse=True)
    np.testing.assert_allclose(out, whole, atol=1e-6)
    np.testing.assert_allclose(merged, lse.transpose(0, 2, 1), rtol=1e-6)
    assert out.dtype == oa.dtype and merged.dtype == np.float32


def test_a_part_without_keys_is_ignored_and_both_empty_give_zero():
    (oa, la), (ob, lb), _ = _parts(np.random.default_rng(1), 10)
    la, lb = la.transpose(0, 2, 1).copy(), lb.transpose(0, 2, 1).copy()
    ob_poisoned, lb_empty = np.full_like(ob, np.nan), np.full_like(lb, -np.inf)
    lb_empty[0, 0, 0] = np.inf  # +inf drops its part too, as vLLM's merge does
    out, lse = cuflash.merge_states(oa, la, ob_poisoned, lb_empty, return_lse=True)
    np.testing.assert_allclose(out, oa, atol=1e-12)
    np.testing.assert_allclose(lse, la, rtol=1e-6)
    out, lse = cuflash.merge_states(np.full_like(oa, np.nan), np.full_like(la, -np.inf), ob_poisoned, lb_empty,
                                    return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_out_and_out_lse_are_written_in_place():
    (oa, la), (ob, lb), (whole, lse) = _parts(np.random.default_rng(2), 7)
    packed = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  (tokens, heads, head_dim)
    out_lse = np.full((4, 10), np.nan, np.float32)  # vLLM's (heads, tokens) layout
    target = packed(oa)  # out may be one of the inputs
    lse_views = [packed(x.transpose(0, 2, 1)) for x in (la, lb)]
    result = cuflash.merge_states(packed(oa), lse_views[0], packed(ob), lse_views[1], out=target, out_lse=out_lse.T)
    assert result is target
    np.testing.assert_allclose(target, packed(whole), atol=1e-6)
    np.testing.assert_allclose(out_lse.T, packed(lse.transpose(0, 2, 1)), rtol=1e-6)


def test_vllm_merge_attn_states_on_cpu_tensors():
    torch = pytest.importorskip("torch")
    from cuflash.torch.vllm import merge_attn_states

    (oa, la), (ob, lb), (whole, lse) = _parts(np.random.default_rng(3), 9, batch=1)
    tokens = lambda x: torch.from_numpy(np.ascontiguousarray(x[0]))  # noqa: E731
    heads_tokens = lambda x: torch.from_numpy(np.ascontiguousarray(x[0]))  # noqa: E731  lse (1, h, s) -> (h, s)
    output, output_lse = torch.empty(5, 4, 16, dtype=torch.float64), torch.empty(4, 5)
    assert merge_attn_states(output, tokens(oa), heads_tokens(la).float(), tokens(ob), heads_tokens(lb).float(),
                             output_lse) is None
    np.testing.assert_allclose(output.numpy(), whole[0], atol=1e-6)
    np.testing.assert_allclose(output_lse.numpy(), lse[0], rtol=1e-6)


@pytest.mark.parametrize("change, error, words", [
    ({"out_b": np.zeros((2, 5, 4, 8))}, ValueError, "out_b: expected shape"),
    ({"out_b": np.zeros((2, 5, 4, 16), np.float32)}, TypeError, "out_b: expected dtype"),
    ({"lse_a": np.zeros((2, 5, 4))}, TypeError, "lse_a: expected float32"),
    ({"lse_b": np.zeros((2, 4, 5), np.float32)}, ValueError, r"lse_b: expected shape \(2, 5, 4\)"),
    ({"out_a": np.zeros((2, 5, 4, 16), np.int32)}, TypeError, "out_a: expected one of"),
    ({"out": np.zeros((2, 5, 4, 16), np.float32)}, TypeError, "out: expected dtype"),
    ({"out_lse": np.zeros((2, 5), np.float32)}, ValueError, "out_lse: expected shape"),
    ({"lse_b": None}, TypeError, "lse_b: required"),
    # Views taken as they are: a (batch, seqlen) pair at any strides, heads at any stride.
    ({"lse_a": np.zeros((5, 2, 4), np.float32).transpose(1, 0, 2)}, None, None),
    ({"lse_a": np.zeros((2, 10, 4), np.float32)[:, ::2]}, None, None),
    ({"lse_a": np.zeros((4, 5, 2), np.float32).transpose(2, 1, 0)}, None, None),
    ({"out_a": np.zeros((5, 3, 2, 4, 16))[:, 0].transpose(1, 0, 2, 3)}, None, None),
])
def test_arguments(change, error, words):
    args = {"out_a": np.zeros((2, 5, 4, 16)), "lse_a": np.zeros((2, 5, 4), np.float32),
            "out_b": np.zeros((2, 5, 4, 16)), "lse_b": np.zeros((2, 5, 4), np.float32)}
    call = dict(args)
    out, out_lse = change.pop("out", None), change.pop("out_lse", None)
    call |= change
    if error is None:  # strided views whose leading dimensions collapse, or a (batch, seqlen) pair: taken
        cuflash.merge_states(**call)
        return
    with pytest.raises(error, match=words):
        cuflash.merge_states(**call, out=out, out_lse=out_lse)


def test_leading_dimensions_that_do_not_collapse_are_refused():
    """(outer, inner) rows: the dimensions before the last one before heads must collapse."""
    args = {"out_a": np.zeros((2, 3, 3, 4, 16)), "out_b": np.zeros((2, 3, 3, 4, 16)),
            "lse_a": np.zeros((2, 3, 3, 4), np.float32), "lse_b": np.zeros((2, 6, 3, 4), np.float32)[:, :3]}
    with pytest.raises(ValueError, match="lse_b: the dimensions before its last two"):
        cuflash.merge_states(**args)
