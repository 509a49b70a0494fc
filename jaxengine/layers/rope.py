import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scaling: float) -> jax.Array:
    """Rotary embedding in the half-split (`rotate_half`) layout of transformers.

    x: [T, heads, head_dim]; positions: i32[T]; inv_freq: f32[head_dim // 2].
    """
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim // 2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, head_dim]
    cos = (jnp.cos(angles) * scaling).astype(x.dtype)
    sin = (jnp.sin(angles) * scaling).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
