"""The on-device sampler on its own: distributions (chi-square), penalties and logit processors against
reference formulas, and a mixed batch through the engine that compiles nothing after warm-up."""

import functools

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import jax
import jax.numpy as jnp

from jaxengine import SamplingParams
from jaxengine.compile_counter import assert_no_compiles
from jaxengine.layers.sampler import (SamplingInputs, SlotState, apply_penalties, first_argmax, process_logits,
                                      sampling_step)
from pallas_kernels import cpu
from tests.engine_util import run_to_completion

VOCAB = 12
NUM_SAMPLES = 20_000
LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.4, 0.0, -0.3, -0.5, -1.0, -1.5, -2.0, -3.0], np.float32)


def inputs(rows, vocab=VOCAB, **params):
    def col(name, default, dtype):
        return jnp.full((rows,), params.get(name, default), dtype)

    return SamplingInputs(
        temperature=col("temperature", 1.0, jnp.float32), top_k=col("top_k", 0, jnp.int32),
        top_p=col("top_p", 1.0, jnp.float32), min_p=col("min_p", 0.0, jnp.float32),
        seeds=jnp.arange(rows, dtype=jnp.uint32), counters=jnp.zeros(rows, jnp.int32),
        bias_ids=jnp.full((rows, 2), vocab, jnp.int32), bias_values=jnp.zeros((rows, 2), jnp.float32),
        banned=jnp.full((rows, 2), vocab, jnp.int32), presence_penalty=col("presence", 0.0, jnp.float32),
        frequency_penalty=col("frequency", 0.0, jnp.float32), repetition_penalty=col("repetition", 1.0, jnp.float32),
        slots=jnp.zeros(rows, jnp.int32), count_slots=jnp.zeros(rows, jnp.int32))


def expected_distribution(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The textbook definition, in numpy: temperature, min-p, top-k, top-p, renormalise."""
    scaled = LOGITS.astype(np.float64) / temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-p)
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0)
    q /= q.sum()
    mass_before = np.cumsum(q[order]) - q[order]
    keep[order[mass_before >= top_p]] = False
    q = np.where(keep, p, 0)
    return q / q.sum()


SETTINGS = {
    "temperature 0.7": dict(temperature=0.7), "temperature 1.3": dict(temperature=1.3), "top-k 5": dict(top_k=5),
    "top-p 0.8": dict(top_p=0.8), "min-p 0.1": dict(min_p=0.1),
    "combined": dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu.available(), reason="the native CPU kernels need a C++ compiler"))], ids=["xla", "native"])
@pytest.mark.parametrize("name", SETTINGS)
def test_sampled_distribution_matches_the_definition(name, native):
    """The sampling step's `sample` variant, on XLA (jax.random, a sort for top-k/top-p) and on the native CPU
    kernel (one uniform per row from its seed and counter, no sort): half the rows differ by seed, half by
    counter under one seed."""
    params = SETTINGS[name]
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (NUM_SAMPLES, VOCAB))
    x = inputs(NUM_SAMPLES, **params)
    half = NUM_SAMPLES // 2
    x.seeds = jnp.where(jnp.arange(NUM_SAMPLES) < half, jnp.arange(NUM_SAMPLES), 5).astype(jnp.uint32)
    x.counters = jnp.where(jnp.arange(NUM_SAMPLES) < half, 0, jnp.arange(NUM_SAMPLES)).astype(jnp.int32)
    step = functools.partial(sampling_step, slot_state=SlotState.zeros(1, VOCAB), variant="sample", num_logprobs=0,
                             native=native)
    tokens = np.asarray(jax.jit(lambda x, i: step(x, i)[0])(logits, x))
    want = expected_distribution(**params)
    observed = np.bincount(tokens, minlength=VOCAB).astype(np.float64)
    assert observed[want == 0].sum() == 0, "a truncated token was sampled"
    support = want > 0
    expected = want[support] / want[support].sum() * observed.sum()
    _, p_value = stats.chisquare(observed[support], expected)
    assert p_value > 1e-3


def test_penalties_match_the_reference_formulas_and_transformers():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 50)).astype(np.float32)
    counts = rng.integers(0, 3, (3, 50)).astype(np.int32) * (rng.random((3, 50)) < 0.3)
    prompt = rng.random((3, 50)) < 0.2
    presence, frequency, repetition = np.array([0.5, 0, -1.0]), np.array([0.3, 0, 1.5]), np.array([1.0, 1.3, 0.8])
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(prompt),
                                     jnp.asarray(presence, jnp.float32), jnp.asarray(frequency, jnp.float32),
                                     jnp.asarray(repetition, jnp.float32)))
    seen = prompt | (counts > 0)
    want = np.where(seen, np.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None]), logits)
    want = want - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # row 1 (repetition only) against transformers' own processor
    ids = torch.from_numpy(np.flatnonzero(seen[1])[None])
    hf = RepetitionPenaltyLogitsProcessor(1.3)(ids, torch.tensor(logits[1:2])).numpy()
    np.testing.assert_allclose(got[1], hf[0], rtol=1e-6)


def test_logit_bias_and_banned_tokens_are_exact():
    rows = 2
    x = inputs(rows)
    x.bias_ids = jnp.array([[3, 12], [0, 5]], jnp.int32)
    x.bias_values = jnp.array([[2.5, 9.0], [-1.0, 0.25]], jnp.float32)
    x.banned = jnp.array([[7, 12], [12, 12]], jnp.int32)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (rows, VOCAB))
    got = np.asarray(process_logits(logits, x, None))
    want = np.stack([LOGITS, LOGITS])
    want[0, 3] += 2.5
    want[1, 0] -= 1.0
    want[1, 5] += 0.25
    want[0, 7] = -np.inf
    np.testing.assert_array_equal(got, want)


def test_presence_penalty_stops_greedy_repetition(engines):
    engine = engines("llama")
    out = run_to_completion(engine, [("pp", [5, 6, 7], SamplingParams(temperature=0, presence_penalty=2.0,
                                                                         max_tokens=20, ignore_eos=True))])
    free = run_to_completion(engine, [("pp-free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20,
                                                                             ignore_eos=True))])
    tokens = out["pp"].outputs[0].token_ids
    assert len(set(free["pp-free"].outputs[0].token_ids)) < 20, "the unpenalised run repeats itself"
    assert tokens != free["pp-free"].outputs[0].token_ids


def test_allowed_token_ids_only(engines):
    engine = engines("llama")
    allowed = [10, 11, 12, 200]
    out = run_to_completion(engine, [("allowed", [5, 6, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                                                                            ignore_eos=True,
                                                                            allowed_token_ids=allowed))])
    assert set(out["allowed"].outputs[0].token_ids) <= set(allowed)


def test_mixed_batch_compiles_nothing_after_warmup(engines):
    engine = engines("qwen2")
    kinds = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.8, top_p=0.9, seed=1,
                                                                         max_tokens=6),
             SamplingParams(temperature=0.5, repetition_penalty=1.2, frequency_penalty=0.5, max_tokens=6),
             SamplingParams(temperature=0, logprobs=3, max_tokens=6),
             SamplingParams(temperature=1.0, allowed_token_ids=[4, 5, 6], min_tokens=2, max_tokens=6, seed=2)]
    with assert_no_compiles("a mixed batch after warm-up"):
        finals = run_to_completion(engine, [(f"mix-{i}", [5, 6, 7 + i], p) for i, p in enumerate(kinds)])
    assert all(len(o.outputs[0].token_ids) == 6 for o in finals.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_first_argmax_is_jnp_argmax_on_ties_infinities_and_nans():
    rng = np.random.default_rng(4)
    logits = rng.integers(-3, 3, (6, 50)).astype(np.float32)  # many ties
    logits[1] = -np.inf  # a fully masked row
    logits[2, [7, 30]] = np.nan
    logits[3, 11] = np.inf
    logits[4, [0, 49]] = 100.0
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))
    assert list(got[1:5]) == [0, 7, 11, 0]


@pytest.mark.parametrize("vocab", [1000, 32000])
def test_first_argmax_takes_the_first_nan_of_long_rows(vocab):
    """Rows as long as a vocabulary, each with one or two NaNs among finite logits: XLA:CPU's max skips them in
    such rows, so first_argmax must not depend on it (when it did, a third to a half of such rows came out
    wrong)."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((64, vocab)).astype(np.float32)
    for row in range(64):
        logits[row, rng.integers(vocab, size=1 + row % 2)] = np.nan
    logits[0] = np.nan  # every entry
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
