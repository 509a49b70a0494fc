"""Turns OpenAI requests into engine requests and engine outputs into OpenAI responses and SSE chunks."""

import asyncio
import base64
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxengine.engine.beam_search import BeamSearch, BeamSearchParams, advance_all, beam_step_params, live_prompts
from jaxengine.engine.pooler import check_cross_encoder, cosine_similarity, cross_encoder_ids, score_pairs
from jaxengine.llm import chat_prompt_ids
from jaxengine.lora import LoRARequest
from jaxengine.outputs import RequestOutput
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from server.engine_client import AsyncEngine, EngineDeadError
from server.errors import APIError, error_body
from server.protocol import (ChatCompletionRequest, ChatMessage, ClassificationRequest, CompletionRequest,
                             EmbeddingRequest, RerankRequest, SamplingFields, ScoreRequest, ScoringFields,
                             TokenizeRequest)
from server.responses import ResponsesAPI, ResponseStore
from server.tool_parsers import (PARSERS, TOOL_CALL_PARSERS, NamedCall, RequiredCalls, ToolCall,
                                 required_schema)


def _refused_field(message: str, req: SamplingFields) -> str | None:
    """The request field an engine refusal is about (its error's `param`): the engine's messages begin with its
    name for the field (prompt_token_ids is the request's prompt, or a chat's messages; a chat's logprobs count
    is its top_logprobs); None where that is no field of the request."""
    name = re.match(r"\w*", message).group()
    chat = isinstance(req, ChatCompletionRequest)
    if name == "structured_outputs" and req.structured_outputs is None:
        return "response_format"  # a chat's response_format made them
    if name.startswith("prompt") and name != "prompt_logprobs":
        return "messages" if chat else {EmbeddingRequest: "input", ClassificationRequest: "input",
                                        CompletionRequest: "prompt"}.get(type(req))
    if chat and name == "logprobs":
        return "top_logprobs"
    return name if name in type(req).model_fields else None


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, defaults: dict) -> SamplingParams:
    """The request's SamplingParams. A field it leaves unset takes the model's generation-config default
    (`defaults`, see EngineConfig.generation_config), else the OpenAI API's."""
    def given(name: str, fallback):
        value = getattr(req, name)
        return defaults.get(name, fallback) if value is None else value

    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
    fields = dict(
        structured_outputs=_structured_outputs(req), n=req.n, temperature=given("temperature", 1.0),
        top_p=given("top_p", 1.0), top_k=given("top_k", 0),
        min_p=given("min_p", 0.0), seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        presence_penalty=given("presence_penalty", 0.0), frequency_penalty=given("frequency_penalty", 0.0),
        repetition_penalty=given("repetition_penalty", 1.0), logit_bias=bias,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, output_kind=RequestOutputKind.CUMULATIVE)
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(" ")[0]) from None


def _structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's `structured_outputs` (vLLM's field), a chat's `response_format` of type json_object or
    json_schema (as vLLM maps them), or what a tool_choice that forces a call holds the output to; one of them."""
    fmt = getattr(req, "response_format", None)
    kind = None if fmt is None else fmt.type
    choice = getattr(req, "tool_choice", None)
    if getattr(req, "tools", None) and (choice == "required" or isinstance(choice, dict)):
        if req.structured_outputs is not None or kind in ("json_object", "json_schema"):
            raise APIError("a tool_choice that forces a call constrains the output itself: not with response_format "
                           "or structured_outputs", param="tool_choice")
        if choice == "required":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            return StructuredOutputsParams(json=required_schema(tools, single=req.parallel_tool_calls is False))
        return StructuredOutputsParams(json=_named_tool(req).function.parameters or {"type": "object"})
    if kind not in (None, "text", "json_object", "json_schema"):
        raise APIError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                       param="response_format")
    given = req.structured_outputs
    if given is not None and kind in ("json_object", "json_schema"):
        raise APIError("response_format and structured_outputs cannot both constrain the output",
                       param="response_format")
    try:
        if given is not None:
            return StructuredOutputsParams(**given.model_dump(by_alias=True))
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = (fmt.model_extra or {}).get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError("response_format json_schema needs a json_schema object with a 'schema' (a JSON "
                               "schema object)", param="response_format")
            return StructuredOutputsParams(json=spec.get("schema", {}))
    except ValueError as e:
        raise APIError(str(e), param="structured_outputs" if given is not None else "response_format") from None
    return None


def _running_usage(req: SamplingFields, prompt_tokens: int, completion_tokens: int) -> dict:
    """`stream_options.continuous_usage_stats` (with include_usage), as vLLM: every chunk carries the usage of its
    choice so far (its prompt's tokens and the tokens generated for it)."""
    options = req.stream_options
    if not (options and options.include_usage and options.continuous_usage_stats):
        return {}
    return {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _usage_chunks(req: SamplingFields, base: dict, usage) -> list[dict]:
    """A stream's last chunk under `stream_options.include_usage`, as vLLM: no choices, the request's usage
    (`usage()`, counted only then); none without it."""
    if not (req.stream_options and req.stream_options.include_usage):
        return []
    return [base | {"choices": [], "usage": usage()}]


def _usage(prompts: list[list[int]], finals: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


_EMBED_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _encode_embedding(vector: np.ndarray, req: EmbeddingRequest) -> list[float] | str:
    """A list of floats, or (`encoding_format` base64) the base64 of its values' bytes as `embed_dtype` in
    `endianness` (the OpenAI client decodes float32 in the machine's order, which is vLLM's default)."""
    if req.encoding_format == "float":
        return vector.tolist()
    values = vector.astype(_EMBED_DTYPES[req.embed_dtype])
    bits = values.view(np.uint16 if values.itemsize == 2 else np.uint32)
    if req.endianness != "native":
        bits = bits.astype(bits.dtype.newbyteorder(">" if req.endianness == "big" else "<"))
    return base64.b64encode(bits.tobytes()).decode("ascii")


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-Sent Events framing shared by completions and chat: each chunk, an error event if the engine
    fails or refuses mid-stream, then `[DONE]`."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except (EngineDeadError, ValueError) as e:
        yield _sse(error_body(str(e), 500 if isinstance(e, EngineDeadError) else 400))
    yield _sse("[DONE]")


def load_chat_template(value: str) -> str:
    """--chat-template, as vLLM reads it: a file's path, or the Jinja template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


class Serving(ResponsesAPI):
    def __init__(self, engine: AsyncEngine, model_name: str | list[str], chat_template: str | None = None,
                 trust_request_chat_template: bool = False, return_tokens_as_token_ids: bool = False,
                 tool_call_parser: str | None = None, lora_modules: list | None = None,
                 responses_store_size: int = 1024):
        """`model_name`: the served name or names (requests may name any; responses carry the first).
        `chat_template`: the template for chat requests over the tokenizer's (--chat-template);
        `trust_request_chat_template`: a request's own `chat_template` is taken (otherwise refused, as vLLM);
        `return_tokens_as_token_ids`: the default of the requests' field (--return-tokens-as-token-ids);
        `tool_call_parser`: how tool calls are found in outputs, one of TOOL_CALL_PARSERS (vLLM's
        --enable-auto-tool-choice --tool-call-parser); None: requests with tools and tool_choice auto are refused.
        `lora_modules`: LoRA adapters (jaxengine.LoRARequest) served under their names (vLLM's --lora-modules):
        a request that names one runs with it; each is read here, so one that does not fit stops the start.
        `responses_store_size`: how many Responses API responses are kept for previous_response_id and GET (the
        newest; 0 keeps none)."""
        self.response_store = ResponseStore(responses_store_size)
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool call parser {tool_call_parser!r} is not supported; supported: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        self.tool_call_parser = tool_call_parser
        self.engine = engine
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(f"served model names must be non-empty strings, got {model_name!r}")
        self.model_name = self.model_names[0]
        self.loras = {}
        for lora in lora_modules or []:
            if lora.lora_name in self.model_names or lora.lora_name in self.loras:
                raise ValueError(f"--lora-modules: the name {lora.lora_name!r} is already served")
            engine.engine.add_lora(lora)
            self.loras[lora.lora_name] = lora
        self.tokenizer = engine.engine.tokenizer
        self.reasoning = engine.engine.reasoning  # the engine's --reasoning-parser (jaxengine.reasoning), or None
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        if chat_template is not None:
            self._check_template_syntax(chat_template)

    def _check_template_syntax(self, template: str) -> None:
        """A server's template that cannot be parsed fails at start, not on every chat request. Errors that
        depend on the conversation (a template's raise_exception on role order, say) are left to requests."""
        import jinja2

        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                               tokenize=False)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template: the template does not parse: {e}") from None
        except Exception:  # noqa: BLE001 - parsed; this conversation is not one it accepts
            pass

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names and name not in self.loras:
            served = ", ".join(map(repr, self.model_names + list(self.loras)))
            raise APIError(f"model {name!r} does not exist; this server serves {served}", status=404,
                           param="model", code="model_not_found")

    async def load_lora(self, req) -> str:
        """Serves a LoRA adapter under its name from here on (POST /v1/load_lora_adapter, as vLLM's): read on the
        engine thread (between steps), a 400 where it does not fit or the name is taken."""
        if req.lora_name in self.loras or req.lora_name in self.model_names:
            raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
        engine = self.engine.engine

        def add() -> LoRARequest:  # an id no adapter of the engine's or the server's has
            taken = engine.list_loras() | {r.lora_int_id for r in self.loras.values()}
            lora = LoRARequest(req.lora_name, max(taken, default=0) + 1, req.lora_path)
            engine.add_lora(lora)
            return lora

        try:
            lora = await self.engine.call(add)
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        self.loras[req.lora_name] = lora
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload_lora(self, req) -> str:
        """Stops serving an adapter (POST /v1/unload_lora_adapter): 404 where none has the name, 400 while requests
        use it."""
        lora = self.loras.get(req.lora_name)
        if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
            raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", status=404, param="lora_name",
                           code="not_found")
        if not await self.engine.call(lambda: self.engine.engine.remove_lora(lora.lora_int_id)):
            raise APIError(f"The lora adapter '{req.lora_name}' is in use by running requests; unload it when they "
                           f"have finished.", param="lora_name")
        del self.loras[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _model_of(self, req) -> str:
        """The model a response names: the LoRA adapter the request named, else the served (first) name."""
        return req.model if req.model in self.loras else self.model_name

    def _check_runner(self, runner: str, route: str, task: str | None = None) -> None:
        """A route of another runner's (or pooling task's) kind is refused (400, as vLLM's server has no such route
        there), saying which the server does."""
        engine = self.engine.engine
        if engine.runner_type == runner and (task is None or task == engine.pooling_task):
            return
        if engine.runner_type == "generate":
            does = "generates text: this route needs a server started with --runner pooling (an embedding model or a "
            does += "classifier)"
        elif engine.pooling_task == "embed":
            does = "makes embeddings (--runner pooling): use /v1/embeddings, /v1/score or /v1/rerank"
        else:
            does = "is a classifier (--runner pooling): use /classify, or /v1/score and /v1/rerank with one label"
        raise APIError(f"{route}: this model {does}", param="model")

    def _admitted(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                  req: SamplingFields) -> list[tuple[str | None, list[int]]]:
        """The prompts as the engine will run them (truncate_prompt_tokens applied; a cut prompt loses its text,
        so echo and usage show what the model saw), each checked by the engine before any is submitted."""
        engine = self.engine.engine
        admitted = []
        try:
            for text, ids in prompts:
                kept = engine.truncate_prompt(ids, params)
                engine.validate(kept, params)
                admitted.append((text if len(kept) == len(ids) else None, kept))
        except ValueError as e:
            raise APIError(str(e), param=_refused_field(str(e), req)) from None
        return admitted

    async def _finals(self, request_id: str, prompts, params: SamplingParams, req) -> dict[int, RequestOutput]:
        """Each prompt's final output, for a response that is not streamed. A refusal when the engine admits the
        request (its id already in use) is the request's fault: 400, where a stream sends it as an error event."""
        finals = {}
        try:
            async for i, out in self._run_all(request_id, prompts, params, req):
                if out.finished:
                    finals[i] = out
        except ValueError as e:
            raise APIError(str(e), param="request_id" if "request_id" in str(e) else None) from None
        return finals

    async def _run_all(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                       req: SamplingFields) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submits every prompt and yields (prompt index, cumulative output) as they arrive."""

        def generate(i, text, ids):
            return self.engine.generate(f"{request_id}-{i}", {"prompt": text, "prompt_token_ids": ids}, params,
                                        priority=req.priority, cache_salt=getattr(req, "cache_salt", None),
                                        lora_request=self.loras.get(req.model))

        if len(prompts) == 1:  # nothing to merge: no task and queue in between
            async with contextlib.aclosing(generate(0, *prompts[0])) as outputs:  # closed (aborted) on leaving
                async for out in outputs:
                    yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, text, ids):
            try:
                async for out in generate(i, text, ids):
                    await merged.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await merged.put((i, e))

        tasks = [asyncio.create_task(pump(i, t, ids)) for i, (t, ids) in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for task in tasks:
                task.cancel()

    # --- embeddings ----------------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest) -> dict:
        """Each input's embedding from a pooling engine (runner 'pooling'), as vLLM's /v1/embeddings: floats, or
        base64 of their bytes (`embed_dtype`, `endianness`)."""
        self.check_model(req.model)
        self._check_runner("pooling", "/v1/embeddings", task="embed")
        if (req.input is None) == (req.messages is None):
            raise APIError("give exactly one of input or messages", param="input")
        if req.input is not None and not req.input:
            raise APIError("input must not be empty", param="input")
        params = self._pooling_params(req, dimensions=req.dimensions)
        if req.messages is not None:
            if req.add_generation_prompt and req.continue_final_message:
                raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                               param="continue_final_message")
            batched = isinstance(req.messages[0], list)
            conversations = req.messages if batched else [req.messages]
            prompts = [(None, self.chat_prompt(req.model_copy(update={"messages": c}))) for c in conversations]
        else:
            prompts = self._completion_prompts(req.input, req.add_special_tokens is not False)
        request_id = req.request_id or f"embd-{uuid.uuid4().hex}"
        pooled, tokens = await self._pool(request_id, req, prompts, params)
        data = [{"index": i, "object": "embedding", "embedding": _encode_embedding(vector, req)}
                for i, vector in enumerate(pooled)]
        return self._pooling_response(request_id, data, tokens)

    async def classify(self, req: ClassificationRequest) -> dict:
        """vLLM's /classify: a sequence classifier's probabilities for each input, and its most likely label."""
        self.check_model(req.model)
        self._check_runner("pooling", "/classify", task="classify")
        if not req.input:
            raise APIError("input must not be empty", param="input")
        params = self._pooling_params(req)
        prompts = self._completion_prompts(req.input, req.add_special_tokens)
        request_id = req.request_id or f"classify-{uuid.uuid4().hex}"
        pooled, tokens = await self._pool(request_id, req, prompts, params)
        labels = self.engine.engine.classifier.labels
        data = [{"index": i, "label": labels[int(np.argmax(probs))], "probs": probs.tolist(),
                 "num_classes": len(probs)} for i, probs in enumerate(pooled)]
        return self._pooling_response(request_id, data, tokens)

    @staticmethod
    def _pooling_params(req, **fields) -> PoolingParams:
        """A pooling route's PoolingParams (its truncate_prompt_tokens and use_activation, and `fields`); a bad
        value is a 400 naming it."""
        try:
            return PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, use_activation=req.use_activation,
                                 **fields)
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(" ")[0]) from None

    async def _pool(self, request_id: str, req, prompts, params: PoolingParams) -> tuple[list, int]:
        """Every prompt checked, then run: (each prompt's pooled data in order, the prompt tokens computed)."""
        prompts = self._admitted(prompts, params, req)
        finals = await self._finals(request_id, prompts, params, req)
        return [finals[i].outputs.data for i in range(len(prompts))], sum(len(ids) for _, ids in prompts)

    def _pooling_response(self, request_id: str, data: list[dict], tokens: int) -> dict:
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                        "prompt_tokens_details": None}}

    async def score(self, req: ScoreRequest) -> dict:
        """vLLM's /v1/score: an embedding model's cosine of each pair's embeddings, or a one-label classifier's
        score of each pair (1:1, 1:N or N:N)."""
        self.check_model(req.model)
        self._check_runner("pooling", "/v1/score")
        try:
            names = req.sides()
        except ValueError as e:
            raise APIError(str(e), param="queries") from None
        sides = [[t] if isinstance(t, str) else t for t in (getattr(req, name) for name in names)]
        request_id = req.request_id or f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._similarities(request_id, *sides, req, names)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.model_name,
                "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, req: RerankRequest) -> dict:
        """vLLM's /v1/rerank: the documents by their score against the query (as /v1/score's), highest first (the
        first `top_n` where it is set)."""
        self.check_model(req.model)
        self._check_runner("pooling", "/v1/rerank")
        documents = [req.documents] if isinstance(req.documents, str) else req.documents
        request_id = req.request_id or f"rerank-{uuid.uuid4().hex}"
        scores, tokens = await self._similarities(request_id, [req.query], documents, req, ("query", "documents"))
        results = sorted(({"index": i, "document": {"text": d}, "relevance_score": s}
                          for i, (d, s) in enumerate(zip(documents, scores))),
                         key=lambda r: r["relevance_score"], reverse=True)
        return {"id": request_id, "model": self.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results[: req.top_n or len(results)]}

    async def _similarities(self, request_id: str, first: list[str], second: list[str], req: ScoringFields,
                            names: tuple[str, str]) -> tuple[list[float], int]:
        """Each pair's score (score_pairs' order) and the prompt tokens computed: an embedding model's cosine (each
        text embedded once), a one-label classifier's score of the pair's joint encoding (a prompt per pair)."""
        classifier = self.engine.engine.pooling_task == "classify"
        try:
            pairs = score_pairs(len(first), len(second))
            if classifier:
                check_cross_encoder(self.engine.engine.classifier)
        except ValueError as e:
            raise APIError(str(e), param="model" if "classifier" in str(e) else names[1]) from None
        params = self._pooling_params(req)
        if classifier:
            prompts = [(None, cross_encoder_ids(self.tokenizer, first[i], second[j])) for i, j in pairs]
        else:
            prompts = self._completion_prompts(first + second, True)
        pooled, tokens = await self._pool(request_id, req, prompts, params)
        if classifier:
            return [float(data[0]) for data in pooled], tokens
        return [cosine_similarity(pooled[i], pooled[len(first) + j]) for i, j in pairs], tokens

    # --- completions ---------------------------------------------------------------------------------

    def _completion_prompts(self, prompt, add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        return [(p, self.tokenizer.encode(p, add_special_tokens=add_special_tokens)) if isinstance(p, str)
                else (None, list(p)) for p in prompt]

    async def completion(self, req: CompletionRequest):
        self.check_model(req.model)
        self._check_runner("generate", "/v1/completions")
        if req.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n (best-of ranking is not supported; use_beam_search ranks n beams)",
                           param="best_of")
        prompts = self._completion_prompts(req.prompt, req.add_special_tokens)
        # An explicit null is the default 16, as vLLM reads it (the generation config's limit is chat's only).
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if req.use_beam_search:
            return await self._beam_completion(req, prompts, max_tokens)
        if req.length_penalty != 1.0:
            raise APIError("length_penalty applies to beam search (use_beam_search)", param="length_penalty")
        # echo with max_tokens 0, as vLLM: the prompt comes back (with its logprobs if asked: how eval harnesses
        # score a text) and nothing is generated; the engine runs one token, which is dropped.
        echo_only = max_tokens == 0
        if echo_only and not req.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo: the prompt and its logprobs come back)",
                           param="max_tokens")
        self._check_streaming_fields(req)
        # The prompt's logprobs serve echo (as many as logprobs asks) and the prompt_logprobs field (as many as
        # it asks): the engine computes the larger count, each use keeps its own.
        echo_logprobs = req.logprobs if req.echo else None
        wanted = [n for n in (echo_logprobs, req.prompt_logprobs) if n is not None]
        params = sampling_params(req, max_tokens=max(max_tokens, 1), logprobs=req.logprobs,
                                 prompt_logprobs=max(wanted) if wanted else None,
                                 defaults=self.engine.engine.default_sampling)
        prompts = self._admitted(prompts, params, req)
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream and not echo_only:
            return _sse_stream(self._stream_completion(request_id, created, prompts, params, req))
        finals = await self._finals(request_id, prompts, params, req)
        choices = []
        for i in range(len(prompts)):
            for c in finals[i].outputs:
                if echo_only:  # the engine's one token is dropped
                    ids, lps, text, finish, stop = [], [] if c.logprobs is not None else None, "", "length", None
                else:
                    ids, lps, text, finish, stop = c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason
                logprobs = self._completion_logprobs(ids, lps, 0, self._as_ids(req))
                if req.echo:
                    text = self._echo_text(prompts[i]) + text
                    if logprobs is not None:
                        logprobs = self._merge_echo_logprobs(prompts[i][1], finals[i].prompt_logprobs, logprobs,
                                                             req)
                choices.append({"index": i * req.n + c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": finish, "stop_reason": stop}
                               | self._prompt_logprobs_field(prompts[i][1], finals[i].prompt_logprobs, req))
        usage = _usage([p[1] for p in prompts], {} if echo_only else finals)
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self._model_of(req)}
        if req.stream:  # echo_only: the whole prompt in one chunk per choice
            return _sse_stream(self._echo_chunks(base, choices, prompts, usage, req))
        return base | {"choices": choices, "usage": usage}

    # Fields beam search does not use: refused with it rather than ignored (vLLM's beam search drops them).
    _NOT_WITH_BEAMS = ("stream", "logprobs", "prompt_logprobs", "stop", "stop_token_ids", "top_p", "top_k", "min_p",
                       "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
                       "bad_words", "min_tokens", "seed", "structured_outputs", "suffix", "top_logprobs",
                       "response_format", "tools", "tool_choice")

    async def _beam_completion(self, req: CompletionRequest, prompts, max_tokens: int) -> dict:
        """use_beam_search, as vLLM's: each prompt's n best beams (jaxengine.engine.beam_search) as its choices,
        best first; `length_penalty`, `temperature`, `ignore_eos`, `include_stop_str_in_output`,
        `skip_special_tokens` and `echo` apply."""
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        prompts, results = await self._beam_search(request_id, req, prompts, max_tokens)
        choices, generated = [], 0
        for i, (prompt, (prompt_len, beams)) in enumerate(zip(prompts, results)):
            for j, beam in enumerate(beams):
                generated += len(beam.tokens) - prompt_len
                text = (self._echo_text(prompt) if req.echo else "") + beam.text
                choices.append({"index": i * req.n + j, "text": text, "logprobs": None,
                                "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason})
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self._model_of(req),
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                                              "total_tokens": prompt_tokens + generated}}

    async def _beam_search(self, request_id: str, req: SamplingFields, prompts, max_tokens: int):
        """Runs every prompt's search (its steps' requests through the engine together); returns the admitted
        prompts and each one's (prompt length, best beams, best first, `text` their generated tokens')."""
        given = [name for name in self._NOT_WITH_BEAMS if name in type(req).model_fields
                 and getattr(req, name) not in (None, False, [], {}, type(req).model_fields[name].default)]
        if given:
            raise APIError(f"{given[0]} is not supported with use_beam_search", param=given[0])
        engine = self.engine.engine
        try:
            params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                      temperature=engine.default_sampling.get("temperature", 1.0)
                                      if req.temperature is None else req.temperature,
                                      length_penalty=req.length_penalty,
                                      include_stop_str_in_output=req.include_stop_str_in_output,
                                      skip_special_tokens=req.skip_special_tokens)
            step = beam_step_params(params, engine.config.max_logprobs)
        except ValueError as e:
            name = str(e).split(" ")[0].split("=")[0]
            raise APIError(str(e), param={"beam_width": "n"}.get(name, name)) from None
        prompts = self._admitted(prompts, step, req)
        searches = [BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len) for _, ids in prompts]
        for t in range(params.max_tokens):
            live = live_prompts(searches)
            if not live:
                break
            finals = await self._finals(f"{request_id}-step{t}", [(None, tokens) for _, tokens in live], step, req)
            advance_all(searches, live, [finals[i].outputs[0].logprobs[0] for i in range(len(live))])

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

        return prompts, [(s.prompt_len, s.result(decode, with_prompt=False).sequences) for s in searches]

    @staticmethod
    async def _echo_chunks(base: dict, choices: list[dict], prompts, usage: dict, req: CompletionRequest):
        for choice in choices:
            yield base | {"choices": [choice]} | _running_usage(req, len(prompts[choice["index"] // req.n][1]), 0)
        for chunk in _usage_chunks(req, base, lambda: usage):
            yield chunk

    def _as_ids(self, req: SamplingFields) -> bool:
        """vLLM's return_tokens_as_token_ids: logprobs name their tokens "token_id:N" (two tokens that decode to
        the same text stay apart); the request's choice, else the server's."""
        given = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if given is None else given

    @staticmethod
    def _name(token: int, piece: str, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else piece

    def _completion_logprobs(self, token_ids, logprobs, offset, as_ids: bool) -> dict | None:
        """text_offset counts the text's characters either way (as_ids renames the tokens only)."""
        if logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(token_ids, logprobs):
            piece = self.tokenizer.decode([tok])
            tokens.append(self._name(tok, piece, as_ids))
            token_lps.append(entry[tok].logprob)
            tops.append({self._name(t, lp.decoded_token, as_ids): lp.logprob for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_text(self, prompt: tuple[str | None, list[int]]) -> str:
        return prompt[0] if prompt[0] is not None else self.tokenizer.decode(prompt[1])

    def _echo_shift(self, prompt_ids: list[int]) -> int:
        """Where the generated tokens' text offsets start after an echoed prompt: its tokens' pieces."""
        return sum(len(self.tokenizer.decode([t])) for t in prompt_ids)

    @staticmethod
    def _top(entry: dict, token: int, n: int) -> dict:
        """A prompt position's entry cut to the top n and the prompt's own token (the engine computes the larger
        of echo's and prompt_logprobs' counts)."""
        return {t: lp for t, lp in entry.items() if lp.rank <= n or t == token}

    def _merge_echo_logprobs(self, prompt_ids, prompt_logprobs, generated: dict, req: CompletionRequest) -> dict:
        as_ids, n = self._as_ids(req), req.logprobs
        pieces = [self.tokenizer.decode([t]) for t in prompt_ids]
        offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
        shift = sum(len(p) for p in pieces)
        return {
            "tokens": [self._name(t, p, as_ids) for t, p in zip(prompt_ids, pieces)] + generated["tokens"],
            "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(prompt_ids, prompt_logprobs)]
            + generated["token_logprobs"],
            "top_logprobs": [None if e is None else {self._name(t, lp.decoded_token, as_ids): lp.logprob
                                                     for t, lp in self._top(e, token, n).items()}
                             for token, e in zip(prompt_ids, prompt_logprobs)] + generated["top_logprobs"],
            "text_offset": offsets + [o + shift for o in generated["text_offset"]],
        }

    @staticmethod
    def _check_streaming_fields(req: SamplingFields) -> None:
        """As vLLM: prompt_logprobs only without streaming, stream_options only with it."""
        if req.prompt_logprobs is not None and req.stream:
            raise APIError("prompt_logprobs are not available with stream=true (as in vLLM)", param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options are only taken with stream=true", param="stream_options")

    def _prompt_logprobs_field(self, prompt_ids, prompt_logprobs, req: SamplingFields) -> dict:
        """vLLM's `prompt_logprobs` response field, where the request asked for it: per prompt token, None for the
        first, else {token id: {logprob, rank, decoded_token}} for the top prompt_logprobs and the token itself."""
        if req.prompt_logprobs is None:
            return {}
        as_ids = self._as_ids(req)
        return {"prompt_logprobs": [
            None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": self._name(t, lp.decoded_token, as_ids)}
                                    for t, lp in self._top(e, token, req.prompt_logprobs).items()}
            for token, e in zip(prompt_ids, prompt_logprobs)]}

    async def _stream_completion(self, request_id, created, prompts, params, req) -> AsyncIterator[dict]:
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, sample) -> (chars, tokens) sent
        finals, shifts, as_ids = {}, {}, self._as_ids(req)  # shifts: an echoed prompt's text offset, by prompt
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self._model_of(req)}
        async for i, out in self._run_all(request_id, prompts, params, req):
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                chars, ntok = sent.get((i, c.index), (0, 0))
                first = (i, c.index) not in sent
                text = c.text[chars:]
                if req.echo and first:
                    text = self._echo_text(prompts[i]) + text
                if not text and c.finish_reason is None and len(c.token_ids) == ntok:
                    continue
                logprobs = None
                if c.logprobs is not None:
                    new = (c.token_ids[ntok:], c.logprobs[ntok:])
                    if req.echo and first:  # the echoed prompt's own logprobs first, as without streaming
                        logprobs = self._merge_echo_logprobs(prompts[i][1], out.prompt_logprobs,
                                                             self._completion_logprobs(*new, 0, as_ids), req)
                    else:  # after an echo, text offsets count the echoed prompt's pieces first
                        if req.echo and i not in shifts:
                            shifts[i] = self._echo_shift(prompts[i][1])
                        logprobs = self._completion_logprobs(*new, shifts.get(i, 0) + chars, as_ids)
                sent[(i, c.index)] = (len(c.text), len(c.token_ids))
                yield base | {"choices": [{"index": i * req.n + c.index, "text": text, "logprobs": logprobs,
                                           "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]} \
                    | _running_usage(req, len(prompts[i][1]), len(c.token_ids))
        for chunk in _usage_chunks(req, base, lambda: _usage([p[1] for p in prompts], finals)):
            yield chunk

    # --- chat ----------------------------------------------------------------------------------------

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest) -> list[int]:
        """The token ids of a request's messages in the chat template (chat completions, /tokenize, embeddings): the
        request's template (where trusted), else the server's --chat-template, else the tokenizer's; tokenized
        as jaxengine.llm.chat_prompt_ids does for LLM.chat."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError("a request's chat_template is taken only from a server started with "
                           "--trust-request-chat-template", param="chat_template")
        template = self.chat_template if req.chat_template is None else req.chat_template
        if template is None and self.tokenizer.chat_template is None:
            raise APIError("this model's tokenizer has no chat template; start the server with --chat-template, "
                           "or use /v1/completions", param="messages")
        messages = [_template_message(m) for m in req.messages]
        # /tokenize renders a request's tools as they stand (nothing is parsed there); chat as its tool_choice says
        tools = getattr(req, "tools", None)
        if not isinstance(req, TokenizeRequest) and self._tool_choice(req) == "none":
            tools = None
        kwargs = req.chat_template_kwargs
        if getattr(req, "reasoning_effort", None) is not None:
            kwargs = {"reasoning_effort": req.reasoning_effort} | (kwargs or {})
        try:
            return chat_prompt_ids(self.tokenizer, messages, chat_template=template,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   chat_template_kwargs=kwargs,
                                   add_special_tokens=bool(req.add_special_tokens),
                                   tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None)
        except Exception as e:  # template errors are the request's fault (roles, kwargs, its own template)
            param = "chat_template" if req.chat_template is not None else "messages"
            raise APIError(f"could not apply the chat template: {e}", param=param) from None

    def _tool_choice(self, req) -> str:
        """As vLLM resolves a request's tool_choice: "none" (no tools rendered, nothing parsed), "auto" (calls
        parsed from the output by --tool-call-parser), "required" or "named" (the output held by structured
        outputs to calls, or to the named function's arguments)."""
        tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
        if choice is not None and not tools:
            raise APIError("tool_choice is only taken with tools", param="tool_choice")
        if not tools or choice == "none":
            return "none"
        if choice == "required":
            return "required"
        if isinstance(choice, dict):
            _named_tool(req)  # refused here if it names none of the tools
            return "named"
        if self.tool_call_parser is None:
            raise APIError('"auto" tool choice requires the server to be started with --enable-auto-tool-choice and '
                           "--tool-call-parser", param="tool_choice")
        return "auto"

    def _tool_calls(self, req):
        """What finds a request's calls in its outputs (`parse(text)` and `Stream()`), or None."""
        mode = self._tool_choice(req)
        if mode == "auto":
            parser = PARSERS[self.tool_call_parser]
            if hasattr(parser, "with_tools"):  # one that reads the request's tool schemas
                return parser.with_tools([t.model_dump(exclude_none=True) for t in req.tools])
            return parser
        if mode == "required":
            return RequiredCalls
        return NamedCall(_named_tool(req).function.name) if mode == "named" else None

    def _thinks(self, req) -> bool:
        """Whether a chat's output begins with reasoning (with --reasoning-parser)."""
        return self.reasoning is not None and self.reasoning.thinks(req.chat_template_kwargs)

    def _split_reasoning(self, text: str, req) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a chat's output, as vLLM's reasoning parsers give them: without a reasoning
        parser no reasoning and the whole text; with one, an empty answer is None, and the reasoning is None where
        the request did not think (Qwen3's enable_thinking false) or asked for none (include_reasoning false)."""
        if self.reasoning is None:
            return None, text
        thinks = self._thinks(req)
        reasoning, answer, _ = self.reasoning.split(text, thinks)
        return (reasoning if thinks and req.include_reasoning else None), answer or None

    def _answer_message(self, text: str, req) -> dict:
        """An assistant message of an output's text: its reasoning and answer (with --reasoning-parser)."""
        reasoning, answer = self._split_reasoning(text, req)
        return {"role": "assistant", "content": answer} | ({"reasoning": reasoning} if reasoning is not None else {})

    def _message(self, c, req) -> tuple[dict, str | None]:
        """A choice's assistant message and finish reason: its reasoning and answer (with --reasoning-parser); the
        calls its answer holds, where the request's tool_choice asks for them (finish reason tool_calls, but for a
        named function's, as OpenAI's)."""
        message = self._answer_message(c.text, req)
        finder = self._tool_calls(req)
        if finder is None:
            return message, c.finish_reason
        content, calls = finder.parse(message["content"] or "")
        if not calls:
            return message, c.finish_reason
        calls = calls[:1] if req.parallel_tool_calls is False else calls
        finish = c.finish_reason if isinstance(finder, NamedCall) else "tool_calls"
        return message | {"content": content, "tool_calls": [t.as_dict() for t in calls]}, finish

    def _keeping_special_tokens(self, req: ChatCompletionRequest) -> ChatCompletionRequest:
        """The request with skip_special_tokens off where the reasoning parser, or the tool-call parser its
        tool_choice uses, reads special tokens in the text."""
        auto = not req.use_beam_search and self._tool_choice(req) == "auto"  # beam search refuses tools itself
        if getattr(self.reasoning, "special_tokens", False) or (
                auto and getattr(PARSERS[self.tool_call_parser], "special_tokens", False)):
            return req.model_copy(update={"skip_special_tokens": False})
        return req

    def prepare_chat(self, req: ChatCompletionRequest):
        """(the request as it runs, its admitted prompt, its SamplingParams) for a chat that is not a beam search:
        a 400 for anything it asks that cannot be run (also the Responses API's way in)."""
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
        self._check_streaming_fields(req)
        req = self._keeping_special_tokens(req)
        ids = self.chat_prompt(req)
        params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                                 logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                 prompt_logprobs=req.prompt_logprobs, defaults=self.engine.engine.default_sampling)
        return req, self._admitted([(None, ids)], params, req), params

    async def chat(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        self._check_runner("generate", "/v1/chat/completions")
        if req.length_penalty != 1.0 and not req.use_beam_search:
            raise APIError("length_penalty applies to beam search (use_beam_search)", param="length_penalty")
        if req.use_beam_search:
            return await self._beam_chat(self._keeping_special_tokens(req))
        req, prompts, params = self.prepare_chat(req)
        ids = prompts[0][1]
        request_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return _sse_stream(self._stream_chat(request_id, created, prompts, params, req))
        final = (await self._finals(request_id, prompts, params, req))[0]
        choices = []
        for c in final.outputs:
            message, finish_reason = self._message(c, req)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0,
                                                            self._as_ids(req)),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": created, "model": self._model_of(req),
                "choices": choices, "usage": _usage([ids], {0: final})} \
            | self._prompt_logprobs_field(ids, final.prompt_logprobs, req)

    async def _beam_chat(self, req: ChatCompletionRequest) -> dict:
        """use_beam_search on chat, as vLLM's: the conversation's n best beams as the choices' messages, best
        first (tools and response_format are refused with it)."""
        ids = self.chat_prompt(req)
        request_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = (req.max_completion_tokens or req.max_tokens or self.engine.engine.default_sampling.get(
            "max_tokens") or max(self.engine.engine.max_model_len - len(ids), 1))
        prompts, [(prompt_len, beams)] = await self._beam_search(request_id, req, [(None, ids)], max_tokens)
        choices = [{"index": j, "message": self._answer_message(beam.text, req), "logprobs": None,
                    "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason}
                   for j, beam in enumerate(beams)]
        prompt_tokens, generated = len(prompts[0][1]), sum(len(b.tokens) - prompt_len for b in beams)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self._model_of(req),
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                                              "total_tokens": prompt_tokens + generated}}

    def _token_info(self, token: int, logprob: float, as_ids: bool) -> dict:
        """`bytes`: the token's text's UTF-8 bytes, also where as_ids names it "token_id:N"."""
        piece = self.tokenizer.decode([token])
        return {"token": self._name(token, piece, as_ids), "logprob": logprob, "bytes": list(piece.encode())}

    def _chat_logprobs(self, token_ids, logprobs, top_n: int, as_ids: bool) -> dict | None:
        if logprobs is None:
            return None
        content = []
        for tok, entry in zip(token_ids, logprobs):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top_n]  # ranks 1..top_n
            content.append(self._token_info(tok, entry[tok].logprob, as_ids)
                           | {"top_logprobs": [self._token_info(t, lp.logprob, as_ids) for t, lp in ranked]})
        return {"content": content}

    async def _stream_chat(self, request_id, created, prompts, params, req) -> AsyncIterator[dict]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self._model_of(req)}
        seen, final = set(), None
        async for out, c, delta, finish_reason, logprobs in self.chat_deltas(request_id, prompts, params, req):
            final = out
            if c.index not in seen:
                seen.add(c.index)
                yield base | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} \
                    | _running_usage(req, len(prompts[0][1]), 0)
            if not delta and c.finish_reason is None:
                continue
            yield base | {"choices": [{"index": c.index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": c.stop_reason}]} \
                | _running_usage(req, len(prompts[0][1]), len(c.token_ids))
        for chunk in _usage_chunks(req, base, lambda: _usage([prompts[0][1]], {0: final})):
            yield chunk

    async def chat_deltas(self, request_id, prompts, params, req) -> AsyncIterator[tuple]:
        """A streamed chat's updates: (the request's output so far, a choice, its delta (`reasoning`, `content`,
        `tool_calls` pieces: what it adds, empty where nothing new can be sent yet), its finish reason, its new
        tokens' logprobs in the chat form or None), on a choice's first output and on every later one with
        something to send. Also the Responses API's stream."""
        sent: dict[int, tuple[int, int]] = {}  # each choice's answer characters and tokens sent
        finder = self._tool_calls(req)
        streams = {}  # with tool calls: each choice's answer split into content and calls (the finder's Stream)
        reasoning_streams = {}  # with --reasoning-parser: each choice's text split into reasoning and answer
        calls_sent: dict[int, int] = {}
        async for _, out in self._run_all(request_id, prompts, params, req):
            for c in out.outputs:
                first = c.index not in sent
                if first:
                    sent[c.index], calls_sent[c.index] = (0, 0), 0
                    streams[c.index] = finder.Stream() if finder is not None else None
                    reasoning_streams[c.index] = (self.reasoning.stream(self._thinks(req))
                                                  if self.reasoning is not None else None)
                chars, ntok = sent[c.index]
                delta, finish_reason = {}, c.finish_reason
                answer = c.text
                if (thoughts := reasoning_streams[c.index]) is not None:
                    reasoning, _ = thoughts.feed(c.text, final=c.finish_reason is not None)
                    answer = thoughts.answer
                    if reasoning and req.include_reasoning:
                        delta["reasoning"] = reasoning
                if finder is not None:
                    text, calls = streams[c.index].feed(answer, final=c.finish_reason is not None)
                    pieces = []  # a whole call, or part of one (ToolCallDelta: its header, or its arguments')
                    for t in calls:
                        whole = isinstance(t, ToolCall)
                        index = calls_sent[c.index] if whole else t.index
                        if req.parallel_tool_calls is False and index > 0:
                            continue
                        pieces.append({"index": index} | t.as_dict() if whole else t.as_dict())
                        if whole or t.call is not None:
                            calls_sent[c.index] = index + 1
                    if pieces:
                        delta["tool_calls"] = pieces
                    if calls_sent[c.index] and finish_reason is not None and not isinstance(finder, NamedCall):
                        finish_reason = "tool_calls"
                else:
                    text = answer[chars:]
                if text:
                    delta = {"content": text} | delta
                if not delta and c.finish_reason is None:
                    if first:
                        yield out, c, delta, finish_reason, None
                    continue
                logprobs = self._chat_logprobs(c.token_ids[ntok:], c.logprobs[ntok:], req.top_logprobs or 0,
                                               self._as_ids(req)) \
                    if c.logprobs is not None else None
                sent[c.index] = (len(answer), len(c.token_ids))
                yield out, c, delta, finish_reason, logprobs


def _named_tool(req: ChatCompletionRequest):
    """The tool a tool_choice object names ({"type": "function", "function": {"name": ...}}); a 400 where it names
    none of the request's tools."""
    choice = req.tool_choice
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    tool = next((t for t in req.tools if t.function.name == name), None)
    if tool is None:
        raise APIError(f"tool_choice must name one of the request's tools as {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
    return tool


def _template_message(m: ChatMessage) -> dict:
    """A request's message as chat templates take it: text content; an assistant's calls with their arguments
    as objects where they are JSON (as vLLM hands them to templates, which index into them), a tool message's
    tool_call_id."""
    message = {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        if m.role != "assistant":
            raise APIError(f"reasoning is an assistant message's field, not a {m.role} message's", param="messages")
        # templates read one of these names (GPT-OSS's `thinking`: its analysis channel)
        message["reasoning"] = message["reasoning_content"] = message["thinking"] = reasoning
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": t.id, "type": t.type,
             "function": {"name": t.function.name, "arguments": _json_or_text(t.function.arguments)}}
            for t in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
