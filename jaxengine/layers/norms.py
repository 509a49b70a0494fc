import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Normalises in float32, casts back, then scales: the order transformers uses for Llama. A float32 weight
    (Gemma's 1 + weight, `gemma_scale`) scales in float32 before the cast, Gemma's order; for float32 x both
    orders are the same numbers. No weight (None): normalised only (Llama 4's q/k norm)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return normed.astype(x.dtype)
    if weight.dtype == jnp.float32:
        return (normed * weight).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def gemma_scale(weight: jax.Array) -> jax.Array:
    """Gemma's RMSNorm scales by 1 + weight, computed in float32 (a bfloat16 1 + w would lose w's bits)."""
    return 1.0 + weight.astype(jnp.float32)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    """LayerNorm over the last axis (its mean taken out, then its variance), scaled and shifted in float32 and cast
    back: torch's LayerNorm in reduced precision, and Cohere's own norm (no bias), compute so."""
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    out = normed * weight.astype(jnp.float32)
    return (out if bias is None else out + bias.astype(jnp.float32)).astype(x.dtype)
