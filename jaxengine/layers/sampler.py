"""On-device sampling, vectorised over the batch with per-row parameters.

Order, as in vLLM v1: penalties and logit processors on the raw logits, then temperature, min-p, top-k
and top-p. Logprobs are taken from the model's raw distribution (log-softmax of the unprocessed logits).

Static variants: `greedy` (argmax only), `sample`, and `full`, which adds the per-sequence slot state (output
token counts, prompt presence, allowed tokens) needed by penalties and `allowed_token_ids`, and logprobs.
Prompt logprobs are `token_logprobs` over every position of the step (see jaxengine/runner/model_runner.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

VARIANTS = ("greedy", "sample", "full")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    seeds: jax.Array  # u32[R]: per-sequence seed
    counters: jax.Array  # i32[R]: tokens the sequence has generated so far
    bias_ids: jax.Array  # i32[R, max_logit_bias]; vocab = unused entry
    bias_values: jax.Array  # f32[R, max_logit_bias]
    banned: jax.Array  # i32[R, max_banned]: tokens that may not be sampled now; vocab = unused entry
    presence_penalty: jax.Array  # f32[R]
    frequency_penalty: jax.Array  # f32[R]
    repetition_penalty: jax.Array  # f32[R]; 1 = off
    slots: jax.Array  # i32[R]: the sequence's slot in SlotState; num_slots = none
    count_slots: jax.Array  # i32[R]: slot whose counts take the sampled token; num_slots = none


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-sequence state on device, one row per slot; donated to the step."""

    output_counts: jax.Array  # i32[num_slots, vocab]: how often each token was generated
    prompt_mask: jax.Array  # bool[num_slots, vocab]: tokens present in the prompt
    allowed: jax.Array  # bool[num_slots, vocab]: tokens that may be sampled

    @classmethod
    def zeros(cls, num_slots: int, vocab: int) -> "SlotState":
        """Empty slots as host arrays: put on the devices, they compile nothing (jnp.zeros would, at every start)."""
        return cls(np.zeros((num_slots, vocab), np.int32), np.zeros((num_slots, vocab), bool),
                   np.ones((num_slots, vocab), bool))


def reset_slot(
    state: SlotState,
    slot: jax.Array,  # i32[]
    prompt_ids: jax.Array,  # i32[max_len]; vocab = padding
    output_ids: jax.Array,  # i32[max_len]; vocab = padding
    allowed_ids: jax.Array,  # i32[max_allowed]; vocab = padding
    restrict: jax.Array,  # bool[]: allowed_ids restricts the vocabulary
) -> SlotState:
    """Rebuilds one slot from the sequence's tokens (on admission, and after preemption)."""
    vocab = state.output_counts.shape[1]
    counts = jnp.zeros(vocab, jnp.int32).at[output_ids].add(1, mode="drop")
    prompt = jnp.zeros(vocab, bool).at[prompt_ids].set(True, mode="drop")
    allowed = jnp.where(restrict, jnp.zeros(vocab, bool).at[allowed_ids].set(True, mode="drop"), True)
    return SlotState(state.output_counts.at[slot].set(counts), state.prompt_mask.at[slot].set(prompt),
                     state.allowed.at[slot].set(allowed))


def set_allowed(
    state: SlotState,
    slots: jax.Array,  # i32[K]; num_slots = padding (dropped)
    bits: jax.Array,  # u32[K, ceil(vocab / 32)]: bit t % 32 of word t // 32 allows token t
) -> SlotState:
    """Sets the allowed tokens of K slots from bitmasks (structured outputs' grammars, before each step)."""
    vocab = state.allowed.shape[1]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    allowed = ((bits[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1)[:, :vocab].astype(bool)
    return dataclasses.replace(state, allowed=state.allowed.at[slots].set(allowed, mode="drop"))


def apply_penalties(
    logits: jax.Array,  # f32[R, vocab]
    output_counts: jax.Array,  # i32[R, vocab]
    prompt_mask: jax.Array,  # bool[R, vocab]
    presence: jax.Array,  # f32[R]
    frequency: jax.Array,  # f32[R]
    repetition: jax.Array,  # f32[R]
) -> jax.Array:
    """vLLM's (and HF's) formulas: repetition over prompt and output tokens divides positive logits and
    multiplies negative ones; frequency subtracts per occurrence, presence once per generated token."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0)


def process_logits(logits: jax.Array, inputs: SamplingInputs, slot_state: SlotState | None) -> jax.Array:
    if slot_state is not None:
        rows = inputs.slots
        counts = slot_state.output_counts.at[rows].get(mode="fill", fill_value=0)
        prompt = slot_state.prompt_mask.at[rows].get(mode="fill", fill_value=False)
        allowed = slot_state.allowed.at[rows].get(mode="fill", fill_value=True)
        logits = apply_penalties(logits, counts, prompt, inputs.presence_penalty, inputs.frequency_penalty,
                                 inputs.repetition_penalty)
        logits = jnp.where(allowed, logits, -jnp.inf)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, inputs.bias_ids].add(inputs.bias_values, mode="drop")
    return logits.at[rows, inputs.banned].set(-jnp.inf, mode="drop")


def first_argmax(logits: jax.Array) -> jax.Array:  # i32[R]
    """jnp.argmax over the last axis (the first maximum; a NaN counts as the maximum, the first NaN wins) as plain
    reductions: XLA:CPU runs argmax's variadic (value, index) reduce ~2.5x slower (4.9 vs 2.0 ms for
    [64, 32000], a greedy decode step's whole sampling). XLA:CPU's vectorised max skips NaNs in rows of a
    thousand or more (a third to a half of such rows came out as their largest number's index), so a row with
    a NaN takes its first NaN without asking max (+0.3 ms on that shape). Single-device CPU engines use the
    native kernel instead (`native_sampler`), which keeps the same rule."""
    nan = jnp.isnan(logits)
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    vocab = logits.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def native_sampler(mesh) -> bool:
    """Whether the sampler runs the native CPU kernels (pallas_kernels/cpu_sampling.cc): the greedy argmax
    (0.17 vs 1.8 ms for a decode step's [64, 32000] logits), the random draw with min-p, top-k and top-p
    (a top-p step over [64, 49152] logits ~4.5 ms against XLA:CPU's sort's ~0.7 s) and the logprobs. The CPU
    backend, one device (the FFI calls are not partitioned over a mesh) and a library that builds."""
    if jax.default_backend() != "cpu" or mesh.devices.size > 1:
        return False
    from pallas_kernels import cpu

    return cpu.available()


def sample(
    logits: jax.Array,  # f32[R, vocab], processed
    inputs: SamplingInputs,
    *,
    all_greedy: bool,
) -> jax.Array:  # i32[R]
    """XLA's sampler (sort-based top-k/top-p, jax.random). Single-device CPU engines draw from the same
    distribution with the native kernel instead (`sampling_step`, `cpu.sample`), from another random stream
    (a seed gives other tokens there than here)."""
    greedy = first_argmax(logits)
    if all_greedy:
        return greedy
    vocab = logits.shape[-1]
    temperature = inputs.temperature
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    scaled = jnp.where(probs >= inputs.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), scaled, -jnp.inf)

    def top_k_top_p(scaled):
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        rank = jnp.arange(vocab)[None, :]
        k = jnp.where(inputs.top_k > 0, jnp.minimum(inputs.top_k, vocab), vocab)[:, None]
        in_top_k = rank < k
        probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # the most likely token is always kept
        kept = in_top_k & (mass_before < inputs.top_p[:, None]) & jnp.isfinite(ordered)
        threshold = jnp.take_along_axis(ordered, jnp.sum(kept, axis=-1, keepdims=True) - 1, axis=-1)
        return jnp.where(scaled >= threshold, scaled, -jnp.inf)

    # The sort runs only in steps where some row truncates (the native CPU sampler does not sort).
    truncates = jnp.any((temperature > 0) & (((inputs.top_k > 0) & (inputs.top_k < vocab)) | (inputs.top_p < 1.0)))
    truncated = jax.lax.cond(truncates, top_k_top_p, lambda scaled: scaled, scaled)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(inputs.seeds, inputs.counters)
    sampled = jax.vmap(jax.random.categorical)(keys, truncated).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def token_logprobs(
    logits: jax.Array,  # f32[R, vocab], raw
    tokens: jax.Array,  # i32[R]: the sampled tokens
    num_top: int,
    native: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(top ids i32[R, num_top], top logprobs f32[R, num_top], sampled logprob f32[R], sampled rank i32[R]).
    `native`: the native CPU kernel (`native_sampler`; ~2 vs ~11 ms for [64, 49152], ~18 vs ~175 ms for a
    512-token prefill's prompt logprobs), which ranks by the logits, exactly where rounding ties two logprobs."""
    if native:
        from pallas_kernels import cpu

        return tuple(cpu.token_logprobs(logits, tokens, num_top))
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, num_top)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > chosen[:, None], axis=-1) + 1  # 1 = most likely
    return top_ids.astype(jnp.int32), top_lp, chosen, rank.astype(jnp.int32)


def sampling_step(logits: jax.Array, inputs: SamplingInputs, slot_state: SlotState, *, variant: str,
                  num_logprobs: int, native: bool = False):
    """Returns (tokens i32[R], logprobs tuple or None, slot_state with the sampled tokens counted)."""
    full = variant == "full"
    if native:  # the native kernels apply the penalties, bias and bans themselves (no copy of the logits)
        from pallas_kernels import cpu

        patches = (inputs.bias_ids, inputs.bias_values, inputs.banned)
        if variant == "greedy":
            return cpu.first_argmax(logits, *patches), None, slot_state
        penalties = (slot_state.output_counts, slot_state.prompt_mask, slot_state.allowed, inputs.slots,
                     inputs.presence_penalty, inputs.frequency_penalty, inputs.repetition_penalty) if full else None
        tokens = cpu.sample(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.min_p, inputs.seeds,
                            inputs.counters, *patches, penalties=penalties)[0]
    else:
        processed = process_logits(logits, inputs, slot_state if full else None)
        tokens = sample(processed, inputs, all_greedy=variant == "greedy")
    if not full:
        return tokens, None, slot_state
    counts = slot_state.output_counts.at[inputs.count_slots, tokens].add(1, mode="drop")
    return (tokens, token_logprobs(logits, tokens, num_logprobs, native=native),
            dataclasses.replace(slot_state, output_counts=counts))
