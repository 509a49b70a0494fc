"""On-device sampling, vectorised over the batch with per-row parameters."""

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,  # f32[R, vocab]
    temperature: jax.Array,  # f32[R]; 0 = greedy
    top_k: jax.Array,  # i32[R]; 0 = off
    top_p: jax.Array,  # f32[R]; 1 = off
    seeds: jax.Array,  # u32[R]: per-sequence seed
    counters: jax.Array,  # i32[R]: tokens the sequence has generated so far
    *,
    all_greedy: bool,
) -> jax.Array:  # i32[R]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    in_top_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # the most likely token is always kept
    kept = in_top_k & (mass_before < top_p[:, None])
    threshold = jnp.take_along_axis(ordered, jnp.sum(kept, axis=-1, keepdims=True) - 1, axis=-1)
    truncated = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    sampled = jax.vmap(jax.random.categorical)(keys, truncated).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
