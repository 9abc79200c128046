"""cuflash.jax on the CPU backend: attention inside jax.jit equal to the eager call and to
jax.nn.dot_product_attention (xla), gradients through the custom VJP equal to autodiff of the
latter, jax.vmap over a leading axis, and bad input refused at trace time naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import cuflash.jax as cj  # noqa: E402

if jax.default_backend() != "cpu":
    pytest.skip("these tests run JAX's CPU backend (cuflash.jax's GPU path needs XLA's FFI)", allow_module_level=True)


def _qkv(seed=0, sq=7, sk=9):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(keys[0], (2, sq, 4, 16)), jax.random.normal(keys[1], (2, sk, 2, 16)),
            jax.random.normal(keys[2], (2, sk, 2, 16)))


def _xla(q, k, v, causal):
    """jax.nn.dot_product_attention over repeated kv heads, the causal mask aligned bottom-right as
    cuflash's."""
    sq, sk = q.shape[1], k.shape[1]
    mask = jnp.tril(jnp.ones((sq, sk), bool), k=sk - sq)[None, None] if causal else None
    return jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mask=mask,
                                        implementation="xla")


@pytest.mark.parametrize("causal", [False, True])
def test_jit_equals_eager_and_xla(causal):
    q, k, v = _qkv(1)
    jitted = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=causal))(q, k, v)
    eager = cj.attention(q, k, v, causal=causal)
    assert jitted.dtype == q.dtype and jitted.shape == q.shape
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(_xla(q, k, v, causal)), atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_autodiff_of_xla(causal):
    q, k, v = _qkv(2)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * weights).sum()

    got = jax.jit(jax.grad(loss(lambda q, k, v: cj.attention(q, k, v, causal=causal)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: _xla(q, k, v, causal)), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


def test_vmap_over_a_leading_axis():
    q, k, v = _qkv(3)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    out = jax.vmap(lambda q, k, v: cj.attention(q, k, v, window=(3, 0)))(*stacked)
    for i, factor in enumerate((1, 2)):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(cj.attention(factor * q, factor * k, factor * v,
                                                                                    window=(3, 0))))


def test_a_small_model_trains():
    """Two attention layers in plain JAX, a few SGD steps on a fixed target: the loss falls."""
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    x = jax.random.normal(keys[0], (2, 8, 32))
    target = jax.random.normal(keys[1], (2, 8, 32))
    params = [jax.random.normal(key, (32, 96)) * 0.1 for key in keys[2:]]

    def forward(params, x):
        for w in params:
            q, k, v = (t.reshape(2, 8, 2, 16) for t in jnp.split(x @ w, 3, axis=-1))
            x = x + cj.attention(q, k, v, causal=True).reshape(2, 8, 32)
        return x

    loss = jax.jit(lambda params: ((forward(params, x) - target) ** 2).mean())
    step = jax.jit(lambda params: [p - 0.5 * g for p, g in zip(params, jax.grad(loss)(params))])
    first = float(loss(params))
    for _ in range(20):
        params = step(params)
    assert float(loss(params)) < 0.9 * first


@pytest.mark.parametrize("change, error, words", [
    ({"k": jnp.zeros((2, 9, 3, 16)), "v": jnp.zeros((2, 9, 3, 16))}, ValueError, "heads_kv"),
    ({"q": jnp.zeros((2, 7, 4))}, ValueError, "q: expected 4 dims"),
    ({"q": jnp.zeros((2, 7, 4, 16), jnp.int32)}, TypeError, "q: dtype int32"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"window": (1,)}, TypeError, "window"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
    ({"q": np.zeros(3)}, ValueError, "q: expected 4 dims"),
    ({"v": [1.0]}, TypeError, "v: expected a JAX array"),
])
def test_bad_input_refused_at_trace_time(change, error, words):
    q, k, v = _qkv(5)
    arrays = {"q": q, "k": k, "v": v}
    options = {name: change[name] for name in change if name not in arrays}
    arrays |= {name: change[name] for name in change if name in arrays}
    with pytest.raises(error, match=words):
        jax.jit(lambda q, k, v: cj.attention(q, k, v, **options))(**arrays)
