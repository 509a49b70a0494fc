"""Pure-JAX ragged paged attention: the CPU path and the oracle for the Pallas bodies.

Requests are split by how many new tokens they bring, because the two cases want different shapes on
XLA:CPU:

- one-token requests (decode) are walked together, one row per request, over their pages in chunks with
  an online softmax; the cost is O(requests x context) and no token gathers another's pages;
- multi-token requests (prefill chunks) are cut into blocks of query rows; a loop over the blocks walks
  each block's request pages once for all its rows, so K/V are gathered per block, not per token, and the
  scores are matmuls of a useful size. Causality bounds the walk: a block stops at its last query's
  position.

Every row's memory use is bounded by a chunk, never by the context or by requests^2.
"""

import functools

import jax
import jax.numpy as jnp

_CHUNK_BYTES = 8 << 20  # budget for one chunk of gathered K/V on the one-token path
_MAX_CHUNK_KEYS = 64  # small chunks keep the work close to the real context length
_BLOCK_QUERIES = 64  # query rows per block on the multi-token path
_BLOCK_KEYS = 128  # keys per chunk on the multi-token path


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
    sliding_window: jax.Array | int | None = None,  # i32[] or int; None or 0: full; -n: chunks of n (Llama 4)
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]: each head's sink logit (GPT-OSS); None: none
    shared_values: int | None = None,  # K and V share each row: V is its first `shared_values` dimensions
) -> jax.Array:  # [T, num_q_heads, head_dim (or shared_values)]; padded tokens get zeros
    """A head's sink is a logit beside its scores in the softmax's denominator that weights no value: the walk
    starts from it (its running maximum the sink, its sum 1) instead of from nothing. With `shared_values` the pool
    holds one row per KV head, [L, P, S, num_kv_heads, head_dim], that is both the key and (its first
    `shared_values` dimensions) the value: multi-head latent attention's latent cache (jaxengine/layers/attention.py,
    latent_attention)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_pages, page_size, kv_width, _ = kv_pages.shape
    num_kv_heads = kv_width if shared_values else kv_width // 2
    value_dim = shared_values or head_dim
    split = functools.partial(_keys_values, shared_values=shared_values)
    group = num_q_heads // num_kv_heads
    num_reqs = kv_lens.shape[0]
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    # Rows of the pool as one flat table: gathering whole pages as rows is several times faster on XLA:CPU
    # than a multi-dimensional gather.
    rows = kv_pages.reshape(-1, page_size * kv_width * head_dim)  # [num_layers * num_pages, page elements]
    tables = block_tables + layer * num_pages
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = jnp.arange(num_reqs) < num_seqs
    walk = functools.partial(_softmax_step, soft_cap=soft_cap)
    head_sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)

    # One-token requests: row r is request r's only token.
    single = live & (q_lens == 1)
    first_token = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)
    kv_len = jnp.where(single, kv_lens, 0)
    q_pos = kv_len - 1
    first_key = _first_key(q_pos, window)
    chunk_pages = _chunk_pages(num_reqs, page_size, kv_width, head_dim, kv_pages.dtype.itemsize)
    chunk = chunk_pages * page_size
    padded = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % chunk_pages)))
    q_single = qg[first_token]  # [R, Hkv, G, D]

    def single_body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(padded, c * chunk_pages, chunk_pages, axis=1)  # [R, chunk_pages]
        gathered = jnp.take(rows, pages, axis=0).reshape(num_reqs, chunk, kv_width, head_dim)  # [R, C, Hkv, D]
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (k_pos[None] < kv_len[:, None]) & (k_pos[None] >= first_key[:, None])  # [R, C]
        if shared_values:  # keys first, the rows whole as values: XLA:CPU multiplies the gathered rows as they lie
            # (no transposed or sliced copy of them; the rotary part's outputs are dropped after), ~20% faster
            kv = gathered.astype(jnp.float32)
            s = jnp.einsum("rchd,rhgd->rhcg", kv, q_single)
            return walk(carry, s, mask[:, None, :, None], kv, "rhcg,rchd->rhgd", axis=2)
        k, v = split(gathered)
        s = jnp.einsum("rhgd,rchd->rhgc", q_single, k)
        return walk(carry, s, mask[:, None, None, :], v, "rhgc,rchd->rhgd")

    lo = jnp.min(jnp.where(single, first_key, jnp.iinfo(jnp.int32).max)) // chunk
    hi = (jnp.max(kv_len) + chunk - 1) // chunk
    state = (num_reqs, num_kv_heads, group)
    _, l, acc = jax.lax.fori_loop(jnp.minimum(lo, hi), hi, single_body,
                                  _init(state, head_dim if shared_values else value_dim, head_sinks))
    out_single = _normalise(l, acc)[..., :value_dim]  # [R, Hkv, G, D]
    out = jnp.zeros((num_tokens + 1, num_kv_heads, group, value_dim), jnp.float32)
    out = out.at[jnp.where(single, first_token, num_tokens)].set(out_single)[:num_tokens]

    # Multi-token requests: blocks of query rows, each walking its request's pages.
    block = min(_BLOCK_QUERIES, num_tokens)
    key_pages = max(1, _BLOCK_KEYS // page_size)
    keys = key_pages * page_size
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % key_pages)))
    blocks_per_req = jnp.where(live & (q_lens > 1), (q_lens + block - 1) // block, 0)
    blocks_end = jnp.cumsum(blocks_per_req)

    def block_body(i, out):
        r = jnp.searchsorted(blocks_end, i, side="right")
        first = cu_q_lens[r] + (i - (blocks_end[r] - blocks_per_req[r])) * block
        end = jnp.minimum(first + block, cu_q_lens[r + 1])
        start = jnp.minimum(first, num_tokens - block)  # the slice must fit; rows before `first` are masked
        token = start + jnp.arange(block, dtype=jnp.int32)
        valid = (token >= first) & (token < end)
        pos = kv_lens[r] - q_lens[r] + (token - cu_q_lens[r])  # [B]
        first_key = _first_key(pos, window)
        q_block = jax.lax.dynamic_slice_in_dim(qg, start, block)  # [B, Hkv, G, D]

        def key_body(c, carry):
            pages = jax.lax.dynamic_slice_in_dim(tables[r], c * key_pages, key_pages)
            k, v = split(jnp.take(rows, pages, axis=0).reshape(keys, kv_width, head_dim))  # [K, Hkv, D]
            s = jnp.einsum("bhgd,khd->hgbk", q_block, k)
            k_pos = c * keys + jnp.arange(keys, dtype=jnp.int32)
            mask = (k_pos[None] <= pos[:, None]) & (k_pos[None] >= first_key[:, None]) & valid[:, None]
            return walk(carry, s, mask[None, None], v, "hgbk,khd->hgbd")

        lo = jnp.min(jnp.where(valid, first_key, jnp.iinfo(jnp.int32).max)) // keys
        hi = jnp.max(jnp.where(valid, pos, -1)) // keys + 1
        block_sinks = None if head_sinks is None else head_sinks[..., None]
        _, l, acc = jax.lax.fori_loop(jnp.minimum(lo, hi), hi, key_body,
                                      _init((num_kv_heads, group, block), value_dim, block_sinks))
        result = _normalise(l, acc).transpose(2, 0, 1, 3)  # [B, Hkv, G, D]
        current = jax.lax.dynamic_slice_in_dim(out, start, block)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None, None, None], result, current),
                                                   start, axis=0)

    out = jax.lax.fori_loop(0, blocks_end[-1], block_body, out)
    return out.reshape(num_tokens, num_q_heads, value_dim).astype(q.dtype)


def _first_key(pos, window):
    """The first key a query at `pos` attends to: its sliding window's (window > 0), its chunk's (window < 0: the
    positions in chunks of -window, Llama 4's chunked attention), else the first."""
    chunk = jnp.maximum(-window, 1)
    return jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), jnp.where(window < 0, pos // chunk * chunk, 0))


def _keys_values(kv, shared_values=None):
    """K and V (float32) of gathered pool rows [..., kv_width, D]: the interleaved even and odd rows, or (with
    `shared_values`) each row as the key and its first `shared_values` dimensions as the value."""
    kv = kv.astype(jnp.float32)
    if shared_values:
        return kv, kv[..., :shared_values]
    return kv[..., 0::2, :], kv[..., 1::2, :]


def _init(shape, head_dim, sinks=None):
    """The online softmax's start: nothing seen, or (`sinks`, broadcast to `shape`) each head's sink seen."""
    if sinks is None:
        return jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (head_dim,))
    return jnp.broadcast_to(sinks, shape), jnp.ones(shape), jnp.zeros(shape + (head_dim,))


def _softmax_step(carry, s, mask, v, pv_spec, *, soft_cap, axis=-1):
    """One chunk of the online softmax: scores `s` (keys along `axis`), their mask, the chunk's values."""
    m, l, acc = carry
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=axis))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - jnp.expand_dims(m_safe, axis))
    correction = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    l = l * correction + jnp.sum(p, axis=axis)
    acc = acc * correction[..., None] + jnp.einsum(pv_spec, p, v)
    return m_new, l, acc


def _normalise(l, acc):
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


@functools.lru_cache(maxsize=None)
def _chunk_pages(num_rows, page_size, kv_width, head_dim, itemsize) -> int:
    per_key = num_rows * kv_width * head_dim * max(itemsize, 4)
    keys = max(page_size, min(_MAX_CHUNK_KEYS, _CHUNK_BYTES // per_key))
    return max(1, keys // page_size)
