"""The KV page pool: allocation, reference counts and automatic prefix caching.

Full blocks are identified by a SHA-256 chained over (parent hash, token ids, extra keys such as a cache
salt). Freed blocks keep their hash in an LRU of free-but-cached blocks and are reused on a hit before
being evicted; token ids are compared on every hit.
"""

import collections
import hashlib

import numpy as np

from jaxengine.engine.request import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


def block_hash(parent: bytes | None, token_ids, extra: str | None) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(token_ids, np.int64).tobytes())
    if extra is not None:
        h.update(b"salt:" + extra.encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.query_tokens = 0  # prefix cache statistics (in tokens)
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (vLLM's `reset_prefix_cache`); False, and nothing forgotten, while any
        sequence holds blocks."""
        if len(self.free) != self.num_blocks:
            return False
        for block_id in self.cached.values():
            self.blocks[block_id].hash = self.blocks[block_id].token_ids = None
        self.cached.clear()
        return True

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """The chained hashes of the first full blocks, extended incrementally on the sequence."""
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_full_blocks:
            tokens = seq.all_token_ids
            for i in range(len(hashes), num_full_blocks):
                hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], seq.cache_salt))
        return hashes[:num_full_blocks]

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> None:
        """Gives a new sequence the cached blocks of its longest cached prefix (at least one token is left
        to compute so that the step has a position to sample from)."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.query_tokens += seq.num_tokens
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return
        tokens, bs = seq.all_token_ids, self.block_size
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            self._take(block_id)
            seq.block_ids.append(block_id)
        seq.num_computed_tokens = len(seq.block_ids) * bs
        self.hit_tokens += seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """n > 1: the child shares the parent's full prompt blocks and computes only the rest (the request's
        prompt logprobs come from the parent)."""
        shared = (len(child.prompt_token_ids) - 1) // self.block_size
        for block_id in parent.block_ids[:shared]:
            self._take(block_id)
        child.block_ids = parent.block_ids[:shared]
        child.num_computed_tokens = shared * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Ensures pages for `num_new_tokens` more tokens; False (and nothing taken) if the pool is short."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_ids)
        if needed > len(self.free):
            return False
        seq.block_ids.extend(self._pop_free() for _ in range(needed))
        return True

    def cache_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publishes the sequence's full blocks to the prefix cache: those of its first `num_computed` tokens
        (default: those computed so far) whose tokens the host knows. A block may still be being written: by a
        launched step (later steps that read it run after it), or by the step being scheduled, where another
        sequence's tokens read it in the same layer after every token's K/V is written (as vLLM shares a prefix
        within a step). Each block is offered once (the scheduler and the engine call this every step, and the
        walk from the first block was ~0.2 ms a call for 64 sequences of 640 tokens): one whose tokens another
        block holds in the cache at that moment stays unpublished."""
        if not self.enable_prefix_caching:
            return
        upto = seq.num_computed_tokens if num_computed is None else num_computed
        num_full = min(upto, seq.num_tokens) // self.block_size
        if num_full <= seq.num_offered_blocks:
            return
        tokens, bs = seq.all_token_ids, self.block_size
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_offered_blocks, num_full):
            block, h = self.blocks[seq.block_ids[i]], hashes[i]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tuple(tokens[i * bs:(i + 1) * bs])
                self.cached[h] = block.block_id
        seq.num_offered_blocks = num_full

    def free_sequence(self, seq: Sequence) -> None:
        """Tail blocks go back first so that they are evicted before the shared prefix."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_ids = []
        seq.num_computed_tokens = seq.num_offered_blocks = 0
