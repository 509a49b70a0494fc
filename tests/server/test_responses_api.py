"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}): a response's output items and
usage against the chat route's answer to the same conversation, its streamed events against the unstreamed
response, conversations continued by previous_response_id, reasoning and tool calls (scripted text, as in the chat
tests), and what is refused. Bodies are checked against the OpenAI client's own types."""

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from server.app import build_app
from server.protocol import ResponsesRequest
from server.responses import input_messages
from server.serving import Serving
from tests.server.conftest import MODEL, LiveServer, wait_until_idle
from tests.server.test_errors_and_ops import _values, assert_no_5xx_and_healthy
from tests.server.test_reasoning_api import HARMONY, HARMONY_CALL, SCRIPT, THOUGHT, Reasoning
from tests.server.test_structured_outputs_api import no_whitespace
from tests.server.test_tool_calls import ARGUMENTS, BOUNDED_TOOLS, CALLS, TEMPLATE, TOOLS, ScriptedText

GREEDY = {"temperature": 0, "max_output_tokens": 8, "ignore_eos": True}
EVENTS = TypeAdapter(ResponseStreamEvent)
# TOOLS in the Responses API's flat form
FLAT_TOOLS = [{"type": "function"} | t["function"] for t in TOOLS]


def create(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/responses", json={"model": MODEL} | GREEDY | body, timeout=60)
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())  # every field the client's type requires, of its type
    return response.json()


def stream(server, **body) -> list[dict]:
    """The events of a streamed response, each checked against the client's event types, in order."""
    response = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "stream": True} | GREEDY | body,
                          timeout=60)
    assert response.status_code == 200, response.text
    lines = response.text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [line[7:] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)
    return events


def refused(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi"} | body, timeout=60)
    assert response.status_code in (400, 404), response.text
    return response.json()["error"]


def chat(server, messages, **body) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 8, "ignore_eos": True} | body
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def texts(response: dict) -> list[tuple]:
    """The output items as (type, their text, or a call's name and arguments)."""
    out = []
    for item in response["output"]:
        if item["type"] == "function_call":
            out.append((item["type"], item["name"], json.loads(item["arguments"])))
        else:
            out.append((item["type"], "".join(p["text"] for p in item["content"])))
    return out


def streamed_response(events: list[dict]) -> dict:
    """The last event's response, after checking that the items it holds are the ones the events built."""
    items = {}
    for e in events:
        if e["type"] == "response.output_item.added":  # as the item stood then: empty, in progress
            assert e["item"]["status"] == "in_progress" and e["item"].get("arguments", "") == ""
            assert all(part["text"] == "" for part in e["item"].get("content", []))
            items[e["output_index"]] = {"item": e["item"], "text": "", "arguments": ""}
        elif e["type"] == "response.content_part.added":
            assert e["part"]["text"] == ""
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            built = items[e["output_index"]]
            assert e["item"]["id"] == built["item"]["id"]
            if e["item"]["type"] == "function_call":
                assert e["item"]["arguments"] == built["arguments"]
            else:
                assert e["item"]["content"][0]["text"] == built["text"]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert kinds[-1] == f"response.{final['status']}" and [i["id"] for i in final["output"]] == [
        items[k]["item"]["id"] for k in sorted(items)]
    return final


def test_a_text_input_is_answered_as_chat_answers_it(live):
    chat_reply = chat(live, [{"role": "user", "content": "Hello there"}])
    response = create(live, input="Hello there")
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert texts(response) == [("message", chat_reply["choices"][0]["message"]["content"])]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete" and response["output"][0]["role"] == "assistant"
    usage = response["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (
        chat_reply["usage"]["prompt_tokens"], 8, chat_reply["usage"]["prompt_tokens"] + 8)
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0} and response["temperature"] == 0


def test_instructions_and_input_items_are_the_conversation(live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    chat_reply = chat(live, messages)
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again"}]}]
    response = create(live, instructions="Be brief.", input=items)
    assert response["usage"]["input_tokens"] == chat_reply["usage"]["prompt_tokens"]
    assert texts(response) == [("message", chat_reply["choices"][0]["message"]["content"])]
    assert response["instructions"] == "Be brief."


def test_streamed_events_build_the_unstreamed_response(live):
    whole = create(live, input="Stream this")
    events = stream(live, input="Stream this")
    final = streamed_response(events)
    assert texts(final) == texts(whole) and final["usage"] == whole["usage"] and final["status"] == "incomplete"
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    got = list(client.responses.create(model=MODEL, input="Stream this", stream=True, temperature=0,
                                       max_output_tokens=8, extra_body={"ignore_eos": True}))
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == texts(whole)[0][1]


def test_previous_response_id_continues_the_stored_conversation(live):
    first = create(live, input="Hi", instructions="Ignored next turn.")
    answer = texts(first)[0][1]
    second = create(live, input="And then?", previous_response_id=first["id"])
    chat_reply = chat(live, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
                             {"role": "user", "content": "And then?"}])
    assert second["usage"]["input_tokens"] == chat_reply["usage"]["prompt_tokens"]
    assert texts(second) == [("message", chat_reply["choices"][0]["message"]["content"])]
    assert second["previous_response_id"] == first["id"]
    got = httpx.get(f"{live.url}/v1/responses/{first['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == first
    assert httpx.delete(f"{live.url}/v1/responses/{first['id']}", timeout=10).json()["deleted"] is True
    assert httpx.get(f"{live.url}/v1/responses/{first['id']}", timeout=10).status_code == 404
    error = refused(live, previous_response_id=first["id"])
    assert error["param"] == "previous_response_id" and error["code"] == "not_found"
    unstored = create(live, input="Hi", store=False)
    assert unstored["store"] is False
    assert httpx.get(f"{live.url}/v1/responses/{unstored['id']}", timeout=10).status_code == 404


def test_the_store_keeps_the_newest(async_engine):
    serving = Serving(async_engine, MODEL, responses_store_size=2)
    for name in ("a", "b", "c"):
        serving.response_store.put({"id": name}, [])
    with pytest.raises(Exception, match="not found"):
        serving.response_store.get("a")
    assert serving.response_store.get("c")[0] == {"id": "c"}
    server = LiveServer(build_app(async_engine, MODEL, responses_store_size=0))
    try:
        assert create(server, input="Hi")["store"] is False
        assert refused(server, store=True)["param"] == "store"
    finally:
        server.stop()
    with pytest.raises(ValueError, match="responses_store_size"):
        Serving(async_engine, MODEL, responses_store_size=-1)


def test_output_text_logprobs_are_the_chats(live):
    chat_reply = chat(live, [{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2)
    response = create(live, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = response["output"][0]["content"][0]["logprobs"]
    assert logprobs == chat_reply["choices"][0]["logprobs"]["content"] and len(logprobs) == 8
    assert all(len(lp["top_logprobs"]) == 2 for lp in logprobs)
    final = streamed_response(stream(live, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2))
    assert final["output"][0]["content"][0]["logprobs"] == logprobs


def test_text_format_holds_the_output_to_a_schema(live, async_engine):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    response = create(live, input="A number", max_output_tokens=40, ignore_eos=False,
                      logit_bias=no_whitespace(async_engine.engine.tokenizer),
                      text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    assert response["text"]["format"]["name"] == "number"
    value = json.loads(texts(response)[0][1])
    assert set(value) == {"n"} and value["n"] in (1, 2, 3)


@pytest.fixture(scope="module")
def scripted(async_engine):
    made = {name: LiveServer(build_app(engine, MODEL, chat_template=TEMPLATE, tool_call_parser=tools))
            for name, engine, tools in (
                ("r1", Reasoning(ScriptedText(async_engine, SCRIPT), "deepseek_r1"), None),
                ("gptoss", Reasoning(ScriptedText(async_engine, HARMONY), "openai_gptoss"), None),
                ("gptoss-tools", Reasoning(ScriptedText(async_engine, HARMONY_CALL), "openai_gptoss"), "openai"),
                ("calls", ScriptedText(async_engine, "Let me look that up.\n" + CALLS), "hermes"))}
    yield made
    for server in made.values():
        server.stop()


@pytest.mark.parametrize("name, answer", [("r1", "\n\nIt is 4."), ("gptoss", "It is 4.")])
def test_reasoning_comes_back_as_a_reasoning_item(scripted, name, answer):
    body = {"input": "2 + 2?", "max_output_tokens": 16}
    response = create(scripted[name], **body)
    assert texts(response) == [("reasoning", THOUGHT), ("message", answer)]
    usage = response["usage"]
    assert 0 <= usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"] == 16
    final = streamed_response(stream(scripted[name], **body))
    assert texts(final) == texts(response)
    error = refused(scripted[name], include=["message.output_text.logprobs"])
    assert error["param"] == "include" and "reasoning parser" in error["message"]


def test_reasoning_tokens_are_those_before_the_answer(async_engine):
    """Counted on real token ids: the tokens up to the reasoning's end tag."""
    serving = Serving(Reasoning(ScriptedText(async_engine, SCRIPT), "deepseek_r1"), MODEL)
    tok = serving.tokenizer
    thought = tok.encode(f"<think>{THOUGHT}</think>", add_special_tokens=False)
    answer = tok.encode("\n\nIt is 4.", add_special_tokens=False)
    request = serving._chat_of(ResponsesRequest(input="x"), input_messages("x"))
    assert serving._reasoning_tokens(thought + answer, request) == len(thought)
    assert serving._reasoning_tokens(thought[:-1], request) == len(thought) - 1  # never ended: all reasoning


def test_calls_come_back_as_function_call_items_and_their_outputs_continue(scripted, async_engine):
    body = {"input": "Weather and time in Paris?", "tools": FLAT_TOOLS, "max_output_tokens": 24}
    response = create(scripted["calls"], **body)
    assert texts(response) == [("message", "Let me look that up.\n"),
                               ("function_call", "get_weather", {"city": "Paris", "unit": "C"}),
                               ("function_call", "get_time", {"zone": "CET"})]
    assert response["tools"] == FLAT_TOOLS and response["tool_choice"] == "auto"
    events = stream(scripted["calls"], **body)
    assert texts(streamed_response(events)) == texts(response)
    assert any(e["type"] == "response.function_call_arguments.delta" for e in events)
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "sunny" if i == 0 else "noon"}
               for i, c in enumerate(calls)]
    continued = create(scripted["calls"], previous_response_id=response["id"], input=outputs, tools=FLAT_TOOLS)
    # the same conversation written out as chat messages reaches the template as the same prompt
    messages = [{"role": "user", "content": "Weather and time in Paris?"},
                {"role": "assistant", "content": "Let me look that up.\n",
                 "tool_calls": [{"id": c["call_id"], "type": "function",
                                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]},
                {"role": "tool", "tool_call_id": calls[0]["call_id"], "content": "sunny"},
                {"role": "tool", "tool_call_id": calls[1]["call_id"], "content": "noon"}]
    tokens = httpx.post(scripted["calls"].url + "/tokenize", timeout=30,
                        json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()["count"]
    assert continued["usage"]["input_tokens"] == tokens
    items = [{"role": "user", "content": "Weather and time in Paris?"}] + [
        {k: v for k, v in i.items() if k != "status"} for i in response["output"]] + outputs
    assert create(scripted["calls"], input=items, tools=FLAT_TOOLS)["usage"]["input_tokens"] == tokens


def test_harmony_calls_and_the_reasoning_before_them(scripted):
    response = create(scripted["gptoss-tools"], input="Weather?", tools=FLAT_TOOLS, max_output_tokens=24)
    assert texts(response) == [("reasoning", THOUGHT),
                               ("function_call", "get_weather", {"city": "Paris", "unit": "C"})]
    assert texts(streamed_response(stream(scripted["gptoss-tools"], input="Weather?", tools=FLAT_TOOLS,
                                          max_output_tokens=24))) == texts(response)


@pytest.mark.parametrize("body, param, message", [
    ({"background": True}, "background", "background mode"),
    ({"truncation": "auto"}, "truncation", "no input item is ever dropped"),
    ({"max_tool_calls": 2}, "max_tool_calls", "no tools of its own"),
    ({"max_tool_calls": 0}, "max_tool_calls", "no tools of its own"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning", "no reasoning summaries"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not available"),
    ({"top_logprobs": 2}, "top_logprobs", "needs include"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' tools are not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].name"),
    ({"tool_choice": {"type": "file_search"}, "tools": FLAT_TOOLS}, "tool_choice", "tool_choice must be"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image' content is not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' items are not supported"),
    ({"input": [{"role": "user", "content": "hi", "name": "x"}]}, "input", "has no field 'name'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "input[0].call_id"),
    ({"input": "word " * 4000}, "input", ""),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs its schema"),
    ({"prompt": {"id": "p"}}, "prompt", ""),
    ({"model": "other"}, "model", "does not exist"),
])
def test_what_cannot_be_honoured_is_refused(live, async_engine, body, param, message):
    error = refused(live, **body)
    assert error["param"] == param and message in error["message"], error
    wait_until_idle(async_engine.engine)


def test_a_stream_left_early_frees_its_blocks(live, async_engine):
    with httpx.stream("POST", live.url + "/v1/responses", timeout=60,
                      json={"model": MODEL, "input": "Go on", "stream": True, "max_output_tokens": 48,
                            "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if "response.output_text.delta" in line:
                break
    wait_until_idle(async_engine.engine)


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_time"}, "required"])
def test_a_forced_tool_choice_calls_a_tool_with_arguments_of_its_schema(live, async_engine, choice):
    """tool_choice naming a function, or required, holds the real model's output to calls (structured outputs),
    through the OpenAI client's own Responses types."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function"} | t["function"] for t in BOUNDED_TOOLS]
    response = client.responses.create(
        model=MODEL, input="Weather and time in Paris?", tools=tools, tool_choice=choice, parallel_tool_calls=False,
        max_output_tokens=80, temperature=1.0, extra_body={"seed": 6, "logit_bias": no_whitespace(
            async_engine.engine.tokenizer)})
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    assert calls[0].name == "get_time" or choice == "required"
    assert json.loads(calls[0].arguments) in ARGUMENTS[calls[0].name]


_ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "input_image", "x"]),
    "role": st.sampled_from(["user", "assistant", "system", "tool", 3]), "content": _values | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "reasoning_text", "input_image"]),
                               "text": _values}), max_size=2),
    "call_id": _values, "name": _values, "arguments": _values, "output": _values, "summary": _values})
_FIELDS = {"input": st.one_of(_values, st.lists(_ITEM, max_size=3)), "instructions": _values,
           "max_output_tokens": st.integers(-1, 4), "tools": _values | st.lists(_values, max_size=2),
           "tool_choice": _values, "text": _values, "reasoning": _values, "include": _values, "top_logprobs": _values,
           "previous_response_id": _values, "stream": st.booleans(), "store": _values, "truncation": _values,
           "metadata": _values, "temperature": _values, "parallel_tool_calls": _values, "unknown": _values}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({}, optional=_FIELDS))
def test_fuzzed_responses_bodies_never_cause_5xx(live, body):
    assert_no_5xx_and_healthy(live, "/v1/responses", {"model": MODEL, "input": "fuzz", "max_output_tokens": 4} | body)
