"""POST /v1/embeddings on a pooling server (runner 'pooling'), through the OpenAI client and raw HTTP."""

import asyncio
import base64
import itertools

import httpx
import ml_dtypes
import numpy as np
import openai
import pytest

from jaxengine import PoolingParams
from server.app import build_app
from server.engine_client import AsyncEngine
from server.metrics import EngineMetrics
from tests.server.conftest import LiveServer, wait_until_idle
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.server.test_errors_and_ops import _values, assert_no_5xx_and_healthy, metric_values

EMBED_MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def embed_server(pooling_engines):
    engine = pooling_engines("base")
    client = AsyncEngine(engine, EngineMetrics(EMBED_MODEL))
    server = LiveServer(build_app(client, EMBED_MODEL))
    yield server, client
    server.stop()
    client.shutdown()


@pytest.fixture
def embed_http(embed_server):
    with httpx.Client(base_url=embed_server[0].url, timeout=60) as c:
        yield c


_ids = itertools.count()


def _direct(client: AsyncEngine, prompt_ids, **params):
    """The server's engine's embedding of a prompt, submitted to it directly (not through HTTP)."""
    async def run():
        async for out in client.generate(f"direct-{next(_ids)}", {"prompt_token_ids": prompt_ids},
                                         PoolingParams(**params)):
            final = out
        return final.outputs.data

    return asyncio.run(run())


def test_embeddings_through_the_openai_client(embed_server):
    server, engine_client = embed_server
    engine = engine_client.engine
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["def main(", "the quick brown fox jumps over the lazy dog, again and again and again"]
    result = client.embeddings.create(model=EMBED_MODEL, input=texts)  # the client asks for base64 float32
    assert result.model == EMBED_MODEL and [d.index for d in result.data] == [0, 1]
    ids = [engine.tokenizer.encode(t) for t in texts]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for d, prompt in zip(result.data, ids):
        np.testing.assert_allclose(d.embedding, _direct(engine_client, prompt), atol=1e-6)
    floats = client.embeddings.create(model=EMBED_MODEL, input=ids[0], encoding_format="float", dimensions=16)
    assert len(floats.data[0].embedding) == 16
    np.testing.assert_allclose(floats.data[0].embedding, _direct(engine_client, ids[0], dimensions=16), atol=1e-6)


def test_base64_dtypes_and_endianness(embed_server, embed_http):
    prompt = [5, 9, 33, 7]
    expected = _direct(embed_server[1], prompt, use_activation=False)
    for dtype, numpy_dtype in [("float32", np.float32), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)]:
        for endianness, order in [("little", "<"), ("big", ">"), ("native", "=")]:
            r = embed_http.post("/v1/embeddings", json={"input": [prompt], "encoding_format": "base64",
                                                        "embed_dtype": dtype, "endianness": endianness,
                                                        "use_activation": False})
            assert r.status_code == 200, r.text
            raw = base64.b64decode(r.json()["data"][0]["embedding"])
            width = np.dtype(numpy_dtype).itemsize
            bits = np.frombuffer(raw, np.dtype(f"{order}u{width}")).astype(f"=u{width}")
            np.testing.assert_allclose(bits.view(numpy_dtype).astype(np.float32), expected.astype(numpy_dtype)
                                       .astype(np.float32), rtol=0, atol=0)
    r = embed_http.post("/v1/embeddings", json={"input": ["a b c", "d e f"], "request_id": "mine",
                                                "truncate_prompt_tokens": 1})
    body = r.json()
    assert r.status_code == 200 and body["id"] == "mine" and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == 2 and body["data"][1]["object"] == "embedding"


def test_chat_form(embed_server, embed_http):
    """vLLM's chat form: `messages` (one conversation or several) rendered by the chat template, without a
    generation prompt unless asked; the same embedding as the template's token ids given as input."""
    tokenizer = embed_server[1].engine.tokenizer
    talk = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    other = [{"role": "user", "content": [{"type": "text", "text": "what "}, {"type": "text", "text": "now"}]}]
    r = embed_http.post("/v1/embeddings", json={"messages": [talk, other], "encoding_format": "float"})
    assert r.status_code == 200, r.text
    joined = [{"role": "user", "content": "what now"}]  # text parts are joined, as for chat
    ids = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in (talk, joined)]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ids]
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, ids))
    direct = embed_http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    for got, expected in zip(r.json()["data"], direct["data"]):
        np.testing.assert_allclose(got["embedding"], expected["embedding"], atol=1e-6)
    one = embed_http.post("/v1/embeddings", json={"messages": other, "add_generation_prompt": True}).json()
    prompt = tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert one["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input"),
    ({}, "input"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": "x", "dimensions": 20}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": [[5, 10**6]]}, "input"),
    ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
    ({"messages": []}, "messages"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": [5] * 200}, "input"),
])
def test_invalid_embedding_requests_get_400(embed_server, embed_http, body, param):
    r = embed_http.post("/v1/embeddings", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param
    wait_until_idle(embed_server[1].engine)


def test_other_routes_and_servers_refuse(embed_http, http):
    """A pooling server refuses to generate; a generating server refuses embeddings; both say why."""
    r = embed_http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "makes embeddings" in r.json()["error"]["message"]
    r = embed_http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "makes embeddings" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def test_metrics_count_embeddings(embed_server, embed_http):
    before = metric_values(embed_http)
    assert embed_http.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).is_success
    wait_until_idle(embed_server[1].engine)
    after = metric_values(embed_http)
    assert after[("vllm:prompt_tokens_total", "")] == before.get(("vllm:prompt_tokens_total", ""), 0) + 5
    assert after[("vllm:request_success_total", "stop")] == before.get(("vllm:request_success_total", "stop"), 0) + 2


def _cosine(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_score_and_rerank(embed_http):
    texts = ["the cat sat", "a dog ran far away", "the cat sat on the mat"]
    body = {"input": texts, "encoding_format": "float"}
    vectors = [d["embedding"] for d in embed_http.post("/v1/embeddings", json=body).json()["data"]]
    for names in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
        r = embed_http.post("/v1/score", json={names[0]: texts[0], names[1]: texts[1:]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        np.testing.assert_allclose([d["score"] for d in body["data"]],
                                   [_cosine(vectors[0], v) for v in vectors[1:]], atol=1e-5)
    pairwise = embed_http.post("/score", json={"text_1": texts[:2], "text_2": texts[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [_cosine(vectors[0], vectors[1]), _cosine(vectors[1], vectors[2])], atol=1e-5)
    for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = embed_http.post(route, json={"query": texts[0], "documents": texts[1:], "top_n": 1, "request_id": "rr"})
        assert r.status_code == 200, r.text
        body = r.json()
        best = int(np.argmax([_cosine(vectors[0], v) for v in vectors[1:]]))
        assert body["id"] == "rr" and len(body["results"]) == 1
        assert body["results"][0]["index"] == best and body["results"][0]["document"] == {"text": texts[1 + best]}
        assert body["usage"]["prompt_tokens"] == sum(len(embed_server_tokens(embed_http, t)) for t in texts)
    everything = embed_http.post("/v1/rerank", json={"query": texts[0], "documents": texts}).json()["results"]
    assert [r["index"] for r in everything][0] == 0  # a text is closest to itself
    scores = [r["relevance_score"] for r in everything]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3


def embed_server_tokens(http, text):
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/score", {"queries": "a"}, "queries"),
    ("/v1/score", {"queries": "a", "text_2": "b"}, "queries"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": ["a"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "max_tokens_per_doc": 4}, "max_tokens_per_doc"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"documents": ["b"]}, "query"),
])
def test_invalid_scoring_requests_get_400(embed_server, embed_http, route, body, param):
    r = embed_http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    wait_until_idle(embed_server[1].engine)


def test_scoring_refused_by_a_generating_server(http):
    r = http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
    r = http.post("/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def classifier_servers(pooling_engines):
    """A three-label classifier's server and a one-label (cross-encoder) one's, with their engine clients."""
    out = {}
    for name in ("classifier", "cross-encoder"):
        client = AsyncEngine(pooling_engines(name), EngineMetrics(name))
        out[name] = (LiveServer(build_app(client, name)), client)
    yield out
    for server, client in out.values():
        server.stop()
        client.shutdown()


def test_classify_route(classifier_servers, embed_http):
    server, client = classifier_servers["classifier"]
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/classify", json={"input": [[5, 9, 33, 7], [40, 41]], "request_id": "c1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "c1" and body["usage"]["prompt_tokens"] == 6
        for item, prompt in zip(body["data"], [[5, 9, 33, 7], [40, 41]]):
            direct = _direct(client, prompt)
            np.testing.assert_allclose(item["probs"], direct, atol=1e-6)
            assert item["num_classes"] == 3 and abs(sum(item["probs"]) - 1) < 1e-5
            assert item["label"] == ["negative", "neutral", "positive"][int(np.argmax(direct))]
        logits = h.post("/classify", json={"input": "some text", "use_activation": False}).json()["data"][0]["probs"]
        assert abs(sum(logits) - 1) > 1e-3  # not probabilities
        for route, body, param in [("/v1/embeddings", {"input": "x"}, "model"),
                                   ("/v1/score", {"text_1": "a", "text_2": "b"}, "model"),
                                   ("/classify", {"input": []}, "input"),
                                   ("/classify", {"input": [[5, 10**6]]}, "input")]:
            r = h.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        wait_until_idle(client.engine)
    r = embed_http.post("/classify", json={"input": "x"})
    assert r.status_code == 400 and "makes embeddings" in r.json()["error"]["message"]


def test_cross_encoder_score_and_rerank(classifier_servers):
    server, client = classifier_servers["cross-encoder"]
    tok = client.engine.tokenizer
    query, documents = "the cat sat", ["a dog ran far away", "the cat sat on the mat", "zzz"]
    expected = [float(_direct(client, tok(query, text_pair=d)["input_ids"])[0]) for d in documents]
    with httpx.Client(base_url=server.url, timeout=60) as h:
        body = h.post("/v1/score", json={"queries": query, "documents": documents}).json()
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-6)
        pair_tokens = sum(len(tok(query, text_pair=d)["input_ids"]) for d in documents)
        assert body["usage"]["prompt_tokens"] == pair_tokens
        results = h.post("/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(expected)[::-1][:2])
        np.testing.assert_allclose([r["relevance_score"] for r in results], sorted(expected, reverse=True)[:2],
                                   atol=1e-6)


_POOLING_FIELDS = {
    "/v1/embeddings": ["model", "input", "messages", "encoding_format", "dimensions", "use_activation",
                       "truncate_prompt_tokens", "add_special_tokens", "embed_dtype", "endianness", "priority",
                       "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "unknown"],
    "/v1/score": ["model", "queries", "documents", "items", "data_1", "data_2", "text_1", "text_2", "use_activation",
                  "truncate_prompt_tokens", "priority", "unknown"],
    "/v1/rerank": ["model", "query", "documents", "top_n", "use_activation", "truncate_prompt_tokens", "unknown"],
    "/classify": ["model", "input", "use_activation", "truncate_prompt_tokens", "add_special_tokens", "unknown"],
}


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(sorted(_POOLING_FIELDS)), data=st.data())
def test_fuzzed_pooling_bodies_never_cause_5xx(embed_server, route, data):
    """Random bodies on every pooling route of an embedding server (/classify included, which it refuses): 200 or
    a 4xx, the server healthy, and no block left held."""
    body = data.draw(st.fixed_dictionaries({}, optional={f: _values for f in _POOLING_FIELDS[route]}))
    assert_no_5xx_and_healthy(embed_server[0], route, body)
    wait_until_idle(embed_server[1].engine)


def test_bench_serve_embeddings_backend(embed_server, capsys):
    """`bench serve --backend openai-embeddings` (vLLM's): /v1/embeddings requests, their latencies and the prompt
    tokens the server counted; generation flags are refused."""
    import json as json_module

    from jaxengine.cli import main

    url = embed_server[0].url
    main(["bench", "serve", "--backend", "openai-embeddings", "--base-url", url, "--num-prompts", "6",
          "--input-len", "10", "--disable-tqdm"])
    result = json_module.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["completed"] == 6 and result["failed"] == 0 and result["endpoint"] == "/v1/embeddings"
    assert result["total_input_tokens"] == 60 and result["total_output_tokens"] == 0
    assert result["median_e2el_ms"] > 0 and "median_ttft_ms" not in result and result["sampling"] == {}
    with pytest.raises(SystemExit, match="--temperature, --ignore-eos do not apply"):
        main(["bench", "serve", "--backend", "openai-embeddings", "--base-url", url, "--num-prompts", "2",
              "--temperature", "0.5", "--ignore-eos"])
    wait_until_idle(embed_server[1].engine)
