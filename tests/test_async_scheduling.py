"""Async scheduling: step N + 1 is launched before step N is read back, its decode tokens taken on the device
from step N's samples. It must give exactly what one step at a time gives, for every sampling feature."""

import pytest

from jaxengine import SamplingParams
from tests.engine_util import random_prompts, run_to_completion


def outputs_of(engine, requests, async_scheduling):
    """{request_id: final RequestOutput} of the requests run with async scheduling on or off."""
    engine.async_scheduling = async_scheduling
    try:
        tag = f"{'async' if async_scheduling else 'sync'}-"
        finals = run_to_completion(engine, [(tag + rid, prompt, params) for rid, prompt, params in requests])
    finally:
        engine.async_scheduling = True
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no KV block leaked
    return {rid.removeprefix(tag): out for rid, out in finals.items()}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for rid in want:
        a, b = got[rid], want[rid]
        assert a.prompt_logprobs == b.prompt_logprobs, rid
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                (y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
            assert (x.logprobs, x.cumulative_logprob) == (y.logprobs, y.cumulative_logprob), rid


@pytest.fixture(scope="module")
def free_run(engines):
    """A greedy continuation to pick stop tokens, stop strings and bad words from."""
    engine = engines("llama")
    prompt = random_prompts(engine.model_config.vocab_size, [12], seed=3)[0]
    out = run_to_completion(engine, [("free", prompt, SamplingParams(temperature=0, max_tokens=24,
                                                                       ignore_eos=True))])["free"].outputs[0]
    return prompt, out


def test_async_scheduling_gives_what_one_step_at_a_time_gives(engines, free_run, monkeypatch):
    engine = engines("llama")
    prompt, free = free_run
    prompts = random_prompts(engine.model_config.vocab_size, [5, 9, 17, 30, 3, 11, 21, 7, 14, 6, 25], seed=4)
    stop_text = next(free.text[i:i + 2] for i in range(6, len(free.text) - 2) if free.text[i:i + 2].strip())
    bad_word = engine.tokenizer.decode([free.token_ids[4]]).strip() or "a"
    requests = [
        ("greedy", prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        ("eos", prompts[1], SamplingParams(temperature=0, max_tokens=30)),
        ("stop-token", prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free.token_ids[6]])),
        ("stop-string", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_text])),
        ("sampled", prompts[2], SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16)),
        ("penalties", prompts[3], SamplingParams(temperature=0.9, seed=5, max_tokens=14, presence_penalty=0.5,
                                                 frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True)),
        ("logprobs", prompts[4], SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True)),
        ("n2", prompts[5], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)),
        ("prompt-logprobs", prompts[6], SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2)),
        ("min-tokens", prompt, SamplingParams(temperature=0, max_tokens=24, min_tokens=10,
                                              stop_token_ids=[free.token_ids[6]])),
        ("bad-words", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[bad_word])),
        ("allowed", prompts[7], SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True,
                                               allowed_token_ids=[5, 6, 7, 8, 9])),
        ("one-token", prompts[8], SamplingParams(temperature=0, max_tokens=1)),
    ]
    dispatch = engine.runner.dispatch

    def checked_dispatch(chunks):  # bad_words need their last tokens on the host: never scheduled ahead
        assert not any(c.seq.bad_words and c.seq.num_pending_tokens for c in chunks)
        return dispatch(chunks)

    monkeypatch.setattr(engine.runner, "dispatch", checked_dispatch)
    got = outputs_of(engine, requests, True)
    assert_same(got, outputs_of(engine, requests, False))
    assert got["stop-token"].outputs[0].token_ids == free.token_ids[:7]  # the row in flight past it is dropped
    assert got["stop-string"].outputs[0].finish_reason == "stop"
    assert got["min-tokens"].outputs[0].finish_reason == "length" or len(got["min-tokens"].outputs[0].token_ids) >= 10


def test_decode_tokens_come_from_the_device_and_no_step_is_launched_past_max_tokens(engines, monkeypatch):
    """With async scheduling every decode step after the first takes its tokens from the step before on the
    device; a sequence whose max_tokens the step in flight reaches is not scheduled again, so both modes
    launch the same steps."""
    engine = engines("llama")
    prompts = random_prompts(engine.model_config.vocab_size, [6, 10, 4], seed=5)
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
                for i, p in enumerate(prompts)]
    run_step = engine.runner._run_step
    for mode in (True, False):
        launched = []

        def recording(num_tokens, num_reqs, variant, host_inputs):
            launched.append(int((host_inputs[3] >= 0).sum()))  # token_sources: tokens taken on the device
            return run_step(num_tokens, num_reqs, variant, host_inputs)

        monkeypatch.setattr(engine.runner, "_run_step", recording)
        outputs_of(engine, requests, mode)
        assert len(launched) == 7  # the prompts, then six decode steps
        assert launched == ([0] + [3] * 6 if mode else [0] * 7)


def test_an_abort_while_its_step_is_in_flight_frees_everything(engines):
    engine = engines("llama")
    prompts = random_prompts(engine.model_config.vocab_size, [8, 13, 5], seed=6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = outputs_of(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)], False)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", p, params)
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine._in_flight and engine.requests["abort-1"].seqs[0].num_pending_tokens == 1
    engine.abort_request("abort-1")
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["abort-1"].outputs[0].finish_reason == "abort"
    for i in (0, 2):
        assert finals[f"abort-{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and not engine._in_flight
