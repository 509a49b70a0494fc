import jax
import jax.numpy as jnp
import numpy as np


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scaling: float, dtype,
                head_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, 1, head_dim] of each token's rotary angles (times the attention scaling), computed once a
    step for every layer.

    positions: i32[T]; inv_freq: f32[rotary_dim // 2]. A partial rotary embedding (fewer frequencies than
    head_dim // 2) pads them with angle 0 and scaling 1: the padded dimensions pass through the rotation
    unchanged. The loader lays each head's q and k dimensions out for this (`partial_rotary_layout`): the
    rotary pairs (i, i + rotary_dim / 2) at (i, i + head_dim / 2), the passed dimensions after them in each half.
    On CPU, where the native kernels build, the tables pass a fusion barrier: otherwise XLA:CPU fuses the cosine
    and sine into every layer's rotation and evaluates them there again for each head (~25 ms of a 512-token step
    of a 30-layer model on the 2-core machine).
    """
    half = inv_freq.shape[0] if head_dim is None else head_dim // 2
    scale = jnp.full(inv_freq.shape, scaling, jnp.float32)
    if inv_freq.shape[0] < half:
        pad = half - inv_freq.shape[0]
        inv_freq = jnp.concatenate([inv_freq, jnp.zeros(pad, inv_freq.dtype)])
        scale = jnp.concatenate([scale, jnp.ones(pad, jnp.float32)])
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim // 2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, head_dim]
    tables = (jnp.stack([jnp.cos(angles), jnp.sin(angles)]) * jnp.concatenate([scale, scale])).astype(dtype)
    if jax.default_backend() == "cpu":
        from pallas_kernels import cpu

        if cpu.available():
            tables = cpu.fusion_barrier(tables)
    return tables[0], tables[1]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split (`rotate_half`) layout of transformers.

    x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim] from `rope_tables`.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def partial_rotary_layout(head_dim: int, rotary_dim: int) -> np.ndarray:
    """The order of a head's q/k dimensions (transformers' -> ours) under which `apply_rope`'s half-split
    rotation over the whole head, with `rope_tables`' padded tables, is transformers' partial rotation (the first
    rotary_dim dimensions rotated in pairs (i, i + rotary_dim / 2), the others passed through): the rotary
    halves first in each half of the head, the passed dimensions' halves after them. Attention scores are dot
    products of q and k, which one order for both leaves unchanged."""
    r, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate([np.arange(r), rotary_dim + np.arange(passed),
                           r + np.arange(r), rotary_dim + passed + np.arange(passed)])


def rotary_layout(head_dim: int, rotary_dim: int, interleaved: bool = False) -> np.ndarray | None:
    """The order of a head's q/k dimensions (transformers' -> ours) that the loader lays out, or None where it is
    transformers' own: a partial rotary embedding's (`partial_rotary_layout`), after rotary pairs that are
    interleaved (GLM's: (2i, 2i + 1)) are made half-split ones ((i, i + rotary_dim / 2))."""
    order = np.arange(head_dim)
    if interleaved:
        order[:rotary_dim] = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)])
    if rotary_dim < head_dim:
        order = order[partial_rotary_layout(head_dim, rotary_dim)]
    return None if (order == np.arange(head_dim)).all() else order
