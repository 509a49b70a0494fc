"""Beam search (LLM.beam_search; the server's use_beam_search) against the same search over transformers' logits."""

import math

import numpy as np
import pytest
import torch
import transformers

from jaxengine import LLM, BeamSearchParams
from jaxengine.engine.beam_search import BeamSearch
from jaxengine.outputs import Logprob
from tests.engine_util import random_prompts


def _llm(engine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(10**9))
    return llm


def _reference(model, prompt, width, steps, length_penalty):
    """The search vLLM runs (2 x width candidates a beam, the best width go on), over transformers' float32
    log-softmax; EOS never ends a beam here (the test's model is random)."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        grown = []
        for tokens, score in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, -1).numpy()
            for t in np.argsort(-logprobs)[: 2 * width]:
                grown.append((tokens + [int(t)], score + float(logprobs[t])))
        beams = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    return sorted(beams, key=lambda b: b[1] / len(b[0]) ** length_penalty, reverse=True)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_matches_the_search_over_transformers(engines, model_dirs, length_penalty):
    engine = engines("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32).eval()
    prompts = random_prompts(engine.model_config.vocab_size, [7, 20], seed=8)
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=length_penalty)
    outputs = _llm(engine).beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        want = _reference(model, prompt, 3, 5, length_penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [w[1] for w in want], atol=1e-4)
        for seq in out.sequences:
            assert seq.finish_reason == "length" and len(seq.logprobs) == 5
            assert seq.text == engine.tokenizer.decode(seq.tokens, skip_special_tokens=True)  # as the default
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _entry(**logprobs):
    return {int(t[1:]): Logprob(lp, 0) for t, lp in logprobs.items()}


def test_eos_length_and_ranking():
    """EOS completes a candidate (kept only with include_stop_str_in_output), live beams end by length, and the
    final ranking divides by length ** length_penalty (EOS not counted)."""
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    search = BeamSearch([5, 6], params, eos_token_ids={2}, max_model_len=100)
    assert search.prompts() == [[5, 6]]
    search.advance([_entry(t2=-0.1, t7=-1.0, t8=-2.0)])  # EOS first: a complete beam [5, 6]
    assert [b.tokens for b in search.beams] == [[5, 6, 7], [5, 6, 8]]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in search.completed] == [([5, 6], "stop", 2)]
    search.advance([_entry(t9=-0.5), _entry(t9=-0.1)])
    search.advance([_entry(t4=-0.2), _entry(t4=-0.3)])
    assert search.done and search.prompts() == []
    out = search.result(lambda ids: ",".join(map(str, ids)), with_prompt=False).sequences
    # scores: [5, 6] -0.1 / 2 = -0.05; [5, 6, 7, 9, 4] -1.7 / 5; [5, 6, 8, 9, 4] -2.4 / 5
    assert [(s.tokens, s.text, s.finish_reason) for s in out] == [([5, 6], "", "stop"),
                                                                  ([5, 6, 7, 9, 4], "7,9,4", "length")]
    assert math.isclose(out[1].cum_logprob, -1.7)
    kept = BeamSearch([5], BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=True), {2}, 100)
    kept.advance([_entry(t2=-0.1, t3=-3.0)])
    assert kept.completed[0].tokens == [5, 2]
    full = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=1, max_tokens=5), {9}, max_model_len=4)
    full.advance([_entry(t4=-0.5)])
    assert full.prompts() == [] and full.completed[0].finish_reason == "length"  # [1, 2, 3, 4] fills the context


def test_refusals(engines):
    llm = _llm(engines("qwen2"))
    for bad, match in [(dict(beam_width=0, max_tokens=3), "beam_width must be in"),
                       (dict(beam_width=2, max_tokens=0), "max_tokens must be >= 1"),
                       (dict(beam_width=2, max_tokens=3, temperature=-1.0), "temperature must be >= 0"),
                       (dict(beam_width=2, max_tokens=3, ignore_eos=1), "ignore_eos must be true or false")]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="beam_width=11 needs 22 logprobs a step; max_logprobs is 20"):
        llm.beam_search(["hello"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(["hello"], {"beam_width": 2})
