"""OpenAI's Responses API as vLLM serves it: POST /v1/responses (unstreamed, or streamed as the API's typed events),
GET and DELETE /v1/responses/{id}.

A request becomes a chat request: `instructions` a system message, `input`'s items the conversation (messages,
function calls and their outputs, reasoning), function `tools`, `tool_choice`, `text.format` (structured outputs),
`reasoning.effort` (the chat template's reasoning_effort); it runs through the chat route's machinery (chat template,
reasoning parser, tool-call parser) and its output comes back as output items: `reasoning` (with a reasoning
parser), an assistant `message` of `output_text`, and a `function_call` per call. Responses are kept (the newest
--responses-store-size, in memory) for `previous_response_id`, which continues a stored conversation, and for GET.
"""

import collections
import copy
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from server.engine_client import EngineDeadError
from server.errors import APIError
from server.protocol import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, ResponseFormat,
                             ResponsesRequest, Tool, ToolCallMessage)

LOGPROBS = "message.output_text.logprobs"  # the one `include` value this server has something for
# The chat request's fields that a refusal from the chat machinery may name, as the Responses API names them.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "logprobs": "include"}
_ITEM_FIELDS = {"message": {"type", "role", "content", "id", "status"},
                "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
                "function_call_output": {"type", "call_id", "output", "id", "status"},
                "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}


class ResponseStore:
    """Stored responses and the conversations they end (what previous_response_id continues): the newest
    `capacity`, the oldest dropped first."""

    def __init__(self, capacity: int):
        self.check_capacity(capacity)
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list[ChatMessage]]] = collections.OrderedDict()

    @staticmethod
    def check_capacity(capacity: int) -> None:
        """--responses-store-size's check (the CLI makes it before the model loads)."""
        if capacity < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {capacity}")

    def put(self, response: dict, conversation: list[ChatMessage]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[ChatMessage]]:
        if response_id not in self._items:
            raise APIError(f"Response with id {response_id!r} not found", status=404, code="not_found")
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def _text_of(content, where: str) -> str:
    """A message item's content (a text, or input_text / output_text parts) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a text or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise APIError(f"{where}.content[{j}]: {kind!r} content is not supported (this server takes text: "
                           f"input_text and output_text parts)", param="input")
        if not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content[{j}].text must be a string", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise APIError(f"{where}.{name} must be a string", param="input")
    return item[name]


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's texts."""
    if item.get("encrypted_content") is not None:
        raise APIError(f"{where}.encrypted_content: this server writes no encrypted reasoning and reads none",
                       param="input")
    parts, kind = item.get("content"), "reasoning_text"
    if not parts:
        parts, kind = item.get("summary") or [], "summary_text"
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind
                                              and isinstance(p.get("text"), str) for p in parts):
        raise APIError(f"{where}: a reasoning item's content is a list of reasoning_text parts (its summary of "
                       f"summary_text parts)", param="input")
    return "\n".join(p["text"] for p in parts)


def input_messages(items: str | list) -> list[ChatMessage]:
    """`input` as chat messages: a text is a user message; items in order, an assistant turn's reasoning, message
    and function calls joined into one assistant message (as chat templates expect them), a function call's output
    a tool message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise APIError("input must not be empty", param="input")
    messages: list[ChatMessage] = []

    def assistant_turn(fresh: bool) -> ChatMessage:
        """The assistant message the item joins: the last message, where it is an assistant's still open to it."""
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or fresh:
            messages.append(ChatMessage(role="assistant", content=None))
        return messages[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an input item (an object)", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_FIELDS:
            raise APIError(f"{where}: {kind!r} items are not supported (this server takes message, function_call, "
                           f"function_call_output and reasoning items)", param="input")
        unknown = sorted(set(item) - _ITEM_FIELDS[kind])
        if unknown:
            raise APIError(f"{where}: a {kind} item has no field {unknown[0]!r}", param="input")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param="input")
            text = _text_of(item.get("content"), where)
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and last.role == "assistant" and last.content is None \
                    and not last.tool_calls:  # the answer after this turn's reasoning
                last.content = text
            else:
                messages.append(ChatMessage(role=role, content=text))
        elif kind == "function_call":
            call = ToolCallMessage(id=_string(item, "call_id", where),
                                   function=FunctionCall(name=_string(item, "name", where),
                                                         arguments=_string(item, "arguments", where)))
            turn = assistant_turn(fresh=False)
            turn.tool_calls = [*(turn.tool_calls or []), call]
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(ChatMessage(role="tool", tool_call_id=_string(item, "call_id", where),
                                        content=output if isinstance(output, str) else _text_of(output, where)))
        else:
            assistant_turn(fresh=True).reasoning = _reasoning_text(item, where)
    return messages


def _chat_tools(tools: list | None) -> list[Tool] | None:
    """Function tools in the chat form; any other kind is refused (this server runs no tools of its own)."""
    if tools is None:
        return None
    chat = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(f"tools[{i}]: {kind!r} tools are not supported: this server runs no tools of its own; "
                           f"give function tools, whose calls come back to you", param="tools")
        fields = {k: v for k, v in tool.items() if k != "type"}
        try:
            chat.append(Tool(function=FunctionDefinition(**fields)))
        except (ValidationError, TypeError) as e:
            first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
            where = ".".join(map(str, first["loc"]))
            raise APIError(f"tools[{i}]{'.' + where if where else ''}: {first['msg']}", param="tools") from None
    return chat


def _chat_tool_choice(choice):
    """`tool_choice` in the chat form: none, auto, required, or {"type": "function", "name": ...}."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
        raise APIError(f'tool_choice must be none, auto, required or {{"type": "function", "name": ...}}, got '
                       f"{choice!r}", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise APIError("text.format: a json_schema format needs its schema", param="text")
    return ResponseFormat(type="json_schema", json_schema={"name": fmt.name, "schema": fmt.schema_})


def _sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class _Events:
    """A streamed response's events: numbered, and the output items they build (the last one maybe still open)."""

    def __init__(self):
        self.numbers = itertools.count()
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # the function_call items by their call's index in the output

    def event(self, kind: str, **fields) -> dict:
        """An event as things stand now: a copy of the items and parts it carries, which later deltas extend."""
        return {"type": kind, "sequence_number": next(self.numbers)} | copy.deepcopy(fields)

    def close(self, status: str = "completed") -> list[dict]:
        """The events that end the open item (none where none is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = {"item_id": item["id"], "output_index": self.output.index(item)}
        if item["type"] == "function_call":
            done = [self.event("response.function_call_arguments.done", **at, name=item["name"],
                               arguments=item["arguments"])]
        else:
            part = item["content"][0]
            text_done = self.event("response.reasoning_text.done", **at, content_index=0, text=part["text"]) \
                if item["type"] == "reasoning" else \
                self.event("response.output_text.done", **at, content_index=0, text=part["text"],
                           logprobs=part["logprobs"])
            done = [text_done, self.event("response.content_part.done", **at, content_index=0, part=part)]
        return done + [self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def begin(self, item: dict) -> list[dict]:
        """The events that end the open item and open `item` (and its one content part, where it has one)."""
        events = self.close()
        self.output.append(item)
        self.open = item
        at = {"output_index": len(self.output) - 1}
        events.append(self.event("response.output_item.added", **at, item=item))
        if "content" in item:
            events.append(self.event("response.content_part.added", **at, item_id=item["id"], content_index=0,
                                     part=item["content"][0]))
        return events

    def text(self, kind: str, delta: str, logprobs: list | None = None) -> list[dict]:
        """Reasoning or answer text (kind `reasoning` or `message`): the events that add it to an item of its kind."""
        events = [] if self.open is not None and self.open["type"] == kind else \
            self.begin(_item(kind, "in_progress", ""))
        part = self.open["content"][0]
        part["text"] += delta
        at = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", **at, delta=delta)]
        part["logprobs"] += logprobs or []
        return events + [self.event("response.output_text.delta", **at, delta=delta, logprobs=logprobs or [])]

    def call(self, piece: dict) -> list[dict]:
        """A streamed tool-call piece (the chat form: its header with id and name, or a piece of its arguments)."""
        events = []
        if "id" in piece:
            item = _call_item(piece["id"], piece["function"]["name"], "", "in_progress")
            self.calls[piece["index"]] = item
            events = self.begin(item)
        item = self.calls[piece["index"]]
        if arguments := piece["function"].get("arguments"):
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=arguments))
        return events


def _item(kind: str, status: str, text: str, logprobs: list | None = None) -> dict:
    """A reasoning item of reasoning_text, or an assistant message of output_text (its one content part)."""
    if kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _turn(output: list[dict]) -> ChatMessage:
    """A response's output items as the assistant message a continued conversation carries."""
    reasoning = [p["text"] for i in output if i["type"] == "reasoning" for p in i["content"]]
    text = [p["text"] for i in output if i["type"] == "message" for p in i["content"]]
    calls = [ToolCallMessage(id=i["call_id"], function=FunctionCall(name=i["name"], arguments=i["arguments"]))
             for i in output if i["type"] == "function_call"]
    return ChatMessage(role="assistant", content="".join(text), reasoning="\n".join(reasoning) if reasoning else None,
                       tool_calls=calls or None)


class ResponsesAPI:
    """The Responses API's part of server.serving.Serving (which sets `response_store`)."""

    response_store: ResponseStore

    def _responses_refusals(self, req: ResponsesRequest) -> bool:
        """Refuses what cannot be honoured (400 naming the field); returns whether the response is stored."""
        refused = {"background": "background mode is not supported: a response runs while its request waits",
                   "max_tool_calls": "this server runs no tools of its own, so it has no tool calls to limit"}
        for name, why in refused.items():
            value = getattr(req, name)
            if value is not None and value is not False:  # max_tool_calls 0 too
                raise APIError(f"{name}: {why}", param=name)
        if req.truncation == "auto":
            raise APIError("truncation 'auto' is not supported: no input item is ever dropped (use 'disabled', and "
                           "keep the conversation within the model's context)", param="truncation")
        if req.reasoning is not None and req.reasoning.summary is not None:
            raise APIError("reasoning.summary: this server writes no reasoning summaries (the reasoning itself comes "
                           "back as a reasoning item's reasoning_text)", param="reasoning")
        include = req.include or []
        if other := [name for name in include if name != LOGPROBS]:
            raise APIError(f"include: {other[0]!r} is not available here (only {LOGPROBS!r})", param="include")
        if req.top_logprobs is not None and LOGPROBS not in include:
            raise APIError(f"top_logprobs needs include: [{LOGPROBS!r}]", param="top_logprobs")
        if LOGPROBS in include and (self.reasoning is not None or (req.tools and req.tool_choice != "none")):
            raise APIError(f"include {LOGPROBS!r} is not available with a reasoning parser or tool calls (the "
                           f"output's tokens are not split between its items)", param="include")
        if req.store and not self.response_store.capacity:
            raise APIError("store: this server keeps no responses (started with --responses-store-size 0)",
                           param="store")
        return req.store is not False and self.response_store.capacity > 0

    def _chat_of(self, req: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
        fields = dict(model=req.model, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed,
                      stop=req.stop, stop_token_ids=req.stop_token_ids, logit_bias=req.logit_bias,
                      ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, priority=req.priority,
                      cache_salt=req.cache_salt, user=req.user,
                      tools=_chat_tools(req.tools), tool_choice=_chat_tool_choice(req.tool_choice),
                      parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req),
                      reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
                      logprobs=LOGPROBS in (req.include or []), top_logprobs=req.top_logprobs, stream=req.stream)
        system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
        return ChatCompletionRequest(messages=system + conversation, **{k: v for k, v in fields.items()
                                                                         if v is not None})

    async def responses(self, req: ResponsesRequest):
        """POST /v1/responses: the response object, or (stream) its events as Server-Sent Events."""
        self.check_model(req.model)
        self._check_runner("generate", "/v1/responses")
        store = self._responses_refusals(req)
        history = []
        if req.previous_response_id is not None:
            try:
                history = self.response_store.get(req.previous_response_id)[1]
            except APIError as e:
                e.param = "previous_response_id"
                raise
        conversation = history + input_messages(req.input)
        try:
            chat, prompts, params = self.prepare_chat(self._chat_of(req, conversation))
        except APIError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise
        response_id = req.request_id or f"resp_{uuid.uuid4().hex}"
        run = (response_id, prompts, params, chat)
        head = dict(response_id=response_id, created=int(time.time()), req=req, params=params, store=store)
        if req.stream:
            return self._response_events(run, head, conversation)
        final = (await self._finals(*run))[0]
        c = final.outputs[0]
        message, _ = self._message(c, chat)
        output = []
        if message.get("reasoning") is not None:
            output.append(_item("reasoning", "completed", message["reasoning"]))
        calls = message.get("tool_calls", [])
        if message["content"] is not None or not calls:  # cut at max_output_tokens where it is the last item
            logprobs = self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, self._as_ids(chat))
            output.append(_item("message", "incomplete" if c.finish_reason == "length" and not calls else "completed",
                                message["content"] or "", logprobs and logprobs["content"]))
        output += [_call_item(t["id"], t["function"]["name"], t["function"]["arguments"], "completed")
                   for t in calls]
        return self._finished(head, output, final, chat, conversation)

    def _finished(self, head: dict, output: list[dict], final, chat, conversation) -> dict:
        """The finished response (stored, where it is kept)."""
        c = final.outputs[0]
        reasoning = self._reasoning_tokens(c.token_ids, chat)
        prompt, generated = len(final.prompt_token_ids), len(c.token_ids)
        # cache_write_tokens: OpenAI's explicit prompt caching, which this server does not offer (its prefix cache
        # is implicit: cached_tokens are the prompt's tokens it found there)
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                 "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
                 "total_tokens": prompt + generated}
        incomplete = c.finish_reason == "length"
        response = self._response(**head, status="incomplete" if incomplete else "completed", output=output,
                                  usage=usage, incomplete={"reason": "max_output_tokens"} if incomplete else None)
        if head["store"]:
            self.response_store.put(response, conversation + [_turn(output)])
        return response

    def _reasoning_tokens(self, token_ids: list[int], chat: ChatCompletionRequest) -> int:
        """How many of the output's tokens come before its answer starts (the reasoning's end tag with them; all of
        an output whose reasoning never ends): the fewest whose text the reasoning parser finds the answer
        begun in, found by bisection."""
        if self.reasoning is None or not self._thinks(chat):
            return 0

        def answered(n: int) -> bool:
            text = self.tokenizer.decode(token_ids[:n], skip_special_tokens=chat.skip_special_tokens)
            return self.reasoning.split(text, True, final=False)[2]

        low, high = 0, len(token_ids)
        if not answered(high):
            return high
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if answered(mid) else (mid + 1, high)
        return low

    def _response(self, response_id: str, created: int, req: ResponsesRequest, params, store: bool, status: str,
                  output: list[dict], usage: dict | None, incomplete: dict | None = None) -> dict:
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        return {"id": response_id, "object": "response", "created_at": created, "status": status,
                "background": False, "error": None, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
                "metadata": req.metadata or {}, "model": self._model_of(req), "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
                "service_tier": req.service_tier or "auto", "store": store, "temperature": params.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": choice, "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0,
                "top_p": params.top_p, "truncation": "disabled", "usage": usage, "user": req.user}

    async def _response_events(self, run: tuple, head: dict, conversation: list[ChatMessage]) -> AsyncIterator[str]:
        """A streamed response: created and in_progress, each output item's added / delta / done events as its text
        arrives, then completed (or incomplete, cut at max_output_tokens); an `error` event where the engine fails."""
        events = _Events()
        begun = self._response(**head, status="in_progress", output=[], usage=None)
        yield _sse_event(events.event("response.created", response=begun))
        yield _sse_event(events.event("response.in_progress", response=begun))
        final = None
        try:
            async for out, c, delta, _, logprobs in self.chat_deltas(*run):
                final = out
                pending = []
                if reasoning := delta.get("reasoning"):
                    pending += events.text("reasoning", reasoning)
                if delta.get("content") or logprobs and logprobs["content"]:
                    pending += events.text("message", delta.get("content", ""), logprobs and logprobs["content"])
                for piece in delta.get("tool_calls", []):
                    pending += events.call(piece)
                for event in pending:
                    yield _sse_event(event)
        except (EngineDeadError, ValueError) as e:
            yield _sse_event(events.event("error", code="500" if isinstance(e, EngineDeadError) else "400",
                                          message=str(e), param=None))
            return
        incomplete = final.outputs[0].finish_reason == "length"
        if not any(item["type"] != "reasoning" for item in events.output):  # no answer: an empty one, as unstreamed
            for event in events.begin(_item("message", "in_progress", "")):
                yield _sse_event(event)
        cut = incomplete and events.open is not None and events.open["type"] == "message"
        for event in events.close("incomplete" if cut else "completed"):
            yield _sse_event(event)
        response = self._finished(head, events.output, final, run[3], conversation)
        kind = "response.incomplete" if incomplete else "response.completed"
        yield _sse_event(events.event(kind, response=response))
