"""Tool calls in a model's text, as vLLM's `--tool-call-parser` finds them, for chat completions with tools.

- `hermes` (Qwen 2.5 / Qwen 3, Hermes, and other templates that write it): each call is a JSON object
  {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; the text before the first call is the
  message's content.
- `llama3_json` (Llama 3.1 and later): an output that is calls only, JSON objects {"name": ..., "parameters":
  {...}} separated by ";" (after <|python_tag|> where special tokens are kept); any other output is content.
- `mistral` (Mistral's instruct models): the content, then [TOOL_CALLS] and the calls: a JSON list of
  {"name", "arguments"} objects (older tokenizers), or `name[ARGS]{...}` after each [TOOL_CALLS] (tokenizers v11
  on); ids of 9 letters and digits, as Mistral's templates require. [TOOL_CALLS] is a special token, so requests
  this parser reads keep special tokens in their text (`special_tokens`), as vLLM's parser sets them.
- `pythonic` (Llama 3.2 and 4, ToolACE): an output that is calls only, a Python list of calls with keyword
  arguments of literal values, `[get_weather(city="Paris"), get_time(zone="CET")]` (between <|python_start|> and
  <|python_end|> where special tokens are kept); any other output is content.
- `qwen3_coder` / `qwen3_xml` (Qwen3-Coder): `<function=name>` blocks of `<parameter=key>value</parameter>`s in
  <tool_call> tags, the values typed by the request's tool schemas (`with_tools`).
- `openai` (GPT-OSS): its harmony messages to `functions.NAME` (jaxengine.harmony), whose content is the call's
  arguments (streamed as they are written); the other messages' contents are the content (with
  `--reasoning-parser openai_gptoss`, the reasoning is already apart). Its headers are special tokens: requests
  keep them (`special_tokens`).
- `granite` (Granite 3.x: a calls-only JSON list after its tag) and `glm45` (GLM-4.5/4.6: `<tool_call>name` blocks of
  <arg_key>/<arg_value> pairs, typed as Qwen3-Coder's).
- `deepseek_v3` (DeepSeek V3, R1-0528), `deepseek_v31` (V3.1 on) and `kimi_k2` (Kimi K2): calls between special
  tokens after the content, each with its arguments' JSON object (DeepSeekV3, DeepSeekV31, KimiK2).
- `gemma4` (Gemma 4): the content, then calls `<|tool_call>call:NAME{ARGS}<tool_call|>` whose arguments are in
  Gemma 4's own syntax (`_gemma4_value`: strings between `<|"|>` quotes, bare keys, numbers and literals, nested
  objects and arrays), special tokens that requests keep; the calls go out whole when the output ends.

Each parser is `parse(text) -> (content, calls)` for a whole output and `Stream()` for a growing one, whose
`feed(text, final) -> (content delta, new calls)`.
"""

import ast
import dataclasses
import json
import math
import re
import uuid
from collections.abc import Callable

from jaxengine import harmony
from jaxengine.reasoning import partial_tag

_START, _END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_START) + r"(.*?)" + re.escape(_END), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """Part of a streamed call: its header (`call`: id and name, arguments still empty) when it opens, then pieces
    of its arguments' JSON text; `index`: the call's place among the output's calls."""

    index: int
    arguments: str = ""
    call: "ToolCall | None" = None

    def as_dict(self) -> dict:
        if self.call is not None:
            return {"index": self.index, "id": self.call.id, "type": "function",
                    "function": {"name": self.call.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(block: str) -> ToolCall | None:
    """The call a <tool_call> block holds, or None where it is not a {"name", "arguments"} JSON object."""
    try:
        return _call_of(json.loads(block))
    except json.JSONDecodeError:
        return None


def _call_of(value) -> ToolCall | None:
    """The call a decoded JSON value is ({"name", "arguments" or "parameters"}), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                           ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output. Without a call, or where a block does not parse, the whole text is
    the content and there are no calls (as vLLM's parser); an empty content is None."""
    blocks = _BLOCK.findall(text)
    calls = [_call(block) for block in blocks]
    if not calls or any(call is None for call in calls):
        return text, []
    content = text[:text.find(_START)]
    return content or None, calls


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# a surrogate pair's two escapes, one \\u escape, or a one-character escape
_ESCAPE = re.compile(r'\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[0-9a-fA-F]{4}|u[0-9a-fA-F]{4}|["\\/bfnrt])')
_LITERAL = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null|-")


def _settled_json(raw: str) -> str:
    """json.dumps' form (ensure_ascii off, its default separators) of as much of the JSON value being written at
    the start of `raw` as is settled: a number or literal once it ends, a string character by character, an escape
    once whole, up to the value's end or to a flaw (where the text stops being JSON). It only grows as `raw` does,
    so a stream can send it piece by piece."""
    out, depth, i, n = [], 0, 0, len(raw)
    while i < n:
        c = raw[i]
        if c in " \t\r\n":
            i += 1
        elif c in "{[":
            out.append(c)
            depth, i = depth + 1, i + 1
        elif c in "}]":
            out.append(c)
            depth, i = depth - 1, i + 1
            if depth <= 0:
                return "".join(out)
        elif c in ",:":
            out.append(c + " ")
            i += 1
        elif c == '"':
            out.append('"')
            i += 1
            while i < n and raw[i] != '"':
                if raw[i] != "\\":
                    out.append(json.dumps(raw[i], ensure_ascii=False)[1:-1])
                    i += 1
                    continue
                escape = _ESCAPE.match(raw, i)
                if escape is None or (len(escape.group()) == 6 and 0xD800 <= int(raw[i + 2:i + 6], 16) < 0xDC00):
                    return "".join(out)  # an escape, or a surrogate pair's second half, still arriving (or a flaw)
                try:
                    out.append(json.dumps(json.loads(f'"{escape.group()}"'), ensure_ascii=False)[1:-1])
                except json.JSONDecodeError:
                    return "".join(out)
                i += len(escape.group())
            if i == n:
                return "".join(out)
            out.append('"')
            i += 1
            if depth == 0:
                return "".join(out)
        else:
            if any(word.startswith(raw[i:]) for word in ("true", "false", "null")):  # one still arriving
                return "".join(out)
            literal = _LITERAL.match(raw, i)
            if literal is None or literal.end() == n:  # a flaw, or a number that may go on
                return "".join(out)
            try:
                out.append(json.dumps(json.loads(literal.group())))
            except json.JSONDecodeError:
                return "".join(out)
            i = literal.end()
            if depth == 0:
                return "".join(out)
    return "".join(out)


class _HermesStream:
    """Splits a growing output into content deltas and calls for a streamed response, as vLLM's hermes parser
    streams them: content goes out up to a possible start of a <tool_call> tag; a call's header (id and name) goes
    out once its block has written `{"name": ..., "arguments":`, then its arguments as they settle, in the JSON
    text the unstreamed response gives (`_settled_json`); a block of another shape goes out whole once closed.
    Decided: a closed block that does not parse, and whose header has not gone out, is passed on as content (the
    unstreamed answer makes the whole text content then, which a stream can no longer do), as is an unclosed one
    when the output ends; arguments that stop being JSON stop streaming (what went out stays)."""

    def __init__(self):
        self.sent = 0  # characters of the text handled (sent as content, or parsed as calls)
        self.in_calls = False  # a <tool_call> has been seen: only calls (and the text between them) follow
        self.count = 0  # calls begun
        self.open: ToolCallDelta | None = None  # the call streaming now: its header, and the arguments sent
        self.arguments_sent = ""
        self.arguments_from = 0  # where the open call's arguments begin in its block

    def feed(self, text: str, final: bool = False) -> tuple[str, list]:
        content, calls = [], []
        while True:
            rest = text[self.sent:]
            start = rest.find(_START)
            if start < 0:
                held = 0 if final else partial_tag(rest, _START)
                if not self.in_calls or final:
                    content.append(rest[:len(rest) - held])
                    self.sent += len(rest) - held
                return "".join(content), calls
            if not self.in_calls:
                content.append(rest[:start])
            self.in_calls = True
            end = rest.find(_END, start)
            block = rest[start + len(_START):end if end >= 0 else len(rest)]
            if end < 0:
                if final and self.open is None:
                    content.append(rest[start:])
                    self.sent = len(text)
                elif not final:
                    calls += self._stream_open(block)
                return "".join(content), calls
            call = _call(block)
            if self.open is not None:  # its header went out: the rest of its arguments
                if call is not None and call.arguments.startswith(self.arguments_sent):
                    remainder = call.arguments[len(self.arguments_sent):]
                    if remainder:
                        calls.append(ToolCallDelta(self.open.index, remainder))
                self.open = None
            elif call is None:
                content.append(rest[start:end + len(_END)])
            else:
                calls.append(call)
                self.count += 1
            self.sent += end + len(_END)

    def _stream_open(self, block: str) -> list:
        """The deltas of the block still being written: its header once the name and the arguments' key are
        written, then the arguments' settled JSON beyond what went out."""
        deltas = []
        if self.open is None:
            head = _HEAD.match(block)
            if head is None:
                return []
            try:
                name = json.loads(head.group(1))
            except json.JSONDecodeError:
                return []
            self.open = ToolCallDelta(self.count, "", ToolCall(name, ""))
            self.count += 1
            self.arguments_sent = ""
            self.arguments_from = head.end()
            deltas.append(self.open)
        settled = _settled_json(block[self.arguments_from:])
        if settled.startswith(self.arguments_sent) and len(settled) > len(self.arguments_sent):
            deltas.append(ToolCallDelta(self.open.index, settled[len(self.arguments_sent):]))
            self.arguments_sent = settled
        return deltas


class Hermes:
    parse = staticmethod(_parse_hermes)
    Stream = _HermesStream


_PYTHON_TAG = "<|python_tag|>"


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """(None, calls) where the whole output is calls; (text, []) otherwise (as vLLM's parser)."""
    body = text.strip()
    body = body[len(_PYTHON_TAG):].lstrip() if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(value)
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    return None, calls


class _WholeStream:
    """A stream whose calls are known only when the output ends: nothing goes out before, then `parse`'s."""

    def __init__(self, parse):
        self.parse = parse

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if not final:
            return "", []
        content, calls = self.parse(text)
        return content or "", calls


class _CallsOnlyStream:
    """For formats whose calls are a whole output: an output that starts as calls (`starts`: "{" or
    <|python_tag|>, say) is held to its end and parsed whole (the calls go out then, or the text as content where
    it does not parse); any other output streams as content."""

    def __init__(self, parse, starts: tuple[str, ...]):
        self.starts = starts
        self.calls = None  # unknown until the output's first characters say
        self.sent = 0
        self._whole = _WholeStream(parse)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if self.calls is None:
            head = text.lstrip()
            if not head or (not final and any(s.startswith(head) and s != head for s in self.starts)):
                return "", []
            self.calls = head.startswith(self.starts)
        if self.calls:
            return self._whole.feed(text, final)
        delta, self.sent = text[self.sent:], len(text)
        return delta, []


class Llama3Json:
    parse = staticmethod(_parse_llama3_json)

    @staticmethod
    def Stream():
        return _CallsOnlyStream(_parse_llama3_json, ("{", _PYTHON_TAG))


_GRANITE_TAGS = ("<|tool_call|>", "<tool_call>")  # Granite 3.0's special token, and the text 3.1+ writes


def _parse_granite(text: str) -> tuple[str | None, list[ToolCall]]:
    """(None, calls) where the whole output is a JSON list of {"name", "arguments"} objects, after Granite's tag (or
    without it: the special token is skipped from the text by default); (text, []) otherwise, as vLLM's parser."""
    body = text.strip()
    for tag in _GRANITE_TAGS:
        body = body[len(tag):].lstrip() if body.startswith(tag) else body
    if not body.startswith("["):
        return text, []
    try:
        values = json.loads(body)
    except json.JSONDecodeError:
        return text, []
    calls = [_call_of(value) for value in values] if isinstance(values, list) and values else [None]
    return (text, []) if None in calls else (None, calls)


class Granite:
    parse = staticmethod(_parse_granite)

    @staticmethod
    def Stream():
        return _CallsOnlyStream(_parse_granite, ("[",) + _GRANITE_TAGS)


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def _parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """(None, calls) where the whole output is a Python list of calls `name(key=literal, ...)`; (text, [])
    otherwise, as vLLM's parser."""
    body = text.strip()
    if body.startswith(_PYTHON_START):
        body = body[len(_PYTHON_START):]
        body = body[:-len(_PYTHON_END)] if body.endswith(_PYTHON_END) else body
        body = body.strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(arguments) != len(node.keywords):  # a **mapping
                return text, []
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text, []
    return None, calls


class Pythonic:
    parse = staticmethod(_parse_pythonic)

    @staticmethod
    def Stream():
        return _CallsOnlyStream(_parse_pythonic, ("[", _PYTHON_START))


_TOOL_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED_ARGUMENTS = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*(\{.*\})\s*$", re.DOTALL)


def _mistral_id() -> str:
    return uuid.uuid4().hex[:9]


def _mistral_calls(part: str) -> list[ToolCall] | None:
    """The calls after one [TOOL_CALLS]: `name[ARGS]{...}`, `name{...}`, or a JSON list (or object) of calls."""
    part = part.strip()
    try:
        if _ARGS in part:
            name, arguments = part.split(_ARGS, 1)
            values = [{"name": name.strip(), "arguments": json.loads(arguments)}]
        elif part.startswith(("[", "{")):
            value = json.loads(part)
            values = value if isinstance(value, list) else [value]
        elif match := _NAMED_ARGUMENTS.match(part):
            values = [{"name": match.group(1), "arguments": json.loads(match.group(2))}]
        else:
            return None
    except json.JSONDecodeError:
        return None
    calls = [_call_of(v) for v in values]
    if not calls or None in calls or any(not c.name for c in calls):
        return None
    return [dataclasses.replace(c, id=_mistral_id()) for c in calls]


def _parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first [TOOL_CALLS], calls); (text, []) where there are none or they do not parse."""
    at = text.find(_TOOL_CALLS)
    if at < 0:
        return text, []
    calls = []
    for part in text[at:].split(_TOOL_CALLS)[1:]:
        found = _mistral_calls(part)
        if found is None:
            return text, []
        calls += found
    return text[:at] or None, calls


def _content_before(text: str, sent: int, tags: tuple[str, ...], final: bool) -> tuple[str, int, bool]:
    """A stream's content from `sent` up to where the first of `tags` begins, or (none found) to the end, less what
    may still become one unless the output has ended: (content, where it stops, whether a tag begins there)."""
    found = [at for tag in tags if (at := text.find(tag, sent)) >= 0]
    end = min(found) if found else len(text) - (0 if final else max(partial_tag(text, tag) for tag in tags))
    return text[sent:end], max(sent, end), bool(found)


class _TaggedStream:
    """Content streams up to a possible start of `tag`; from the tag on, the output is held to its end and parsed
    whole (the calls go out then, or the held text as content where it does not parse)."""

    def __init__(self, tag: str, parse):
        self.tag, self.parse = tag, parse
        self.sent = 0  # characters sent as content
        self.tagged = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if not self.tagged:
            delta, self.sent, self.tagged = _content_before(text, self.sent, (self.tag,), final)
            if not self.tagged:
                return delta, []
        else:
            delta = ""
        if not final:
            return delta, []
        content, calls = self.parse(text)
        return (delta, calls) if calls else (delta + text[self.sent:], [])


class Mistral:
    parse = staticmethod(_parse_mistral)
    special_tokens = True  # [TOOL_CALLS] is one: the output's text must keep it

    @staticmethod
    def Stream():
        return _TaggedStream(_TOOL_CALLS, _parse_mistral)


_FUNCTION_START, _FUNCTION_END = "<function=", "</function>"
_XML_STARTS = (_START, _FUNCTION_START)
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_TYPE_NAMES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
               "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
               "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
               "float": "number", "float32": "number", "float64": "number", "double": "number", "bool": "boolean",
               "dict": "object", "arr": "array", "list": "array", "sequence": "array"}
_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object"}


def _schema_types(schema) -> set[str]:
    """The JSON types a property's schema allows (`type`, its `enum` values' types, anyOf/oneOf/allOf), by their
    JSON Schema names (common aliases mapped); {"string"} where it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    types = set()
    named = schema.get("type")
    for name in [named] if isinstance(named, str) else named if isinstance(named, list) else []:
        if isinstance(name, str):
            types.add(_TYPE_NAMES.get(name.strip().lower(), name.strip().lower()))
    if isinstance(schema.get("enum"), list):
        types |= {_JSON_TYPES.get(type(v), "string") for v in schema["enum"]}
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or [] if isinstance(schema.get(key), list) else []:
            types |= _schema_types(option)
    return types or {"string"}


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _typed(value: str, schema):
    """An XML parameter's text as the type its schema gives it, as vLLM reads Qwen3-Coder's calls: the first of
    null, integer, number, boolean, object, array, string that the schema allows and the text is; else the text
    as JSON, else the text."""
    types = _schema_types(schema)
    if "null" in types and value.lower() == "null":
        return None
    if "integer" in types:
        try:
            return int(value)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(value)
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        except ValueError:
            pass
    if "boolean" in types and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    if types & {"object", "array"}:
        try:
            parsed = json.loads(value)
            if isinstance(parsed, (dict, list)) and _finite(parsed):
                return parsed
        except json.JSONDecodeError:
            pass
    if "string" in types:
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    return parsed if _finite(parsed) else value


def _qwen3_pairs(body: str) -> list[tuple[str, str]]:
    """A `<function=name>` block's `<parameter=key>value</parameter>`s, one newline each side of a value dropped."""
    pairs = []
    for key, value in _XML_PARAMETER.findall(body):
        value = value[1:] if value.startswith("\n") else value
        pairs.append((key, value[:-1] if value.endswith("\n") else value))
    return pairs


_GLM_CALL = re.compile(r"<tool_call>([^\n<]*)\n?(.*?)(</tool_call>|$)", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class _BlockFormat:
    """A format of tagged call blocks: `starts`, the tags the calls may begin with; `blocks`, a call's header, body
    and closing tag (empty where the output leaves it open); `call` reads a block."""

    starts: tuple[str, ...]
    blocks: re.Pattern

    def call(self, header: str, body: str, tools: list[dict]) -> ToolCall | None:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict]) -> tuple[str | None, list[ToolCall]]:
        """(content before the first call's tag, calls); (text, []) where there are none or one does not parse. A
        block the output leaves open (cut by the token limit) is read as far as it goes."""
        content, at, tagged = _content_before(text, 0, self.starts, final=True)
        if not tagged:
            return text, []
        calls = [self.call(name, body, tools) for name, body, _ in self.blocks.findall(text, at)]
        if not calls or None in calls:
            return text, []
        return content or None, calls


@dataclasses.dataclass(frozen=True)
class _XmlFormat(_BlockFormat):
    """Blocks whose header is the function's name and whose arguments are written as key/value pairs (`pairs`: a
    body's (key, value) texts)."""

    pairs: Callable[[str], list[tuple[str, str]]] = None

    def call(self, name: str, body: str, tools: list[dict]) -> ToolCall | None:
        """A block's call, each value typed by the tool's parameter schema where the request gives one (`_typed`),
        a string otherwise; None for a block without a name."""
        name = name.strip()
        if not name:
            return None
        tool = next((t["function"] for t in tools if t["function"]["name"] == name), None)
        properties = ((tool or {}).get("parameters") or {}).get("properties") or {}
        arguments = {key.strip(): _typed(value, properties.get(key.strip())) for key, value in self.pairs(body)}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


@dataclasses.dataclass(frozen=True)
class _JsonFormat(_BlockFormat):
    """Blocks whose body is the arguments' JSON object (`fence`: inside a ```json fence); `named`: the function's
    name and the call's id (None: one of ours) in a block's header."""

    named: Callable[[str], tuple[str, str | None]] = lambda header: (header.strip(), None)
    fence: bool = False

    def call(self, header: str, body: str, tools: list[dict]) -> ToolCall | None:
        """A block's call, its arguments in json.dumps' form; None for a block without a name or whose body is not
        a JSON object."""
        name, call_id = self.named(header)
        body = body.strip()
        if self.fence:
            if not (body.startswith("```json") and body.endswith("```")):
                return None
            body = body[len("```json"):-len("```")]
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not name or not isinstance(arguments, dict):
            return None
        arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, arguments) if call_id is None else ToolCall(name, arguments, call_id)


# Qwen3-Coder's `<function=name>` blocks (inside <tool_call> tags) of <parameter=key>s; GLM-4.5's `<tool_call>name`
# blocks of <arg_key>/<arg_value> pairs
_QWEN3_XML = _XmlFormat(_XML_STARTS, _XML_FUNCTION, _qwen3_pairs)
_GLM45 = _XmlFormat(("<tool_call>",), _GLM_CALL, _GLM_ARGUMENT.findall)

# DeepSeek's special tokens (fullwidth bars, U+2581 for spaces)
_DS_CALLS, _DS_CALL = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>"
_DS_SEP, _DS_END = "<\uff5ctool\u2581sep\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
# DeepSeek V3 / R1: `<call begin>function<sep>NAME` then the arguments in a ```json fence, `<call end>`; V3.1 on:
# `<call begin>NAME<sep>ARGUMENTS<call end>`
_DEEPSEEK_V3 = _JsonFormat((_DS_CALLS, _DS_CALL), re.compile(
    re.escape(_DS_CALL) + r"[^\n]*?" + re.escape(_DS_SEP) + r"([^\n]*)\n(.*?)(" + re.escape(_DS_END) + "|$)",
    re.DOTALL), fence=True)
_DEEPSEEK_V31 = _JsonFormat((_DS_CALLS, _DS_CALL), re.compile(
    re.escape(_DS_CALL) + r"(.*?)" + re.escape(_DS_SEP) + r"(.*?)(" + re.escape(_DS_END) + "|$)", re.DOTALL))


def _kimi_name(header: str) -> tuple[str, str]:
    """Kimi K2's call header `functions.NAME:INDEX`: the name, and the header itself as the call's id (its template
    writes the ids back so)."""
    call_id = header.strip()
    return call_id.split(":")[0].split(".")[-1], call_id


_KIMI_SECTION, _KIMI_CALL, _KIMI_ARGUMENTS, _KIMI_END = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                         "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_KIMI_K2 = _JsonFormat((_KIMI_SECTION, "<|tool_call_section_begin|>", _KIMI_CALL), re.compile(
    re.escape(_KIMI_CALL) + r"(.*?)" + re.escape(_KIMI_ARGUMENTS) + r"(.*?)(" + re.escape(_KIMI_END) + "|$)",
    re.DOTALL), named=_kimi_name)


class _BlockStream:
    """Content streams up to a possible start of a call's tag (the format's `starts`); each call goes out, arguments
    whole, once its block closes (the text between calls being framing), an open one when the output ends. A closed
    block that does not parse, or an output with no block after the tag, goes out as content."""

    def __init__(self, tools: list[dict], fmt: _BlockFormat):
        self.tools, self.fmt = tools, fmt
        self.sent = 0  # characters handled (sent as content, or read as calls)
        self.in_calls = False
        self.any_call = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        if not self.in_calls:
            content, self.sent, self.in_calls = _content_before(text, self.sent, self.fmt.starts, final)
            if not self.in_calls:
                return content, []
        for match in self.fmt.blocks.finditer(text, self.sent):
            if not match.group(3) and not final:  # still open
                break
            call = self.fmt.call(match.group(1), match.group(2), self.tools)
            if call is None:
                content += text[self.sent:match.end()]
            else:
                calls.append(call)
                self.any_call = True
            self.sent = match.end()
        if final and not self.any_call:
            content, self.sent = content + text[self.sent:], len(text)
        return content, calls


class _Blocks:
    """A parser of a `_BlockFormat`'s calls, made for a request's tools (`with_tools`)."""

    FORMAT: _BlockFormat

    def __init__(self, tools: list[dict]):
        self.tools = tools

    @classmethod
    def with_tools(cls, tools: list[dict]) -> "_Blocks":
        return cls(tools)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self.FORMAT.parse(text, self.tools)

    def Stream(self):
        return _BlockStream(self.tools, self.FORMAT)


class Qwen3Xml(_Blocks):
    """`qwen3_coder` / `qwen3_xml` (Qwen3-Coder and later Qwen templates): each call a `<function=name>` block of
    `<parameter=key>value</parameter>`s, inside <tool_call> tags; the text before the first is the content. The
    parameters are typed by the request's tool schemas, so a parser is made for a request's tools."""

    FORMAT = _QWEN3_XML


class Glm45(_Blocks):
    """`glm45` (GLM-4.5/4.6): each call `<tool_call>name` then `<arg_key>key</arg_key><arg_value>value</arg_value>`
    pairs, `</tool_call>`; the text before the first is the content; typed as Qwen3-Coder's. Its tags are special
    tokens, kept in such requests' text, as vLLM's parser keeps them."""

    FORMAT = _GLM45
    special_tokens = True


class DeepSeekV3(_Blocks):
    """`deepseek_v3` (DeepSeek V3 and R1-0528): the content, then `<｜tool▁calls▁begin｜>` and each call as
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a newline, its arguments' JSON object in a ```json fence,
    `<｜tool▁call▁end｜>`. Each call goes out as it closes; a block that does not parse makes the output content. Its
    tags are special tokens: requests keep them in their text."""

    FORMAT = _DEEPSEEK_V3
    special_tokens = True


class DeepSeekV31(DeepSeekV3):
    """`deepseek_v31` (DeepSeek V3.1 on): as `deepseek_v3`, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>` and its
    arguments' JSON object, `<｜tool▁call▁end｜>`."""

    FORMAT = _DEEPSEEK_V31


class KimiK2(DeepSeekV3):
    """`kimi_k2` (Kimi K2): the content, then `<|tool_calls_section_begin|>` and each call as
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>` and its arguments' JSON object,
    `<|tool_call_end|>`; the call's id is its header (`functions.NAME:INDEX`), as vLLM gives it and Kimi's template
    writes it back."""

    FORMAT = _KIMI_K2


def _parse_harmony(text: str) -> tuple[str | None, list[ToolCall]]:
    content, calls = harmony.answer_and_calls(text)
    return content or None, [ToolCall(name, arguments) for name, arguments in calls]


class _HarmonyStream:
    """Content as its messages grow; a call's header (id and name) once its message's header has ended (its
    `<|message|>`), then its arguments' text as it grows (as vLLM's openai parser streams them: the model's own
    text, not re-serialised)."""

    def __init__(self):
        self.sent = 0  # content characters sent
        self.arguments = []  # each call's arguments sent

    def feed(self, text: str, final: bool = False) -> tuple[str, list]:
        content, calls = harmony.answer_and_calls(text, final)
        deltas = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.arguments):
                self.arguments.append("")
                deltas.append(ToolCallDelta(index, "", ToolCall(name, "")))
            if len(arguments) > len(self.arguments[index]):
                deltas.append(ToolCallDelta(index, arguments[len(self.arguments[index]):]))
                self.arguments[index] = arguments
        delta, self.sent = content[self.sent:], max(self.sent, len(content))
        return delta, deltas


_GEMMA4_CALL, _GEMMA4_CALL_END, _GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA4_NAME = re.compile(r"call:([\w.-]+)\{")
_GEMMA4_BARE = re.compile(r"[^,}\]]*")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _gemma4_value(text: str, at: int):
    """(value, the index after it) of Gemma 4's argument syntax at `at`: a string between <|"|> quotes, an object
    {key:value,...} (keys bare or quoted), an array [value,...], or a bare number, true, false or null (other bare
    text: a string, as Gemma 4's parsers read it). A ValueError where it is malformed."""
    at = _skip_space(text, at)
    if text.startswith(_GEMMA4_QUOTE, at):
        end = text.find(_GEMMA4_QUOTE, at + len(_GEMMA4_QUOTE))
        if end < 0:
            raise ValueError("an unterminated string")
        return text[at + len(_GEMMA4_QUOTE):end], end + len(_GEMMA4_QUOTE)
    if text.startswith("{", at):
        return _gemma4_object(text, at + 1)
    if text.startswith("[", at):
        return _gemma4_items(text, at + 1, "]", _gemma4_value)
    word = _GEMMA4_BARE.match(text, at).group(0)
    if at + len(word) >= len(text):
        raise ValueError("an unterminated value")
    bare = word.strip()
    if bare in ("true", "false", "null"):
        return json.loads(bare), at + len(word)
    try:
        number = json.loads(bare)
    except json.JSONDecodeError:
        return bare, at + len(word)
    return (number if isinstance(number, (int, float)) and _finite(number) else bare), at + len(word)


def _gemma4_items(text: str, at: int, close: str, item) -> tuple[list, int]:
    """The items `item(text, at) -> (item, the index after it)` reads from `at` on, separated by commas up to `close`:
    (their list, the index after `close`)."""
    items, at = [], _skip_space(text, at)
    if text.startswith(close, at):
        return items, at + 1
    while True:
        value, at = item(text, at)
        items.append(value)
        at = _skip_space(text, at)
        if not text.startswith((",", close), at):
            raise ValueError(f"no {close!r} after the items")
        if text[at] == close:
            return items, at + 1
        at += 1


def _gemma4_pair(text: str, at: int) -> tuple[tuple, int]:
    """An object's `key:value` at `at` (the key bare or quoted), and the index after it."""
    at = _skip_space(text, at)
    if text.startswith(_GEMMA4_QUOTE, at):
        key, at = _gemma4_value(text, at)
        at = _skip_space(text, at)
    else:
        colon = text.find(":", at)
        key, at = text[at:colon].strip(), colon if colon >= 0 else len(text)
    if not text.startswith(":", at):
        raise ValueError("a key without a value")
    value, at = _gemma4_value(text, at + 1)
    return (key, value), at


def _gemma4_object(text: str, at: int) -> tuple[dict, int]:
    """The object whose "{" ends before `at` (`_gemma4_value`), and the index after its "}"."""
    pairs, at = _gemma4_items(text, at, "}", _gemma4_pair)
    return dict(pairs), at


def _parse_gemma4(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call, calls), each `<|tool_call>call:NAME{ARGS}` closed by `<tool_call|>` (or by the
    output's end); (text, []) where there are none or one does not parse."""
    first = text.find(_GEMMA4_CALL)
    if first < 0:
        return text, []
    calls, at = [], first
    while (at := text.find(_GEMMA4_CALL, at)) >= 0:
        name = _GEMMA4_NAME.match(text, at + len(_GEMMA4_CALL))
        try:
            arguments, at = _gemma4_object(text, name.end()) if name else (None, at)
        except ValueError:
            return text, []
        if name is None:
            return text, []
        calls.append(ToolCall(name.group(1), json.dumps(arguments, ensure_ascii=False)))
    return text[:first] or None, calls


class Gemma4:
    parse = staticmethod(_parse_gemma4)
    special_tokens = True  # its calls' tags and quotes are special tokens

    @staticmethod
    def Stream():
        return _TaggedStream(_GEMMA4_CALL, _parse_gemma4)


class OpenAI:
    """`openai` (GPT-OSS): harmony messages to `functions.NAME` are calls of NAME with their content as the
    arguments; the other messages' contents are the message's content (jaxengine.harmony)."""
    parse = staticmethod(_parse_harmony)
    Stream = _HarmonyStream
    special_tokens = True  # the messages' headers are special tokens


PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral, "pythonic": Pythonic,
           "qwen3_coder": Qwen3Xml, "qwen3_xml": Qwen3Xml, "openai": OpenAI, "granite": Granite, "glm45": Glm45,
           "deepseek_v3": DeepSeekV3, "deepseek_v31": DeepSeekV31, "kimi_k2": KimiK2, "gemma4": Gemma4}
TOOL_CALL_PARSERS = tuple(PARSERS)


def required_schema(tools: list[dict], single: bool) -> dict:
    """tool_choice "required", as vLLM holds it: the output is a JSON array of one call or more, each
    {"name": one of the tools, "parameters": that tool's parameters} (`single`: exactly one)."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                "parameters": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({"maxItems": 1} if single else {})


def _parse_required(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:  # cut by the token limit
        return text, []
    calls = [_call_of(item) for item in value] if isinstance(value, list) else [None]
    return (None, calls) if calls and None not in calls else (text, [])


class RequiredCalls:
    """tool_choice "required": the output (held to `required_schema`) is the calls."""
    parse = staticmethod(_parse_required)

    @staticmethod
    def Stream():
        return _WholeStream(_parse_required)


class NamedCall:
    """tool_choice naming a function: the output (held to its parameters' schema) is that call's arguments."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return None, [ToolCall(self.name, text)]

    def Stream(self):
        return _WholeStream(self.parse)
