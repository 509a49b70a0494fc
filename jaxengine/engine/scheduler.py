"""vLLM v1-style scheduling: no prefill/decode phases, one token budget per step.

Running sequences are served first (a decode token, or the next chunk of a long prompt), then waiting ones
while `max_num_seqs` and the budget allow. A sequence that cannot get a block preempts the newest (or, under
the priority policy, the lowest-priority) running sequence, which frees its blocks and is recomputed later.
"""

import dataclasses
import time

from jaxengine.engine import speculative
from jaxengine.engine.block_manager import BlockManager
from jaxengine.engine.request import Sequence, Status


@dataclasses.dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # new tokens computed this step (speculative guesses included)
    start: int = dataclasses.field(init=False)  # the first one's position: seq.num_computed_tokens when scheduled
    # The chunk reaches the sequence's last token (known or pending), so its logits give the next token.
    completes_sequence: bool = dataclasses.field(init=False)
    drafts: list[int] = dataclasses.field(default_factory=list)  # guessed tokens after the last (speculative)

    def __post_init__(self):
        self.start = self.seq.num_computed_tokens
        self.completes_sequence = self.start + self.num_tokens == self.seq.num_tokens_with_pending


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", max_model_len: int | None = None,
                 speculation: speculative.SpeculativeConfig | None = None, lora_slots=None):
        """`max_model_len`: where a sequence stops by length (None: no limit but max_tokens). `speculation`: guess
        tokens for the decoding sequences that may speculate (Sequence.speculative). `lora_slots`: the LoRA
        adapters' device slots (jaxengine.lora.LoRASlots): a sequence with an adapter runs while it holds one."""
        self.speculation = speculation
        self.lora_slots = lora_slots
        self.block_manager = block_manager
        self.max_model_len = max_model_len if max_model_len is not None else float("inf")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_pending_tokens and seq.reaches_length_limit(self.max_model_len, with_pending=True):
                continue  # finishes when the step in flight is read back
            num_new = min(seq.num_tokens_with_pending - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                budget += sum(c.num_tokens for c in chunks if c.seq is victim)
                chunks = [c for c in chunks if c.seq is not victim]
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                chunks.append(ScheduledChunk(seq, num_new))
                budget -= num_new
        # The surviving chunks' full blocks are shared from here on (a preempted victim's were never computed):
        # with the waiting sequences admitted below, and with the next step, scheduled before this one returns.
        for chunk in chunks:
            self.block_manager.cache_full_blocks(chunk.seq, chunk.start + chunk.num_tokens)
        if not preempted:
            budget = self._admit_waiting(chunks, budget)
        if self.speculation is not None:
            self._add_drafts(chunks, budget)
        return chunks

    def may_add_drafts(self, rows: int) -> bool:
        """Whether a step of `rows` sampling rows leaves room for guesses (a row each) and the running batch is
        below disable_by_batch_size."""
        limit = self.speculation.disable_by_batch_size
        return rows < self.max_num_seqs and (limit is None or len(self.running) < limit)

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Guesses for the step's decoding sequences that may speculate, from the token budget the step leaves, a
        sampling row each (a step has max_num_seqs rows) and the blocks free (none is preempted for a guess);
        never past max_tokens or max_model_len."""
        if not self.may_add_drafts(len(chunks)):
            return
        spec, rows = self.speculation, len(chunks)
        for chunk in chunks:
            seq = chunk.seq
            if not (seq.speculative and chunk.num_tokens == 1 and chunk.completes_sequence
                    and not seq.num_pending_tokens):
                continue
            max_tokens = seq.params.max_tokens
            left = spec.num_speculative_tokens if max_tokens is None else max_tokens - len(seq.output_token_ids) - 1
            k = min(spec.num_speculative_tokens, budget, self.max_num_seqs - rows, left,
                    self.max_model_len - seq.num_tokens - 1)
            drafts = speculative.propose(seq.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if drafts and self.block_manager.allocate(seq, 1 + len(drafts)):
                chunk.drafts = drafts
                chunk.num_tokens += len(drafts)
                budget -= len(drafts)
                rows += len(drafts)

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> int:
        self.waiting.sort(key=lambda s: s.sort_key(self.policy))
        admitted = []
        for seq in self.waiting:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.fork_parent is not None and not self._fork_ready(seq):
                continue
            if seq.num_pending_tokens:  # preempted with a token in flight: resumes once it is read back
                continue
            if seq.lora is not None and not self.lora_slots.acquire(seq):
                continue  # every LoRA slot holds other adapters' running sequences: waits for one
            if not seq.block_ids:
                if seq.fork_parent is not None:
                    self.block_manager.fork(seq.fork_parent, seq)
                else:
                    self.block_manager.match_prefix(seq)
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, num_new):
                self.block_manager.free_sequence(seq)  # give back prefix hits; retried next step
                self._release_lora(seq)
                break
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            admitted.append(seq)
            chunks.append(ScheduledChunk(seq, num_new))
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + num_new)  # for the next admitted
            budget -= num_new
        self.waiting = [s for s in self.waiting if s not in admitted]
        return budget

    def _fork_ready(self, seq: Sequence) -> bool:
        """A forked sample waits until its parent has computed the shared prompt."""
        parent = seq.fork_parent
        if parent.is_finished or parent.num_preemptions:
            seq.fork_parent = None  # the parent cannot share any more: compute the prompt alone
            return True
        return parent.status == Status.RUNNING and parent.num_computed_tokens >= len(parent.prompt_token_ids)

    def _pick_victim(self) -> Sequence:
        return max(self.running, key=lambda s: s.sort_key(self.policy))

    def _release_lora(self, seq: Sequence) -> None:
        if self.lora_slots is not None:
            self.lora_slots.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        self._release_lora(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
        self._release_lora(seq)
        seq.status = Status.FINISHED
