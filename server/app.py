"""The FastAPI application: OpenAI-compatible routes, auth, errors, health and metrics."""

import asyncio
import hashlib
import hmac
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import jaxengine
from jaxengine import profiler
from server.engine_client import AsyncEngine, EngineDeadError
from server.errors import APIError, error_body, error_response
from server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest, DetokenizeRequest,
                             EmbeddingRequest, LoadLoRAAdapterRequest, RerankRequest, ResponsesRequest,
                             ScoreRequest, StartProfileRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from server.serving import Serving

logger = logging.getLogger(__name__)


class _HttpMiddleware:
    """A plain ASGI middleware over HTTP requests (`http`); other scopes (lifespan) pass straight through.
    Starlette's `@app.middleware("http")` would pass each streamed chunk through a memory stream and a task
    switch of its own."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def http(self, scope, receive, send):
        raise NotImplementedError


class RequireKey(_HttpMiddleware):
    """Every /v1 route needs `Authorization: Bearer <key>` with one of the keys (the scheme in any case, as
    vLLM's server reads it)."""

    def __init__(self, app, api_keys: list[str]):
        super().__init__(app)
        self.digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    def _valid(self, header: bytes) -> bool:
        scheme, _, token = header.decode("latin-1").partition(" ")
        digest = hashlib.sha256(token.encode("latin-1")).digest()
        matches = [hmac.compare_digest(digest, expected) for expected in self.digests]  # every key, every time
        return scheme.lower() == "bearer" and any(matches)

    async def http(self, scope, receive, send):
        if scope["path"].startswith("/v1"):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not self._valid(given):
                response = error_response(APIError("missing or invalid API key: send 'Authorization: Bearer <key>'",
                                                   status=401, code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaders(_HttpMiddleware):
    """`--enable-request-id-headers`, as vLLM's: every HTTP response carries an `X-Request-Id` header, the
    request's own where it sent one, otherwise a fresh random id (as vLLM's, not the id in the body)."""

    async def http(self, scope, receive, send):
        given = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class UnexpectedErrors(_HttpMiddleware):
    """A bug in a route (an exception no handler answers) becomes a 500 with an OpenAI error body, its traceback
    logged. Starlette's own answer is a plain-text 500 that also drops the keep-alive connection (it re-raises
    the error to the server). A stream that has begun is left to end as the server ends it."""

    async def http(self, scope, receive, send):
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as err:  # noqa: BLE001 - answered, and logged with its traceback
            if started:
                raise
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            body = error_body(f"internal error: {type(err).__name__}: {err}", 500)
            await JSONResponse(body, status_code=500)(scope, receive, send)


CORS_DEFAULTS = {"allow_origins": [], "allow_credentials": False, "allow_methods": ["*"], "allow_headers": ["*"]}


def build_app(engine: AsyncEngine, model_name: str | list[str], api_key: str | list[str] | None = None,
              request_id_headers: bool = False, cors: dict | None = None, chat_template: str | None = None,
              trust_request_chat_template: bool = False, return_tokens_as_token_ids: bool = False,
              tool_call_parser: str | None = None, lora_modules: list | None = None,
              runtime_lora_updating: bool = False, responses_store_size: int = 1024) -> FastAPI:
    """`model_name`: the served name, or names (vLLM's --served-model-name: requests may name any, responses
    carry the first). `api_key`: the key, or keys, any of which a /v1 request must bear. `cors`: Starlette
    CORSMiddleware's settings, as vLLM's --allowed-origins, --allow-credentials, --allowed-methods and
    --allowed-headers set them (default CORS_DEFAULTS: no cross-origin browser access). `chat_template` (the
    template's text), `trust_request_chat_template`, `return_tokens_as_token_ids`, `tool_call_parser`,
    `lora_modules` and `responses_store_size`: see Serving. `runtime_lora_updating` (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING): an engine with enable_lora gets POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter."""
    app = FastAPI(title="jaxengine", version=jaxengine.__version__)
    serving = Serving(engine, model_name, chat_template, trust_request_chat_template, return_tokens_as_token_ids,
                      tool_call_parser, lora_modules, responses_store_size)
    app.state.engine, app.state.serving = engine, serving

    # Each middleware added wraps those before it. The key is checked innermost: a browser's preflight (which
    # carries no key) is answered by CORS, and a refused key's 401 carries the CORS and request id headers.
    app.add_middleware(UnexpectedErrors)  # innermost: its 500 gets the CORS and request id headers
    if api_key is not None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if not keys or not all(keys):
            raise ValueError("api_key: every key must be a non-empty string")
        app.add_middleware(RequireKey, api_keys=keys)
    app.add_middleware(CORSMiddleware, **(CORS_DEFAULTS | (cors or {})))
    if request_id_headers:
        app.add_middleware(RequestIdHeaders)

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', message)}"
        where = ".".join(loc)
        return JSONResponse(error_body(f"{where}: {message}" if where else message, 400, loc[0] if loc else None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):
        message = "route not found" if err.status_code == 404 else str(err.detail)
        return JSONResponse(error_body(message, err.status_code), status_code=err.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, err: EngineDeadError):
        return JSONResponse(error_body(str(err), 500), status_code=500)

    def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    def with_header_id(req, raw: Request):
        """An X-Request-Id header names the request (over the body's request_id, as vLLM's server reads it)."""
        if header := raw.headers.get("x-request-id"):
            req.request_id = header
        return req

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return respond(await serving.completion(with_header_id(req, raw)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return respond(await serving.chat(with_header_id(req, raw)))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return respond(await serving.responses(with_header_id(req, raw)))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return serving.response_store.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        serving.response_store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        return JSONResponse(await serving.embeddings(with_header_id(req, raw)))

    @app.post("/classify")
    async def classify(req: ClassificationRequest, raw: Request):
        return JSONResponse(await serving.classify(with_header_id(req, raw)))

    @app.post("/v1/score")
    @app.post("/score")
    async def score(req: ScoreRequest, raw: Request):
        return JSONResponse(await serving.score(with_header_id(req, raw)))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest, raw: Request):
        return JSONResponse(await serving.rerank(with_header_id(req, raw)))

    @app.get("/v1/models")
    async def models():
        root = engine.engine.config.model or serving.model_name
        base = [{"id": name, "object": "model", "created": 0, "owned_by": "jaxengine", "root": root,
                 "max_model_len": engine.engine.max_model_len} for name in serving.model_names]
        adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "jaxengine", "root": lora.lora_path,
                     "parent": serving.model_name, "max_model_len": engine.engine.max_model_len}
                    for name, lora in serving.loras.items()]  # as vLLM lists --lora-modules
        return {"object": "list", "data": base + adapters}

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the same check
    async def health():
        if engine.is_alive:
            return PlainTextResponse("", status_code=200)
        return JSONResponse(error_body(f"the engine loop has stopped: {engine.error!r}", 503), status_code=503)

    @app.get("/version")
    async def version():
        return {"version": jaxengine.__version__}

    if engine.engine.config.profiler_dir:  # as vLLM's routes, there only with a profiler configured
        async def profiling(action, *args):
            try:  # in a thread: writing a long trace takes seconds, which the other requests must not wait for
                await asyncio.to_thread(action, *args)
            except ValueError as e:
                raise APIError(str(e), param="profile_prefix" if "profile_prefix" in str(e) else None) from None
            return Response(status_code=200)

        @app.post("/start_profile")
        async def start_profile(req: StartProfileRequest | None = None):
            return await profiling(profiler.start, engine.engine.config.profiler_dir, req and req.profile_prefix)

        @app.post("/stop_profile")
        async def stop_profile():
            return await profiling(profiler.stop)

    if runtime_lora_updating and engine.engine.config.enable_lora:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            return PlainTextResponse(await serving.load_lora(req))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            return PlainTextResponse(await serving.unload_lora(req))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        tok = serving.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if req.tools is not None and req.messages is None:
            raise APIError("tools are rendered with messages (the chat template), not with a prompt", param="tools")
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            ids = serving.chat_prompt(req)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics():
        registry = engine.metrics.registry
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
