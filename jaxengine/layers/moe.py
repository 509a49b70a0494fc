"""Mixture-of-experts MLP: each token through its top-k experts' gated MLPs, weighted by the router."""

import jax
import jax.numpy as jnp


def route(x, router, top_k: int, renormalize: bool):
    """(weights f32[T, top_k], experts i32[T, top_k]) for x [T, D] and router [D, E]: the softmax of the router
    logits (in float32) at its top_k experts, renormalised to sum to 1 where `renormalize` (Mixtral, and Qwen
    MoE's `norm_topk_prob`)."""
    logits = jnp.dot(x.astype(router.dtype), router, preferred_element_type=jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def moe_mlp(
    x: jax.Array,  # [T, D], normed
    router: jax.Array,  # [D, E]
    gate: jax.Array,  # [E, D, I]
    up: jax.Array,  # [E, D, I]
    down: jax.Array,  # [E, I, D]
    *,
    top_k: int,
    renormalize: bool,
    activation,
) -> jax.Array:  # [T, D] in x's dtype
    """The tokens' (token, expert) pairs sorted by expert run as one grouped matmul per projection
    (`lax.ragged_dot`: each group of rows against its expert's weight), in the weights' dtype with float32
    accumulation, then are weighted and summed back per token. A bucket's padding rows are routed like the
    others; their results are never read."""
    T, E = x.shape[0], router.shape[-1]
    weights, experts = route(x, router, top_k, renormalize)
    flat = experts.reshape(-1)  # [T * top_k]
    order = jnp.argsort(flat, stable=True)
    rows = order // top_k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E] rows per expert

    def grouped(a, w):
        return jax.lax.ragged_dot(a.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32)

    xs = x[rows]
    hidden = activation(grouped(xs, gate)) * grouped(xs, up)
    out = grouped(hidden, down) * weights.reshape(-1)[order][:, None]  # [T * top_k, D] f32
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[rows].add(out).astype(x.dtype)
