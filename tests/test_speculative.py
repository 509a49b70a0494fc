"""Speculative decoding by n-gram lookup: the same tokens as decoding one at a time, in fewer steps."""

import pytest

from jaxengine import EngineConfig, SamplingParams
from jaxengine.compile_counter import assert_no_compiles
from jaxengine.engine.speculative import SpeculativeConfig, propose
from tests.engine_util import random_prompts, run_to_completion

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_propose():
    assert propose([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]  # the suffix [1, 2, 3] occurred at 0
    assert propose([5, 1, 2, 7, 7, 1, 2], 2, 1, 3) == [7, 7]  # the longest suffix that recurs: [1, 2]
    assert propose([4, 4, 4, 4, 4], 3, 1, 2) == [4, 4, 4]  # the latest occurrence that 3 tokens follow
    assert propose([1, 2, 3, 1, 2], 4, 1, 2) == [3, 1, 2]  # fewer follow: the earliest, as many as there are
    assert propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert propose([1, 2, 1, 2], 2, 3, 3) == []  # shorter than prompt_lookup_min + 1 matches
    assert propose([1, 2, 1], 0, 1, 3) == []


def test_config():
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(3, 5, 5)
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}) == \
        SpeculativeConfig(3, 2, 2)
    for settings, match in [({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of ngram"),
                            ({"method": "ngram"}, "num_speculative_tokens is required"),
                            ({"method": "ngram", "num_speculative_tokens": 0}, "must be a positive integer"),
                            ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                              "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
                            ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown keys")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=settings)


def _greedy(engine, prompts, **params):
    requests = [(f"r{i}", p, SamplingParams(temperature=0, ignore_eos=True, **params)) for i, p in enumerate(prompts)]
    finals = run_to_completion(engine, requests)
    return [finals[f"r{i}"].outputs[0] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_same_tokens_as_one_at_a_time(engines, backend):
    """Greedy requests (random prompts, and prompts that repeat, whose outputs the guesses follow) give the same
    tokens with and without speculation, through chunked prompts, max_tokens and max_model_len cut inside a run
    of guesses; guesses are made and accepted; nothing compiles; every block comes back."""
    base = engines("llama", attention_backend=backend)
    spec = engines("llama", attention_backend=backend, speculative_config=NGRAM)
    prompts = random_prompts(base.model_config.vocab_size, [5, 70, 12, 1], seed=3) + [[7, 8, 9, 10] * 9]
    for params in (dict(max_tokens=40), dict(max_tokens=7)):
        want = _greedy(base, prompts, **params)
        with assert_no_compiles("speculative steps"):
            got = _greedy(spec, prompts, **params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert all(type(t) is int for o in got for t in o.token_ids)  # as the server serialises them
    stats = spec.spec_stats
    assert stats["draft_tokens"] > stats["drafts"] > 0 and stats["accepted_tokens"] > 0
    long = [random_prompts(base.model_config.vocab_size, [480], seed=4)[0]]  # ends at max_model_len (512)
    assert [o.token_ids for o in _greedy(spec, long, max_tokens=100)] == \
        [o.token_ids for o in _greedy(base, long, max_tokens=100)]
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_logprobs_of_guessed_tokens(engines):
    """A speculating sequence's logprobs (each token's from the row that verified it) equal one-at-a-time
    decoding's."""
    base, spec = engines("llama"), engines("llama", speculative_config=NGRAM)
    prompts = [[7, 8, 9, 10] * 9, random_prompts(base.model_config.vocab_size, [12], seed=11)[0]]
    accepted = spec.spec_stats["accepted_tokens"]
    want, got = (_greedy(engine, prompts, max_tokens=20, logprobs=3) for engine in (base, spec))
    assert spec.spec_stats["accepted_tokens"] > accepted
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 20
        for a, b in zip(w.logprobs, g.logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].rank == b[token].rank and abs(a[token].logprob - b[token].logprob) < 1e-4
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3


def test_mixed_batches_stops_and_preemption(engines):
    """Speculating sequences (greedy, sampled, with logprobs, n=2 samples) beside one that may not (penalties):
    each request's tokens and stops as without speculation; a pool too small for all preempts and recomputes."""
    base = engines("llama", num_kv_blocks=24)
    spec = engines("llama", num_kv_blocks=24, speculative_config=NGRAM)
    prompts = random_prompts(base.model_config.vocab_size, [30, 40, 50, 20, 60, 35], seed=5)
    prompts[0] = [11, 12, 13] * 10
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),  # speculates too
              SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=45, n=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    first = _greedy(base, prompts[:1], max_tokens=48)[0].token_ids
    params[0] = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[first[20]])  # stops inside a run

    def run(engine):
        before = engine.scheduler.num_preemptions
        finals = run_to_completion(engine, [(f"m{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
        return [[(c.token_ids, c.finish_reason) for c in finals[f"m{i}"].outputs] for i in range(len(prompts))], \
            engine.scheduler.num_preemptions - before

    want, _ = run(base)
    accepted = spec.spec_stats["accepted_tokens"]
    got, preempted = run(spec)
    assert got == want and preempted > 0
    assert got[0][0][1] == "stop" and len(got[0][0][0]) == first.index(first[20]) + 1
    assert spec.spec_stats["accepted_tokens"] > accepted
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_refused_for_pooling(embedding_models):
    from jaxengine import LLM

    with pytest.raises(ValueError, match="speculative_config applies to generation"):
        LLM(str(embedding_models["base"]), runner="pooling", speculative_config=NGRAM, dtype="float32",
            max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, kv_cache_gib=0.01, warmup=False,
            progress=False)


def test_full_batches_keep_scheduling_ahead(engines, monkeypatch):
    """Guesses need the tokens read back, so a step that may get some waits for the one before; a batch that fills
    the step's sampling rows (max_num_seqs) gets none and keeps scheduling ahead (its decode tokens taken on the
    device), as does one past disable_by_batch_size."""
    for settings, count, ahead in [(NGRAM, 8, True), (NGRAM, 3, False),
                                   (NGRAM | {"disable_by_batch_size": 3}, 3, True)]:
        engine = engines("llama", speculative_config=settings)
        prompts = random_prompts(engine.model_config.vocab_size, [6] * count, seed=9)
        run_step, from_device = engine.runner._run_step, []

        def recording(num_tokens, num_reqs, variant, host_inputs):
            from_device.append(int((host_inputs[3] >= 0).sum()))  # token_sources: tokens taken on the device
            return run_step(num_tokens, num_reqs, variant, host_inputs)

        monkeypatch.setattr(engine.runner, "_run_step", recording)
        _greedy(engine, prompts, max_tokens=6)
        monkeypatch.undo()
        assert (sum(from_device) > 0) == ahead, (settings, count, from_device)


def _sampled_runs(base, spec, prompts, params):
    """Each request's tokens and logprobs from both engines, and how many guesses the speculating one took."""
    requests = [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    accepted = spec.spec_stats["accepted_tokens"]
    want = run_to_completion(base, requests)
    with assert_no_compiles("speculative sampled steps"):
        got = run_to_completion(spec, requests)
    return ([[(c.token_ids, c.logprobs) for c in want[f"s{i}"].outputs] for i in range(len(prompts))],
            [[(c.token_ids, c.logprobs) for c in got[f"s{i}"].outputs] for i in range(len(prompts))],
            spec.spec_stats["accepted_tokens"] - accepted)


def _check_same_samples(base, spec):
    prompts = [[7, 8, 9, 10] * 9, [11, 12, 13] * 10] + random_prompts(base.model_config.vocab_size, [20, 9], seed=12)
    # Low temperatures: the tiny random model's draws then repeat often enough that guesses hold and fail.
    params = [SamplingParams(temperature=0.05, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.1, top_k=4, top_p=0.9, seed=8, max_tokens=33, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.1, min_p=0.2, seed=9, n=2, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=2, seed=10, max_tokens=30, ignore_eos=True)]
    drafted = spec.spec_stats["draft_tokens"]
    want, got, accepted = _sampled_runs(base, spec, prompts, params)
    assert 0 < accepted < spec.spec_stats["draft_tokens"] - drafted  # guesses taken, and guesses drawn against
    for w, g in zip(want, got):
        for (want_ids, want_lps), (got_ids, got_lps) in zip(w, g):
            assert got_ids == want_ids
            if want_lps is not None:
                for a, b in zip(want_lps, got_lps):
                    assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_sampled_requests_draw_the_tokens_they_draw_without_guesses(engines):
    """A sampled sequence speculates too (temperature, top-k, top-p, min-p, n > 1, logprobs): each row draws the
    token it verifies with that token's own key, so a seeded request gives the same tokens with and without
    speculation (speculative sampling with a point-mass guess: taken with the model's probability of it)."""
    _check_same_samples(engines("llama"), engines("llama", speculative_config=NGRAM))


def test_sampled_guesses_with_the_xla_sampler(model_dirs, monkeypatch):
    """The same through XLA's sampler (sort-based, jax.random; sharded engines run it) instead of the native one."""
    from jaxengine import LLMEngine
    from jaxengine.runner import model_runner

    monkeypatch.setattr(model_runner, "native_sampler", lambda mesh: False)
    settings = dict(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256, max_num_seqs=8,
                    max_num_batched_tokens=32, min_token_bucket=8, kv_cache_gib=0.01, seed=0)
    base = LLMEngine(EngineConfig(**settings), progress=False)
    spec = LLMEngine(EngineConfig(**settings, speculative_config=NGRAM), progress=False)
    assert not base.runner._native_sampler and not spec.runner._native_sampler
    _check_same_samples(base, spec)
