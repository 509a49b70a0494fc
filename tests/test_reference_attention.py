"""The CPU attention bodies (the pure-JAX reference and the native FFI kernel) against a naive dense attention
on random ragged batches."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from pallas_kernels.reference import ragged_paged_attention
from tests.ragged import ragged_case

HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS = 32, 2, 2


def naive_attention(q, k, v, q_lens, kv_lens, sm_scale, window, soft_cap):
    """Dense attention per request over contiguous K/V; q [Tq, Hq, D], k/v per request [kv_len, Hkv, D]."""
    out, start = [], 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qi = q[start:start + ql].astype(np.float64)
        group = qi.shape[1] // k[i].shape[1]
        ki = np.repeat(k[i], group, axis=1).astype(np.float64)
        vi = np.repeat(v[i], group, axis=1).astype(np.float64)
        s = np.einsum("qhd,khd->hqk", qi, ki) * sm_scale
        if soft_cap:
            s = soft_cap * np.tanh(s / soft_cap)
        q_pos = np.arange(kl - ql, kl)[:, None]
        k_pos = np.arange(kl)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,khd->qhd", p, vi))
        start += ql
    return np.concatenate(out)


BODIES = ("reference", "native")


def body(name):
    if name == "reference":
        return ragged_paged_attention
    if not cpu.available():
        pytest.skip("the native CPU attention could not be built here (no C++ compiler?)")
    return cpu.ragged_paged_attention


def run_case(seed, mode, page_size, group, window=None, soft_cap=None, name="reference"):
    case = ragged_case(seed, mode, page_size, group, HEAD_DIM, num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    sm_scale = HEAD_DIM ** -0.5
    attend = jax.jit(functools.partial(body(name), sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap))
    got = np.asarray(attend(*case.args))
    ks, vs = zip(*(case.contiguous_kv(i) for i in range(len(case.kv_lens))))
    want = naive_attention(np.asarray(case.args[0]), ks, vs, case.q_lens, case.kv_lens, sm_scale, window, soft_cap)
    real = case.num_real_tokens
    np.testing.assert_allclose(got[:real], want, atol=2e-5, rtol=1e-5)
    assert np.all(got[real:] == 0), "padded tokens must produce zeros"


@pytest.mark.parametrize("name", BODIES)
@pytest.mark.parametrize("mode,page_size,group", list(itertools.product(
    ("prefill", "decode", "mixed"), (1, 16, 64), (1, 4, 7))))
def test_matches_dense_attention(mode, page_size, group, name):
    run_case(seed=100 * page_size + 10 * group + len(mode), mode=mode, page_size=page_size, group=group, name=name)


@pytest.mark.parametrize("name", BODIES)
@pytest.mark.parametrize("mode", ("prefill", "decode", "mixed"))
@pytest.mark.parametrize("window", (1, 7, 40))
def test_sliding_window_matches_dense_attention(mode, window, name):
    run_case(seed=window, mode=mode, page_size=16, group=4, window=window, name=name)


@pytest.mark.parametrize("name", BODIES)
@pytest.mark.parametrize("mode", ("prefill", "mixed"))
def test_soft_cap_matches_dense_attention(mode, name):
    run_case(seed=3, mode=mode, page_size=16, group=2, soft_cap=5.0, name=name)


def test_native_ignores_page_ids_outside_the_pool():
    """A corrupt block table must not make the native body read outside the pool: such keys are skipped."""
    attend = body("native")
    kv_pages = jnp.ones((1, 2, 4, 2, 8), jnp.float32)
    q = jnp.ones((1, 1, 8), jnp.float32)
    out = attend(q, kv_pages, 0, jnp.array([8]), jnp.array([[1, 1 << 30]]), jnp.array([0, 1]), 1, sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(out), 1.0)


def test_native_refuses_inconsistent_request_arrays():
    attend = body("native")
    kv_pages = jnp.ones((1, 2, 4, 2, 8), jnp.float32)
    q = jnp.ones((1, 1, 8), jnp.float32)
    with pytest.raises(Exception, match="cu_q_lens"):
        attend(q, kv_pages, 0, jnp.array([8]), jnp.array([[0, 1]]), jnp.array([0]), 1, sm_scale=1.0)


@pytest.mark.parametrize("name", BODIES)
def test_traced_window_and_layer_inside_jit(name):
    """Layers run under lax.scan, so the window and layer index arrive as traced values."""
    attend = body(name)
    rng = np.random.default_rng(0)
    kv_pages = jnp.asarray(rng.standard_normal((2, 4, 16, 2, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((16, 2, 8)), jnp.float32)
    args = (jnp.array([16, 0]), jnp.array([[0, 1], [0, 0]]), jnp.array([0, 16, 16]), jnp.int32(1))

    @jax.jit
    def f(window, layer):
        return attend(q, kv_pages, layer, *args, sm_scale=1.0, sliding_window=window)

    eager = attend(q, kv_pages, 1, *args, sm_scale=1.0, sliding_window=4)
    np.testing.assert_allclose(np.asarray(f(jnp.int32(4), jnp.int32(1))), np.asarray(eager), atol=1e-6)
    assert not np.allclose(np.asarray(f(jnp.int32(0), jnp.int32(1))), np.asarray(eager))


@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
def test_shared_values_attend_over_one_row_per_token_as_dense_attention(mode):
    """Multi-head latent attention's pool (one row per token and KV head: the key, whose first `shared_values`
    dimensions are the value): every query head of the group over the same rows, against the dense attention with
    V the rows' leading dimensions."""
    case = ragged_case(7, mode, 16, 4, HEAD_DIM, num_kv_heads=NUM_KV_HEADS, num_layers=NUM_LAYERS)
    values, sm_scale = 24, HEAD_DIM ** -0.5
    rows = case.kv[:, :, :, 0::2]  # [L, P, S, Hkv, D]: one row per KV head
    q, _, layer, *rest = case.args
    attend = jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm_scale, shared_values=values))
    got = np.asarray(attend(q, jnp.asarray(rows), layer, *rest))
    assert got.shape == (q.shape[0], q.shape[1], values)
    keys = [case.contiguous_kv(i)[0] for i in range(len(case.kv_lens))]
    want = naive_attention(np.asarray(q), keys, [k[..., :values] for k in keys], case.q_lens, case.kv_lens, sm_scale,
                           None, None)
    real = int(case.q_lens.sum())
    np.testing.assert_allclose(got[:real], want, atol=1e-5, rtol=0)
    assert np.all(got[real:] == 0)
