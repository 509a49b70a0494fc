"""Structured outputs: every output of a constrained request is in its language (JSON schema, regex, choice,
Lark grammar, any JSON object), whatever the model (a random one here) prefers, through sampling, n > 1,
preemption and async scheduling; specs that cannot compile are refused naming the field."""

import json
import re

import pytest

from jaxengine import SamplingParams, StructuredOutputsParams
from tests.engine_util import random_prompts, run_to_completion

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "score"], "additionalProperties": False}


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no")
    assert isinstance(value["score"], int) and 0 <= value["score"] <= 99


CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), check_schema),
    "json-text": (StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True), check_schema),
    "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or pytest.fail(t)),
    "choice": (StructuredOutputsParams(choice=["red", "green", "blue sky"]),
               lambda t: t in ("red", "green", "blue sky") or pytest.fail(t)),
    "grammar": (StructuredOutputsParams(grammar='start: "(" NUM ("," NUM)~0..3 ")"\nNUM: /[1-9][0-9]?/'),
                lambda t: re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?){0,3}\)", t) or pytest.fail(t)),
}


@pytest.mark.parametrize("case", CASES)
def test_sampled_outputs_are_in_the_language(case, engines):
    spec, check = CASES[case]
    engine = engines("qwen2")
    prompts = random_prompts(engine.model_config.vocab_size, (5, 23, 40), seed=3)
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=64, structured_outputs=spec)
    finals = run_to_completion(engine, [(f"{case}-{i}", p, params) for i, p in enumerate(prompts)])
    for out in finals.values():
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            check(c.text)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_greedy_json_object_with_the_closing_brace_favoured_is_an_empty_object(engines):
    engine = engines("qwen2")
    brace = engine.tokenizer.encode("}", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=32, logit_bias={brace[0]: 100},
                            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    out = run_to_completion(engine, [("object", [5, 6, 7], params)])["object"].outputs[0]
    assert json.loads(out.text) == {} and out.finish_reason == "stop"


def test_the_grammar_ends_the_sequence_even_under_ignore_eos(engines):
    engine = engines("qwen2")
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=40, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = run_to_completion(engine, [("ends", [9, 10, 11], params)])["ends"].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop" and len(out.token_ids) < 40


def test_constrained_sequences_survive_preemption(engines):
    """Six requests of two sequences each on a pool that cannot hold them all: preempted sequences are
    recomputed, their grammar state kept (their tokens are), and every output still parses."""
    engine = engines("qwen2", max_num_batched_tokens=32, num_kv_blocks=12)
    before = engine.scheduler.num_preemptions
    spec = StructuredOutputsParams(json=SCHEMA)  # with whitespace: long outputs, to fill the pool
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=120, structured_outputs=spec)
    prompts = random_prompts(engine.model_config.vocab_size, (30, 41, 25, 33, 28, 36), seed=8)
    finals = run_to_completion(engine, [(f"pre-{i}", p, params) for i, p in enumerate(prompts)])
    for out in finals.values():
        for c in out.outputs:
            if c.finish_reason == "stop":
                check_schema(c.text)
            else:  # the token limit cut it: what there is is a prefix the grammar allowed
                assert c.finish_reason == "length" and c.text.lstrip().startswith("{")
    assert engine.scheduler.num_preemptions > before
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("spec,message", [
    (dict(regex="[a-"), "structured_outputs.regex is not valid"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json is not valid"),
    (dict(json="{not json"), "structured_outputs.json is not valid"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar is not valid"),
])
def test_specs_that_do_not_compile_are_refused_naming_the_field(engines, spec, message):
    engine = engines("qwen2")
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad-spec", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("fields,message", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "non-empty list"), ({"choice": ["a", ""]}, "non-empty strings"),
    ({"json": 5}, "structured_outputs.json must be"),
])
def test_malformed_structured_outputs_params_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_allowed_token_ids_with_a_grammar_is_refused(engines):
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined with structured_outputs"):
        engines("qwen2").add_request("both", [1, 2], SamplingParams(
            allowed_token_ids=[5], structured_outputs=StructuredOutputsParams(regex="a")))
