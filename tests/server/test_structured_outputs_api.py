"""Structured outputs over the API: a chat's response_format (json_object, json_schema) and vLLM's
structured_outputs field on both routes, streamed or not; specs that cannot compile are a 400 naming the field."""

import json
import re

import pytest

from tests.server.conftest import MODEL
from tests.test_structured_outputs import SCHEMA, check_schema

CHAT = [{"role": "user", "content": "Answer in JSON."}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


def no_whitespace(tokenizer) -> dict:
    """A logit bias against every whitespace-only token: the random model would otherwise fill the JSON's
    optional whitespace (response_format allows it, as vLLM's) up to the token limit."""
    return {str(t): -100 for t in range(len(tokenizer)) if (s := tokenizer.decode([t])) and not s.strip()}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, async_engine, stream):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=SCHEMA_FORMAT,
                                              max_tokens=120, temperature=1.0, seed=3, n=2, stream=stream,
                                              logit_bias=no_whitespace(async_engine.engine.tokenizer))
    if stream:
        texts = {}
        for chunk in response:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        assert sorted(texts) == [0, 1]
    else:
        texts = {c.index: c.message.content for c in response.choices}
        assert all(c.finish_reason == "stop" for c in response.choices)
    for text in texts.values():
        check_schema(text)


def test_chat_response_format_json_object(client, async_engine):
    brace = async_engine.engine.tokenizer.encode("}", add_special_tokens=False)[0]
    response = client.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "json_object"},
                                              max_tokens=40, temperature=0, logit_bias={str(brace): 100})
    assert json.loads(response.choices[0].message.content) == {}


@pytest.mark.parametrize("field,check", [
    ({"regex": "[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
    ({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: check_schema(t) is None),
])
def test_completions_take_vllm_structured_outputs(client, field, check):
    response = client.completions.create(model=MODEL, prompt="Say:", max_tokens=64, temperature=1.0, seed=5,
                                         extra_body={"structured_outputs": field})
    assert check(response.choices[0].text) and response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"whitespace_pattern": " "}}, None),  # vLLM's, not taken: refused
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
])
def test_specs_that_cannot_be_honoured_are_a_400(http, route, body, param):
    payload = {"model": MODEL, "max_tokens": 4} | body
    payload |= {"messages": CHAT} if route == "chat" else {"prompt": "x"}
    response = http.post(f"/v1/{route}/completions" if route == "chat" else "/v1/completions", json=payload)
    assert response.status_code == 400
    if param is not None:
        assert response.json()["error"]["param"] == param
