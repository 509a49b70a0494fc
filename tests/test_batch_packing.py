"""The step's host inputs travel as one buffer per dtype kind (jaxengine/runner/batch.py:Packing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.runner.batch import Packing, RaggedBatch


def _tree(rng):
    batch = RaggedBatch(rng.integers(-5, 9, 8, dtype=np.int32), np.arange(8, dtype=np.int32),
                        np.array([0, 3, 8], np.int32), np.array([3, 5], np.int32),
                        rng.integers(0, 100, (2, 4), dtype=np.int32), np.int32(2), np.array([2, 7], np.int32))
    seeds = np.array([0, 2**32 - 1], np.uint32)  # the top bit survives the int32 buffer
    sampling = {"seeds": seeds, "temperature": np.array([0.0, 0.7], np.float32),
                "bias": rng.standard_normal((2, 3)).astype(np.float32)}
    return batch, sampling


def test_pack_then_unpack_in_a_program_gives_every_field_back():
    tree = _tree(np.random.default_rng(0))
    packing = Packing.of(tree)
    assert [dtype for dtype, _ in packing.buffers] == ["int32", "float32"]
    buffers = packing.pack(tree)
    assert [b.dtype for b in buffers] == [np.int32, np.float32]
    out = jax.jit(packing.unpack)(*buffers)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype and got.shape == np.shape(want)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert isinstance(out[0], RaggedBatch) and out[0].num_seqs.shape == ()


def test_a_tree_of_one_kind_has_one_buffer_and_packings_are_static_arguments():
    tree = (np.arange(6, dtype=np.int32).reshape(2, 3), np.int32(4))
    packing = Packing.of(tree)
    assert packing.buffers == (("int32", 7),)
    assert hash(packing) == hash(Packing.of(tree)) and packing == Packing.of(tree)

    total = jax.jit(lambda buffer, *, packing: jnp.sum(packing.unpack(buffer)[0]) * packing.unpack(buffer)[1],
                    static_argnames="packing")
    assert int(total(*packing.pack(tree), packing=packing)) == 15 * 4


def test_an_unsupported_dtype_is_refused_by_name():
    with pytest.raises(TypeError, match="bool"):
        Packing.of((np.zeros(3, np.int32), np.zeros(2, np.bool_)))


def test_the_runner_round_trips_a_real_steps_inputs(engines):
    """What the runner packs for each bucket (its batch with prompt targets and token sources, its sampling
    inputs) comes back field for field, seeds' top bit included."""
    runner = engines("llama").runner
    for tokens in runner.token_buckets:
        reqs = runner.requests_for(tokens)
        batch, sampling, targets, sources = runner._host_inputs(tokens, reqs)
        saved, sampling.seeds[0] = sampling.seeds[0], 2**32 - 1  # a view of the runner's buffer: restored below
        for packing, tree in ((runner._batch_packing(tokens, reqs), (batch, targets, sources)),
                              (runner._sampling_packing(reqs), sampling)):
            out = jax.jit(packing.unpack)(*packing.pack(tree))
            for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(np.asarray(got), want)
        sampling.seeds[0] = saved
