"""The server through the official openai SDK: completions and chat, streaming and not."""

import concurrent.futures
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, wait_until_idle


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0


def test_max_tokens_past_the_context_is_capped_not_refused(client):
    # vLLM's server caps max_tokens at what the context leaves (max_model_len 512 here) instead of a 400.
    out = client.completions.create(model=MODEL, prompt=[7] * 505, max_tokens=100, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 512 - 505


def test_completion_stream_concatenates_to_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, prompt="import json", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, n=2,
                                            stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == 3 for c in chunks)
    done = {}
    for c in chunks[:-1]:  # each choice's count rises to 4; the last chunk is the total, as without the option
        index = c.choices[0].index
        assert c.usage.completion_tokens >= done.get(index, 0)
        done[index] = c.usage.completion_tokens
    assert done == {0: 4, 1: 4} and chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    assert chat[0].usage.completion_tokens == 0 and chat[-1].usage.completion_tokens == 3
    assert all(c.usage is not None for c in chat)
    plain = list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)  # without include_usage there is no usage at all, as in vLLM


def test_chat_and_its_stream_agree(client):
    kwargs = dict(model=MODEL, messages=[{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}],
                  max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert stream[-1].usage.completion_tokens == 10 == whole.usage.completion_tokens


def test_chat_text_parts_and_max_completion_tokens(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hel"},
                                                            {"type": "text", "text": "lo"}]}],
        max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_n_two_gives_two_choices(client):
    out = client.completions.create(model=MODEL, prompt="x = ", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], n=2,
                                          max_tokens=4, seed=1)
    assert len(chat.choices) == 2


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt="a b", max_tokens=4, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    prompt_len = out.usage.prompt_tokens
    assert len(lp.tokens) == prompt_len + 4
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith("a b")


def test_prompt_logprobs_come_back_in_the_response(http, async_engine):
    """vLLM's prompt_logprobs field: per prompt token (None first), the top N and the token itself, keyed by id;
    with echo and logprobs too, each keeps its own count; refused with streaming, as in vLLM."""
    tok = async_engine.engine.tokenizer
    prompt = tok.encode("a b c d")
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    choice = http.post("/v1/completions", json=body | {"prompt_logprobs": 2}).json()["choices"][0]
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(prompt) and lps[0] is None
    for token, entry in zip(prompt[1:], lps[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert {e["rank"] for e in entry.values()} >= {1, 2} and all(e["logprob"] <= 0 for e in entry.values())
        assert entry[str(token)]["decoded_token"] == tok.decode([token])
    both = http.post("/v1/completions", json=body | {"prompt_logprobs": 3, "echo": True, "logprobs": 1}).json()
    echoed = both["choices"][0]["logprobs"]
    assert all(top is None or len(top) <= 2 for top in echoed["top_logprobs"][:len(prompt)])  # logprobs' 1
    assert all(e is None or len(e) >= 3 for e in both["choices"][0]["prompt_logprobs"])  # prompt_logprobs' 3
    assert echoed["token_logprobs"][1:len(prompt)] == [e[str(t)]["logprob"] for t, e in zip(prompt[1:], lps[1:])]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                     "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # just the prompt's token
    for route, streamed in (("/v1/completions", body), ("/v1/chat/completions",
                                                        {"messages": [{"role": "user", "content": "hi"}]})):
        refused = http.post(route, json=streamed | {"prompt_logprobs": 1, "stream": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    wait_until_idle(async_engine.engine)


def test_a_streamed_echo_has_the_prompts_logprobs_as_without_streaming(http, async_engine):
    body = {"prompt": "a b c", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 2}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                for key in merged:
                    merged[key] += choice["logprobs"][key] if choice["logprobs"] else []
    assert text == whole["text"] and merged == whole["logprobs"]
    wait_until_idle(async_engine.engine)


def test_echo_with_max_tokens_0_scores_the_prompt(client, http):
    """As vLLM (and eval harnesses' loglikelihood requests): the prompt and its logprobs, nothing generated."""
    kwargs = dict(model=MODEL, prompt="a b c d", temperature=0, logprobs=1, echo=True)
    scored = client.completions.create(max_tokens=0, **kwargs)
    with_one = client.completions.create(max_tokens=1, **kwargs)
    n = scored.usage.prompt_tokens
    choice = scored.choices[0]
    assert choice.text == "a b c d" and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == n and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs == with_one.choices[0].logprobs.token_logprobs[:n]
    chunks = list(client.completions.create(max_tokens=0, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "a b c d"
    assert chunks[-1].usage.completion_tokens == 0
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client, async_engine):
    """vLLM's return_tokens_as_token_ids: "token_id:N" for every token of the logprobs (echoed prompt, samples,
    top candidates); logprobs and text offsets as without it."""
    tok = async_engine.engine.tokenizer
    kwargs = dict(model=MODEL, prompt="a b", max_tokens=4, temperature=0, logprobs=2, echo=True)
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].logprobs
    named = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = named.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    prompt = tok.encode("a b")
    assert all(t.startswith("token_id:") for t in lp.tokens) and ids[:len(prompt)] == prompt
    assert [tok.decode([i]) for i in ids] == plain.tokens
    assert lp.token_logprobs == plain.token_logprobs and lp.text_offset == plain.text_offset
    assert all(key.startswith("token_id:") for top in lp.top_logprobs if top for key in top)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=3, temperature=0,
                logprobs=True, top_logprobs=2)
    for stream in (False, True):
        out = client.chat.completions.create(**chat, stream=stream, extra_body={"return_tokens_as_token_ids": True,
                                                                                "ignore_eos": True})
        items = [i for c in out if c.choices[0].logprobs for i in c.choices[0].logprobs.content] if stream \
            else out.choices[0].logprobs.content
        assert len(items) == 3
        for item in items:
            token = int(item.token.removeprefix("token_id:"))
            assert item.bytes == list(tok.decode([token]).encode())  # the token's own bytes
            assert all(t.token.startswith("token_id:") for t in item.top_logprobs)
    wait_until_idle(async_engine.engine)


def test_return_tokens_as_token_ids_server_default(async_engine):
    """--return-tokens-as-token-ids makes it every request's default; a request's false overrides it."""
    import httpx

    from server.app import build_app
    from tests.server.conftest import LiveServer

    server = LiveServer(build_app(async_engine, MODEL, return_tokens_as_token_ids=True))
    try:
        body = {"prompt": "a", "max_tokens": 2, "logprobs": 1, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as c:
            named = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
            plain = c.post("/v1/completions", json=body | {"return_tokens_as_token_ids": False}).json()
        assert all(t.startswith("token_id:") for t in named)
        assert not any(t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"])
    finally:
        server.stop()
    wait_until_idle(async_engine.engine)


def test_stop_string(client):
    free = client.completions.create(model=MODEL, prompt="def g(", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(free[i:i + 2] for i in range(3, len(free)) if "\ufffd" not in free[i:i + 2])
    out = client.completions.create(model=MODEL, prompt="def g(", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.text == free[: free.index(stop)] and out.finish_reason == "stop"


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="seed", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=42, **kwargs).choices[0].text
    b = client.completions.create(seed=42, **kwargs).choices[0].text
    c = client.completions.create(seed=43, **kwargs).choices[0].text
    assert a == b != c


def test_vllm_extra_fields_are_honoured(client):
    out = client.completions.create(model=MODEL, prompt="z", max_tokens=6, temperature=1.0, seed=0,
                                    extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 6,
                                                "repetition_penalty": 1.1, "priority": 2})
    greedy = client.completions.create(model=MODEL, prompt="z", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.1})
    assert out.choices[0].text == greedy.choices[0].text


def test_truncate_prompt_tokens_runs_the_prompts_tail(client, async_engine):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what runs, is echoed and is counted."""
    tokenizer = async_engine.engine.tokenizer
    text = "word salad " * 300  # past max_model_len (512): refused whole
    tail = tokenizer.encode(text)[-8:]
    cut = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                    extra_body={"truncate_prompt_tokens": 8, "ignore_eos": True})
    direct = client.completions.create(model=MODEL, prompt=tail, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                       extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == direct.choices[0].text
    assert cut.choices[0].text.startswith(tokenizer.decode(tail))
    assert cut.choices[0].logprobs.token_logprobs == direct.choices[0].logprobs.token_logprobs
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"truncate_prompt_tokens": -1}))
    assert chunks[-1].usage.prompt_tokens == 511 and chunks[-1].usage.completion_tokens == 1  # max_model_len - 1


def batched_steps(http) -> float:
    """How many engine steps so far ran more than one request, from /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    buckets = {s.labels["le"]: s.value for s in families["jaxengine:step_batch_requests"].samples
               if s.name.endswith("_bucket")}
    return buckets["+Inf"] - buckets["1.0"]


def test_64_concurrent_streams_complete_and_are_batched(client, http, async_engine):
    before = batched_steps(http)

    def one(i):
        stream = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        streamed = list(pool.map(one, range(64)))
    assert batched_steps(http) > before
    for i, text in enumerate(streamed):
        want = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert text == want
    wait_until_idle(async_engine.engine)
