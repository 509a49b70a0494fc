"""Packs scheduled chunks into bucketed ragged batches and runs the jitted step (forward + sampling)."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxengine.engine.scheduler import ScheduledChunk
from jaxengine.layers.sampler import apply_logit_processors, sample, token_logprobs

MAX_LOGIT_BIAS = 64  # entries of `logit_bias` per request
MAX_BANNED = 32  # tokens banned at once per request (min_tokens' EOS/stop ids plus bad_words)
from jaxengine.runner.batch import RaggedBatch

logger = logging.getLogger(__name__)


def power_of_two_buckets(low: int, high: int) -> list[int]:
    buckets, b = [], low
    while b < high:
        buckets.append(b)
        b *= 2
    return buckets + [high]


def _step(graphdef, state, kv_cache, batch: RaggedBatch, sampling, *, all_greedy: bool, num_logprobs: int):
    logits, kv_cache = nnx.merge(graphdef, state)(kv_cache, batch)
    *params, bias_ids, bias_values, banned = sampling
    tokens = sample(apply_logit_processors(logits, bias_ids, bias_values, banned), *params, all_greedy=all_greedy)
    logprobs = token_logprobs(logits, tokens, num_logprobs) if num_logprobs else None
    return tokens, logprobs, kv_cache


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, min_token_bucket: int = 16, max_logprobs: int = 20):
        graphdef, self.state = nnx.split(model)
        self.kv_cache = jnp.zeros(model.kv_cache_shape(num_blocks, block_size), model.dtype)
        self.token_buckets = power_of_two_buckets(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens)
        self.req_buckets = power_of_two_buckets(min(8, max_num_seqs), max_num_seqs)
        self.pages_per_seq = -(-max_model_len // block_size)
        self.block_size = block_size
        self.max_logprobs = max_logprobs
        self.num_compiles = 0
        self._jitted = jax.jit(functools.partial(_step, graphdef), static_argnames=("all_greedy", "num_logprobs"),
                               donate_argnums=(1,))
        self._compiled = {}
        max_t, max_r = max_num_batched_tokens, max_num_seqs
        self.input_ids = np.zeros(max_t, np.int32)  # host buffers, allocated once at their maximum size
        self.positions = np.zeros(max_t, np.int32)
        self.cu_q_lens = np.zeros(max_r + 1, np.int32)
        self.kv_lens = np.zeros(max_r, np.int32)
        self.block_tables = np.zeros((max_r, self.pages_per_seq), np.int32)
        self.logits_indices = np.zeros(max_r, np.int32)
        self.temperature = np.zeros(max_r, np.float32)
        self.top_k = np.zeros(max_r, np.int32)
        self.top_p = np.ones(max_r, np.float32)
        self.min_p = np.zeros(max_r, np.float32)
        self.seeds = np.zeros(max_r, np.uint32)
        self.counters = np.zeros(max_r, np.int32)
        self.vocab_size = model.cfg.vocab_size
        self.bias_ids = np.full((max_r, MAX_LOGIT_BIAS), self.vocab_size, np.int32)
        self.bias_values = np.zeros((max_r, MAX_LOGIT_BIAS), np.float32)
        self.banned = np.full((max_r, MAX_BANNED), self.vocab_size, np.int32)

    def shapes(self) -> list[tuple[int, int, bool, int]]:
        """Every (token bucket, request bucket, all_greedy, num_logprobs) the step is compiled for."""
        return [(t, r, g, lp) for t in self.token_buckets for r in self.req_buckets
                if r <= t or r == self.req_buckets[0] for g in (True, False) for lp in (0, self.max_logprobs)]

    def warmup(self, progress: bool = True) -> None:
        for shape in tqdm(self.shapes(), desc="Compiling buckets", disable=not progress):
            self._executable(*shape)

    def _executable(self, num_tokens: int, num_reqs: int, all_greedy: bool, num_logprobs: int):
        key = (num_tokens, num_reqs, all_greedy, num_logprobs)
        if key not in self._compiled:
            batch, sampling = self._device_inputs(num_tokens, num_reqs)
            self._compiled[key] = self._jitted.lower(self.state, self.kv_cache, batch, sampling,
                                                     all_greedy=all_greedy, num_logprobs=num_logprobs).compile()
            self.num_compiles += 1
        return self._compiled[key]

    def _bucket(self, buckets: list[int], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def _device_inputs(self, num_tokens: int, num_reqs: int, num_seqs: int = 0):
        t, r = num_tokens, num_reqs
        batch = RaggedBatch(self.input_ids[:t], self.positions[:t], self.cu_q_lens[: r + 1], self.kv_lens[:r],
                            self.block_tables[:r], np.int32(num_seqs), self.logits_indices[:r])
        sampling = (self.temperature[:r], self.top_k[:r], self.top_p[:r], self.min_p[:r], self.seeds[:r],
                    self.counters[:r], self.bias_ids[:r], self.bias_values[:r], self.banned[:r])
        return jax.device_put((batch, sampling))

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[np.ndarray, tuple | None]:
        """Runs one step; returns the sampled token of each chunk (meaningful where the chunk completes its
        sequence) and, when any sequence asked for logprobs, (top ids, top logprobs, token logprob, rank)."""
        num_tokens = self._bucket(self.token_buckets, sum(c.num_tokens for c in chunks))
        num_reqs = self._bucket(self.req_buckets, len(chunks))
        start = 0
        for i, chunk in enumerate(chunks):
            seq, n, done = chunk.seq, chunk.num_tokens, chunk.seq.num_computed_tokens
            self.input_ids[start:start + n] = seq.all_token_ids[done:done + n]
            self.positions[start:start + n] = np.arange(done, done + n)
            self.kv_lens[i] = done + n
            self.block_tables[i, : len(seq.block_ids)] = seq.block_ids
            start += n
            self.cu_q_lens[i + 1] = start
            self.logits_indices[i] = start - 1
            params = seq.params
            self.temperature[i] = params.temperature
            self.top_k[i] = params.top_k
            self.top_p[i] = params.top_p
            self.min_p[i] = params.min_p
            self.seeds[i] = seq.seed
            self.counters[i] = len(seq.output_token_ids)
            self.bias_ids[i] = self.vocab_size
            self.banned[i] = self.vocab_size
            if params.logit_bias:
                self.bias_ids[i, : len(params.logit_bias)] = list(params.logit_bias)
                self.bias_values[i, : len(params.logit_bias)] = list(params.logit_bias.values())
            banned = seq.banned_tokens()
            self.banned[i, : len(banned)] = banned
        self.cu_q_lens[len(chunks) + 1: num_reqs + 1] = start
        self.kv_lens[len(chunks):num_reqs] = 0
        self.temperature[len(chunks):num_reqs] = 0
        self.bias_ids[len(chunks):num_reqs] = self.vocab_size
        self.banned[len(chunks):num_reqs] = self.vocab_size
        all_greedy = all(c.seq.params.temperature == 0 for c in chunks)
        wants_logprobs = any(c.seq.params.logprobs is not None for c in chunks)
        step = self._executable(num_tokens, num_reqs, all_greedy, self.max_logprobs if wants_logprobs else 0)
        batch, sampling = self._device_inputs(num_tokens, num_reqs, len(chunks))
        tokens, logprobs, self.kv_cache = step(self.state, self.kv_cache, batch, sampling)
        if logprobs is not None:
            logprobs = tuple(np.asarray(x)[: len(chunks)] for x in logprobs)
        return np.asarray(tokens)[: len(chunks)], logprobs
