"""Tool calls: tools rendered by the chat template, calls parsed from the output (vLLM's
--enable-auto-tool-choice --tool-call-parser hermes or llama3_json), unstreamed and streamed, and the tool
choices we refuse. The tiny model's output is random, so the server tests replace its text with a fixed one,
revealed in step with the generated tokens."""

import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

from server.app import build_app
from server.tool_parsers import (PARSERS, Gemma4, Glm45, Granite, Hermes, Llama3Json, Mistral, Pythonic, Qwen3Xml,
                                 ToolCall, ToolCallDelta)
from tests.server.conftest import MODEL, LiveServer
from tests.server.test_structured_outputs_api import no_whitespace

CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
SCRIPT = "Let me look that up.\n" + CALLS
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
            "{{ m.content or '' }}{% for t in m.tool_calls or [] %} call {{ t.function.name }} "
            "{{ t.function.arguments.city }}{% endfor %}\n{% endfor %}assistant:")
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


def test_hermes_calls_and_the_content_before_them():
    content, calls = Hermes.parse(SCRIPT)
    assert content == "Let me look that up.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert Hermes.parse(CALLS)[0] is None


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{not json}</tool_call>", "<tool_call>[1, 2]</tool_call>",
                                  "<tool_call>{\"name\": \"f\"}"])
def test_text_without_a_well_formed_call_is_all_content(text):
    assert Hermes.parse(text) == (text, [])


def assembled(pieces) -> list[tuple[int, str, str, str]]:
    """A stream's calls, (index, id, name, arguments), from its pieces in order: whole calls (ToolCall, numbered in
    turn) and parts of calls (ToolCallDelta: a header, then arguments)."""
    calls = {}
    for piece in pieces:
        if isinstance(piece, ToolCall):
            calls[len(calls)] = [piece.id, piece.name, piece.arguments]
        elif piece.call is not None:
            assert piece.index == len(calls)
            calls[piece.index] = [piece.call.id, piece.call.name, piece.arguments]
        else:
            calls[piece.index][2] += piece.arguments
    return [(i, *fields) for i, fields in calls.items()]


def test_streamed_split_gives_the_same_content_and_calls_whatever_the_chunks():
    """A call's header goes out once its name and the arguments' key are written, then its arguments as they
    settle, in the unstreamed response's JSON text; joined, the same calls as the whole output's."""
    for step in (1, 3, 7, len(SCRIPT)):
        stream, content, pieces = Hermes.Stream(), "", []
        for end in list(range(step, len(SCRIPT), step)) + [len(SCRIPT)]:
            text, new = stream.feed(SCRIPT[:end], final=end == len(SCRIPT))
            assert "<" not in text  # a possible start of a tag is held back
            if any(isinstance(p, ToolCallDelta) and p.call is not None for p in new):
                assert SCRIPT[:end].count("</tool_call>") < SCRIPT[:end].count("<tool_call>")  # before it closes
            content, pieces = content + text, pieces + new
        assert content == "Let me look that up.\n"
        assert [(name, arguments) for _, _, name, arguments in assembled(pieces)] == \
            [(c.name, c.arguments) for c in Hermes.parse(SCRIPT)[1]]
        if step == 1:  # each argument streamed in pieces: the quote-delimited values character by character
            assert sum(isinstance(p, ToolCallDelta) and p.call is None for p in pieces) > 20


@pytest.mark.parametrize("block, want", [
    ('{"name": "f", "arguments": {"q": "caf\\u00e9 \\ud83d\\ude00", "n": [1, 2.50, true, null]}}',
     '{"q": "café 😀", "n": [1, 2.5, true, null]}'),
    ('{ "name" : "f" , "parameters" : { "a" :{"b":[ ]} } }', '{"a": {"b": []}}'),
    ('{"arguments": {"x": 1}, "name": "f"}', '{"x": 1}'),  # another order: the call goes out whole when it closes
])
def test_streamed_arguments_are_the_unstreamed_ones(block, want):
    text = "<tool_call>" + block + "</tool_call>"
    for step in (1, 2, 5):
        stream, pieces = Hermes.Stream(), []
        for end in list(range(step, len(text), step)) + [len(text)]:
            pieces += stream.feed(text[:end], final=end == len(text))[1]
        assert [(name, arguments) for _, _, name, arguments in assembled(pieces)] == [("f", want)]
        assert Hermes.parse(text)[1][0].arguments == want


def test_arguments_that_stop_being_json_stop_streaming():
    stream = Hermes.Stream()
    _, pieces = stream.feed('<tool_call>{"name": "f", "arguments": {"a": 1, \'b\': 2')
    assert assembled(pieces) == [(0, pieces[0].call.id, "f", '{"a": 1, ')]
    _, more = stream.feed('<tool_call>{"name": "f", "arguments": {"a": 1, \'b\': 2}}</tool_call>', final=True)
    assert more == []  # what went out stays; nothing more follows


def test_streamed_text_that_only_looks_like_a_tag_is_released():
    stream = Hermes.Stream()
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("a <tools are fine>") == ("<tools are fine>", [])
    assert stream.feed("a <tools are fine> <tool_call>{\"name\"", final=True) == (" <tool_call>{\"name\"", [])


LLAMA3 = ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
          '{"name": "get_time", "parameters": {"zone": "CET"}}')


def test_llama3_json_output_that_is_calls_only():
    content, calls = Llama3Json.parse(LLAMA3)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    assert [c.name for c in Llama3Json.parse("<|python_tag|>" + LLAMA3)[1]] == ["get_weather", "get_time"]


@pytest.mark.parametrize("text", ["The weather is fine.", '{"name": "f"', '{"no": "name"}', '{"name": "f"} and more'])
def test_llama3_json_output_that_is_not_calls_is_content(text):
    assert Llama3Json.parse(text) == (text, [])


def test_llama3_json_stream_holds_calls_to_the_end_and_streams_content():
    stream = Llama3Json.Stream()
    assert stream.feed(" ") == ("", []) and stream.feed(' {"name"') == ("", [])
    content, calls = stream.feed(" " + LLAMA3, final=True)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    stream = Llama3Json.Stream()
    assert stream.feed("The") == ("The", []) and stream.feed("The weather", final=True) == (" weather", [])
    stream = Llama3Json.Stream()
    assert stream.feed('{"name": "f"', final=True) == ('{"name": "f"', [])


GRANITE = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
           '{"name": "get_time", "arguments": {"zone": "CET"}}]')


@pytest.mark.parametrize("tag", ["<|tool_call|>", "<tool_call>", ""])
def test_granite_output_that_is_calls_only(tag):
    """Granite 3.0's special token, 3.1+'s text tag, or neither (the special token skipped from the text)."""
    content, calls = Granite.parse(GRANITE.replace("<|tool_call|>", tag))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("text", ["The weather is fine.", "[1, 2]", "[]", '[{"name": "f"}', '{"name": "f"}',
                                  'Sure: <|tool_call|>[{"name": "f", "arguments": {}}]'])
def test_granite_output_that_is_not_calls_is_content(text):
    assert Granite.parse(text) == (text, [])


def test_granite_stream_holds_calls_to_the_end_and_streams_content():
    stream = Granite.Stream()
    assert stream.feed(" <|tool") == ("", []) and stream.feed(" <|tool_call|>[{") == ("", [])
    content, calls = stream.feed(" " + GRANITE, final=True)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    stream = Granite.Stream()
    assert stream.feed("The") == ("The", []) and stream.feed("The weather", final=True) == (" weather", [])


PYTHONIC = '[get_weather(city="Paris", unit="C"), get_time(zone="CET", hours=[1, 2.5], dst=True, note=None)]'
PYTHONIC_CALLS = [("get_weather", {"city": "Paris", "unit": "C"}),
                  ("get_time", {"zone": "CET", "hours": [1, 2.5], "dst": True, "note": None})]


def test_pythonic_output_that_is_calls_only():
    content, calls = Pythonic.parse(PYTHONIC)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == PYTHONIC_CALLS
    wrapped = Pythonic.parse("<|python_start|>" + PYTHONIC + "<|python_end|>")
    assert [(c.name, json.loads(c.arguments)) for c in wrapped[1]] == PYTHONIC_CALLS
    assert Pythonic.parse(" [f()] ")[1][0].arguments == "{}"


@pytest.mark.parametrize("text", ["The weather is fine.", "[get_weather(city=\"Paris\")", "[1, 2]", "[]",
                                  "[f(x)]", "[f(a=g())]", "[f(**kw)]", "[obj.f(a=1)]", "[f(a=1)] and more",
                                  "[" * 200 + "]" * 200])
def test_pythonic_output_that_is_not_calls_is_content(text):
    assert Pythonic.parse(text) == (text, [])


def _streamed(parser, output: str, step: int, held: str = "") -> tuple[str, list]:
    """The content and (name, arguments) calls a parser's stream gives for `output` fed `step` characters at a
    time; no content delta holds a character of `held`."""
    stream, content, calls = parser.Stream(), "", []
    for end in list(range(step, len(output), step)) + [len(output)]:
        text, new = stream.feed(output[:end], final=end == len(output))
        assert not set(held) & set(text)
        content, calls = content + text, calls + new
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_pythonic_stream_holds_calls_to_the_end_and_streams_content():
    for step in (1, 4, len(PYTHONIC)):
        assert _streamed(Pythonic, PYTHONIC, step) == ("", PYTHONIC_CALLS)
    stream = Pythonic.Stream()
    assert stream.feed("<|py") == ("", []) and stream.feed("It") == ("It", [])
    assert Pythonic.Stream().feed("[not a call", final=True) == ("[not a call", [])


MISTRAL_V11 = ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'
               '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}')
MISTRAL_LIST = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, ' \
               '{"name": "get_time", "arguments": {"zone": "CET"}}]'
MISTRAL_CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("text, content", [(MISTRAL_V11, "Let me check."), (MISTRAL_LIST, None),
                                           ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "C"}'
                                            '[TOOL_CALLS]get_time{"zone": "CET"}', None)])
def test_mistral_calls_in_each_format(text, content):
    got, calls = Mistral.parse(text)
    assert got == content and [(c.name, json.loads(c.arguments)) for c in calls] == MISTRAL_CALLS
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # Mistral's templates check the ids


@pytest.mark.parametrize("text", ["no calls", "text[TOOL_CALLS]", "[TOOL_CALLS]f[ARGS]{bad", "[TOOL_CALLS][1, 2]",
                                  "[TOOL_CALLS]f(x)", '[TOOL_CALLS][ARGS]{"a": 1}'])
def test_mistral_output_without_well_formed_calls_is_content(text):
    assert Mistral.parse(text) == (text, [])


def test_mistral_stream_sends_content_then_the_calls_at_the_end():
    for step in (1, 5, len(MISTRAL_V11)):
        assert _streamed(Mistral, MISTRAL_V11, step, held="[") == ("Let me check.", MISTRAL_CALLS)
    stream = Mistral.Stream()
    assert stream.feed("a [TOOL") == ("a ", []) and stream.feed("a [TOOLS]") == ("[TOOLS]", [])
    assert stream.feed("a [TOOLS] [TOOL_CALLS]f[ARGS]{", final=True) == (" [TOOL_CALLS]f[ARGS]{", [])


GEMMA4 = ('Let me check.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,hourly:true,unit:<|"|>C<|"|>}'
          '<tool_call|><|tool_call>call:get_time{zone:<|"|>CET<|"|>, at:{h:9,m:[0,30]}, note:null, rate:-1.5e2}'
          '<tool_call|>')
GEMMA4_CALLS = [("get_weather", {"city": 'Paris, "FR"', "days": 3, "hourly": True, "unit": "C"}),
                ("get_time", {"zone": "CET", "at": {"h": 9, "m": [0, 30]}, "note": None, "rate": -150.0})]


def test_gemma4_calls_in_its_argument_syntax():
    """Strings between <|"|> quotes (commas, braces and JSON quotes inside them their own), bare numbers and
    literals, nested objects and arrays; a call the output's end closes; the content before the first call. Its tags
    are special tokens: requests keep them in their text."""
    assert PARSERS["gemma4"] is Gemma4 and Gemma4.special_tokens
    content, calls = Gemma4.parse(GEMMA4)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == GEMMA4_CALLS
    assert Gemma4.parse('<|tool_call>call:f{x:<|"|>{a}<|"|>,y:[]}')[1][0].arguments == '{"x": "{a}", "y": []}'
    assert Gemma4.parse("<|tool_call>call:f{}<tool_call|>")[1][0].arguments == "{}"


@pytest.mark.parametrize("text", ["no calls", "text<|tool_call>", '<|tool_call>call:f{a:<|"|>x}', "<|tool_call>f{}",
                                  "<|tool_call>call:f{a:1", "<|tool_call>call:f{a:[1,2}", "<|tool_call>call:f{a}",
                                  '<|tool_call>call:f{a:1}<tool_call|><|tool_call>call:g{b:<|"|>y'])
def test_gemma4_output_without_well_formed_calls_is_content(text):
    assert Gemma4.parse(text) == (text, [])


def test_gemma4_stream_sends_content_then_the_calls_at_the_end():
    for step in (1, 5, len(GEMMA4)):
        assert _streamed(Gemma4, GEMMA4, step, held="<") == ("Let me check.", GEMMA4_CALLS)
    stream = Gemma4.Stream()
    assert stream.feed("a <|tool") == ("a ", []) and stream.feed("a <|tools") == ("<|tools", [])


QWEN3_XML = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n<parameter=unit>\nC\n"
             "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n"
             "</parameter>\n<parameter=at>\n{\"h\": 9}\n</parameter>\n</function>\n</tool_call>")
XML_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": ["boolean", "null"]},
    "unit": {"enum": ["C", "F"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}, "at": {"anyOf": [{"type": "object"}, {"type": "string"}]}}}}}]
XML_CALLS = [("get_weather", {"city": "Paris", "days": 3, "hourly": True, "unit": "C"}),
             ("get_time", {"zone": "CET", "at": {"h": 9}})]


GLM45 = ("I will check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>hourly</arg_key>\n<arg_value>true</arg_value>\n"
         "<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>"
         '\n<arg_value>CET</arg_value>\n<arg_key>at</arg_key>\n<arg_value>{"h": 9}</arg_value>\n</tool_call>')


def test_glm45_calls_typed_by_the_tools_schemas():
    """GLM-4.5's calls: `<tool_call>name` and its <arg_key>/<arg_value> pairs, typed by the request's tool schemas
    as Qwen3-Coder's are; the text before the first call the content; a call without a name is all content."""
    parser = Glm45.with_tools(XML_TOOLS)
    content, calls = parser.parse(GLM45)
    assert content == "I will check.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == XML_CALLS
    content, calls = parser.parse("<tool_call>get_time</tool_call>")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {})]
    assert parser.parse("No call.") == ("No call.", [])
    assert parser.parse("x <tool_call>\n<arg_key>a</arg_key></tool_call>") == (
        "x <tool_call>\n<arg_key>a</arg_key></tool_call>", [])


@pytest.mark.parametrize("step", [1, 5, 40])
def test_glm45_stream_sends_the_content_then_each_call_as_it_closes(step):
    stream, content, calls = Glm45.with_tools(XML_TOOLS).Stream(), "", []
    ends = list(range(step, len(GLM45), step)) + [len(GLM45)]
    for end in ends:
        text, new = stream.feed(GLM45[:end], final=end == len(GLM45))
        content, calls = content + text, calls + new
        if end < GLM45.index("</tool_call>"):
            assert not calls
    assert content == "I will check.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == XML_CALLS


def test_qwen3_xml_calls_typed_by_the_tools_schemas():
    """Qwen3-Coder's XML calls: parameters typed by the request's tool schemas (strings without one), the text
    before the first call the content; an output without a well-formed call is all content."""
    content, calls = Qwen3Xml.with_tools(XML_TOOLS).parse(QWEN3_XML)
    assert content == "I will check.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == XML_CALLS
    untyped = Qwen3Xml.with_tools([]).parse(QWEN3_XML)[1]
    assert json.loads(untyped[0].arguments) == {"city": "Paris", "days": "3", "hourly": "true", "unit": "C"}
    parser = Qwen3Xml.with_tools(XML_TOOLS)
    # no <tool_call> wrapper, an unclosed parameter, and a block cut by the token limit
    assert [(c.name, json.loads(c.arguments)) for c in parser.parse(
        "<function=get_weather><parameter=days>7<parameter=city>Oslo</function>")[1]] == [
        ("get_weather", {"days": 7, "city": "Oslo"})]
    assert json.loads(parser.parse("<tool_call><function=get_weather><parameter=days>\n2")[1][0].arguments) == \
        {"days": 2}
    for text in ("plain text", "<tool_call>{\"name\": \"get_weather\"}</tool_call>", "<function=>x</function>"):
        assert parser.parse(text) == (text, [])


def test_qwen3_xml_stream_sends_each_call_when_its_function_closes():
    parser = Qwen3Xml.with_tools(XML_TOOLS)
    for step in (1, 5, 13, len(QWEN3_XML)):
        stream, content, calls = parser.Stream(), "", []
        for end in list(range(step, len(QWEN3_XML), step)) + [len(QWEN3_XML)]:
            text, new = stream.feed(QWEN3_XML[:end], final=end == len(QWEN3_XML))
            assert "<" not in text
            if new and end < len(QWEN3_XML):
                assert QWEN3_XML[:end].count("</function>") == len(calls) + len(new)  # sent as each closes
            content, calls = content + text, calls + new
        assert content == "I will check.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == XML_CALLS
    stream = parser.Stream()
    assert stream.feed("a <func") == ("a ", []) and stream.feed("a <funny>") == ("<funny>", [])
    assert stream.feed("a <funny> <function=get_time><parameter=zone>UTC", final=True)[1][0].name == "get_time"
    stream = parser.Stream()
    assert stream.feed("x <tool_call>{}</tool_call>", final=True) == ("x <tool_call>{}</tool_call>", [])


DEEPSEEK_V3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Paris", "unit": "C"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
               'get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
                '"unit": "C"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}'
                '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
KIMI_K2 = ('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
           '<|tool_call_argument_begin|>{"city": "Paris", "unit": "C"}<|tool_call_end|><|tool_call_begin|>'
           'functions.get_time:1<|tool_call_argument_begin|> {"zone": "CET"} <|tool_call_end|><|tool_calls_section_end|>')
JSON_CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("name, text", [("deepseek_v3", DEEPSEEK_V3), ("deepseek_v31", DEEPSEEK_V31),
                                        ("kimi_k2", KIMI_K2)])
def test_special_token_calls_with_json_arguments(name, text):
    """DeepSeek V3's (a ```json fence after the name), V3.1's and Kimi K2's calls: the text before the calls the
    content, each call's arguments in json.dumps' form; streamed in any chunks, each call goes out as it closes and
    the calls' framing never as content; a block that does not parse makes the output content (streamed: the block,
    after the calls gone out), as does an output without calls. Kimi K2's ids are its headers (functions.NAME:INDEX), as its template writes them back."""
    parser = PARSERS[name].with_tools(TOOLS)
    assert PARSERS[name].special_tokens
    content, calls = parser.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == JSON_CALLS
    assert calls[1].arguments == '{"zone": "CET"}'
    if name == "kimi_k2":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    closes = [i + 1 for i in range(len(text)) if text.endswith(("<｜tool▁call▁end｜>", "<|tool_call_end|>"), 0, i + 1)]
    for step in (1, 7, len(text)):
        stream, streamed, got = parser.Stream(), "", []
        for end in list(range(step, len(text), step)) + [len(text)]:
            delta, new = stream.feed(text[:end], final=end == len(text))
            streamed, got = streamed + delta, got + new
            assert len(got) == sum(c <= end for c in closes) or end == len(text)
        assert streamed == "Let me check." and [(c.name, c.arguments) for c in got] == [
            (c.name, c.arguments) for c in calls]
    broken = text.replace('"CET"}', '"CET"')
    assert parser.parse(broken) == (broken, []) and parser.parse("No call.") == ("No call.", [])
    delta, got = parser.Stream().feed(broken, final=True)  # the first call went out; the broken block is content
    assert [c.name for c in got] == ["get_weather"] and delta.startswith("Let me check.") and '"CET"' in delta


class ScriptedText:
    """The shared engine, its completions' text replaced by SCRIPT: a prefix in proportion to the tokens
    generated so far, all of it once a completion finishes."""

    def __init__(self, engine, script):
        self.inner, self.script = engine, script

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, prompt, params, **kwargs):
        async for out in self.inner.generate(request_id, prompt, params, **kwargs):
            for c in out.outputs:
                shown = len(self.script) * len(c.token_ids) // params.max_tokens
                c.text = self.script if c.finish_reason else self.script[:shown]
            yield out


@pytest.fixture(scope="module")
def tool_servers(async_engine):
    servers = {name: LiveServer(build_app(ScriptedText(async_engine, script), MODEL, chat_template=TEMPLATE,
                                          tool_call_parser=parser))
               for name, script, parser in (("calls", SCRIPT, "hermes"), ("plain", "Just text.", "hermes"),
                                            ("no-parser", SCRIPT, None), ("llama3", LLAMA3, "llama3_json"),
                                            ("pythonic", PYTHONIC, "pythonic"), ("mistral", MISTRAL_V11, "mistral"),
                                            ("qwen3-xml", QWEN3_XML, "qwen3_coder"), ("granite", GRANITE, "granite"),
                                            ("glm45", GLM45, "glm45"),
                                            ("deepseek_v3", DEEPSEEK_V3, "deepseek_v3"),
                                            ("deepseek_v31", DEEPSEEK_V31, "deepseek_v31"),
                                            ("kimi_k2", KIMI_K2, "kimi_k2"), ("gemma4", GEMMA4, "gemma4"))}
    yield servers
    for server in servers.values():
        server.stop()


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(server, **kwargs):
    return client_of(server).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24,
                                                     extra_body={"ignore_eos": True}, **kwargs)


def test_calls_in_the_output_come_back_as_tool_calls(tool_servers):
    choice = ask(tool_servers["calls"]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look that up.\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "C"}), ("function", "get_time", {"zone": "CET"})]


def joined_calls(pieces) -> list[SimpleNamespace]:
    """Streamed tool-call deltas (the OpenAI client's objects) joined by index, as clients join them: the first of a
    call brings its id and name, every one a piece of its arguments."""
    calls = {}
    for t in pieces:
        if t.index not in calls:
            calls[t.index] = SimpleNamespace(index=t.index, id=t.id, name=t.function.name, arguments="")
        else:
            assert t.id is None and t.function.name is None
        calls[t.index].arguments += t.function.arguments or ""
    return list(calls.values())


def test_parallel_tool_calls_false_keeps_the_first_call(tool_servers):
    for stream in (False, True):
        response = ask(tool_servers["calls"], parallel_tool_calls=False, stream=stream)
        if stream:
            calls = joined_calls([t for chunk in response for c in chunk.choices for t in c.delta.tool_calls or []])
            names = [t.name for t in calls]
        else:
            names = [t.function.name for t in response.choices[0].message.tool_calls]
        assert names == ["get_weather"]


def test_streamed_calls_arrive_in_pieces_with_their_index_after_the_content(tool_servers):
    content, pieces, finish = "", [], None
    for chunk in ask(tool_servers["calls"], stream=True):
        delta = chunk.choices[0].delta
        assert not (delta.content and "<" in delta.content)
        content += delta.content or ""
        pieces += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look that up.\n" and finish == "tool_calls" and len(pieces) > 2
    assert [(t.index, t.id is not None, t.name, json.loads(t.arguments)) for t in joined_calls(pieces)] == [
        (0, True, "get_weather", {"city": "Paris", "unit": "C"}), (1, True, "get_time", {"zone": "CET"})]


def _content_calls_finish(response, stream: bool) -> tuple[str, list, str]:
    """A chat response's content, its calls' functions and its finish reason, streamed (chunks gathered) or not."""
    if stream:
        chunks = [c for chunk in response for c in chunk.choices]
        calls = joined_calls([t for c in chunks for t in c.delta.tool_calls or []])
        return "".join(c.delta.content or "" for c in chunks), calls, chunks[-1].finish_reason
    choice = response.choices[0]
    return choice.message.content or "", [t.function for t in choice.message.tool_calls], choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_mistral_calls_come_back_as_tool_calls(tool_servers, stream, monkeypatch):
    """The content before [TOOL_CALLS], then the calls; the request keeps special tokens in its text (the
    parser reads one), as vLLM's mistral parser sets it."""
    seen = []
    generate = ScriptedText.generate

    def recording(self, request_id, prompt, params, **kwargs):
        seen.append(params.skip_special_tokens)
        return generate(self, request_id, prompt, params, **kwargs)

    monkeypatch.setattr(ScriptedText, "generate", recording)
    response = ask(tool_servers["mistral"], stream=stream)
    content, calls, finish = _content_calls_finish(response, stream)
    assert content == "Let me check." and finish == "tool_calls" and seen == [False]
    assert [(f.name, json.loads(f.arguments)) for f in calls] == MISTRAL_CALLS
    seen.clear()
    ask(tool_servers["calls"])
    assert seen == [True]  # hermes' tags are plain text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("server, tools, content, want", [
    ("qwen3-xml", XML_TOOLS, "I will check.\n", XML_CALLS),
    ("glm45", XML_TOOLS, "I will check.\n", XML_CALLS),
    ("pythonic", TOOLS, "", PYTHONIC_CALLS),
    ("llama3", TOOLS, "", [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]),
    ("granite", TOOLS, "", [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]),
    ("deepseek_v3", TOOLS, "Let me check.", JSON_CALLS),
    ("deepseek_v31", TOOLS, "Let me check.", JSON_CALLS),
    ("kimi_k2", TOOLS, "Let me check.", JSON_CALLS),
    ("gemma4", TOOLS, "Let me check.", GEMMA4_CALLS),
])
def test_parsed_calls_come_back_as_tool_calls(tool_servers, server, tools, content, want, stream):
    """qwen3_coder, glm45, pythonic, llama3_json, granite, deepseek_v3, deepseek_v31, kimi_k2 and gemma4: the content
    before the calls (none for the calls-only formats), the calls, finish reason tool_calls; streamed or not."""
    response = client_of(tool_servers[server]).chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, max_tokens=24, extra_body={"ignore_eos": True}, stream=stream)
    got_content, calls, finish = _content_calls_finish(response, stream)
    assert got_content == content and finish == "tool_calls"
    assert [(f.name, json.loads(f.arguments)) for f in calls] == want


def test_output_without_calls_is_plain_content(tool_servers):
    choice = ask(tool_servers["plain"]).choices[0]
    assert choice.message.content == "Just text." and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_tool_choice_none_leaves_the_output_unparsed_and_the_tools_out_of_the_prompt(tool_servers, async_engine):
    response = ask(tool_servers["calls"], tool_choice="none")
    assert response.choices[0].message.content == SCRIPT and not response.choices[0].message.tool_calls
    tokenizer = async_engine.engine.tokenizer
    without_tools = tokenizer.apply_chat_template(ASK, chat_template=TEMPLATE, tokenize=False)
    assert response.usage.prompt_tokens == len(tokenizer.encode(without_tools, add_special_tokens=False))


def test_tools_and_a_conversation_with_calls_reach_the_template(tool_servers, async_engine):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C"}]
    response = client_of(tool_servers["calls"]).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=24, extra_body={"ignore_eos": True})
    tokenizer = async_engine.engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [m | ({"tool_calls": [{"id": "call-1", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
              if m.get("tool_calls") else {}) for m in history], tools=TOOLS, chat_template=TEMPLATE, tokenize=False)
    assert "call get_weather Paris" in rendered and "get_time" in rendered
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


BOUNDED_TOOLS = [  # parameters a random model cannot ramble in
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
ARGUMENTS = {"get_weather": [{"city": "Paris"}, {"city": "Oslo"}], "get_time": [{"zone": "CET"}, {"zone": "UTC"}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_arguments_of_its_schema(client, async_engine, stream):
    """tool_choice naming a function holds the real model's output to that function's parameters (structured
    outputs; no parser needed): the output is the call's arguments."""
    named = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=BOUNDED_TOOLS, tool_choice=named, max_tokens=60, temperature=1.0, seed=4,
        stream=stream, logit_bias=no_whitespace(async_engine.engine.tokenizer))
    if stream:
        chunks = [c for chunk in response for c in chunk.choices]
        calls, finish = [t for c in chunks for t in c.delta.tool_calls or []], chunks[-1].finish_reason
    else:
        calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
    assert finish == "stop" and [t.function.name for t in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments) in ARGUMENTS["get_time"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_one_of_the_tools(client, async_engine, stream):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=BOUNDED_TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=1.0, seed=6, stream=stream, logit_bias=no_whitespace(async_engine.engine.tokenizer))
    if stream:
        chunks = [c for chunk in response for c in chunk.choices]
        calls, finish = [t for c in chunks for t in c.delta.tool_calls or []], chunks[-1].finish_reason
    else:
        calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1
    assert json.loads(calls[0].function.arguments) in ARGUMENTS[calls[0].function.name]


@pytest.mark.parametrize("server,body,message", [
    ("no-parser", {"tools": TOOLS}, "--enable-auto-tool-choice"),
    ("calls", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "must name one of the request's tools"),
    ("calls", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "not with response_format"),
    ("calls", {"tool_choice": "auto"}, "only taken with tools"),
])
def test_tool_choices_that_cannot_be_honoured_are_refused(tool_servers, server, body, message):
    response = httpx.post(tool_servers[server].url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": ASK, "max_tokens": 4} | body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and message in error["message"]


def test_tokenize_renders_tools_with_the_messages(tool_servers, async_engine):
    """/tokenize takes a chat's tools (vLLM's), rendered by the template as chat renders them, with or without a
    tool call parser; a prompt with tools is refused."""
    tokenizer = async_engine.engine.tokenizer
    rendered = tokenizer.apply_chat_template(ASK, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True,
                                             tools=TOOLS)
    for name in ("no-parser", "calls"):
        with httpx.Client(base_url=tool_servers[name].url, timeout=60) as h:
            r = h.post("/tokenize", json={"messages": ASK, "tools": TOOLS})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
            r = h.post("/tokenize", json={"prompt": "hi", "tools": TOOLS})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=4), _JSON_VALUES, max_size=4), ascii_only=st.booleans(),
       indent=st.sampled_from([None, 1]))
def test_settled_json_grows_into_the_unstreamed_arguments(value, ascii_only, indent):
    """Whatever way a model writes an arguments object (escapes, spacing, number forms), every prefix's settled
    text is a prefix of json.dumps' of the whole, which it reaches once the object closes."""
    from server.tool_parsers import _settled_json

    raw, want = json.dumps(value, ensure_ascii=ascii_only, indent=indent), json.dumps(value, ensure_ascii=False)
    previous = ""
    for end in range(1, len(raw) + 1):
        settled = _settled_json(raw[:end])
        assert settled.startswith(previous) and want.startswith(settled), (raw[:end], settled)
        previous = settled
    assert previous == want
