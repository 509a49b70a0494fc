"""LoRA adapters served by name (vLLM's --enable-lora --lora-modules): /v1/models lists them, a request that names
one runs with it (its tokens are the engine's with that adapter), and its response names it."""

import json

import httpx
import pytest

from jaxengine import SamplingParams
from server.app import build_app
from server.engine_client import AsyncEngine
from server.metrics import EngineMetrics
from tests.engine_util import run_to_completion
from tests.server.conftest import LiveServer
from tests.lora_util import LORA

BASE = "tiny-llama"


@pytest.fixture(scope="module")
def lora_server(engines, lora_adapters):
    engine = engines("llama", **LORA)
    client = AsyncEngine(engine, EngineMetrics(BASE))
    server = LiveServer(build_app(client, BASE, lora_modules=[lora_adapters["all"][0], lora_adapters["attn"][0]]))
    yield server, engine
    server.stop()
    client.shutdown()


def test_models_lists_the_adapters(lora_server, lora_adapters):
    server, _ = lora_server
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [(BASE, None), ("all", BASE), ("attn", BASE)]
    assert data[1]["root"] == lora_adapters["all"][0].lora_path


def test_a_request_naming_an_adapter_runs_with_it(lora_server, lora_adapters):
    server, engine = lora_server
    prompt = [5, 17, 42, 99, 7, 250, 31]
    texts = {}
    for model in (BASE, "all", "attn"):
        for stream in (False, True):
            response = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": stream})
            assert response.status_code == 200, response.text
            if stream:
                events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
                assert {e["model"] for e in events} == {model}
            else:
                body = response.json()
                text = body["choices"][0]["text"]
                assert body["model"] == model
            texts.setdefault(model, set()).add(text)
    for model, lora in ((BASE, None), ("all", lora_adapters["all"][0]), ("attn", lora_adapters["attn"][0])):
        engine.add_request("offline", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=lora)
        assert texts[model] == {run_to_completion(engine, [])["offline"].outputs[0].text}, model
    assert len({next(iter(t)) for t in texts.values()}) == 3
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "attn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == "attn"


def test_unknown_names_and_adapters_that_do_not_fit_are_refused(lora_server, engines, tmp_path):
    server, _ = lora_server
    response = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert response.status_code == 404 and "'all', 'attn'" in response.json()["error"]["message"]
    from types import SimpleNamespace

    from jaxengine import LoRARequest
    from server.serving import Serving

    client = SimpleNamespace(engine=engines("llama", **LORA))  # what Serving reads at its start
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        Serving(client, BASE, lora_modules=[LoRARequest("gone", 9, str(tmp_path))])
    with pytest.raises(ValueError, match="the name 'tiny-llama' is already served"):
        Serving(client, BASE, lora_modules=[LoRARequest(BASE, 9, str(tmp_path))])


def test_adapters_load_and_unload_at_run_time(engines, lora_adapters, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with runtime updating allowed (else no such
    routes): an adapter loaded by path is served under its name until unloaded."""
    engine = engines("llama", **LORA)
    client = AsyncEngine(engine, EngineMetrics(BASE))
    server = LiveServer(build_app(client, BASE, runtime_lora_updating=True))
    plain = LiveServer(build_app(client, BASE))
    try:
        url, path = server.url, lora_adapters["mlp"][0].lora_path
        body = {"model": "mlp", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 404
        loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": path})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["model"] == "mlp"
        assert "mlp" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": path})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "mlp"})
        assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404
        assert httpx.post(url + "/v1/completions", json=body).status_code == 404
        assert httpx.post(plain.url + "/v1/load_lora_adapter",
                          json={"lora_name": "mlp", "lora_path": path}).status_code == 404
    finally:
        server.stop()
        plain.stop()
        client.shutdown()
