"""use_beam_search on /v1/completions, against the same search over transformers' logits."""

import pytest
import torch
import transformers

from tests.server.conftest import wait_until_idle
from tests.test_beam_search import _reference


def test_beam_search_completion(http, async_engine, model_dirs):
    engine = async_engine.engine
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32).eval()
    prompts = ["def f(x):", "hello there"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "use_beam_search": True, "ignore_eos": True,
            "length_penalty": 0.5, "temperature": 0, "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        ids = engine.tokenizer.encode(prompt)
        want = _reference(model, ids, 2, 4, 0.5)
        for j, (tokens, _) in enumerate(want):
            choice = out["choices"][2 * i + j]
            assert choice["text"] == prompt + engine.tokenizer.decode(tokens[len(ids):], skip_special_tokens=True)
            assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                            "total_tokens": prompt_tokens + 16}
    wait_until_idle(engine)


@pytest.mark.parametrize("body, param", [
    ({"stream": True}, "stream"),
    ({"logprobs": 1}, "logprobs"),
    ({"stop": ["x"]}, "stop"),
    ({"top_k": 5}, "top_k"),
    ({"seed": 3}, "seed"),
    ({"n": 11}, "n"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
])
def test_beam_search_refusals(http, async_engine, body, param):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "use_beam_search": True} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "use_beam_search": True, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    wait_until_idle(async_engine.engine)


def test_beam_search_chat(http, async_engine, model_dirs):
    engine = async_engine.engine
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "hello there"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "n": 3, "max_tokens": 3, "temperature": 0,
                                                "use_beam_search": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True),
                                  add_special_tokens=False)
    want = _reference(model, ids, 3, 3, 1.0)
    got = r.json()["choices"]
    assert [c["message"]["content"] for c in got] == [engine.tokenizer.decode(t[len(ids):], skip_special_tokens=True)
                                                      for t, _ in want]
    assert r.json()["usage"]["completion_tokens"] == 9
    wait_until_idle(engine)
