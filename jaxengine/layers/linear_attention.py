"""State layers over a ragged batch: Gated DeltaNet (Qwen3.5, Qwen3-Next; Kimi Delta Attention, whose decay is each
key row's own), Mamba2 (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1) and the short convolution LFM2's layers gate.

Each sequence carries a state instead of a KV cache: the last `width - 1` inputs of a short causal convolution and
(but for LFM2), per value head, a [key head_dim, value head_dim] matrix that every token decays (exp(g)), corrects
towards its value along its key (the delta rule, at rate beta; Mamba2: writes beta v along k) and reads with its query
(`recurrence`). The states of the running sequences live in per-layer arrays of rows (`state_shapes`); the batch
names each request's row (`RaggedBatch.state_slots`), and a request whose chunk starts its sequence (no context before
it: `starts_sequence`) starts from zeros, so rows need no clearing when they change hands and a preempted sequence
recomputes from its start. Padding requests' rows are the arrays' last, a scratch row.

On one CPU device the recurrence is a native kernel that updates each row in place (pallas_kernels/
cpu_linear_attention.cc). XLA's form runs token by token, as transformers' recurrent form: every request's first
token of the step at once (one token per request: a decode step is only this), then the others in order (a prefill
chunk's), each on its request's state. Sequential over a prompt, but exact; a chunked form (the state updated once per
block of tokens through a triangular solve) would make long prefills matmul-bound and is the next step on
accelerators.
"""

import functools

import jax
import jax.numpy as jnp

from jaxengine.runner.batch import RaggedBatch

L2_NORM_EPS = 1e-6  # the queries' and keys' L2 norms' (transformers' and FLA's)


def state_shapes(num_layers: int, num_rows: int, heads: tuple, dtype, state_dtype=jnp.float32) -> tuple:
    """(shape, dtype) of the convolution's state [layers, rows, width - 1, channels] (in the activations' dtype, as
    its inputs) and of the recurrent state [layers, rows, value heads, key head_dim, value head_dim] (`state_dtype`:
    float32, or bfloat16 where the engine's mamba_ssm_cache_dtype asks; computed in float32 either way)."""
    num_k, num_v, dk, dv, width = heads
    channels = 2 * num_k * dk + num_v * dv
    return ((num_layers, num_rows, width - 1, channels), dtype), ((num_layers, num_rows, num_v, dk, dv), state_dtype)


def starts_sequence(batch: RaggedBatch):
    """bool[R]: each request's chunk starts its sequence (no context before it: its state starts from zeros)."""
    return batch.kv_lens == batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]


def _token_requests(batch: RaggedBatch, num_tokens: int):
    """Each token's request i32[T] (padding tokens: the last request) and its index within the request's chunk."""
    starts = batch.cu_q_lens[:-1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], t, side="right"), starts.shape[0] - 1).astype(jnp.int32)
    return req, t - starts[req]


def causal_conv(x, weight, conv_state, layer, rows, fresh, batch: RaggedBatch, activation, bias=None):
    """The depthwise causal convolution of x [T, channels] (weight [width, channels], `bias` [channels] or None):
    each token's output from its own and its `width - 1` predecessors in its sequence (those before the step from the
    request's state row, zeros before the sequence's start), through `activation`. Returns (the outputs in x's dtype,
    the state with each request's last `width - 1` inputs written to its row)."""
    T, C = x.shape
    width = weight.shape[0]
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    prev = jnp.where(fresh[:, None, None], 0, conv_state[layer][rows]).astype(x.dtype)  # [R, width - 1, C]
    req, index = _token_requests(batch, T)
    out = jnp.zeros((T, C), jnp.float32)
    for tap in range(width):  # tap j reads the input d = width - 1 - j tokens back
        d = width - 1 - tap
        earlier = prev[req, jnp.clip(width - 1 - d + index, 0, width - 2)]
        taken = jnp.where((index >= d)[:, None], x[jnp.maximum(jnp.arange(T) - d, 0)], earlier)
        out = out + taken.astype(jnp.float32) * weight[tap].astype(jnp.float32)
    # each request's last width - 1 inputs: from the chunk, or (a chunk shorter than that) the state before it
    back = q_lens[:, None] - (width - 1) + jnp.arange(width - 1)[None, :]  # [R, width - 1], relative to the chunk
    from_chunk = x[jnp.clip(batch.cu_q_lens[:-1, None] + back, 0, T - 1)]
    from_prev = prev[jnp.arange(rows.shape[0])[:, None], jnp.clip(width - 1 + back, 0, width - 2)]
    kept = jnp.where((back >= 0)[..., None], from_chunk, from_prev)
    conv_state = conv_state.at[layer, rows].set(kept.astype(conv_state.dtype))
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return activation(out).astype(x.dtype), conv_state


def _l2_normed(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + L2_NORM_EPS)


def _step(state, q, k, v, g, beta, delta: bool):
    """One token on one state [heads, dk, dv]: decay (g [heads], or [heads, dk]: per key row), then the delta rule's
    correction along k (`delta`; else Mamba2's plain write of beta v along k), then the read along q."""
    state = state * (jnp.exp(g)[:, :, None] if g.ndim == 2 else jnp.exp(g)[:, None, None])
    if delta:
        v = v - jnp.einsum("hkv,hk->hv", state, k)
    state = state + k[:, :, None] * (v * beta[:, None])[:, None, :]
    return state, jnp.einsum("hkv,hk->hv", state, q)


def native(backend: str, one_device: bool) -> bool:
    """Whether the native CPU recurrence runs (pallas_kernels/cpu_linear_attention.cc): on one CPU device where the
    kernels build, unless the attention backend is "reference" (XLA's ops throughout: the form accelerators run)."""
    if backend == "reference" or not one_device or jax.default_backend() != "cpu":
        return False
    from pallas_kernels import cpu

    return cpu.available()


def gated_delta_rule(q, k, v, g, beta, rec_state, layer, rows, fresh, batch: RaggedBatch, native: bool = False):
    """The gated delta rule over the batch's tokens: q, k [T, key heads, dk], v [T, value heads, dv], g and beta [T,
    value heads] (float32). q and k are L2-normalised here (q then scaled by dk ** -0.5). Returns `recurrence`'s."""
    q = _l2_normed(q.astype(jnp.float32)) * q.shape[-1] ** -0.5
    k = _l2_normed(k.astype(jnp.float32))
    return recurrence(q, k, v, g, beta, rec_state, layer, rows, fresh, batch, native)


def recurrence(q, k, v, g, beta, rec_state, layer, rows, fresh, batch: RaggedBatch, native: bool = False,
               delta: bool = True):
    """Each request's state [value heads, dk, dv] over its tokens in order: decayed by exp(g), then (`delta`) the delta
    rule's correction k (beta (v - state^T k))^T (Gated DeltaNet) or (not `delta`) k (beta v)^T (Mamba2: k its B, v
    its x, beta its time step), then read along q: out = state^T q. q, k [T, key heads, dk] (each key head serves
    value_heads / key_heads consecutive value heads), v [T, value heads, dv], g [T, value heads] (or [T, value
    heads, dk]: each key row its own decay, Kimi Delta Attention's) and beta [T, value heads]. Returns
    (out f32[T, value heads, dv], zeros for tokens of no request; the state with each request's final state written to
    its row). `native`: the CPU kernel updates each request's row in place (`fresh` is then its kv_lens equal to its
    chunk's length, as `starts_sequence` gives it)."""
    T = q.shape[0]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if native:
        from pallas_kernels import cpu

        return cpu.gated_delta_rule(q, k, v, g, beta, rec_state, layer, batch.cu_q_lens, batch.kv_lens, rows,
                                    batch.num_seqs, delta=delta)
    repeat = v.shape[1] // k.shape[1]
    q, k = jnp.repeat(q, repeat, axis=1), jnp.repeat(k, repeat, axis=1)
    step = functools.partial(_step, delta=delta)
    starts, q_lens = batch.cu_q_lens[:-1], batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    states = jnp.where(fresh[:, None, None, None], 0.0, rec_state[layer][rows].astype(jnp.float32))  # [R, heads,
    # dk, dv], in float32 whatever the pool's dtype
    # every request's first token at once
    first = jnp.minimum(starts, T - 1)
    stepped, first_out = jax.vmap(step)(states, q[first], k[first], v[first], g[first], beta[first])
    states = jnp.where((q_lens > 0)[:, None, None, None], stepped, states)  # a request without tokens keeps its state
    out = jnp.zeros(v.shape, jnp.float32).at[jnp.where(q_lens > 0, first, T)].set(first_out, mode="drop")
    # then the rest of each chunk, token by token in order
    req, index = _token_requests(batch, T)
    later = (index > 0) & (jnp.arange(T) < batch.cu_q_lens[batch.num_seqs])
    (order,) = jnp.nonzero(later, size=T, fill_value=0)

    def one_token(j, carry):
        states, out = carry
        t = order[j]
        r = req[t]
        state, o = step(states[r], q[t], k[t], v[t], g[t], beta[t])
        return states.at[r].set(state), out.at[t].set(o)

    states, out = jax.lax.fori_loop(0, jnp.sum(later, dtype=jnp.int32), one_token, (states, out))
    return out, rec_state.at[layer, rows].set(states.astype(rec_state.dtype))


def gated_rms_norm(x, gate, weight, eps: float, activation=jax.nn.silu):
    """Each head's output [T, heads, dv] RMS-normalised, times `weight` (in x's dtype), times activation(gate) in
    float32 (transformers' Qwen3.5 RMSNormGated; Kimi Linear's through a sigmoid)."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * weight.astype(x.dtype)
    return (normed.astype(jnp.float32) * activation(gate.astype(jnp.float32))).astype(x.dtype)
