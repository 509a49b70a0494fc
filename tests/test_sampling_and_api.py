"""Seeds, sampling parameters, n > 1, bad input, chat and the offline LLM API."""

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine.detokenizer import IncrementalDetokenizer
from tests.engine_util import random_prompts, run_to_completion

PROMPT = [5, 17, 42, 99, 100, 7]


def sample_tokens(engine, tag, params, prompt=PROMPT):
    return run_to_completion(engine, [(tag, prompt, params)])[tag].outputs


def test_same_seed_same_output_and_different_seeds_differ(engines):
    engine = engines("qwen3")
    params = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    a = sample_tokens(engine, "seed-a", SamplingParams(seed=1, **params))[0].token_ids
    b = sample_tokens(engine, "seed-b", SamplingParams(seed=1, **params))[0].token_ids
    c = sample_tokens(engine, "seed-c", SamplingParams(seed=2, **params))[0].token_ids
    assert a == b
    assert a != c


def test_seeded_output_is_the_same_alone_or_among_16_others(engines):
    engine = engines("qwen3")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    alone = sample_tokens(engine, "alone", params)[0].token_ids
    lengths = [3, 30, 9, 50, 1, 17, 64, 5, 12, 40, 2, 8, 25, 33, 6, 90]  # 16 others, mixed settings
    others = [(f"other-{i}", p, SamplingParams(temperature=[0, 1.0, 0.7][i % 3], top_k=[0, 5][i % 2],
                                               presence_penalty=[0, 0.5][i % 2], logprobs=[None, 2][i % 2],
                                               max_tokens=20, ignore_eos=True))
              for i, p in enumerate(random_prompts(engine.model_config.vocab_size, lengths, seed=3))]
    finals = run_to_completion(engine, others + [("batched", PROMPT, params)])
    assert finals["batched"].outputs[0].token_ids == alone


def test_top_k_one_equals_greedy(engines):
    engine = engines("mistral")
    greedy = sample_tokens(engine, "greedy", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    top1 = sample_tokens(engine, "top1", SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=20,
                                                        ignore_eos=True))
    assert top1[0].token_ids == greedy[0].token_ids


def test_n_samples_share_the_prompt_and_differ(engines):
    engine = engines("llama")
    outs = sample_tokens(engine, "n4", SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
                         prompt=list(range(3, 80)))
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert all(len(o.token_ids) == 12 for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_ids_and_eos(engines):
    engine = engines("mistral")
    free_run = sample_tokens(engine, "free", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_at = free_run.token_ids[3]
    stopped = sample_tokens(engine, "stopped", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                             stop_token_ids=[stop_at]))[0]
    first = free_run.token_ids.index(stop_at)
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(n=10 ** 9), "n"),  # each sequence is built when the request is added: this once hung the engine
    (dict(min_p=1.5), "min_p"), (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=1e300), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"), (dict(logit_bias={5: float("nan")}), "logit_bias"),
    # Wrong types are refused when the parameters are made (a dict for skip_special_tokens once failed in a step).
    (dict(skip_special_tokens={}), "skip_special_tokens"), (dict(ignore_eos=None), "ignore_eos"),
    (dict(temperature="0.5"), "temperature"), (dict(top_k=2.5), "top_k"), (dict(seed=1.5), "seed"),
    (dict(max_tokens="8"), "max_tokens"), (dict(stop=2), "stop"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(logit_bias={"5": 1}), "logit_bias"), (dict(bad_words="word"), "bad_words"),
    (dict(output_kind=1), "output_kind"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens"),
])
def test_bad_or_unsupported_sampling_params_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_numbers_as_python_ones():
    params = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.int64(7), max_tokens=np.int32(9),
                            stop_token_ids=np.array([3, 4]), allowed_token_ids=(5, 6), logit_bias={np.int64(5): 1})
    assert (params.n, params.temperature, params.seed, params.max_tokens) == (2, 0.5, 7, 9)
    assert type(params.n) is int and type(params.temperature) is float and type(params.max_tokens) is int
    assert params.stop_token_ids == [3, 4] and all(type(t) is int for t in params.stop_token_ids)
    assert params.allowed_token_ids == [5, 6] and params.logit_bias == {5: 1.0}


def test_a_top_k_beyond_the_device_int32_keeps_every_token(engines):
    """A top_k past int32 (the device's type) is a top_k of the whole vocabulary, not an error at step time."""
    engine = engines("mistral")
    huge = sample_tokens(engine, "huge-k", SamplingParams(temperature=1.0, top_k=2**40, seed=5, max_tokens=6,
                                                          ignore_eos=True))[0]
    free = sample_tokens(engine, "no-k", SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))[0]
    assert huge.token_ids == free.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "prompt is empty"),
    ("", SamplingParams(), "prompt is empty"),
    ([1, 2, 100000], SamplingParams(), r"prompt_token_ids contains \[100000\] outside the vocabulary \[0, 331\)"),
    ([-1], SamplingParams(), "prompt_token_ids.*outside the vocabulary"),
    (list(range(3, 3)) + [5] * 512, SamplingParams(), "max_model_len=512"),
    ([5], SamplingParams(stop_token_ids=[999]), "stop_token_ids.*outside the vocabulary"),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(engines, prompt, params, match):
    engine = engines("mistral")
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    ok = sample_tokens(engine, "after-bad", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(ok[0].token_ids) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_past_the_context_stops_at_max_model_len(engines):
    """As vLLM: prompt + max_tokens beyond max_model_len is not refused; the output stops at the context's end."""
    engine = engines("mistral")
    out = sample_tokens(engine, "past-context", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        prompt=[5] * 500)[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(engines):
    """As vLLM: k keeps the last k prompt tokens; -1 the most that leaves room to generate (max_model_len - 1);
    a k above max_model_len is refused."""
    engine = engines("mistral")  # max_model_len 512
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = random_prompts(300, [40], seed=11)[0]
    cut = run_to_completion(engine, [("cut", prompt, SamplingParams(truncate_prompt_tokens=9, **greedy))])["cut"]
    tail = run_to_completion(engine, [("tail", prompt[-9:], SamplingParams(**greedy))])["tail"]
    assert cut.prompt_token_ids == prompt[-9:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    short = run_to_completion(engine, [("short", prompt[:5], SamplingParams(truncate_prompt_tokens=9, **greedy))])
    assert short["short"].prompt_token_ids == prompt[:5]  # shorter than k: kept whole
    long_prompt = random_prompts(300, [600], seed=12)[0]
    whole = run_to_completion(engine, [("whole", long_prompt, SamplingParams(truncate_prompt_tokens=-1, **greedy))])
    assert whole["whole"].prompt_token_ids == long_prompt[-511:] and len(whole["whole"].outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens=513 is greater than max_model_len=512"):
        engine.add_request("too-far", prompt, SamplingParams(truncate_prompt_tokens=513))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_duplicate_request_id_is_refused(engines):
    engine = engines("mistral")
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    run_to_completion(engine, [])


def test_detokenizer_never_splits_multibyte_characters(engines):
    tokenizer = engines("mistral").tokenizer
    text = "naïve café → 日本語 ok 🙂!"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [5, 6])
    pieces = [detok.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text


def test_detokenizer_fast_path_is_transformers_decode(engines):
    """The backend's own decode (taken where transformers' decode is exactly that call) gives the text that
    transformers' decode gives, with and without special tokens; a tokenizer that cleans up spaces keeps the
    transformers path."""
    import copy

    from jaxengine.engine.detokenizer import _backend_decoder

    tokenizer = engines("mistral").tokenizer
    assert _backend_decoder(tokenizer) is not None
    rng = np.random.default_rng(0)
    special = sorted(tokenizer.all_special_ids)
    for skip in (True, False):
        ids = [int(t) for t in rng.integers(0, tokenizer.vocab_size, 60)] + special + [int(rng.integers(100))]
        fast = IncrementalDetokenizer(tokenizer, [5, 6], skip_special_tokens=skip)
        slow = IncrementalDetokenizer(tokenizer, [5, 6], skip_special_tokens=skip)
        slow._backend = None
        assert [fast.add(t) for t in ids] == [slow.add(t) for t in ids]
        fast.flush(), slow.flush()
        assert fast.text == slow.text
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert _backend_decoder(cleaning) is None


@pytest.fixture(scope="module")
def llm(engines):
    api = LLM.__new__(LLM)  # the LLM API over the shared test engine (no second warm-up)
    api.engine = engines("qwen2")
    import itertools

    api._ids = itertools.count()
    return api


def test_llm_generate_returns_outputs_in_input_order(llm):
    prompts = ["def f(x):", "import json", [5, 6, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["def f(x):", "import json", None]
    assert outs[2].prompt_token_ids == [5, 6, 7]
    tokenizer = llm.get_tokenizer()
    for o in outs:
        assert o.finished and len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    single = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_llm_generate_validates_every_prompt_before_scheduling_any(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_llm_generate_truncates_before_it_checks_the_length(llm):
    """A prompt past max_model_len passes with truncate_prompt_tokens; RequestOutput.prompt keeps the text given."""
    text = "import json " * 400
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate(text, SamplingParams(max_tokens=2, truncate_prompt_tokens=16), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == llm.get_tokenizer().encode(text)[-16:]
    assert not llm.engine.has_unfinished_requests()


def test_llm_chat_applies_the_chat_template(llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == 4
    # Text parts are joined, as the server does; continue_final_message leaves off the generation prompt.
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    joined = llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert joined.prompt_token_ids == llm.chat([messages[1]], SamplingParams(max_tokens=1), use_tqdm=False)[0] \
        .prompt_token_ids
    reply = messages + [{"role": "assistant", "content": "Hello"}]
    continued = llm.chat(reply, SamplingParams(max_tokens=1), use_tqdm=False, continue_final_message=True)[0]
    assert llm.get_tokenizer().decode(continued.prompt_token_ids).endswith("Hello")


def test_llm_chat_renders_tools_in_the_template(llm):
    template = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=template, tools=tools)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "get_weather;hi"


@pytest.mark.parametrize("messages", [
    "hi", None, 5, [[]], [{"content": "no role"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],  # not dropped silently
])
def test_llm_chat_refuses_what_it_cannot_template(llm, messages):
    with pytest.raises(ValueError, match="messages"):
        llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="messages: could not apply the chat template"):
        llm.chat([{"role": "user", "content": "x"}], use_tqdm=False, chat_template_kwargs={"tokenize": False})
    assert not llm.engine.has_unfinished_requests()
