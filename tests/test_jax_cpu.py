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


def _with_sinks(q, k, v, sinks):
    """gpt-oss's formula in JAX: the sink a last score column, dropped after the softmax."""
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / jnp.sqrt(q.shape[-1])
    column = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr)


def test_sinks_forward_and_gradients():
    q, k, v = _qkv(6)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    got = jax.jit(lambda q, k, v, s: cj.attention(q, k, v, sinks=s))(q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_with_sinks(q, k, v, sinks)), atol=2e-6)
    weights = jax.random.normal(jax.random.PRNGKey(7), q.shape)
    grads = jax.grad(lambda *a: (cj.attention(*a[:3], sinks=a[3]) * weights).sum(), argnums=(0, 1, 2, 3))(q, k, v,
                                                                                                       sinks)
    want = jax.grad(lambda *a: (_with_sinks(*a) * weights).sum(), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3e-5)


def test_varlen_under_jit_equals_each_sequence_alone():
    keys = jax.random.split(jax.random.PRNGKey(8), 3)
    lengths_q, lengths_k = [3, 0, 6], [5, 2, 6]
    cu_q, cu_k = (jnp.array(np.concatenate([[0], np.cumsum(n)]), jnp.int32) for n in (lengths_q, lengths_k))
    q = jax.random.normal(keys[0], (9, 4, 16))
    k, v = (jax.random.normal(key, (13, 2, 16)) for key in keys[1:])
    run = jax.jit(lambda q, k, v, cu_q, cu_k: cj.attention_varlen(q, k, v, cu_q, cu_k, 6, 6, causal=True))
    out = run(q, k, v, cu_q, cu_k)
    weights = jax.random.normal(jax.random.PRNGKey(10), out.shape)
    grads = jax.grad(lambda q, k, v: (cj.attention_varlen(q, k, v, cu_q, cu_k, 6, 6, causal=True) * weights).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    for i in (0, 2):
        rows, keys_ = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        alone = cj.attention(q[None, rows], k[None, keys_], v[None, keys_], causal=True)[0]
        np.testing.assert_allclose(np.asarray(out[rows]), np.asarray(alone), atol=1e-6)
        want = jax.grad(lambda a, b, c: (cj.attention(a[None], b[None], c[None], causal=True)[0] * weights[rows]).sum(),
                        argnums=(0, 1, 2))(q[rows], k[keys_], v[keys_])
        for g, w, part in zip(grads, want, (rows, keys_, keys_)):
            np.testing.assert_allclose(np.asarray(g[part]), np.asarray(w), atol=1e-5)
    with pytest.raises(TypeError, match="max_seqlen_q: expected a non-negative Python int"):
        cj.attention_varlen(q, k, v, cu_q, cu_k, None, 6)
    with pytest.raises(TypeError, match="cu_seqlens_k: expected int32"):
        cj.attention_varlen(q, k, v, cu_q, cu_k.astype(jnp.float32), 6, 6)


def test_kvcache_append_and_decode_under_jit():
    """A decoding step under jax.jit: the caches come back with the token appended, out equal to
    cuflash's NumPy call (the float64 reference) on the same arrays."""
    import cuflash

    rng = np.random.default_rng(11)
    k_cache, v_cache = (rng.standard_normal((3, 32, 2, 16)).astype(np.float32) for _ in range(2))
    q, k, v = (rng.standard_normal((3, 1, n, 16)).astype(np.float32) for n in (4, 2, 2))
    lengths = np.array([0, 7, 31], np.int32)
    step = jax.jit(lambda *a: cj.attention_with_kvcache(*a[:5], cache_seqlens=a[5], causal=True, return_lse=True))
    out, new_k, new_v, lse = step(q, k_cache, v_cache, k, v, lengths)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    want, want_lse = cuflash.attention_with_kvcache(q, want_k, want_v, k, v, cache_seqlens=lengths, causal=True,
                                                    return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    np.testing.assert_array_equal(np.asarray(new_k), want_k)
    np.testing.assert_array_equal(np.asarray(new_v), want_v)
    assert not np.array_equal(want_k, k_cache)  # the append happened, into copies of the inputs


def test_mla_decode_under_jit():
    import cuflash

    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    cache = rng.standard_normal((4, 16, 1, 64)).astype(np.float32)
    table, lengths = np.array([[0, 1], [2, 3]], np.int32), np.array([20, 9], np.int32)
    got = jax.jit(lambda *a: cj.mla_decode(*a, head_dim_v=48))(q, cache, table, lengths)
    want = cuflash.mla_decode(q, cache, table, lengths, head_dim_v=48)
    np.testing.assert_array_equal(np.asarray(got), want)
