"""A sequence being generated: one per (request, sample index)."""

import enum
import time

from jaxengine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.index = index  # sample index within the request (n > 1)
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.status = Status.WAITING
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of the full blocks, grown as they fill
        self.num_offered_blocks = 0  # full blocks from the first offered to the prefix cache (cache_full_blocks)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache, or written by a step already launched
        # Async scheduling: tokens sampled by launched steps that the host has not read back yet (at most one
        # per step in flight), and where the newest is, (step, row), for the next step to take on the device.
        self.num_pending_tokens = 0
        self.pending_source: tuple[int, int] | None = None
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache at first scheduling
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # prompt_logprobs[p]: logprobs of prompt token p given the tokens before it (p = 0 has none)
        self.prompt_logprobs: list[dict | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.cumulative_logprob = 0.0
        self.min_tokens_banned: list[int] = []  # EOS and stop ids, banned until min_tokens are generated
        self.bad_words: list[list[int]] = []  # token sequences that must never be completed
        self.state_row: int | None = None  # its row of a linear-attention model's state (ModelRunner)
        self.fork_parent: "Sequence | None" = None  # n > 1: waits for this sequence's prompt, then shares it
        self.slot: int | None = None  # the runner's device-state row, for penalties / allowed_token_ids
        self.grammar = None  # structured outputs: its engine.structured_outputs.Matcher
        self.grammar_after_reasoning = None  # the Matcher that starts after the reasoning's end (reasoning_parser)
        self.pooling = None  # a pooling request's engine.pooler.PoolState (its one sampled token is dropped)
        self.speculative = False  # its tokens may be guessed ahead (engine.speculative): nothing decided per token
        self.lora = None  # its LoRA adapter (jaxengine.lora.LoRAAdapter), or None: the base model
        self.lora_slot: int | None = None  # the device slot holding the adapter while it runs (lora.LoRASlots)

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt position, MEAN and CLS pooling their hidden states: a
        cached prefix would skip them."""
        return self.params.prompt_logprobs is None and (self.pooling is None or self.pooling.reads_prefix_cache)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] (start >= 0), without concatenating the prompt and the output."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    def banned_tokens(self) -> list[int]:
        """Tokens that may not be sampled next: stop tokens before min_tokens, and the last token of any bad
        word whose other tokens the output has just produced."""
        out = self.output_token_ids
        banned = list(self.min_tokens_banned) if self.num_output_tokens_with_pending < self.params.min_tokens else []
        for word in self.bad_words:
            prefix = word[:-1]
            if not prefix or out[len(out) - len(prefix):] == prefix and len(out) >= len(prefix):
                banned.append(word[-1])
        return sorted(set(banned))

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows: the prompt and the output read back so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """What the scheduler computes towards: the known tokens and those still on the device."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_output_tokens_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    def reaches_length_limit(self, max_model_len: int, *, with_pending: bool = False) -> bool:
        """The sequence is finished by length (max_tokens or max_model_len): with its known tokens, or
        `with_pending`, once the tokens on the device are read back too (a step launched before then has
        nothing to compute for it)."""
        pending = self.num_pending_tokens if with_pending else 0
        max_tokens = self.params.max_tokens
        by_max_tokens = max_tokens is not None and len(self.output_token_ids) + pending >= max_tokens
        return by_max_tokens or self.num_tokens + pending >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def sort_key(self, policy: str):
        """Lower runs first; preemption evicts the largest."""
        return (self.priority, self.arrival_time) if policy == "priority" else (self.arrival_time,)
