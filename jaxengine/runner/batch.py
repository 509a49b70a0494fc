"""The ragged batch contract between the runner, the model and the attention kernels."""

import dataclasses

import jax


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
