"""The ragged batch contract between the runner, the model and the attention kernels."""

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedBatch:
    input_ids: jax.Array  # i32[T]: every scheduled token of every request, padded to the token bucket
    positions: jax.Array  # i32[T]: position of each token in its sequence
    cu_q_lens: jax.Array  # i32[R + 1]: cumulative new-token counts; tail repeats the last value
    kv_lens: jax.Array  # i32[R]: context length of each request after this step's tokens are written
    block_tables: jax.Array  # i32[R, pages_per_seq]
    num_seqs: jax.Array  # i32[]: real requests; rows beyond are padding
    logits_indices: jax.Array  # i32[R]: flat token index whose logits each request samples


def pack_batch(
    chunks: list[tuple[list[int], int, list[int]]],  # (new token ids, tokens already in the cache, page ids)
    *,
    num_tokens: int,
    num_reqs: int,
    pages_per_seq: int,
) -> RaggedBatch:
    """Packs one step's scheduled chunks into a padded host batch (numpy, ready for device_put)."""
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
    return RaggedBatch(input_ids, positions, cu_q_lens, kv_lens, block_tables, np.int32(len(chunks)), logits_indices)
