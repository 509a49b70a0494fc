"""Default sampling parameters from the model's generation config, as vLLM's `--generation-config auto`: requests
that leave temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset take the model's values,
offline (`LLM.generate` without sampling_params) and on the server; `vllm` turns them off; an override merges."""

import json
import shutil

import openai
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.cli import main
from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import generation_defaults
from tests.server.conftest import LiveServer, wait_until_idle

FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "max_new_tokens": 9, "min_p": None, "num_beams": 1, "presence_penalty": 0.25}
DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "presence_penalty": 0.25,
            "max_tokens": 9}
PROMPT = [5, 9, 14, 3, 77, 120, 31]


@pytest.fixture(scope="module")
def model_dir(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen-config") / "qwen2"
    shutil.copytree(model_dirs["qwen2"], out)
    (out / "generation_config.json").write_text(json.dumps(FILE))
    return out


def test_defaults_come_from_the_file_and_the_override(model_dir, tmp_path):
    assert generation_defaults(model_dir) == DEFAULTS  # do_sample, num_beams, ids and nulls are not defaults
    assert generation_defaults(model_dir, "vllm") == {}
    assert generation_defaults(tmp_path) == {}  # no generation_config.json
    assert generation_defaults(tmp_path, str(model_dir)) == DEFAULTS  # a directory of its own
    merged = generation_defaults(model_dir, override={"temperature": 0.2, "top_k": None, "min_p": 0.05})
    assert merged == {"temperature": 0.2, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.05,
                      "presence_penalty": 0.25, "max_tokens": 9}
    assert generation_defaults(model_dir, "vllm", {"max_new_tokens": 4}) == {"max_tokens": 4}
    with pytest.raises(ValueError, match="override_generation_config: unknown keys \\['num_beams'\\]"):
        generation_defaults(model_dir, override={"num_beams": 4})
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a directory"):
        generation_defaults(model_dir, "hf")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config: the default sampling parameters.*temperature"):
        generation_defaults(tmp_path)


def test_cli_flags_parse_the_override_as_json(model_dir):
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        main(["generate", "--prompt", "x", "--model", str(model_dir), "--override-generation-config", "[1]"])


@pytest.fixture(scope="module")
def llm(model_dir):
    # Greedy by override, so that outputs compare exactly, and a repetition penalty strong enough to change them;
    # the other defaults are the file's.
    config = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                          max_num_batched_tokens=64, min_token_bucket=8, kv_cache_gib=0.01, seed=0,
                          override_generation_config={"temperature": 0, "repetition_penalty": 3.0})
    return LLM(config=config, progress=False)


def test_offline_generate_without_params_uses_the_defaults(llm):
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.top_k, default.repetition_penalty, default.presence_penalty,
            default.max_tokens) == (0, 0.8, 20, 3.0, 0.25, 9)
    implicit = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(PROMPT, SamplingParams(temperature=0, top_p=0.8, top_k=20, repetition_penalty=3.0,
                                                   presence_penalty=0.25, max_tokens=9), use_tqdm=False)[0].outputs[0]
    assert implicit.token_ids == explicit.token_ids and len(implicit.token_ids) <= 9
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids != implicit.token_ids  # the repetition penalty of the defaults changes this prompt


def test_server_requests_take_the_defaults_for_unset_fields(llm):
    from server.app import build_app
    from server.engine_client import AsyncEngine
    from server.metrics import EngineMetrics

    engine = AsyncEngine(llm.engine, EngineMetrics("gen"))
    server = LiveServer(build_app(engine, "gen"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        implicit = client.completions.create(model="gen", prompt=PROMPT, max_tokens=12,
                                             extra_body={"ignore_eos": True}).choices[0].text
        explicit = client.completions.create(model="gen", prompt=PROMPT, max_tokens=12, temperature=0, top_p=0.8,
                                             presence_penalty=0.25, extra_body={"ignore_eos": True, "top_k": 20,
                                                         "repetition_penalty": 3.0}).choices[0].text
        plain = client.completions.create(model="gen", prompt=PROMPT, max_tokens=12, temperature=0, top_p=1,
                                          presence_penalty=0, extra_body={"ignore_eos": True, "top_k": 0,
                                                      "repetition_penalty": 1.0}).choices[0].text
        assert implicit == explicit != plain
        # Chat without max_tokens: the generation config's max_new_tokens (the OpenAI default would run to the
        # context's end).
        chat = client.chat.completions.create(model="gen", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 9 and chat.choices[0].finish_reason == "length"
        # Completions keep OpenAI's (and vLLM's) 16, an explicit null included.
        for body in ({}, {"max_tokens": None}):
            out = client.completions.create(model="gen", prompt=PROMPT, extra_body={"ignore_eos": True, **body})
            assert out.usage.completion_tokens == 16
        wait_until_idle(llm.engine)
    finally:
        server.stop()
        engine.shutdown()


def test_cli_generate_takes_the_defaults_and_the_override_flag(llm, model_dir, capsys):
    main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--dtype", "float32", "--max-model-len",
          "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--min-token-bucket", "8", "--kv-cache-gib",
          "0.01", "--override-generation-config", '{"temperature": 0, "repetition_penalty": 3.0}'])
    expected = llm.generate("def f(x):", use_tqdm=False)[0].outputs[0]  # the same defaults (max_new_tokens 9)
    assert capsys.readouterr().out == expected.text + "\n"
