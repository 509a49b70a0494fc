"""Drives a model through the paged cache the way the runner does, for the model tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.runner.batch import RaggedBatch


class PagedModel:
    """A model, its KV pool and a jitted forward; sequences get pages scattered over the pool."""

    def __init__(self, model, *, page_size=16, num_pages=64, pages_per_seq=16, seed=0):
        graphdef, self.state = nnx.split(model)
        self.forward = jax.jit(lambda s, kv, b: nnx.merge(graphdef, s)(kv, b), donate_argnums=1)
        shape = model.kv_cache_shape(num_pages, page_size)  # Gemma 4's: one per kind of layer
        self.kv = (tuple(jnp.zeros(s, model.kv_dtype) for s in shape) if isinstance(shape[0], tuple)
                   else jnp.zeros(shape, model.kv_dtype))
        self.max_seqs = 16  # a linear-attention model's state rows: sequence i's is row i, padding's the last
        state = model.state_shapes(self.max_seqs + 1)
        self.recurrent = state is not None
        if self.recurrent:
            self.kv = (self.kv, tuple(jnp.zeros(s, dtype) for s, dtype in state))
        self.page_size, self.pages_per_seq = page_size, pages_per_seq
        self.free_pages = np.random.default_rng(seed).permutation(num_pages).tolist()
        self.seqs = []  # per sequence: [tokens in cache, page ids]

    def add_sequences(self, n):
        self.seqs = [[0, []] for _ in range(n)]

    def step(self, new_tokens: list[list[int]], num_tokens: int, all_logits=False) -> list[np.ndarray]:
        """Feeds each sequence its new tokens; returns logits of every new token (or of the last one)."""
        chunks = []
        for seq, tokens in zip(self.seqs, new_tokens):
            total = seq[0] + len(tokens)
            while len(seq[1]) * self.page_size < total:
                seq[1].append(self.free_pages.pop())
            chunks.append((tokens, seq[0], list(seq[1])))
            seq[0] = total
        batch = pack_batch(chunks, num_tokens=num_tokens, num_reqs=max(8, len(chunks)),
                           pages_per_seq=self.pages_per_seq, state_rows=self.max_seqs if self.recurrent else None)
        if all_logits:
            batch.logits_indices = np.arange(num_tokens, dtype=np.int32)
        logits, self.kv = self.forward(self.state, self.kv, jax.tree.map(jnp.asarray, batch))
        logits = np.asarray(logits.astype(jnp.float32))
        if not all_logits:
            return [logits[i] for i in range(len(chunks))]
        bounds = np.cumsum([0] + [len(t) for t in new_tokens])
        return [logits[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def pack_batch(
    chunks: list[tuple[list[int], int, list[int]]],  # (new token ids, tokens already in the cache, page ids)
    *,
    num_tokens: int,
    num_reqs: int,
    pages_per_seq: int,
    state_rows: int | None = None,
) -> RaggedBatch:
    """Packs chunks into a padded host batch the way the runner does, but with every logit row selectable. `state_rows`:
    a linear-attention model's scratch row (its sequences' rows are their chunks' indices)."""
    if len(chunks) > num_reqs or sum(len(c[0]) for c in chunks) > num_tokens:
        raise ValueError(f"{len(chunks)} requests do not fit the bucket of {num_tokens} tokens, {num_reqs} requests")
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu_q_lens = np.zeros(num_reqs + 1, np.int32)
    kv_lens = np.zeros(num_reqs, np.int32)
    block_tables = np.zeros((num_reqs, pages_per_seq), np.int32)
    logits_indices = np.zeros(num_reqs, np.int32)
    start = 0
    for i, (tokens, num_cached, pages) in enumerate(chunks):
        end = start + len(tokens)
        input_ids[start:end] = tokens
        positions[start:end] = np.arange(num_cached, num_cached + len(tokens))
        kv_lens[i] = num_cached + len(tokens)
        block_tables[i, : len(pages)] = pages
        logits_indices[i] = end - 1
        cu_q_lens[i + 1] = end
        start = end
    cu_q_lens[len(chunks) + 1:] = start
    state_slots = None
    if state_rows is not None:  # a linear-attention model's: chunk i's sequence's row i, padding's the scratch row
        state_slots = np.full(num_reqs, state_rows, np.int32)
        state_slots[:len(chunks)] = np.arange(len(chunks))
    return RaggedBatch(input_ids, positions, cu_q_lens, kv_lens, block_tables, np.int32(len(chunks)), logits_indices,
                       state_slots)
