"""Packs scheduled chunks into bucketed ragged batches and runs the jitted step (forward + sampling)."""

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxengine.engine.request import Sequence, Status
from jaxengine.engine.scheduler import ScheduledChunk
from jaxengine.layers.sampler import (VARIANTS, SamplingInputs, SlotState, native_sampler, reset_slot, sampling_step,
                                      set_allowed, token_logprobs)
from jaxengine.parallel import multihost
from jaxengine.parallel.sharding import named_sharding, replicated
from jaxengine.runner.batch import Packing, RaggedBatch
from jaxengine.runner.executables import ExecutableCache, signature

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 64  # entries of `logit_bias` per request
MAX_BANNED = 32  # tokens banned at once per request (min_tokens' EOS/stop ids plus bad_words)
STEP_VARIANTS = VARIANTS + ("prompt",)  # the sampler's variants, and "full" with prompt logprobs


def power_of_two_buckets(low: int, high: int) -> list[int]:
    buckets, b = [], low
    while b < high:
        buckets.append(b)
        b *= 2
    return buckets + [high]


def _forward(graphdef, state_treedef, replicated, state_leaves, kv_cache, last_tokens, batch_ints, lora_weights=None,
             *, packing: Packing):
    """The model over one ragged batch: logits f32[R, vocab] at `batch.logits_indices`, every token's final
    hidden state [T, hidden] (what prompt logprobs need; both replicated, as the programs after it expect
    them) and the updated cache. The weights come as their flat list of arrays (no pytree to flatten at each
    call: ~0.25 ms of host time a step for a 30-layer model), the batch packed (`Packing`). Rows of logits past
    `num_seqs` are padding: the native CPU matmul leaves them zero instead of computing them.
    `last_tokens`: i32[max_num_seqs], what the previous step sampled; a token whose `token_sources` entry is
    a row r >= 0 is last_tokens[r] (async scheduling: the host launched this step before reading them).
    `lora_weights`: the LoRA slots' weights (jaxengine/lora.py), with each token's slot packed after the batch."""
    batch, _, token_sources, *adapter_slots = packing.unpack(batch_ints)
    from_device = last_tokens[jnp.maximum(token_sources, 0)]
    batch = dataclasses.replace(batch, input_ids=jnp.where(token_sources >= 0, from_device, batch.input_ids))
    model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, state_leaves))
    lora = (lora_weights, adapter_slots[0]) if lora_weights is not None else None
    hidden, kv_cache = model.hidden_states(kv_cache, batch, lora)
    logits = model.logits(hidden[batch.logits_indices], batch.num_seqs)
    constrain = functools.partial(jax.lax.with_sharding_constraint, shardings=replicated)
    if replicated.mesh.size > 1:  # the cache leaves as it came (a cache whose KV heads the mesh cannot split, Gemma
        # 4's, came replicated; the sharded K/V written into it would otherwise leave it split along another axis)
        kv_cache = jax.tree.map(lambda kv: jax.lax.with_sharding_constraint(
            kv, named_sharding(model.KV_CACHE_AXES, kv.shape, replicated.mesh)), kv_cache)
    return constrain(logits), constrain(hidden), kv_cache


def _sample(native, max_rows, logits, slot_state, sampling_ints, sampling_floats, *, packing: Packing, variant: str,
            num_logprobs: int):
    """The sampled tokens come padded to `max_rows` (i32[max_num_seqs]): one shape for every request bucket,
    as the next step's forward takes them (`last_tokens`)."""
    sampling = packing.unpack(sampling_ints, sampling_floats)
    tokens, logprobs, slot_state = sampling_step(logits, sampling, slot_state, variant=variant,
                                                 num_logprobs=num_logprobs, native=native)
    return jnp.pad(tokens, (0, max_rows - tokens.shape[0])), logprobs, slot_state


def _prompt_logprobs(graphdef, state_treedef, native, state_leaves, hidden, batch_ints, *, packing: Packing,
                     num_logprobs: int):
    """`prompt_logprobs` of every flat position. hidden: [T, hidden] from the forward program; the packed
    batch's prompt_targets: i32[T], the token that follows each position."""
    _, prompt_targets, *_ = packing.unpack(batch_ints)
    model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, state_leaves))
    return token_logprobs(model.logits(hidden), prompt_targets, num_logprobs, native=native)


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, mesh, min_token_bucket: int = 1, max_logprobs: int = 20,
                 channel: multihost.CommandChannel | None = None,
                 executable_cache: ExecutableCache | None = None, lora: tuple[int, int] | None = None):
        """`channel`: on the leader of a multi-process mesh, every device command is sent through it first.
        `executable_cache`: where compiled programs are kept across processes. `lora`:
        (max_loras, max_lora_rank): device slots for LoRA adapters (jaxengine/lora.py), else none."""
        graphdef, self.state = nnx.split(model)
        self._state_leaves, state_treedef = jax.tree.flatten(self.state)
        self.vocab_size = vocab = model.cfg.vocab_size
        self.hidden_size, self.dtype = model.cfg.hidden_size, model.dtype
        self.attention_body = model.attention_body(block_size)
        self._model_key = f"{graphdef!r}|{self.attention_body}"  # what the model programs close over
        self._native_sampler = native_sampler(mesh)
        self._cache = executable_cache
        self.channel = channel
        self.replicated = replicated(mesh)
        def zeros(shape):
            return jnp.zeros(shape, model.kv_dtype, device=named_sharding(model.KV_CACHE_AXES, shape, mesh))

        kv_shape = model.kv_cache_shape(num_blocks, block_size)  # one array's, or (Gemma 4) one per kind of layer
        self.kv_cache = tuple(map(zeros, kv_shape)) if isinstance(kv_shape[0], tuple) else zeros(kv_shape)
        # A linear-attention model's per-sequence state: a row per running sequence and a scratch row (the last) for
        # padding requests, passed with the KV cache as (KV cache, state) (LlamaForCausalLM._run_layers)
        self.scratch_state_row = None
        state = model.state_shapes(max_num_seqs + 1)
        if state is not None:
            self.kv_cache = (self.kv_cache, tuple(jnp.zeros(shape, dtype, device=self.replicated)
                                                  for shape, dtype in state))
            self.scratch_state_row = max_num_seqs
            self.free_state_rows = list(range(max_num_seqs))
            self.state_row_owners: dict[int, Sequence] = {}
            self.state_slots = np.full(max_num_seqs, max_num_seqs, np.int32)
        self.token_buckets = power_of_two_buckets(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens)
        self.req_buckets = power_of_two_buckets(min(self.token_buckets[0], max_num_seqs), max_num_seqs)
        self.pages_per_seq = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self._jitted = {
            "forward": jax.jit(functools.partial(_forward, graphdef, state_treedef, self.replicated),
                               donate_argnums=1, static_argnames=("packing",)),
            "sample": jax.jit(functools.partial(_sample, self._native_sampler, max_num_seqs),
                              static_argnames=("packing", "variant", "num_logprobs"), donate_argnums=1),
            "prompt": jax.jit(functools.partial(_prompt_logprobs, graphdef, state_treedef, self._native_sampler),
                              static_argnames=("packing", "num_logprobs")),
            "reset": jax.jit(reset_slot, donate_argnums=0),
            "allow": jax.jit(set_allowed, donate_argnums=0),
        }
        self._compiled = {}
        self._packings: dict[tuple, Packing] = {}
        # Slots hold device state for sequences that use penalties or allowed_token_ids; running sequences
        # never outnumber max_num_seqs, and a preempted one rebuilds its slot when it runs again.
        self.num_slots = max_num_seqs
        self.slot_state = multihost.put(SlotState.zeros(self.num_slots, vocab), self.replicated)
        self.free_slots = list(range(self.num_slots))
        self.slot_owners: dict[int, Sequence] = {}
        max_t, max_r = max_num_batched_tokens, max_num_seqs
        self.input_ids = np.zeros(max_t, np.int32)  # host buffers, allocated once at their maximum size
        self.positions = np.zeros(max_t, np.int32)
        self.cu_q_lens = np.zeros(max_r + 1, np.int32)
        self.kv_lens = np.zeros(max_r, np.int32)
        self.block_tables = np.zeros((max_r, self.pages_per_seq), np.int32)
        self.logits_indices = np.zeros(max_r, np.int32)
        self.prompt_targets = np.zeros(max_t, np.int32)
        self.token_sources = np.full(max_t, -1, np.int32)  # see _forward
        self.last_tokens = multihost.put(np.zeros(max_r, np.int32), self.replicated)  # the latest step's samples
        self.lora_weights = self._lora_host = None
        if lora is not None:  # every slot's A and B per projection: host copies, and the device's
            from jaxengine.lora import projection_shapes

            num_loras, rank = lora
            self._lora_host = {p: (np.zeros((model.cfg.num_layers, num_loras, n_in, rank), np.float32),
                                   np.zeros((model.cfg.num_layers, num_loras, rank, n_out), np.float32))
                               for p, (n_in, n_out) in projection_shapes(model.cfg).items()}
            self.lora_weights = multihost.put(jax.tree.map(np.copy, self._lora_host), self.replicated)
            self.adapter_slots = np.full(max_t, num_loras, np.int32)  # each token's LoRA slot; num_loras: none
            self.num_loras = num_loras
        self.num_steps = 0  # steps launched: a pending token's source is (step, row)
        self._row_owners: list[Sequence | None] = [None] * max_r  # whose parameters each sampling row holds
        self.sampling = SamplingInputs(
            temperature=np.zeros(max_r, np.float32), top_k=np.zeros(max_r, np.int32),
            top_p=np.ones(max_r, np.float32), min_p=np.zeros(max_r, np.float32), seeds=np.zeros(max_r, np.uint32),
            counters=np.zeros(max_r, np.int32), bias_ids=np.full((max_r, MAX_LOGIT_BIAS), vocab, np.int32),
            bias_values=np.zeros((max_r, MAX_LOGIT_BIAS), np.float32),
            banned=np.full((max_r, MAX_BANNED), vocab, np.int32), presence_penalty=np.zeros(max_r, np.float32),
            frequency_penalty=np.zeros(max_r, np.float32), repetition_penalty=np.ones(max_r, np.float32),
            slots=np.full(max_r, self.num_slots, np.int32), count_slots=np.full(max_r, self.num_slots, np.int32))

    # --- compilation ----------------------------------------------------------------------------------

    def shapes(self) -> list[tuple]:
        """Every program the step runs, compiled ahead of time. Each token bucket T has one request bucket
        (`requests_for(T)`), so the model compiles once per token bucket ("forward"). The small programs
        after it do not multiply that: `prompt_logprobs` over the forward's hidden states, one per token
        bucket ("prompt"), and sampling, one per request bucket and variant ("sample")."""
        forward = [("forward", t, self.requests_for(t)) for t in self.token_buckets]
        prompt = [("prompt", t, None) for t in self.token_buckets]
        sample = [("sample", r, v) for r in sorted({self.requests_for(t) for t in self.token_buckets})
                  for v in VARIANTS]
        allow = [("allow", r, None) for r in self.req_buckets]  # structured outputs' allowed rows, r at a time
        return forward + prompt + sample + allow

    def requests_for(self, num_tokens: int) -> int:
        """The request bucket that goes with a token bucket: enough rows for one request per token, up to
        max_num_seqs. Padding rows cost little: the attention skips them and the sampler is cheap."""
        return self._bucket(self.req_buckets, min(num_tokens, self.req_buckets[-1]))

    def warmup(self, progress: bool = True) -> None:
        start, hits = time.perf_counter(), self._cache.hits if self._cache else 0
        shapes = self.shapes() + [("reset", None, None)]
        for shape in tqdm(shapes, desc="Compiling buckets", disable=not progress):
            self._executable(*shape)
        if jax.process_count() > 1:  # every command's broadcast, so that none compiles while serving
            commands = {"forward": multihost.STEP, "allow": multihost.SET_ALLOWED, "reset": multihost.RESET_SLOT}
            multihost.warm_up_channel([self._payload_like(commands[kind], (size or 0, extra or 0, 0))
                                       for kind, size, extra in shapes if kind in commands])
        loaded = (self._cache.hits - hits) if self._cache else 0
        logger.info("%d programs ready in %.1f s (%d loaded from the executable cache)", len(self._compiled),
                    time.perf_counter() - start, loaded)

    def _executable(self, kind: str, size, extra):
        """("forward", num_tokens, num_reqs), ("prompt", num_tokens, None), ("sample", num_reqs, variant),
        ("allow", num_rows, None) or ("reset", None, None)."""
        key = (kind, size, extra)
        if key not in self._compiled:
            args, statics = self._arguments_like(kind, size, extra)
            lower = functools.partial(self._jitted[kind].lower, *args, **statics)
            if self._cache is None:
                self._compiled[key] = lower().compile()
            else:
                native = "|native sampler" * self._native_sampler
                closes_over = {"forward": self._model_key, "prompt": self._model_key + native, "sample": native}
                name = f"{kind}{sorted(statics.items())}" + closes_over.get(kind, "")
                self._compiled[key] = self._cache.get(name, signature(args), lower)
        return self._compiled[key]

    def _arguments_like(self, kind: str, size, extra) -> tuple[tuple, dict]:
        """Arguments with the shapes, dtypes and shardings a program is called with, and its static ones."""
        if kind == "forward":
            packing = self._batch_packing(size, extra)
            return ((self._state_leaves, self.kv_cache, self.last_tokens, *packing.like(self.replicated),
                     self.lora_weights), {"packing": packing})
        if kind == "prompt":
            packing = self._batch_packing(size, self.requests_for(size))
            hidden = jax.ShapeDtypeStruct((size, self.hidden_size), self.dtype, sharding=self.replicated)
            return ((self._state_leaves, hidden, *packing.like(self.replicated)),
                    {"packing": packing, "num_logprobs": self.max_logprobs})
        if kind == "sample":
            packing = self._sampling_packing(size)
            logits = jax.ShapeDtypeStruct((size, self.vocab_size), jnp.float32, sharding=self.replicated)
            num_logprobs = self.max_logprobs if extra == "full" else 0
            return ((logits, self.slot_state, *packing.like(self.replicated)),
                    {"packing": packing, "variant": extra, "num_logprobs": num_logprobs})
        if kind == "allow":
            return (self.slot_state, *multihost.put(self._allow_args_like(size), self.replicated)), {}
        return (self.slot_state, *multihost.put(self._reset_args_like(), self.replicated)), {}

    # --- slots ----------------------------------------------------------------------------------------

    def load_lora(self, slot: int, adapter) -> None:
        """An adapter's weights (jaxengine.lora.LoRAAdapter) into a LoRA slot, the projections it does not adapt
        zeroed there. A step in flight keeps the arrays it was given; nothing compiles."""
        for p, (a_all, b_all) in self._lora_host.items():
            a_all[:, slot], b_all[:, slot] = 0.0, 0.0
            if p in adapter.weights:
                a, b = adapter.weights[p]
                a_all[:, slot, :, :adapter.rank], b_all[:, slot, :adapter.rank, :] = a, b
        # Copies: a CPU device array may share its host buffer, which the next load rewrites (a step in flight
        # keeps the arrays it was given).
        self.lora_weights = multihost.put(jax.tree.map(np.copy, self._lora_host), self.replicated)

    @staticmethod
    def _release(owners: dict, free: list, attribute: str) -> None:
        """Rows of `owners` ({row: Sequence}) whose sequence no longer runs back to `free`, its `attribute` cleared."""
        for row, seq in list(owners.items()):
            if seq.status != Status.RUNNING:
                del owners[row]
                free.append(row)
                setattr(seq, attribute, None)

    def _assign_state_rows(self, chunks: list[ScheduledChunk], num_reqs: int) -> None:
        """Each chunk's sequence's row of the linear-attention state (taken when it first runs; given back once it no
        longer runs: a preempted sequence recomputes from its start, on a fresh row), padding requests' the scratch
        row. A row that changes hands needs no clearing: a chunk that starts its sequence starts from zeros."""
        self._release(self.state_row_owners, self.free_state_rows, "state_row")
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.state_row is None:
                seq.state_row = self.free_state_rows.pop()
                self.state_row_owners[seq.state_row] = seq
            self.state_slots[i] = seq.state_row
        self.state_slots[len(chunks):num_reqs] = self.scratch_state_row

    def _assign_slot(self, seq: Sequence) -> None:
        seq.slot = self.free_slots.pop()
        self.slot_owners[seq.slot] = seq
        vocab, params = self.vocab_size, seq.params

        def padded(ids, size):
            out = np.full(size, vocab, np.int32)
            out[: len(ids)] = ids
            return out

        args = (np.int32(seq.slot), padded(seq.prompt_token_ids, self.max_model_len),
                padded(seq.output_token_ids, self.max_model_len), padded(params.allowed_token_ids or [], vocab),
                np.bool_(params.allowed_token_ids is not None))
        if self.channel is not None:
            self.channel.send(multihost.RESET_SLOT, payload=args)
        self._run_reset(args)

    def _run_reset(self, args) -> None:
        self.slot_state = self._executable("reset", None, None)(self.slot_state, *multihost.put(args, self.replicated))

    def _set_allowed(self, seqs: list[Sequence]) -> None:
        """Each sequence's grammar's allowed tokens into its slot, in one call for all (rows bucketed)."""
        rows = self._bucket(self.req_buckets, len(seqs))
        slots, bits = self._allow_args_like(rows)
        for i, seq in enumerate(seqs):
            slots[i] = seq.slot
            bits[i] = seq.grammar.allowed_bits()
        if self.channel is not None:
            self.channel.send(multihost.SET_ALLOWED, (rows, 0, 0), payload=(slots, bits))
        self._run_allow((slots, bits))

    def _run_allow(self, args) -> None:
        rows = args[0].shape[0]
        self.slot_state = self._executable("allow", rows, None)(self.slot_state, *multihost.put(args, self.replicated))

    def _allow_args_like(self, rows: int):
        """Arguments of set_allowed for `rows` rows, all padding (slot num_slots: dropped)."""
        return np.full(rows, self.num_slots, np.int32), np.zeros((rows, -(-self.vocab_size // 32)), np.uint32)

    def _reset_args_like(self):
        """Placeholder arguments of reset_slot: their shapes and dtypes (compilation, followers)."""
        padded = np.zeros(self.max_model_len, np.int32)
        return (np.int32(0), padded, padded, np.zeros(self.vocab_size, np.int32), np.bool_(False))

    # --- the step -------------------------------------------------------------------------------------

    def _bucket(self, buckets: list[int], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def _host_inputs(self, num_tokens: int, num_reqs: int, num_seqs: int = 0):
        t, r = num_tokens, num_reqs
        batch = RaggedBatch(self.input_ids[:t], self.positions[:t], self.cu_q_lens[: r + 1], self.kv_lens[:r],
                            self.block_tables[:r], np.int32(num_seqs), self.logits_indices[:r],
                            None if self.scratch_state_row is None else self.state_slots[:r])
        sampling = jax.tree.map(lambda a: a[:r], self.sampling)
        adapters = (self.adapter_slots[:t],) if self.lora_weights is not None else ()  # each token's LoRA slot
        return batch, sampling, self.prompt_targets[:t], self.token_sources[:t], *adapters

    def _batch_packing(self, num_tokens: int, num_reqs: int) -> Packing:
        """The forward's (and prompt logprobs') inputs: the batch, prompt_targets and token_sources, in one int32
        buffer."""
        key = ("batch", num_tokens, num_reqs)
        if key not in self._packings:
            batch, _, *rest = self._host_inputs(num_tokens, num_reqs)
            self._packings[key] = Packing.of((batch, *rest))
        return self._packings[key]

    def _sampling_packing(self, num_reqs: int) -> Packing:
        key = ("sampling", num_reqs)
        if key not in self._packings:
            self._packings[key] = Packing.of(self._host_inputs(1, num_reqs)[1])
        return self._packings[key]

    def _fill_sampling_row(self, i: int, chunk: ScheduledChunk) -> None:
        """Row i's sampling inputs. What depends only on the sequence (its parameters, seed, logit bias) is
        written when the row changes hands: in steady decoding the same sequences hold the same rows."""
        seq, params, s = chunk.seq, chunk.seq.params, self.sampling
        new_owner = self._row_owners[i] is not seq
        if new_owner:
            self._row_owners[i] = seq
            s.temperature[i], s.top_k[i], s.top_p[i] = params.temperature, params.top_k, params.top_p
            s.min_p[i], s.seeds[i] = params.min_p, seq.seed
            s.presence_penalty[i] = params.presence_penalty
            s.frequency_penalty[i] = params.frequency_penalty
            s.repetition_penalty[i] = params.repetition_penalty
            s.bias_ids[i], s.bias_values[i] = self.vocab_size, 0.0
            if params.logit_bias:
                s.bias_ids[i, : len(params.logit_bias)] = list(params.logit_bias)
                s.bias_values[i, : len(params.logit_bias)] = list(params.logit_bias.values())
        s.counters[i] = seq.num_output_tokens_with_pending
        if new_owner or (seq.min_tokens_banned and params.min_tokens) or seq.bad_words:  # else none, as written
            s.banned[i] = self.vocab_size
            banned = seq.banned_tokens()
            s.banned[i, : len(banned)] = banned
        slot = self.num_slots if seq.slot is None else seq.slot
        s.slots[i] = slot
        s.count_slots[i] = slot if chunk.completes_sequence else self.num_slots

    def _clear_padding_rows(self, start: int, end: int) -> None:
        s = self.sampling
        self._row_owners[start:end] = [None] * (end - start)
        s.temperature[start:end] = 0
        s.bias_ids[start:end] = self.vocab_size
        s.banned[start:end] = self.vocab_size
        s.slots[start:end] = s.count_slots[start:end] = self.num_slots

    def dispatch(self, chunks: list[ScheduledChunk]):
        """Packs and launches the step without waiting for it (JAX dispatch is asynchronous)."""
        self._release(self.slot_owners, self.free_slots, "slot")
        for chunk in chunks:
            if chunk.seq.params.needs_slot_state and chunk.seq.slot is None:
                self._assign_slot(chunk.seq)
        constrained = [c.seq for c in chunks if c.seq.grammar is not None and c.completes_sequence]
        if constrained:
            self._set_allowed(constrained)
        num_tokens = self._bucket(self.token_buckets, sum(c.num_tokens for c in chunks))
        num_reqs = self.requests_for(num_tokens)  # >= len(chunks): each chunk has a token
        # Sampling rows: one per chunk (its last real token's logits), then one per speculative guess (the logits
        # after it), at most max_num_seqs in all (the scheduler's limit) and so within num_reqs.
        draft_row = len(chunks)
        start = 0
        self.token_sources[:num_tokens] = -1  # every token from the host but those pending below
        if self.lora_weights is not None:
            self.adapter_slots[:num_tokens] = self.num_loras  # no adapter, but the chunks' below (padding too)
        for i, chunk in enumerate(chunks):
            seq, n, done = chunk.seq, chunk.num_tokens - len(chunk.drafts), chunk.start
            known = seq.token_ids(done, done + n)
            self.input_ids[start:start + len(known)] = known
            if len(known) < n:  # the last token is the step in flight's sample, taken on the device
                step, row = seq.pending_source
                if len(known) != n - 1 or step != self.num_steps - 1:
                    raise AssertionError(f"a chunk of {n} tokens with {n - len(known)} pending from step {step} "
                                         f"(step {self.num_steps - 1} is in flight)")
                self.token_sources[start + n - 1] = row
            following = seq.token_ids(done + 1, done + n + 1)
            self.prompt_targets[start:start + len(following)] = following
            self.logits_indices[i] = start + n - 1
            self._fill_sampling_row(i, chunk)
            if self.lora_weights is not None:
                slot = self.num_loras if seq.lora_slot is None else seq.lora_slot
                self.adapter_slots[start:start + chunk.num_tokens] = slot
            for j, draft in enumerate(chunk.drafts):  # after the known tokens; each row verifies the next guess
                self.input_ids[start + n + j] = draft
                self.logits_indices[draft_row] = start + n + j
                self._fill_sampling_row(draft_row, chunk)
                self.sampling.counters[draft_row] += j + 1  # it draws the (j + 1)th token after the chunk's row's
                draft_row += 1
            n = chunk.num_tokens
            self.positions[start:start + n] = np.arange(done, done + n)
            self.kv_lens[i] = done + n
            self.block_tables[i, : len(seq.block_ids)] = seq.block_ids
            start += n
            self.cu_q_lens[i + 1] = start
        if draft_row > num_reqs:
            raise AssertionError(f"{draft_row} sampling rows in a step of {num_reqs}")
        if self.scratch_state_row is not None:
            self._assign_state_rows(chunks, num_reqs)
        self.cu_q_lens[len(chunks) + 1: num_reqs + 1] = start
        self.kv_lens[len(chunks):num_reqs] = 0
        self._clear_padding_rows(draft_row, num_reqs)
        variant = self._variant(chunks)
        # num_seqs: the live rows (requests beyond the chunks are empty: no tokens, no keys)
        host_inputs = self._host_inputs(num_tokens, num_reqs, draft_row)
        if self.channel is not None:
            self.channel.send(multihost.STEP, (num_tokens, num_reqs, STEP_VARIANTS.index(variant)), host_inputs)
        return self._run_step(num_tokens, num_reqs, variant, host_inputs)

    def _run_step(self, num_tokens: int, num_reqs: int, variant: str, host_inputs):
        """`variant`: one of STEP_VARIANTS; "prompt" samples as "full" does and adds prompt logprobs."""
        batch, sampling, *rest = host_inputs
        # Host arrays straight into the calls, which transfer them (~0.45 ms less a step than device_put first)
        batch_buffers = self._batch_packing(num_tokens, num_reqs).pack((batch, *rest))
        sampling_buffers = self._sampling_packing(num_reqs).pack(sampling)
        logits, hidden, self.kv_cache = self._executable("forward", num_tokens, num_reqs)(
            self._state_leaves, self.kv_cache, self.last_tokens, *batch_buffers, self.lora_weights)
        prompt_logprobs = None
        if variant == "prompt":
            prompt_logprobs = self._executable("prompt", num_tokens, None)(self._state_leaves, hidden, *batch_buffers)
            variant = "full"
        tokens, logprobs, self.slot_state = self._executable("sample", num_reqs, variant)(
            logits, self.slot_state, *sampling_buffers)
        self.last_tokens = tokens
        self.num_steps += 1
        return tokens, logprobs, prompt_logprobs, hidden

    def follow(self) -> None:
        """A follower process: run every command the leader sends until it sends STOP."""
        channel = multihost.CommandChannel()
        while True:
            kind, shape, payload = channel.receive(self._payload_like)
            if kind == multihost.STOP:
                return
            if kind == multihost.RESET_SLOT:
                self._run_reset(payload)
            elif kind == multihost.SET_ALLOWED:
                self._run_allow(payload)
            else:
                tokens, _, _, _ = self._run_step(shape[0], shape[1], STEP_VARIANTS[shape[2]], payload)
                tokens.block_until_ready()  # one step at a time: back-to-back collectives can deadlock on CPU

    def _payload_like(self, kind: int, shape: tuple[int, int, int]):
        """A dummy of the payload a command of `kind` and header `shape` sends (its structure), or None."""
        if kind == multihost.STEP:
            return self._host_inputs(shape[0], shape[1])
        if kind == multihost.SET_ALLOWED:
            return self._allow_args_like(shape[0])
        return self._reset_args_like() if kind == multihost.RESET_SLOT else None

    def stop_followers(self) -> None:
        if self.channel is not None:
            self.channel.send(multihost.STOP)
            self.channel = None

    @staticmethod
    def collect(launched, num_chunks: int, hidden: bool = False):
        """Waits for a dispatched step and brings its results to the host: (tokens, logprobs, prompt logprobs,
        and with `hidden` every flat position's final hidden state [T, hidden], else None)."""
        tokens, logprobs, prompt_logprobs, hidden_states = launched
        if logprobs is not None:
            logprobs = tuple(multihost.to_host(x)[:num_chunks] for x in logprobs)
        if prompt_logprobs is not None:
            prompt_logprobs = tuple(multihost.to_host(x) for x in prompt_logprobs)
        hidden_states = multihost.to_host(hidden_states) if hidden else None
        return multihost.to_host(tokens)[:num_chunks], logprobs, prompt_logprobs, hidden_states

    @staticmethod
    def _variant(chunks: list[ScheduledChunk]) -> str:
        params = [c.seq.params for c in chunks]
        if any(c.seq.params.prompt_logprobs is not None and c.seq.num_computed_tokens < len(c.seq.prompt_token_ids)
               for c in chunks):
            return "prompt"
        if any(p.needs_slot_state or p.logprobs is not None for p in params):
            return "full"
        return "greedy" if all(p.temperature == 0 for p in params) else "sample"
