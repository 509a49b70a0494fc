"""The KV page pool on its own: prefix-cache hits, verification, LRU reuse, forks, no leaks."""

import pytest

from jaxengine.engine import block_manager as bm_module
from jaxengine.engine.block_manager import BlockManager
from jaxengine.engine.request import Sequence
from jaxengine.sampling_params import SamplingParams


def seq(tokens, rid="r", salt=None):
    return Sequence(rid, 0, list(tokens), SamplingParams(), seed=0, cache_salt=salt)


def compute_prompt(bm, s):
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_full_blocks_of_a_finished_sequence_are_hit_by_the_next():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(10))
    bm.match_prefix(a)
    compute_prompt(bm, a)
    bm.free_sequence(a)
    assert bm.num_free_blocks == 10
    b = seq(list(range(8)) + [99, 98])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 8 and len(b.block_ids) == 2
    assert bm.num_free_blocks == 8  # the two hits left the free list


def test_blocks_are_offered_as_they_fill_and_again_after_a_preemption():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(10))
    assert bm.allocate(a, 10)
    bm.cache_full_blocks(a, 6)  # scheduled: a chunk of 6 tokens
    assert len(bm.cached) == 1 and a.num_offered_blocks == 1
    bm.cache_full_blocks(a, 6)  # read back: nothing new
    bm.cache_full_blocks(a, 10)
    assert len(bm.cached) == 2 and a.num_offered_blocks == 2
    bm.free_sequence(a)  # preempted
    assert a.num_offered_blocks == 0 and bm.reset_prefix_cache() and not bm.cached
    bm.match_prefix(a)  # resumed: recomputes from the start
    assert a.num_computed_tokens == 0 and bm.allocate(a, 10)
    bm.cache_full_blocks(a, 10)
    assert len(bm.cached) == 2 and a.num_offered_blocks == 2
    b = seq(list(range(8)) + [5])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 8 and b.block_ids == a.block_ids[:2]


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(8))
    compute_prompt(bm, a)
    b = seq(range(8))
    bm.match_prefix(b)
    assert b.num_computed_tokens == 4


def test_hash_collision_is_caught_by_token_verification(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens, extra: b"same")
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq([1, 2, 3, 4, 5])
    compute_prompt(bm, a)
    b = seq([9, 9, 9, 9, 5])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0


def test_cache_salt_changes_the_hash():
    bm = BlockManager(num_blocks=10, block_size=4)
    compute_prompt(bm, seq(range(9), salt="a"))
    b = seq(range(9), salt="b")
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0


def test_least_recently_freed_blocks_are_evicted_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, recent = seq([1, 2, 3]), seq([7, 8, 9])
    compute_prompt(bm, old)
    bm.free_sequence(old)
    compute_prompt(bm, recent)
    bm.free_sequence(recent)
    filler = seq([5, 5])  # one block: must evict one of the four free blocks
    assert bm.allocate(filler, 2)
    again = seq([7, 8, 0])
    bm.match_prefix(again)
    assert again.num_computed_tokens == 2  # the recently freed prefix survived


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=6, block_size=2)
    parent = seq([1, 2, 3, 4, 5])
    compute_prompt(bm, parent)
    child = seq([1, 2, 3, 4, 5])
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids[:2]
    assert bm.allocate(child, 1)
    bm.free_sequence(parent)
    assert bm.blocks[child.block_ids[0]].ref_count == 1
    bm.free_sequence(child)
    assert bm.num_free_blocks == 6


def test_allocation_failure_takes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(20))
    assert not bm.allocate(s, 20)
    assert bm.num_free_blocks == 2 and s.block_ids == []


@pytest.mark.parametrize("caching", [True, False])
def test_disabled_prefix_caching_never_hits(caching):
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=caching)
    compute_prompt(bm, seq(range(9)))
    b = seq(range(9))
    bm.match_prefix(b)
    assert b.num_computed_tokens == (8 if caching else 0)


def test_reset_prefix_cache_forgets_cached_blocks_once_none_is_held():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(9))
    compute_prompt(bm, a)
    assert not bm.reset_prefix_cache() and bm.cached  # `a` still holds its blocks: nothing forgotten
    bm.free_sequence(a)
    assert bm.reset_prefix_cache() and not bm.cached
    assert all(b.hash is None and b.token_ids is None for b in bm.blocks)
    b = seq(range(9))
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0 and bm.num_free_blocks == 10


def test_sequence_token_ids_is_a_slice_of_prompt_and_output():
    s = seq([1, 2, 3, 4])
    s.output_token_ids += [5, 6, 7]
    for start in range(8):
        for end in range(start, 9):
            assert s.token_ids(start, end) == s.all_token_ids[start:end], (start, end)
