"""The sm90 forward's persistent grid on the GPU: a grid of a few CTAs, each walking many tiles
(its K/V ring, Q buffer and ping-pong turns carried from tile to tile), gives bitwise the out and
lse of one CTA per tile, and passes the float64 reference. The other GPU tests mostly have fewer
tiles than SMs, so one CTA per tile; here the CTA count is forced down, for masked kernels over
long sequences too (which users run at one CTA per tile, dispatch.sm90_ctas)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": (200, 50)},
         "softcap": {"causal": True, "softcap": 20.0}}


@pytest.fixture
def sm90(monkeypatch):
    """The sm90 family, and ``run(ctas, call)``: ``call()`` with the persistent grid capped at
    ``ctas`` CTAs (the plan cache emptied so the grid is rebuilt)."""
    import cupy

    from cuflash._core import dispatch, plan

    capability = divmod(int(cupy.cuda.Device().compute_capability), 10)
    try:
        dispatch.select_family(capability, "sm90")
    except ValueError as error:
        pytest.skip(str(error))
    monkeypatch.setenv("CUFLASH_FAMILY", "sm90")
    dispatch.device_target.cache_clear()

    def run(ctas, call):
        # Every mask, not only the unmasked grids that run persistent for users: the kernel's loop
        # over tiles is one code path.
        monkeypatch.setattr(dispatch, "sm90_ctas", lambda unequal, max_seqlen_k, tiles, device: min(tiles, ctas))
        monkeypatch.setattr(plan, "PLANS", plan.PlanCache())
        result = call()
        cupy.cuda.Device().synchronize()
        return result

    yield run
    dispatch.device_target.cache_clear()


def _bitwise_equal(a, b) -> bool:
    import cupy as cp

    bits = cp.uint16 if a.dtype.itemsize == 2 else cp.uint32
    return bool(cp.array_equal(a.view(bits), b.view(bits)))


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_few_ctas_match_one_cta_per_tile(sm90, mask, head_dim, rng):
    import cuflash
    from tests.gpu_reference import check_forward, random_bshd

    q = random_bshd((2, 700, 4, head_dim), "bfloat16", rng)
    k, v = (random_bshd((2, 900, 2, head_dim), "bfloat16", rng) for _ in range(2))
    options = MASKS[mask]
    call = lambda: cuflash.attention(q, k, v, return_lse=True, **options)  # noqa: E731
    out, lse = sm90(10**6, call)  # one CTA per tile
    for ctas in (1, 3, 7):
        out_few, lse_few = sm90(ctas, call)
        assert _bitwise_equal(out_few, out) and _bitwise_equal(lse_few, lse), ctas
    sm90(3, lambda: check_forward(q, k, v, options.get("causal", False), "bfloat16",
                                  window=options.get("window", (-1, -1)), softcap=options.get("softcap", 0.0)))


@pytest.mark.parametrize("causal", [False, True])
def test_few_ctas_packed_batch(sm90, causal, rng):
    """Sequences of mixed lengths, empty ones among them: tiles past a sequence's end and tiles
    without keys are skipped by the producer and the consumers alike."""
    import cupy as cp

    import cuflash
    from tests.gpu_reference import random_bshd

    lengths_q, lengths_k = [300, 0, 1, 517, 64, 0], [300, 5, 0, 517, 200, 0]
    cu_q, cu_k = (cp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    q = random_bshd((1, sum(lengths_q), 4, 128), "float16", rng)[0]
    k, v = (random_bshd((1, sum(lengths_k), 2, 128), "float16", rng)[0] for _ in range(2))
    call = lambda: cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)  # noqa: E731
    out, lse = sm90(10**6, call)
    assert bool(cp.isfinite(out.astype(cp.float32)).all())
    for ctas in (1, 2, 5):
        out_few, lse_few = sm90(ctas, call)
        assert _bitwise_equal(out_few, out) and _bitwise_equal(lse_few, lse), ctas
