"""The ragged-batch pieces of Gated DeltaNet, Kimi Delta Attention and Mamba2 (jaxengine/layers/linear_attention.py)
against transformers' Qwen3.5, Kimi Linear and Granite 4.0-H ones, on a batch that mixes a sequence's first chunk, a
decode step, chunks that continue a state (one shorter than the convolution's memory), padding requests and padding
tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf_granite
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
from transformers.models.mamba import modeling_mamba as hf_mamba
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from jaxengine.layers import linear_attention
from pallas_kernels import cpu
from jaxengine.runner.batch import RaggedBatch

NUM_K, NUM_V, WIDTH, CHANNELS = 2, 4, 4, 40
# (new tokens, tokens before them): a first chunk, a decode step, a 3-token and a 2-token continuation
REQUESTS = [(5, 0), (1, 9), (3, 4), (2, 7)]
NUM_TOKENS, NUM_REQS, NUM_ROWS = 16, 6, 8  # padding tokens and requests; rows: 7 sequences' and the scratch row
ROWS = [3, 0, 6, 2]  # each request's state row (padding requests: the scratch row, 7)


def ragged_batch():
    q_lens = [n for n, _ in REQUESTS] + [0] * (NUM_REQS - len(REQUESTS))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.array([n + before for n, before in REQUESTS] + [0] * (NUM_REQS - len(REQUESTS)), np.int32)
    rows = np.array(ROWS + [NUM_ROWS - 1] * (NUM_REQS - len(REQUESTS)), np.int32)
    zeros = np.zeros(NUM_TOKENS, np.int32)
    batch = RaggedBatch(zeros, zeros, cu, kv_lens, np.zeros((NUM_REQS, 1), np.int32), np.int32(len(REQUESTS)),
                        np.zeros(NUM_REQS, np.int32), rows)
    fresh = kv_lens == cu[1:] - cu[:-1]
    return jax.tree.map(jnp.asarray, batch), jnp.asarray(fresh)


# (key head_dim, value head_dim): the native kernel's whole-head path (value heads not a multiple of its 32-column
# blocks), and its blocked path over two blocks with an odd key head_dim
@pytest.fixture(scope="module", params=[(8, 6), (9, 64)], ids=["whole-heads", "column-blocks"])
def inputs(request):
    DK, DV = request.param
    rng = np.random.default_rng(0)
    return dict(
        x=rng.normal(size=(NUM_TOKENS, CHANNELS)).astype(np.float32),
        weight=rng.normal(size=(WIDTH, CHANNELS)).astype(np.float32) * 0.5,
        conv_state=rng.normal(size=(2, NUM_ROWS, WIDTH - 1, CHANNELS)).astype(np.float32),
        q=rng.normal(size=(NUM_TOKENS, NUM_K, DK)).astype(np.float32),
        k=rng.normal(size=(NUM_TOKENS, NUM_K, DK)).astype(np.float32),
        v=rng.normal(size=(NUM_TOKENS, NUM_V, DV)).astype(np.float32),
        g=-rng.uniform(0.01, 0.5, size=(NUM_TOKENS, NUM_V)).astype(np.float32),
        beta=rng.uniform(0.1, 0.9, size=(NUM_TOKENS, NUM_V)).astype(np.float32),
        rec_state=rng.normal(size=(2, NUM_ROWS, NUM_V, DK, DV)).astype(np.float32),
    )


def spans():
    start = 0
    for (n, before), row in zip(REQUESTS, ROWS):
        yield slice(start, start + n), before == 0, row
        start += n


def test_causal_conv_matches_transformers_per_sequence(inputs):
    batch, fresh = ragged_batch()
    layer = 1
    out, state = linear_attention.causal_conv(jnp.asarray(inputs["x"]), jnp.asarray(inputs["weight"]),
                                              jnp.asarray(inputs["conv_state"]), jnp.int32(layer), batch.state_slots,
                                              fresh, batch, jax.nn.silu)
    out, state = np.asarray(out), np.asarray(state)
    for tokens, first, row in spans():
        before = np.zeros((WIDTH - 1, CHANNELS), np.float32) if first else inputs["conv_state"][layer, row]
        conv_state = torch.tensor(before.T[None].copy())  # transformers': [batch, channels, width - 1]
        want = hf.causal_conv1d_update(torch.tensor(inputs["x"][tokens].T[None].copy()), conv_state,
                                       torch.tensor(inputs["weight"].T.copy()), None, activation="silu")
        np.testing.assert_allclose(out[tokens], want[0].T.numpy(), atol=1e-5)
        np.testing.assert_allclose(state[layer, row], conv_state[0].T.numpy(), atol=1e-6)
    untouched = [r for r in range(NUM_ROWS - 1) if r not in ROWS]
    np.testing.assert_array_equal(state[layer, untouched], inputs["conv_state"][layer, untouched])
    np.testing.assert_array_equal(state[0], inputs["conv_state"][0])  # another layer's


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu.available(), reason="the native CPU kernels need a C++ compiler"))])
def test_gated_delta_rule_matches_transformers_recurrence_per_sequence(inputs, native):
    """XLA's form (accelerators') and the native CPU kernel, which updates each request's row in place."""
    batch, fresh = ragged_batch()
    layer = 0
    out, state = jax.jit(functools.partial(linear_attention.gated_delta_rule, native=native))(
        *(jnp.asarray(inputs[name]) for name in ("q", "k", "v", "g", "beta", "rec_state")), jnp.int32(layer),
        batch.state_slots, fresh, batch)
    out, state = np.asarray(out), np.asarray(state)
    for tokens, first, row in spans():
        initial = None if first else torch.tensor(inputs["rec_state"][layer, row][None].copy())
        want, final = hf.torch_recurrent_gated_delta_rule(
            *(torch.tensor(inputs[name][tokens][None].copy()) for name in ("q", "k", "v", "g", "beta")),
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(out[tokens], want[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(state[layer, row], final[0].numpy(), atol=1e-5)
    untouched = [r for r in range(NUM_ROWS - 1) if r not in ROWS]
    np.testing.assert_array_equal(state[layer, untouched], inputs["rec_state"][layer, untouched])
    np.testing.assert_array_equal(state[1], inputs["rec_state"][1])


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu.available(), reason="the native CPU kernels need a C++ compiler"))])
def test_kimi_delta_rule_matches_transformers_recurrence_per_sequence(inputs, native):
    """Kimi Delta Attention: the gated delta rule whose decay is each key row's own (g [T, heads, dk]), against
    transformers' Kimi Linear recurrence (its q and k one per value head: ours repeated to them)."""
    batch, fresh = ragged_batch()
    layer = 1
    dk = inputs["q"].shape[-1]
    g = -np.random.default_rng(1).uniform(0.01, 0.5, size=(NUM_TOKENS, NUM_V, dk)).astype(np.float32)
    out, state = jax.jit(functools.partial(linear_attention.gated_delta_rule, native=native))(
        *(jnp.asarray(x) for x in (inputs["q"], inputs["k"], inputs["v"], g, inputs["beta"], inputs["rec_state"])),
        jnp.int32(layer), batch.state_slots, fresh, batch)
    out, state = np.asarray(out), np.asarray(state)
    per_v = NUM_V // NUM_K
    for tokens, first, row in spans():
        initial = None if first else torch.tensor(inputs["rec_state"][layer, row][None].copy())
        q, k = (torch.tensor(np.repeat(inputs[name][tokens], per_v, 1)[None].copy()) for name in ("q", "k"))
        want, final = hf_kimi.recurrent_kimi_delta_attention(
            q, k, torch.tensor(inputs["v"][tokens][None].copy()), torch.tensor(g[tokens][None].copy()),
            torch.tensor(inputs["beta"][tokens][None].copy()), initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(out[tokens], want[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(state[layer, row], final[0].numpy(), atol=1e-5)
    untouched = [r for r in range(NUM_ROWS - 1) if r not in ROWS]
    np.testing.assert_array_equal(state[layer, untouched], inputs["rec_state"][layer, untouched])


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu.available(), reason="the native CPU kernels need a C++ compiler"))])
def test_mamba2_recurrence_matches_transformers_state_update_per_sequence(inputs, native):
    """Mamba2's recurrence (`delta` off: x times its time step written along B, read along C; our state [heads,
    state size, head_dim], transformers' transposed) against transformers' Granite 4.0-H state update, token by
    token: B and C per group (2) serving 2 heads each, A per head, the decay exp(dt A)."""
    batch, fresh = ragged_batch()
    layer = 1
    A = -np.linspace(0.2, 1.5, NUM_V).astype(np.float32)
    dt = inputs["beta"]
    out, state = jax.jit(functools.partial(linear_attention.recurrence, native=native, delta=False))(
        *(jnp.asarray(x) for x in (inputs["q"], inputs["k"], inputs["v"], dt * A, dt, inputs["rec_state"])),
        jnp.int32(layer), batch.state_slots, fresh, batch)
    out, state = np.asarray(out), np.asarray(state)
    dk, dv = inputs["q"].shape[-1], inputs["v"].shape[-1]
    for tokens, first, row in spans():
        theirs = torch.zeros(1, NUM_V, dv, dk) if first else torch.tensor(
            inputs["rec_state"][layer, row].swapaxes(-1, -2)[None].copy())
        for t in range(tokens.start, tokens.stop):
            got = hf_granite.mamba2_selective_state_update(
                theirs, torch.tensor(inputs["v"][t][None]), torch.tensor(np.repeat(dt[t][None, :, None], dv, -1)),
                torch.tensor(np.broadcast_to(A[:, None, None], (NUM_V, dv, dk)).copy()),
                torch.tensor(inputs["k"][t][None]), torch.tensor(inputs["q"][t][None]))
            np.testing.assert_allclose(out[t], got[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(state[layer, row], theirs[0].numpy().swapaxes(-1, -2), atol=1e-5)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu.available(), reason="the native CPU kernels need a C++ compiler"))])
def test_mamba1_recurrence_matches_transformers_state_update_per_sequence(native):
    """Mamba1's recurrence through `recurrence` (each inner channel a value head of one column, its [state size] state
    decayed per state by exp(dt A): the decay per key row; B and C one key head for all channels) against
    transformers' Mamba state update, token by token: 40 channels (the native kernel takes such small heads several
    to an item)."""
    batch, fresh = ragged_batch()
    layer, inner, N = 1, 40, 8
    rng = np.random.default_rng(2)
    x = rng.normal(size=(NUM_TOKENS, inner)).astype(np.float32)
    b, c = (rng.normal(size=(NUM_TOKENS, N)).astype(np.float32) for _ in range(2))
    dt = rng.uniform(0.05, 0.5, size=(NUM_TOKENS, inner)).astype(np.float32)
    A = -rng.uniform(0.5, 2.0, size=(inner, N)).astype(np.float32)
    rec_state = rng.normal(size=(2, NUM_ROWS, inner, N, 1)).astype(np.float32)
    out, state = jax.jit(functools.partial(linear_attention.recurrence, native=native, delta=False))(
        *(jnp.asarray(v) for v in (c[:, None], b[:, None], x[:, :, None], dt[:, :, None] * A, dt, rec_state)),
        jnp.int32(layer), batch.state_slots, fresh, batch)
    out, state = np.asarray(out), np.asarray(state)
    for tokens, first, row in spans():
        theirs = torch.zeros(1, inner, N) if first else torch.tensor(rec_state[layer, row, ..., 0][None].copy())
        for t in range(tokens.start, tokens.stop):
            got = hf_mamba.mamba_selective_state_update(
                theirs, torch.tensor(x[t][None]), torch.tensor(dt[t][None]), torch.tensor(A), torch.tensor(b[t][None]),
                torch.tensor(c[t][None]))
            np.testing.assert_allclose(out[t, :, 0], got[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(state[layer, row, ..., 0], theirs[0].numpy(), atol=1e-5)
    untouched = [r for r in range(NUM_ROWS - 1) if r not in ROWS]
    np.testing.assert_array_equal(state[layer, untouched], rec_state[layer, untouched])


@pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels need a C++ compiler")
@pytest.mark.parametrize("delta", [True, False])
def test_bfloat16_state_rows_round_as_xla_rounds_them(inputs, delta):
    """A bfloat16 state pool (mamba_ssm_cache_dtype bfloat16): each row read into float32, its chunk's tokens run in
    float32 and the row rounded once as it is stored, in the native kernel (both paths: whole heads, column blocks)
    as in XLA's form; the outputs those of the float32 recurrence from the rounded rows."""
    batch, fresh = ragged_batch()
    layer = 0
    args = [jnp.asarray(inputs[name]) for name in ("q", "k", "v", "g", "beta")]
    pool = jnp.asarray(inputs["rec_state"]).astype(jnp.bfloat16)
    outs = {}
    for native in (False, True):
        outs[native] = jax.jit(functools.partial(linear_attention.recurrence, native=native, delta=delta))(
            *args, pool, jnp.int32(layer), batch.state_slots, fresh, batch)
    (xla_out, xla_state), (native_out, native_state) = outs[False], outs[True]
    assert native_state.dtype == xla_state.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(native_out), np.asarray(xla_out), atol=1e-4, rtol=1e-4)
    # every row but the scratch one (padding requests': XLA's form writes them, the kernel skips them)
    got, want = (np.asarray(x.astype(jnp.float32))[:, :-1] for x in (native_state, xla_state))
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)  # at most an ulp's rounding apart, where the
    assert (got == want).mean() > 0.99  # float32 values before it straddle a rounding boundary (nearest, ties even)
    exact, _ = jax.jit(functools.partial(linear_attention.recurrence, delta=delta))(
        *args, pool.astype(jnp.float32), jnp.int32(layer), batch.state_slots, fresh, batch)
    np.testing.assert_allclose(np.asarray(xla_out), np.asarray(exact), atol=1e-5)
    untouched = [r for r in range(NUM_ROWS - 1) if r not in ROWS]
    np.testing.assert_array_equal(got[layer, untouched], np.asarray(pool.astype(jnp.float32))[layer, untouched])
