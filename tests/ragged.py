"""Random ragged attention batches over a paged pool with scattered pages, for the attention tests."""

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class RaggedCase:
    args: tuple  # positional arguments of ragged_paged_attention (after q: pool, layer, lens, tables, cu, n)
    q_lens: np.ndarray  # new tokens per real request
    kv_lens: np.ndarray  # context per real request
    kv: np.ndarray  # [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]
    tables: np.ndarray  # [num_reqs, pages_per_seq]
    layer: int

    @property
    def num_real_tokens(self) -> int:
        return int(self.q_lens.sum())

    def contiguous_kv(self, request: int) -> tuple[np.ndarray, np.ndarray]:
        """The request's K and V in position order: [kv_len, num_kv_heads, head_dim] each."""
        page_size = self.kv.shape[2]
        length = int(self.kv_lens[request])
        pages = self.tables[request, : -(-length // page_size)]
        flat = self.kv[self.layer, pages].reshape(-1, *self.kv.shape[3:])[:length]
        return flat[:, 0::2], flat[:, 1::2]


def ragged_case(seed, mode, page_size, group, head_dim, *, dtype=jnp.float32, max_kv_len=150, max_reqs=6,
                num_kv_heads=2, num_layers=2, layer=1) -> RaggedCase:
    """`mode`: decode (one new token each), prefill (whole prompts) or mixed (decode rows first). Two padded
    request rows and a few padded tokens follow the real ones."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_reqs + 1))
    kv_lens = rng.integers(1, max_kv_len, n)
    if mode == "decode":
        q_lens = np.ones(n, int)
    elif mode == "prefill":
        q_lens = kv_lens.copy()
    else:
        q_lens = np.concatenate([np.ones(n // 2, int), rng.integers(1, kv_lens[n // 2:] + 1)])
    pages_per_seq = -(-max_kv_len // page_size)
    num_pages = pages_per_seq * n + 2
    num_reqs, num_tokens = n + 2, int(q_lens.sum()) + 3
    kv = rng.standard_normal((num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    tables = np.zeros((num_reqs, pages_per_seq), np.int32)
    free = rng.permutation(num_pages).tolist()  # scattered, non-contiguous pages
    for i, k in enumerate(kv_lens):
        for j in range(-(-k // page_size)):
            tables[i, j] = free.pop()
    cu = np.full(num_reqs + 1, q_lens.sum(), np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.zeros(num_reqs, np.int32)
    lens[:n] = kv_lens
    kv = kv.astype(jnp.dtype(dtype))
    args = (jnp.asarray(q, dtype), jnp.asarray(kv), jnp.int32(layer), jnp.asarray(lens), jnp.asarray(tables),
            jnp.asarray(cu), jnp.int32(n))
    return RaggedCase(args, q_lens, kv_lens, kv, tables, layer)
