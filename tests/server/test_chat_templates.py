"""The server's chat templates (vLLM's --chat-template, --trust-request-chat-template and a request's
chat_template) and add_special_tokens on completions, chat and /tokenize."""

import copy

import httpx
import pytest
from tokenizers.processors import TemplateProcessing

from jaxengine.cli import main
from server.app import build_app
from server.serving import load_chat_template
from tests.server.conftest import MODEL, LiveServer, wait_until_idle

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = {"messages": [{"role": "user", "content": "hi there"}]}


@pytest.fixture(scope="module")
def templated(async_engine):
    """A server whose chat template is TEMPLATE (--chat-template), requests' own templates trusted."""
    server = LiveServer(build_app(async_engine, MODEL, chat_template=TEMPLATE, trust_request_chat_template=True))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    server.stop()


def test_the_servers_chat_template_replaces_the_tokenizers(templated, http, async_engine):
    tok = async_engine.engine.tokenizer
    ours = templated.post("/tokenize", json=CHAT).json()["tokens"]
    assert ours == tok.encode("<user>hi there<assistant>", add_special_tokens=False)
    assert http.post("/tokenize", json=CHAT).json()["tokens"] != ours  # the tokenizer's own template
    out = templated.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2}).json()
    assert out["usage"]["prompt_tokens"] == len(ours)
    wait_until_idle(async_engine.engine)


def test_a_requests_chat_template_only_where_trusted(templated, http, async_engine):
    own = {"chat_template": "{{ messages[0]['content'] }}!"}
    tok = async_engine.engine.tokenizer
    assert templated.post("/tokenize", json=CHAT | own).json()["tokens"] == tok.encode("hi there!",
                                                                                     add_special_tokens=False)
    out = templated.post("/v1/chat/completions", json=CHAT | own | {"max_tokens": 2}).json()
    assert out["usage"]["prompt_tokens"] == len(tok.encode("hi there!", add_special_tokens=False))
    refused = http.post("/v1/chat/completions", json=CHAT | own)  # the default server does not trust requests
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    broken = templated.post("/v1/chat/completions", json=CHAT | {"chat_template": "{% if %}"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
    wait_until_idle(async_engine.engine)


def test_chat_template_flag_reads_a_file_or_the_template_and_refuses_the_rest(tmp_path, async_engine):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE and load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="--chat-template.*neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template: the template does not parse"):
        build_app(async_engine, MODEL, chat_template="{% for m in messages %}")
    with pytest.raises(SystemExit, match="neither a file"):  # before any model is loaded
        main(["serve", "--model", str(tmp_path), "--chat-template", str(tmp_path / "missing.jinja")])


@pytest.fixture
def bos_server(async_engine):
    """A server whose tokenizer puts a BOS token before every text it encodes with special tokens (the test
    tokenizer adds none)."""
    app = build_app(async_engine, MODEL)
    tok = copy.deepcopy(async_engine.engine.tokenizer)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    app.state.serving.tokenizer = tok
    server = LiveServer(app)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c, tok
    server.stop()


def test_add_special_tokens_as_vllm_reads_it(bos_server, async_engine):
    c, tok = bos_server
    plain = tok.encode("a b c", add_special_tokens=False)
    assert c.post("/tokenize", json={"prompt": "a b c"}).json()["tokens"] == [1] + plain
    assert c.post("/tokenize", json={"prompt": "a b c", "add_special_tokens": False}).json()["tokens"] == plain

    def prompt_tokens(route, body):
        out = c.post(route, json=body | {"max_tokens": 1})
        assert out.status_code == 200, out.text
        return out.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("/v1/completions", {"prompt": "a b c"}) == len(plain) + 1  # default True
    assert prompt_tokens("/v1/completions", {"prompt": "a b c", "add_special_tokens": False}) == len(plain)
    templated = c.post("/tokenize", json=CHAT).json()["tokens"]  # messages: default False (the template's own)
    assert templated[0] != 1
    assert c.post("/tokenize", json=CHAT | {"add_special_tokens": True}).json()["tokens"] == [1] + templated
    assert prompt_tokens("/v1/chat/completions", CHAT) == len(templated)
    assert prompt_tokens("/v1/chat/completions", CHAT | {"add_special_tokens": True}) == len(templated) + 1
    wait_until_idle(async_engine.engine)


def test_reasoning_effort_reaches_the_template(templated, async_engine):
    """OpenAI's reasoning_effort, as vLLM passes it: the template's `reasoning_effort` (GPT-OSS's renders it into its
    system message); chat_template_kwargs' own wins; other values are refused."""
    own = {"chat_template": "{{ messages[0]['content'] }} effort={{ reasoning_effort | default('none') }}",
           "max_tokens": 2}
    tok = async_engine.engine.tokenizer
    for extra, effort in (({}, "none"), ({"reasoning_effort": "low"}, "low"),
                          ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high")):
        out = templated.post("/v1/chat/completions", json=CHAT | own | extra).json()
        assert out["usage"]["prompt_tokens"] == len(tok.encode(f"hi there effort={effort}", add_special_tokens=False))
    refused = templated.post("/v1/chat/completions", json=CHAT | own | {"reasoning_effort": "extreme"})
    assert refused.status_code == 400 and "reasoning_effort" in refused.text
    wait_until_idle(async_engine.engine)
