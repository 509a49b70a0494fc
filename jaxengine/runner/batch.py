"""The ragged batch contract between the runner, the model and the attention kernels."""

import dataclasses

import jax
import jax.numpy as jnp
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
    # i32[R]: each request's row of the per-sequence state (linear-attention models only: layers.linear_attention;
    # padding requests' the scratch row), else None
    state_slots: jax.Array | None = None


_BUFFER = {"int32": "int32", "uint32": "int32", "float32": "float32"}  # a field's dtype -> its buffer's


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a pytree of host arrays (int32, uint32, float32) travels to the device: as one int32 buffer and
    one float32 buffer (a kind with no field has no buffer), unpacked by the program at static offsets.
    Each transfer has a fixed cost far above its bytes (~35 us for a step's small arrays on CPU), so a
    buffer per kind instead of one per field takes ~0.6 ms off a 64-request step's host time. Hashable: it
    is a static argument of the programs, and part of their cache key."""

    treedef: jax.tree_util.PyTreeDef
    fields: tuple[tuple[int, int, tuple[int, ...], str], ...]  # (buffer, offset, shape, dtype) per leaf
    buffers: tuple[tuple[str, int], ...]  # (dtype, elements) of each buffer

    @classmethod
    def of(cls, tree) -> "Packing":
        leaves, treedef = jax.tree.flatten(tree)
        dtypes = [np.dtype(leaf.dtype).name for leaf in leaves]
        bad = sorted(set(dtypes) - set(_BUFFER))
        if bad:
            raise TypeError(f"cannot pack {bad} fields (int32, uint32 and float32 only)")
        kinds = [k for k in ("int32", "float32") if k in {_BUFFER[d] for d in dtypes}]
        sizes = dict.fromkeys(kinds, 0)
        fields = []
        for leaf, dtype in zip(leaves, dtypes):
            kind = _BUFFER[dtype]
            fields.append((kinds.index(kind), sizes[kind], tuple(leaf.shape), dtype))
            sizes[kind] += int(np.prod(leaf.shape, dtype=np.int64))
        return cls(treedef, tuple(fields), tuple(sizes.items()))

    def pack(self, tree) -> tuple[np.ndarray, ...]:
        parts: list[list[np.ndarray]] = [[] for _ in self.buffers]
        for (buffer, _, _, _), leaf in zip(self.fields, jax.tree.leaves(tree), strict=True):
            flat = np.ravel(leaf)
            parts[buffer].append(flat.view(np.int32) if flat.dtype == np.uint32 else flat)
        return tuple(np.concatenate(p) for p in parts)

    def like(self, sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct((n,), dtype, sharding=sharding) for dtype, n in self.buffers)

    def unpack(self, *buffers):
        """Inside a program: the pytree back from the device buffers."""
        leaves = []
        for buffer, offset, shape, dtype in self.fields:
            size = int(np.prod(shape, dtype=np.int64))
            x = jax.lax.slice(buffers[buffer], (offset,), (offset + size,)).reshape(shape)
            leaves.append(jax.lax.bitcast_convert_type(x, jnp.uint32) if dtype == "uint32" else x)
        return jax.tree.unflatten(self.treedef, leaves)
