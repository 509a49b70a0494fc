"""Error bodies, API keys, disconnects, health, metrics, tokenization and a schema fuzz."""

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from jaxengine.cli import main
from server.app import build_app
from server.engine_client import AsyncEngine
from server.metrics import EngineMetrics, StatsLogger
from tests.server.conftest import API_KEY, MODEL, LiveServer, wait_until_idle


def assert_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 100000}, "n"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "frobnicate": True}, "frobnicate"),
    ({"prompt": "hi", "logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),  # the engine's refusals name the field too
    ({"prompt": "hi", "prompt_logprobs": 50}, "prompt_logprobs"),
    ({"prompt": "hi", "stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),
    ({"prompt": [1, 2, 999999]}, "prompt"),
    ({"prompt": "word " * 600, "max_tokens": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),  # above max_model_len
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as vLLM
])
def test_invalid_completion_requests_get_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "structural_tag"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 600}, "truncate_prompt_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": False, "stream_options": {}}, "stream_options"),
])
def test_invalid_chat_requests_get_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_an_unknown_model_gets_404(http):
    # As OpenAI and vLLM: 404 with code model_not_found, on every route that names a model.
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                        ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        error = assert_error(http.post(route, json=body | {"model": "other-model"}), 404, "model")
        assert error["code"] == "model_not_found" and error["type"] == "NotFoundError"


def test_several_served_model_names_answer_to_any_and_respond_with_the_first(async_engine):
    """vLLM's --served-model-name a b: /v1/models lists both, a request may name either, responses carry the first."""
    server = LiveServer(build_app(async_engine, [MODEL, "alias"]))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL, "alias"]
            out = c.post("/v1/completions", json={"model": "alias", "prompt": "x", "max_tokens": 1})
            assert out.status_code == 200 and out.json()["model"] == MODEL
            error = assert_error(c.post("/v1/completions", json={"model": "other", "prompt": "x"}), 404, "model")
            assert f"'{MODEL}', 'alias'" in error["message"]
    finally:
        server.stop()
    with pytest.raises(ValueError, match="served model names"):
        build_app(async_engine, [])
    wait_until_idle(async_engine.engine)


def test_malformed_json_gets_400(http):
    error = assert_error(http.post("/v1/completions", content=b'{"prompt": "x",',
                                   headers={"content-type": "application/json"}), 400)
    assert "JSON" in error["message"]


def test_unknown_route_gets_404(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_engine_keeps_serving_after_bad_requests(http, async_engine):
    http.post("/v1/completions", json={"prompt": "hi", "n": 100000})
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    wait_until_idle(async_engine.engine)


def test_api_key_is_required_on_v1_routes(live_with_key):
    with httpx.Client(base_url=live_with_key.url) as c:
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # not under /v1


def test_any_of_several_api_keys_is_accepted(async_engine):
    """As vLLM's --api-key K1 K2: either key, the scheme in any case; nothing else, and no empty key."""
    server = LiveServer(build_app(async_engine, MODEL, api_key=["first-key", "second-key"]))
    try:
        with httpx.Client(base_url=server.url) as c:
            for header in ("Bearer first-key", "Bearer second-key", "bearer second-key"):
                assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
            for header in ("Bearer first", "Bearer first-key second-key", "Basic first-key", "first-key", ""):
                assert_error(c.get("/v1/models", headers={"Authorization": header}), 401)
    finally:
        server.stop()
    for keys in ([], ["ok", ""], ""):
        with pytest.raises(ValueError, match="non-empty"):
            build_app(async_engine, MODEL, api_key=keys)


def test_no_api_key_needed_when_none_is_configured(http):
    assert http.get("/v1/models").status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(live, http, async_engine):
    engine = async_engine.engine
    wait_until_idle(engine)
    aborted = metric_values(http).get(("vllm:request_success_total", "abort"), 0.0)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "long", "max_tokens": 400, "stream": True,
                                                       "ignore_eos": True}) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    wait_until_idle(engine)
    assert metric_values(http)[("vllm:request_success_total", "abort")] == aborted + 1  # not run to its end


def test_health_version_tokenize_detokenize(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "def f(x):"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "def f(x):"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    # As chat completions template them (continue_final_message: no generation prompt after the last message).
    ask = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]}
    ids = http.post("/tokenize", json=ask | {"continue_final_message": True}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("Hello")
    assert_error(http.post("/detokenize", json={"tokens": [10 ** 7]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"messages": []}), 400, "messages")  # was a 500 (the template's error)
    assert_error(http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                              "chat_template_kwargs": {"tokenize": False}}), 400, "messages")
    assert http.get("/health").status_code == 200


def metric_values(http) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[(s.name, s.labels.get("finished_reason", s.labels.get("le", "")))] = s.value
    return out


def test_metrics_parse_and_counters_move(http):
    before = metric_values(http)
    for _ in range(2):
        assert http.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3, "ignore_eos": True}).is_success
    after = metric_values(http)
    assert after[("vllm:generation_tokens_total", "")] >= before.get(("vllm:generation_tokens_total", ""), 0) + 6
    assert after[("vllm:prompt_tokens_total", "")] > before.get(("vllm:prompt_tokens_total", ""), 0)
    assert after[("vllm:request_success_total", "length")] >= before.get(("vllm:request_success_total", "length"),
                                                                         0) + 2
    assert after[("vllm:prefix_cache_queries_total", "")] > before.get(("vllm:prefix_cache_queries_total", ""), 0)
    assert after[("vllm:time_to_first_token_seconds_count", "")] >= 2
    assert after[("vllm:e2e_request_latency_seconds_count", "")] >= 2
    assert after[("vllm:request_queue_time_seconds_count", "")] >= 2
    assert after[("vllm:inter_token_latency_seconds_count", "")] > 0
    assert ("jaxengine:compile_count", "") in after
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (name, "") in after


class FaultyEngine:
    """Fault injection: the real engine's interface, but the step crashes."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.model_config, self.validate = engine.model_config, engine.validate
        self.truncate_prompt = engine.truncate_prompt
        self.default_sampling, self.config = engine.default_sampling, engine.config
        self.runner_type, self.reasoning = engine.runner_type, engine.reasoning
        self.pending = []

    def add_request(self, request_id, *args, **kwargs):
        self.pending.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def abort_request(self, request_id):
        pass

    def step(self):
        raise RuntimeError("injected device fault")


def test_a_dead_engine_loop_fails_requests_promptly_and_health_reports_it(engines):
    faulty = AsyncEngine(FaultyEngine(engines("qwen2", max_num_seqs=16, max_num_batched_tokens=64)),
                         EngineMetrics(MODEL))
    server = LiveServer(build_app(faulty, MODEL))
    try:
        with httpx.Client(base_url=server.url, timeout=20) as c:
            start = time.monotonic()
            response = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert time.monotonic() - start < 10
            assert_error(response, 500)
            assert_error(c.get("/health"), 503)
            assert_error(c.get("/ping"), 503)
            assert_error(c.post("/v1/completions", json={"prompt": "x"}), 500)
    finally:
        server.stop()


def test_an_unexpected_error_in_a_handler_is_a_500_error_body(http, async_engine, monkeypatch):
    """A bug (here injected into the engine's checks) answers with an OpenAI error body; the server goes on."""
    def broken(ids, params):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(async_engine.engine, "validate", broken)
    error = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500)
    assert error["message"] == "internal error: RuntimeError: injected bug" and error["type"] == "InternalServerError"
    monkeypatch.undo()
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    wait_until_idle(async_engine.engine)


_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.integers(-10 ** 12, 10 ** 12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.lists(st.integers(-3, 400), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                      "logprobs", "echo", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                      "min_tokens", "ignore_eos", "stop_token_ids", "allowed_token_ids", "bad_words", "priority",
                      "prompt_logprobs", "stream", "best_of", "suffix", "truncate_prompt_tokens", "structured_outputs",
                      "use_beam_search", "length_penalty", "unknown"]
_CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "logprobs", "top_logprobs",
                "n", "stop", "seed", "stream", "response_format", "top_k", "min_p", "truncate_prompt_tokens",
                "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "use_beam_search",
                "length_penalty", "include_reasoning", "chat_template_kwargs"]


def _bodies(fields, required):
    base = st.fixed_dictionaries({}, optional={f: _values for f in fields})
    # generations stay short: a fuzzed max_tokens is kept only when it is a small integer (0 included: echo-only)
    return base.map(lambda d: {**required, **d}).map(
        lambda d: d if isinstance(d.get("max_tokens"), int) and 0 <= d["max_tokens"] <= 8 else {**d, "max_tokens": 4})


def assert_no_5xx_and_healthy(live, path, body):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        response = c.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        assert c.get("/health").status_code == 200


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies(_COMPLETION_FIELDS, {"prompt": "fuzz"}))
def test_fuzzed_completion_bodies_never_cause_5xx(live, body):
    assert_no_5xx_and_healthy(live, "/v1/completions", body)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies(_CHAT_FIELDS, {"messages": [{"role": "user", "content": "fuzz"}]}))
def test_fuzzed_chat_bodies_never_cause_5xx(live, body):
    assert_no_5xx_and_healthy(live, "/v1/chat/completions", body)


def test_an_x_request_id_header_names_the_request(http, async_engine):
    """As vLLM's server: the header's id (over the body's request_id); one already running is refused."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert http.post("/v1/completions", json=body | {"request_id": "from-body"}).json()["id"] == "from-body"
    named = http.post("/v1/completions", json=body | {"request_id": "from-body"}, headers={"x-request-id": "mine-1"})
    assert named.status_code == 200 and named.json()["id"] == "mine-1"
    chat = http.post("/v1/chat/completions", headers={"X-Request-Id": "mine-2"},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["id"] == "mine-2"
    # The first runs for the whole context (hundreds of steps) while the second is refused.
    with http.stream("POST", "/v1/completions", json=body | {"max_tokens": 4096, "stream": True, "ignore_eos": True},
                     headers={"x-request-id": "twice"}) as first:
        # Kept: a discarded iterator closes the response, which aborts the request.
        events = (json.loads(line[6:]) for line in first.iter_lines() if line)
        assert next(events)["choices"][0]["finish_reason"] is None  # running
        second = http.post("/v1/completions", json=body, headers={"x-request-id": "twice"})
        assert_error(second, 400, param="request_id")
        assert "already in use" in second.json()["error"]["message"]
        assert next(events)["choices"][0]["finish_reason"] is None  # the first runs on
    wait_until_idle(async_engine.engine)


def test_request_id_headers_are_echoed_only_when_enabled(async_engine, http):
    """`--enable-request-id-headers`, as vLLM's: each response (streamed, refused, or not a /v1 route) carries
    the request's X-Request-Id, or a fresh one where it sent none; without the flag no response has one."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert "x-request-id" not in http.post("/v1/completions", json=body, headers={"x-request-id": "a"}).headers
    server = LiveServer(build_app(async_engine, MODEL, api_key=API_KEY, request_id_headers=True))
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            done = c.post("/v1/completions", json=body, headers={"x-request-id": "echo-1"})
            assert done.status_code == 200 and done.headers["x-request-id"] == "echo-1"
            assert done.json()["id"] == "echo-1"
            with c.stream("POST", "/v1/completions", json=body | {"stream": True},
                          headers={"x-request-id": "echo-2"}) as streamed:
                assert streamed.headers["x-request-id"] == "echo-2"
                assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
            fresh = [c.get("/health").headers["x-request-id"] for _ in range(2)]
            assert fresh[0] != fresh[1] and all(len(f) == 32 for f in fresh)
            refused = c.post("/v1/completions", json=body, headers={"x-request-id": "echo-3", "Authorization": "no"})
            assert refused.status_code == 401 and refused.headers["x-request-id"] == "echo-3"
            bad = c.post("/v1/completions", json=body | {"max_tokens": -1}, headers={"x-request-id": "echo-4"})
            assert bad.status_code == 400 and bad.headers["x-request-id"] == "echo-4"
    finally:
        server.stop()
    wait_until_idle(async_engine.engine)


def traces(directory) -> list:
    """The jax.profiler traces written under a folder (an .xplane.pb and a .trace.json.gz each)."""
    return sorted(p.suffix for p in directory.rglob("*") if p.name.endswith((".xplane.pb", ".trace.json.gz")))


def test_profiling_routes_trace_the_server_only_where_configured(async_engine, http, monkeypatch, tmp_path):
    """As vLLM's /start_profile and /stop_profile: routes only on a server with a profiler (--profiler-dir), and
    `bench serve --profile` calls them around its load; a server without them fails the client's run up front."""
    assert http.post("/start_profile").status_code == 404
    with pytest.raises(SystemExit, match="--profile: POST .*/start_profile answered HTTP 404 .*--profiler-dir"):
        main(["bench", "serve", "--base-url", str(http.base_url), "--num-prompts", "1", "--input-len", "4",
              "--output-len", "2", "--profile", "--disable-tqdm"])
    monkeypatch.setattr(async_engine.engine.config, "profiler_dir", str(tmp_path))
    server = LiveServer(build_app(async_engine, MODEL))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.post("/stop_profile").status_code == 400  # none running
            assert_error(c.post("/start_profile", json={"profile_prefix": "../up"}), 400, param="profile_prefix")
            assert_error(c.post("/start_profile", json={"max_iterations": 3}), 400)  # not taken: refused
            assert c.post("/start_profile", json={"profile_prefix": "one"}).status_code == 200
            assert "already running" in c.post("/start_profile").json()["error"]["message"]
            done = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
            assert done.status_code == 200
            assert c.post("/stop_profile").status_code == 200
        assert traces(tmp_path / "one") == [".gz", ".pb"]
        main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--input-len", "4", "--output-len",
              "2", "--profile", "--disable-tqdm", "--output-json", str(tmp_path / "result.json")])
        assert json.loads((tmp_path / "result.json").read_text())["profiled"] is True
        assert len(traces(tmp_path)) == 4  # a second trace, beside the first's folder
    finally:
        server.stop()
    wait_until_idle(async_engine.engine)


def test_the_stats_log_line_reports_each_interval_with_work(caplog):
    """vLLM's periodic log line: throughputs over the interval, the load, KV usage and the interval's prefix hits;
    nothing while idle."""
    metrics = EngineMetrics(MODEL)
    stats = StatsLogger(metrics, interval=10.0)
    start = stats._since
    caplog.set_level("INFO", logger="jaxengine.stats")
    metrics.totals.update(prompt_tokens=500, generation_tokens=200, prefix_queries=400, prefix_hits=100)
    metrics.load.update(running=3, waiting=2, kv_usage=0.25)
    stats.maybe_log(start + 5)  # within the interval: nothing yet
    stats.maybe_log(start + 10)
    stats.maybe_log(start + 20)  # the same totals and the same load: still working, so another line
    metrics.load.update(running=0, waiting=0)
    stats.maybe_log(start + 30)  # idle
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxengine.stats"]
    assert lines == ["Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 "
                     "reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%",
                     "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 3 "
                     "reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 0.0%"]


def test_the_server_logs_stats_while_it_works(async_engine, http, monkeypatch, caplog):
    caplog.set_level("INFO", logger="jaxengine.stats")
    monkeypatch.setattr(async_engine, "stats", StatsLogger(async_engine.metrics, interval=0.01))
    body = {"model": MODEL, "prompt": "hi there", "max_tokens": 24, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    wait_until_idle(async_engine.engine)
    deadline = time.monotonic() + 10
    while not any("Avg generation throughput" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no stats line"
        time.sleep(0.02)


def test_cross_origin_browser_access_is_off_unless_origins_are_allowed(async_engine, http):
    """As vLLM's server: no origin by default; --allowed-origins lets a browser page call the API (its preflight
    answered without the API key, the key still required for the call itself)."""
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    refused = http.options("/v1/completions", headers=preflight)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert "access-control-allow-origin" not in http.post("/v1/completions", json=body,
                                                          headers={"Origin": "http://ui.example"}).headers
    server = LiveServer(build_app(async_engine, MODEL, api_key=API_KEY, cors={"allow_origins": ["http://ui.example"]}))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            allowed = c.options("/v1/completions", headers=preflight)
            assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ui.example"
            assert "POST" in allowed.headers["access-control-allow-methods"]
            assert c.options("/v1/completions", headers=preflight | {"Origin": "http://evil.example"}).status_code == 400
            keyless = c.post("/v1/completions", json=body, headers={"Origin": "http://ui.example"})
            assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == "http://ui.example"
            done = c.post("/v1/completions", json=body,
                          headers={"Origin": "http://ui.example", "Authorization": f"Bearer {API_KEY}"})
            assert done.status_code == 200 and done.headers["access-control-allow-origin"] == "http://ui.example"
    finally:
        server.stop()
    wait_until_idle(async_engine.engine)


def test_requests_are_logged_when_asked(async_engine, http, monkeypatch, caplog):
    """vLLM's --enable-log-requests: arrival (prompt and ids cut to --max-log-len, the parameters), finish and
    abort."""
    caplog.set_level("INFO", logger="jaxengine.requests")
    monkeypatch.setattr(async_engine, "log_requests", True)
    monkeypatch.setattr(async_engine, "max_log_len", 5)
    body = {"model": MODEL, "prompt": "hello there my friend", "max_tokens": 3, "ignore_eos": True}
    assert http.post("/v1/completions", json=body, headers={"x-request-id": "logged"}).status_code == 200
    with http.stream("POST", "/v1/completions", json=body | {"max_tokens": 400, "stream": True},
                     headers={"x-request-id": "dropped"}) as response:
        next(line for line in response.iter_lines() if line)  # running; leaving closes the connection
    wait_until_idle(async_engine.engine)
    deadline = time.monotonic() + 10
    while not any(r.getMessage() == "Aborted request dropped-0" for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxengine.requests"]
    received = next(line for line in lines if line.startswith("Received request logged-0: "))
    ids = async_engine.engine.tokenizer.encode("hello there my friend")
    assert f"prompt: 'hello', prompt_token_ids: {ids[:5]}, params: SamplingParams(" in received
    assert "max_tokens=3" in received
    assert (f"Finished request logged-0: finish_reason: length, prompt_tokens: {len(ids)}, completion_tokens: 3"
            in lines)
