"""Logprobs against transformers, min-p, and stop strings that span token boundaries."""

import numpy as np
import pytest
import torch
import transformers

from jaxengine import SamplingParams
from tests.engine_util import run_to_completion

PROMPT = [5, 17, 42, 99, 100, 7, 8, 9]


def only(engine, tag, params, prompt=PROMPT):
    return run_to_completion(engine, [(tag, prompt, params)])[tag].outputs[0]


def test_logprobs_match_transformers_log_softmax(engines, model_dirs):
    engine = engines("llama")
    out = only(engine, "lp", SamplingParams(temperature=0.7, seed=4, max_tokens=8, ignore_eos=True, logprobs=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits, -1).numpy()[len(PROMPT) - 1:-1]  # raw distribution at each generated step
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        want_top = np.argsort(-ref[step])[:5]
        top = [t for t, lp in entry.items() if lp.rank <= 5 and t in want_top]
        assert len(top) == 5 and all(entry[t].rank == r + 1 for r, t in enumerate(want_top))
        for t in want_top:
            assert abs(entry[t].logprob - ref[step, t]) < 1e-4
        assert abs(entry[token].logprob - ref[step, token]) < 1e-4
        assert entry[token].rank == 1 + int((ref[step] > ref[step, token]).sum())
        total += ref[step, token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_logprobs_above_the_limit_are_refused(engines):
    with pytest.raises(ValueError, match="logprobs=21 exceeds max_logprobs=20"):
        engines("llama").add_request("too-many", PROMPT, SamplingParams(logprobs=21))


def test_min_p_one_keeps_only_the_most_likely_token(engines):
    engine = engines("qwen3")
    greedy = only(engine, "g", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    min_p = only(engine, "mp", SamplingParams(temperature=1.0, min_p=1.0, seed=1, max_tokens=12, ignore_eos=True))
    assert min_p.token_ids == greedy.token_ids


def test_min_p_only_samples_tokens_above_the_threshold(engines):
    engine = engines("qwen3")
    out = only(engine, "mp2", SamplingParams(temperature=1.0, min_p=0.3, seed=2, max_tokens=30, ignore_eos=True,
                                             logprobs=1))
    for token, entry in zip(out.token_ids, out.logprobs):
        best = max(lp.logprob for lp in entry.values())
        assert entry[token].logprob >= best + np.log(0.3) - 1e-5


def spanning_stop_string(engine, text, token_ids):
    """Two characters around a token boundary, chosen where that is their first occurrence in the text."""
    for i in range(2, len(token_ids)):
        boundary = len(engine.tokenizer.decode(token_ids[:i]))
        stop = text[boundary - 1: boundary + 1]
        if len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == boundary - 1:
            return stop
    pytest.skip("no token boundary with a unique two-character string in the greedy output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary_cuts_the_text(engines, include):
    engine = engines("mistral")
    free = only(engine, f"free-{include}", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop = spanning_stop_string(engine, free.text, free.token_ids)
    out = only(engine, f"stop-{include}", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                         include_stop_str_in_output=include))
    cut = free.text.index(stop)
    assert out.text == free.text[: cut + (len(stop) if include else 0)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(free.token_ids)


def test_delta_outputs_concatenate_to_the_final_text(engines):
    from jaxengine import RequestOutputKind

    engine = engines("mistral")
    free = only(engine, "free-delta", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = spanning_stop_string(engine, free.text, free.token_ids)
    engine.add_request("delta", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                       output_kind=RequestOutputKind.DELTA))
    texts, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            tokens += out.outputs[0].token_ids
    assert "".join(texts) == free.text[: free.text.index(stop)]
    assert tokens == free.token_ids[: len(tokens)]
    assert all(stop not in t for t in texts)


def greedy_run(engine, tag, **kwargs):
    return only(engine, tag, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kwargs))


def test_min_tokens_suppresses_stop_tokens_until_reached(engines):
    engine = engines("mistral")
    free = greedy_run(engine, "mt-free")
    stop_id = free.token_ids[1]
    early = greedy_run(engine, "mt-early", stop_token_ids=[stop_id])
    assert len(early.token_ids) == 2 and early.finish_reason == "stop"
    held = greedy_run(engine, "mt-held", stop_token_ids=[stop_id], min_tokens=6)
    assert stop_id not in held.token_ids[:6]
    assert len(held.token_ids) >= 6


def test_bad_words_never_appear(engines):
    engine = engines("mistral")
    free = greedy_run(engine, "bw-free")
    tok = engine.tokenizer
    word_ids = next(t for t in free.token_ids if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    out = greedy_run(engine, "bw", bad_words=[tok.decode([word_ids])])
    assert word_ids not in out.token_ids


def test_logit_bias_shifts_the_logits(engines):
    engine = engines("qwen2")
    free = greedy_run(engine, "lb-free")
    pushed_down = greedy_run(engine, "lb-down", logit_bias={free.token_ids[0]: -100})
    assert pushed_down.token_ids[0] != free.token_ids[0]
    forced = greedy_run(engine, "lb-up", logit_bias={7: 250})  # clamped to 100, still dominant
    assert forced.token_ids == [7] * 12


def test_a_sampling_row_keeps_nothing_of_its_previous_sequence(engines):
    """The runner rewrites a row's per-sequence inputs when the row changes hands: an unbiased request that
    follows a forced one into the same row decodes as it does alone."""
    engine = engines("qwen2")
    free = greedy_run(engine, "row-free")
    assert greedy_run(engine, "row-forced", logit_bias={7: 250}).token_ids == [7] * 12
    assert greedy_run(engine, "row-after").token_ids == free.token_ids
    held = greedy_run(engine, "row-held", stop_token_ids=[free.token_ids[1]], min_tokens=6)
    assert free.token_ids[1] not in held.token_ids[:6]
    assert greedy_run(engine, "row-after-ban").token_ids == free.token_ids


def test_logit_bias_outside_the_vocabulary_is_refused(engines):
    with pytest.raises(ValueError, match=r"logit_bias contains \[999\] outside the vocabulary"):
        engines("qwen2").add_request("lb-bad", PROMPT, SamplingParams(logit_bias={999: 1.0}))


def test_prompt_logprobs_match_transformers_across_prefill_chunks(engines, model_dirs):
    engine = engines("llama", max_num_batched_tokens=32, num_kv_blocks=30)  # a 70-token prompt takes 3 chunks
    prompt = list(np.random.default_rng(9).integers(3, engine.model_config.vocab_size, 70))
    out = run_to_completion(engine, [("plp", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))])
    result = out["plp"].prompt_logprobs
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    assert len(result) == len(prompt) and result[0] is None
    for p in range(1, len(prompt)):
        entry, token = result[p], prompt[p]
        assert abs(entry[token].logprob - ref[p - 1, token]) < 1e-4
        assert entry[token].rank == 1 + int((ref[p - 1] > ref[p - 1, token]).sum())
        top = sorted((t for t in entry if entry[t].rank <= 3), key=lambda t: entry[t].rank)
        assert top == list(np.argsort(-ref[p - 1])[:3])


def test_skip_special_tokens_controls_their_text(engines):
    engine = engines("mistral")
    special = engine.tokenizer.convert_tokens_to_ids("<|user|>")
    common = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={special: 100})
    shown = only(engine, "special-shown", SamplingParams(skip_special_tokens=False, **common))
    hidden = only(engine, "special-hidden", SamplingParams(**common))
    assert shown.token_ids == hidden.token_ids == [special] * 3
    assert shown.text == "<|user|>" * 3
    assert hidden.text == ""


def test_detokenize_off_gives_the_same_tokens_without_text(engines):
    """SamplingParams(detokenize=False), as vLLM's: the same token ids and log probabilities, no text."""
    engine = engines("llama")
    params = dict(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with_text = run_to_completion(engine, [("text", PROMPT, SamplingParams(**params))])["text"]
    ids_only = run_to_completion(engine, [("ids", PROMPT, SamplingParams(**params, detokenize=False))])["ids"]
    a, b = with_text.outputs[0], ids_only.outputs[0]
    assert a.text and b.text == "" and b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    assert [{t: lp.logprob for t, lp in e.items()} for e in b.logprobs] == \
        [{t: lp.logprob for t, lp in e.items()} for e in a.logprobs]
    assert all(lp.decoded_token is None for e in b.logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in ids_only.prompt_logprobs[1:] for lp in e.values())
    assert all(lp.decoded_token is not None for e in a.logprobs for lp in e.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)  # stop strings are matched in the text
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")
    SamplingParams(stop_token_ids=[5], detokenize=False)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_adds_its_text_only_when_included(engines, include):
    """As vLLM's: the token that stops a sequence (a stop_token_id here; EOS alike) stays in token_ids, and its text
    joins the output only with include_stop_str_in_output."""
    engine = engines("llama")
    tok = engine.tokenizer
    prompt = [5, 9, 33, 7, 100]
    free = run_to_completion(engine, [("free", prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                      ignore_eos=True))])["free"].outputs[0]
    stop = next(t for t in free.token_ids if tok.decode([t]).strip())  # a token with visible text
    out = run_to_completion(engine, [("stopped", prompt, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
        include_stop_str_in_output=include))])["stopped"].outputs[0]
    assert out.token_ids[-1] == stop and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == tok.decode(out.token_ids if include else out.token_ids[:-1])
