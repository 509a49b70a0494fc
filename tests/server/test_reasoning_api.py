"""Chat answers split into `reasoning` and `content` by the server's reasoning parser (vLLM's --reasoning-parser),
unstreamed and streamed, with tool calls in the answer. The tiny model's output is random, so its text is
replaced by a fixed one (tests.server.test_tool_calls.ScriptedText)."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxengine.reasoning import ReasoningParser
from server.app import build_app
from tests.server.conftest import MODEL, LiveServer
from tests.server.test_errors_and_ops import _CHAT_FIELDS, _bodies, assert_no_5xx_and_healthy
from tests.server.test_tool_calls import CALLS, TOOLS, ScriptedText

THOUGHT = "The user wants 2 + 2. That is 4."
SCRIPT = f"<think>{THOUGHT}</think>\n\nIt is 4."
# GPT-OSS's harmony output (its text with special tokens kept): analysis, then the final answer or a call
HARMONY = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
HARMONY_CALL = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "C"}')


class Reasoning:
    """The scripted engine as one started with --reasoning-parser `name`."""

    def __init__(self, scripted, name):
        self.inner = scripted
        self.engine = _EngineWith(scripted.engine, ReasoningParser.of(name, scripted.engine.tokenizer))

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class _EngineWith:
    def __init__(self, engine, reasoning):
        self.inner, self.reasoning = engine, reasoning

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


@pytest.fixture(scope="module")
def servers(async_engine):
    made = {name: LiveServer(build_app(Reasoning(ScriptedText(async_engine, script), parser), MODEL,
                                       tool_call_parser=tools))
            for name, script, parser, tools in (("r1", SCRIPT, "deepseek_r1", None),
                                                ("qwen3", "<think>Weather first.</think>\n" + CALLS, "qwen3", "hermes"),
                                                ("unclosed", "<think>Still going", "qwen3", None),
                                                ("no-thinking", "It is 4.", "qwen3", None),
                                                ("deepseek-v3", "Let me see.</think>It is 4.", "deepseek_v3", None),
                                                ("gptoss", HARMONY, "openai_gptoss", None),
                                                ("gptoss-tools", HARMONY_CALL, "openai_gptoss", "openai"))}
    yield made
    for server in made.values():
        server.stop()


def chat(server, stream=False, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 16,
            "ignore_eos": True, "stream": stream} | body
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]
    deltas = [json.loads(line[6:])["choices"] for line in response.text.splitlines()
              if line.startswith("data: {")]
    return [c for choices in deltas for c in choices]


def gathered(chunks) -> tuple[str, str, list, str]:
    deltas = [c["delta"] for c in chunks]
    calls = {}
    for t in (t for d in deltas for t in d.get("tool_calls") or []):  # joined by index, as clients join them
        call = calls.setdefault(t["index"], {"function": {"name": t["function"].get("name"), "arguments": ""}})
        call["function"]["arguments"] += t["function"].get("arguments") or ""
    calls = list(calls.values())
    return ("".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            calls, chunks[-1]["finish_reason"])


def test_reasoning_and_answer_come_apart(servers):
    message = chat(servers["r1"])["message"]
    assert message["reasoning"] == THOUGHT and message["content"] == "\n\nIt is 4."
    reasoning, content, calls, finish = gathered(chat(servers["r1"], stream=True))
    assert (reasoning, content, calls, finish) == (THOUGHT, "\n\nIt is 4.", [], "length")


def test_include_reasoning_false_leaves_it_out(servers):
    message = chat(servers["r1"], include_reasoning=False)["message"]
    assert "reasoning" not in message and message["content"] == "\n\nIt is 4."
    chunks = chat(servers["r1"], stream=True, include_reasoning=False)
    assert not any("reasoning" in c["delta"] for c in chunks) and gathered(chunks)[1] == "\n\nIt is 4."


def reasoning_and_calls(server, stream: bool) -> tuple[str, str, list, str]:
    """(reasoning, content, calls, finish reason) of a chat with TOOLS, unstreamed or gathered from its stream."""
    got = chat(server, stream=stream, tools=TOOLS, max_tokens=24)
    if stream:
        return gathered(got)
    message = got["message"]
    return message["reasoning"], message["content"], message["tool_calls"], got["finish_reason"]


def test_tool_calls_in_the_answer_after_the_reasoning(servers):
    for stream in (False, True):
        reasoning, content, calls, finish = reasoning_and_calls(servers["qwen3"], stream)
        assert reasoning == "Weather first." and (content or "").strip() == "" and finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]


def test_unclosed_reasoning_and_thinking_turned_off(servers):
    message = chat(servers["unclosed"])["message"]
    assert message["reasoning"] == "Still going" and message["content"] is None
    assert gathered(chat(servers["unclosed"], stream=True))[:2] == ("Still going", "")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(servers["no-thinking"], **off)["message"]
    assert "reasoning" not in message and message["content"] == "It is 4."
    assert gathered(chat(servers["no-thinking"], stream=True, **off))[:2] == ("", "It is 4.")


def test_deepseek_v3_reasons_only_where_thinking_is_asked(servers):
    """`deepseek_v3` (DeepSeek V3.1): with `chat_template_kwargs: {"thinking": true}` the output is reasoning up to
    </think>; without, all answer (its template thinks only where asked)."""
    on = {"chat_template_kwargs": {"thinking": True}}
    message = chat(servers["deepseek-v3"], **on)["message"]
    assert (message["reasoning"], message["content"]) == ("Let me see.", "It is 4.")
    assert gathered(chat(servers["deepseek-v3"], stream=True, **on))[:2] == ("Let me see.", "It is 4.")
    message = chat(servers["deepseek-v3"])["message"]
    assert "reasoning" not in message and message["content"] == "Let me see.</think>It is 4."


def test_an_assistant_turn_with_reasoning_reaches_the_template(servers):
    """An earlier turn's reasoning (`reasoning`, or `reasoning_content` as DeepSeek's API and older vLLM name it)
    goes to the template under both names, and as `thinking` (GPT-OSS's template's); on another role it is
    refused."""
    from server.protocol import ChatMessage
    from server.serving import _template_message

    for field in ("reasoning", "reasoning_content"):
        message = _template_message(ChatMessage(role="assistant", content="4", **{field: "2 + 2"}))
        assert message["reasoning"] == message["reasoning_content"] == message["thinking"] == "2 + 2"
    response = httpx.post(servers["r1"].url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi", "reasoning": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "reasoning is an assistant message's field" in response.json()["error"]["message"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies(_CHAT_FIELDS, {"messages": [{"role": "user", "content": "fuzz"}]}),
       stream=st.booleans())
def test_fuzzed_chat_bodies_with_a_reasoning_parser_never_cause_5xx(servers, body, stream):
    """The fuzzer of tests/server/test_errors_and_ops.py against the qwen3 reasoning server with tool calls."""
    assert_no_5xx_and_healthy(servers["qwen3"], "/v1/chat/completions", body | {"stream": stream})


def test_gpt_oss_harmony_reasoning_answer_and_calls(servers):
    """--reasoning-parser openai_gptoss: the analysis channel is the reasoning, the final channel the answer; with
    --tool-call-parser openai a message to functions.NAME is a call (finish reason tool_calls), unstreamed and
    streamed (its header first, then its arguments in pieces)."""
    message = chat(servers["gptoss"])["message"]
    assert message["reasoning"] == THOUGHT and message["content"] == "It is 4."
    assert gathered(chat(servers["gptoss"], stream=True)) == (THOUGHT, "It is 4.", [], "length")
    for stream in (False, True):
        reasoning, content, calls, finish = reasoning_and_calls(servers["gptoss-tools"], stream)
        assert reasoning == THOUGHT and not content and finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "C"})]
    chunks = chat(servers["gptoss-tools"], stream=True, tools=TOOLS, max_tokens=24)
    pieces = [t for c in chunks for t in c["delta"].get("tool_calls") or []]  # the header, then the arguments
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"] and pieces[0]["index"] == 0
    assert sum(bool(t["function"].get("arguments")) for t in pieces) > 1


def test_gpt_oss_chat_keeps_the_special_tokens_its_parser_reads(async_engine):
    """The harmony parser reads special tokens, so chat requests keep them in their text (skip_special_tokens is
    set false, as vLLM's harmony path decodes): a model pushed to write <|channel|> over and over (a header that
    never reaches its <|message|>) answers with that text as it stands."""
    server = LiveServer(build_app(Reasoning(async_engine, "openai_gptoss"), MODEL))
    try:
        channel = async_engine.engine.tokenizer.convert_tokens_to_ids("<|channel|>")
        message = chat(server, max_tokens=3, logit_bias={str(channel): 100})["message"]
        assert message["content"] == "<|channel|>" * 3 and "reasoning" in message and not message["reasoning"]
    finally:
        server.stop()
