"""Pure-JAX ragged paged attention: the CPU path and the oracle for the Pallas bodies.

Each query token walks its own request's pages in chunks with an online softmax, so the cost is
O(tokens x context) and memory per chunk O(tokens x chunk), never O(requests^2).
"""

import functools

import jax
import jax.numpy as jnp

_CHUNK_BYTES = 32 << 20  # budget for one chunk of gathered K/V
_MAX_CHUNK_TOKENS = 128  # small chunks keep the work close to the real context length


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim], K/V interleaved
    layer: jax.Array | int,  # i32[]: which layer's pool to read
    kv_lens: jax.Array,  # i32[R]: context length of each request, this step's tokens included
    block_tables: jax.Array,  # i32[R, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[R + 1]: cumulative new-token counts; tail repeats the last value
    num_seqs: jax.Array | int,  # i32[]: real requests; rows beyond are padding
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,  # i32[] or int; None or <= 0: full attention
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim]; padded tokens get zeros
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, kv_width, _ = kv_pages.shape
    num_kv_heads = kv_width // 2
    group = num_q_heads // num_kv_heads
    chunk_pages = _chunk_pages(num_tokens, page_size, kv_width, head_dim, kv_pages.dtype.itemsize)
    chunk_tokens = chunk_pages * page_size

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token, side="right"), kv_lens.shape[0] - 1)
    valid = token < cu_q_lens[num_seqs]  # [T]
    kv_len = jnp.where(valid, kv_lens[req], 0)  # [T]
    q_pos = kv_len - (cu_q_lens[req + 1] - cu_q_lens[req]) + (token - cu_q_lens[req])  # [T]
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    first_key = jnp.where(window > 0, q_pos - window + 1, 0)  # [T]

    pad = (-block_tables.shape[1]) % chunk_pages
    # Rows of the pool as one flat table: gathering whole pages as rows is several times faster on XLA:CPU
    # than a multi-dimensional gather.
    num_pages = kv_pages.shape[1]
    rows = kv_pages.reshape(-1, page_size * kv_width * head_dim)  # [num_layers * num_pages, page elements]
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))[req] + layer * num_pages  # [T, padded_pages]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    num_chunks = (jnp.max(kv_len) + chunk_tokens - 1) // chunk_tokens

    def body(c, carry):
        m, l, acc = carry  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        pages = jax.lax.dynamic_slice_in_dim(tables, c * chunk_pages, chunk_pages, axis=1)  # [T, chunk_pages]
        kv = jnp.take(rows, pages, axis=0).reshape(num_tokens, chunk_tokens, kv_width, head_dim)
        k, v = kv[:, :, 0::2].astype(jnp.float32), kv[:, :, 1::2].astype(jnp.float32)  # [T, C, Hkv, D]
        s = jnp.einsum("thgd,tchd->thgc", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)  # [C]
        mask = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] < kv_len[:, None]) & (k_pos[None] >= first_key[:, None])
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * correction + jnp.sum(p, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("thgc,tchd->thgd", p, v)
        return m_new, l, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


@functools.lru_cache(maxsize=None)
def _chunk_pages(num_tokens, page_size, kv_width, head_dim, itemsize) -> int:
    per_key = num_tokens * kv_width * head_dim * max(itemsize, 4)
    tokens = max(page_size, min(_MAX_CHUNK_TOKENS, _CHUNK_BYTES // per_key))
    return max(1, tokens // page_size)
