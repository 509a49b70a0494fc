"""Engine configuration from YAML and flags, and the `jaxengine generate` command."""

import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxengine.cli import main
from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import scan_warning

CONFIGS = Path(__file__).parent.parent / "configs"


def test_cpu_preset_loads_and_flags_override_it():
    cfg = EngineConfig.from_yaml(CONFIGS / "cpu-small.yaml", max_num_seqs=4, model=None)
    assert cfg.max_num_seqs == 4 and cfg.dtype == "float32" and cfg.enable_prefix_caching


def test_unknown_yaml_setting_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("max_num_seqs: 4\nmax_batch: 3\n")
    with pytest.raises(ValueError, match=r"unknown engine settings \['max_batch'\]"):
        EngineConfig.from_yaml(path)


def test_unknown_llm_settings_are_named_with_vllm_hints():
    """vLLM's LLM(...) settings of another name or no counterpart are refused with what to use instead, before any
    model loads; a setting no one knows is named too."""
    from jaxengine import LLM

    with pytest.raises(ValueError, match=r"LLM: unknown engine settings \['gpu_memory_utilization'\] "
                                         r"\(gpu_memory_utilization: the KV cache takes kv_cache_memory_fraction"):
        LLM("no/such-model", gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"\['enforce_eager', 'max_batch'\] \(enforce_eager: there are no CUDA"):
        LLM("no/such-model", enforce_eager=True, max_batch=3)
    with pytest.raises(ValueError, match="not both"):
        LLM("no/such-model", config=EngineConfig())



def test_unknown_flags_of_vllm_settings_get_the_same_hints(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--gpu-memory-utilization", "0.9", "--no-enforce-eager", "--max-batch", "3"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --gpu-memory-utilization 0.9 --no-enforce-eager --max-batch 3" in err
    assert "--gpu-memory-utilization: the KV cache takes kv_cache_memory_fraction" in err
    assert "--enforce-eager: there are no CUDA graphs" in err and "--max-batch:" not in err


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (dict(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction"),
    # Types are checked when the config is made, not found later in the engine.
    (dict(block_size=7.5), "block_size must be an integer"), (dict(max_model_len="512"), "max_model_len"),
    (dict(kv_cache_gib=float("nan")), "kv_cache_gib must be a finite number"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be true or false"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"), (dict(seed=-1), "seed must be >= 0"),
    (dict(dtype="fp8"), "dtype must be one of"), (dict(tokenizer=5), "tokenizer must be a path"),
    (dict(override_generation_config=[1]), "override_generation_config"),
])
def test_invalid_engine_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_generate_command_prints_the_completion(model_dirs, capsys):
    main(["generate", "--model", str(model_dirs["llama"]), "--prompt", "def f(x):", "--max-tokens", "6",
          "--ignore-eos", "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "512",
          "--kv-cache-gib", "0.01", "--dtype", "float32"])
    printed = capsys.readouterr().out.strip()
    from jaxengine import LLM, SamplingParams

    assert printed
    llm = LLM(model_dirs["llama"], dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32,
              kv_cache_gib=0.01, progress=False)
    want = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert printed == want[0].outputs[0].text.strip()


def test_generate_command_reports_bad_input_without_a_traceback(model_dirs):
    with pytest.raises(SystemExit, match="error: prompt is empty"):
        main(["generate", "--model", str(model_dirs["llama"]), "--prompt", "", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "32", "--max-model-len", "512", "--kv-cache-gib", "0.01"])


@pytest.mark.parametrize("flags,expected", [
    ([], None),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--enable-prefix-caching", "false"], False),
    (["--enable-prefix-caching", "on"], True),
])
def test_boolean_engine_flags_take_vllm_spellings(flags, expected):
    import argparse

    from jaxengine.cli import add_engine_flags, engine_config

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--max-num-seqs", "8", *flags])
    assert args.enable_prefix_caching is expected
    assert engine_config(args).enable_prefix_caching == (True if expected is None else expected)
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-prefix-caching", "maybe"])


def test_async_scheduling_is_on_unless_turned_off():
    import argparse

    from jaxengine.cli import add_engine_flags, engine_config

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).async_scheduling
    assert not engine_config(parser.parse_args(["--no-async-scheduling"])).async_scheduling


def test_serve_cors_flags_take_json_lists_of_strings(capsys):
    from jaxengine.cli import json_strings

    assert json_strings('["http://localhost:3000", "https://ui.example"]') == ["http://localhost:3000",
                                                                               "https://ui.example"]
    for bad in ("http://localhost:3000", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):  # argparse refuses it before anything starts
            main(["serve", "--allowed-origins", bad])
        assert "expected a JSON list of strings" in capsys.readouterr().err


def test_serve_flags_reach_the_app_and_uvicorn(engines, monkeypatch, tmp_path):
    """`jaxengine serve`'s own flags, wired through (uvicorn and the engine faked: no server runs, no request is
    generated): the served names, the API key, CORS, request id headers, the stats log, request logging, TLS, the
    log level, a profile left running (written at shutdown), the chat template flags, token ids in logprobs,
    the tool call parser and the Responses API's store size."""
    import uvicorn
    from fastapi.testclient import TestClient

    from jaxengine.engine import dp_engine

    engine = engines("llama")

    def create(config):  # the shared engine, under the config the flags made (restored after the test)
        monkeypatch.setattr(engine, "config", config)
        return engine

    monkeypatch.setattr(dp_engine, "create_engine", create)
    ran = {}

    def run(app, **kwargs):
        ran.update(kwargs, app=app)
        with TestClient(app) as client:
            models = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
            ran["models"] = [m["id"] for m in models]
            ran["keyless"] = client.get("/v1/models")
            ran["preflight"] = client.options("/v1/completions", headers={
                "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
            ran["profiling"] = client.post("/start_profile").status_code  # and never stopped
        ran["stats"] = app.state.engine.stats
        ran["log_requests"] = (app.state.engine.log_requests, app.state.engine.max_log_len)

    monkeypatch.setattr(uvicorn, "run", run)
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    main(["serve", "--served-model-name", "mine", "alias", "--api-key", "k",
          "--allowed-origins", '["http://ui.example"]',
          "--enable-request-id-headers", "--disable-log-stats", "--ssl-keyfile", str(key), "--ssl-certfile",
          str(cert), "--uvicorn-log-level", "warning", "--port", "8123", "--enable-log-requests", "--max-log-len", "9",
          "--profiler-dir", str(tmp_path / "traces"), "--chat-template", "{{ messages[0]['content'] }}",
          "--trust-request-chat-template", "--return-tokens-as-token-ids", "--enable-auto-tool-choice",
          "--tool-call-parser", "hermes", "--responses-store-size", "7"])
    assert ran["ssl_keyfile"] == str(key) and ran["ssl_certfile"] == str(cert) and ran["log_level"] == "warning"
    assert ran["port"] == 8123 and ran["models"] == ["mine", "alias"] and ran["stats"] is None
    assert ran["log_requests"] == (True, 9)
    serving = ran["app"].state.serving
    assert serving.chat_template == "{{ messages[0]['content'] }}" and serving.trust_request_chat_template
    assert serving.return_tokens_as_token_ids and serving.model_name == "mine" and serving.tool_call_parser == "hermes"
    assert serving.response_store.capacity == 7
    assert ran["keyless"].status_code == 401 and "x-request-id" in ran["keyless"].headers
    assert ran["preflight"].headers["access-control-allow-origin"] == "http://ui.example"
    # The profile left running was written when the server stopped.
    assert ran["profiling"] == 200 and list((tmp_path / "traces").rglob("*.xplane.pb"))
    with pytest.raises(SystemExit, match="--max-log-len must be >= 0"):
        main(["serve", "--max-log-len", "-1"])
    with pytest.raises(SystemExit, match="responses_store_size must be >= 0"):
        main(["serve", "--responses-store-size", "-1"])
    with pytest.raises(SystemExit, match="--ssl-keyfile and --ssl-certfile go together"):
        main(["serve", "--ssl-keyfile", str(key)])
    with pytest.raises(SystemExit, match="--ssl-certfile: no such file"):
        main(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "none.pem")])


def test_layer_loop_scan_over_bfloat16_weights_for_xla_dots_on_cpu_is_warned_about():
    """XLA:CPU converts a scan's stacked bfloat16 weights to float32 at every step where its own dots take
    their slices (benchmarks/README, sessions 21-22); the native matmul reads them in place. The engine says so
    at start-up where that applies, and only there."""
    warning = scan_warning("scan", "cpu", jnp.bfloat16, native_matmul=False)
    assert warning is not None and "1.8x slower" in warning and "unrolled" in warning
    assert scan_warning("scan", "cpu", jnp.bfloat16, native_matmul=True) is None
    assert scan_warning("auto", "cpu", jnp.bfloat16, native_matmul=False) is None
    assert scan_warning("unrolled", "cpu", jnp.bfloat16, native_matmul=False) is None
    assert scan_warning("scan", "cpu", jnp.float32, native_matmul=False) is None
    assert scan_warning("scan", "tpu", jnp.bfloat16, native_matmul=False) is None


@pytest.mark.parametrize("flags", [["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]])
def test_tool_call_flags_go_together(flags):
    """As vLLM: tool_choice auto needs both; either alone is refused at start, before the model loads."""
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice and --tool-call-parser go together"):
        main(["serve", *flags])


def test_lora_modules_flag(engines, lora_adapters, monkeypatch, capsys):
    """`--lora-modules name=path` or JSON, with --enable-lora (refused without it, before the model loads): the
    adapters reach the app under their names; VLLM_ALLOW_RUNTIME_LORA_UPDATING adds the load/unload routes."""
    import uvicorn

    from jaxengine.cli import lora_module
    from jaxengine.engine import dp_engine

    assert lora_module("a=/x") == ("a", "/x") and lora_module('{"name": "b", "path": "/y"}') == ("b", "/y")
    for bad in ("nopath", "=/x", '{"name": "b"}', '{"name": "b", "path": "/y", "rank": 4}'):
        with pytest.raises(SystemExit):
            main(["serve", "--lora-modules", bad])
        assert "expected" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--lora-modules needs --enable-lora"):
        main(["serve", "--lora-modules", "a=/x"])
    engine = engines("llama", enable_lora=True, max_loras=2, max_lora_rank=8)
    monkeypatch.setattr(dp_engine, "create_engine", lambda config: engine)
    ran = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.update(app=app))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    paths = {name: lora_adapters[name][0].lora_path for name in ("all", "attn")}
    main(["serve", "--enable-lora", "--lora-modules", f"all={paths['all']}",
          json.dumps({"name": "attn", "path": paths["attn"]})])
    serving = ran["app"].state.serving
    assert {name: r.lora_path for name, r in serving.loras.items()} == paths
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= {route.path for route in ran["app"].routes}
