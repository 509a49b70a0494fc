"""On-device sampling, vectorised over the batch with per-row parameters.

Order, as in vLLM v1: temperature, then min-p, then top-k and top-p. Logprobs are taken from the model's raw
distribution (log-softmax of the unprocessed logits), before temperature and truncation.
"""

import jax
import jax.numpy as jnp


def apply_logit_processors(
    logits: jax.Array,  # f32[R, vocab]
    bias_ids: jax.Array,  # i32[R, max_logit_bias]; vocab = unused entry
    bias_values: jax.Array,  # f32[R, max_logit_bias]
    banned: jax.Array,  # i32[R, max_banned]: tokens that may not be sampled now; vocab = unused entry
) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, bias_ids].add(bias_values, mode="drop")
    return logits.at[rows, banned].set(-jnp.inf, mode="drop")


def sample(
    logits: jax.Array,  # f32[R, vocab], after apply_logit_processors
    temperature: jax.Array,  # f32[R]; 0 = greedy
    top_k: jax.Array,  # i32[R]; 0 = off
    top_p: jax.Array,  # f32[R]; 1 = off
    min_p: jax.Array,  # f32[R]; 0 = off
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
    probs = jax.nn.softmax(scaled, axis=-1)
    scaled = jnp.where(probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), scaled, -jnp.inf)
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    in_top_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # the most likely token is always kept
    kept = in_top_k & (mass_before < top_p[:, None]) & jnp.isfinite(ordered)
    threshold = jnp.take_along_axis(ordered, jnp.sum(kept, axis=-1, keepdims=True) - 1, axis=-1)
    truncated = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    sampled = jax.vmap(jax.random.categorical)(keys, truncated).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def token_logprobs(
    logits: jax.Array,  # f32[R, vocab]
    tokens: jax.Array,  # i32[R]: the sampled tokens
    num_top: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(top ids i32[R, num_top], top logprobs f32[R, num_top], sampled logprob f32[R], sampled rank i32[R])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, num_top)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > chosen[:, None], axis=-1) + 1  # 1 = most likely
    return top_ids.astype(jnp.int32), top_lp, chosen, rank.astype(jnp.int32)
