"""`jaxengine bench serve`, the client that drives any OpenAI-compatible server, against ours: its counts and
its sampling flags (sent in each request, recorded in the result), the token-id datasets (prefix_repetition,
burstgpt), a timed trace sent at its timestamps, failed requests counted (not fatal), text datasets through the
chat and responses endpoints, the statistics asked for, and bad flags refused before any load."""

import json
import shutil
import subprocess

import pytest

from jaxengine.cli import main
from server.app import build_app
from tests.server.conftest import API_KEY, MODEL, LiveServer, wait_until_idle
from jaxengine.bench_data import burstgpt_requests
from tests.test_bench_tools import _burstgpt, _sharegpt, _trace


def _result(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_serve_reports_the_load_it_sent(live, async_engine, tmp_path, capsys):
    main(["bench", "serve", "--base-url", live.url, "--num-prompts", "6", "--input-len", "9", "--output-len", "5",
          "--max-concurrency", "4", "--ignore-eos", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
          "--min-p", "0.01", "--presence-penalty", "0.5", "--num-warmups", "2"])
    result = _result(capsys)
    assert result["benchmark"] == "serve" and result["num_prompts"] == 6
    assert result["completed"] == 6 and result["failed"] == 0 and result["errors"] == []
    assert result["total_output_tokens"] == 6 * 5  # ignore_eos: every request runs to its max_tokens
    assert result["total_input_tokens"] == 6 * 9
    assert result["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01,
                                  "presence_penalty": 0.5}
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"] and result["output_throughput"] > 0
    assert {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")} \
        <= result.keys()
    main(["bench", "serve", "--base-url", live.url, "--dataset-name", "prefix_repetition", "--num-prompts", "4",
          "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", "8",
          "--prefix-repetition-suffix-len", "4", "--prefix-repetition-output-len", "2", "--ignore-eos"])
    result = _result(capsys)  # token ids below the vocabulary the server's /detokenize bounds, as random's
    assert result["completed"] == 4 and result["total_input_tokens"] == 4 * 12 and result["total_output_tokens"] == 8
    burst = _burstgpt(tmp_path, [("GPT-4", 7, 2), ("GPT-4", 5, 3), ("ChatGPT", 9, 9)])
    main(["bench", "serve", "--base-url", live.url, "--dataset-name", "burstgpt", "--dataset-path", str(burst),
          "--num-prompts", "3", "--ignore-eos"])
    result = _result(capsys)
    reqs = burstgpt_requests(str(burst), 100, 3, seed=0)  # the rows --seed 0 draws (the vocabulary sets only ids)
    assert result["completed"] == 3 and result["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert result["total_output_tokens"] == sum(r.output_len for r in reqs)
    wait_until_idle(async_engine.engine)


def test_bench_serve_replays_a_timed_trace_at_its_timestamps(live, async_engine, tmp_path, capsys):
    lines = [{"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]},
             {"timestamp": 300, "input_length": 12, "output_length": 4, "hash_ids": [7]},
             {"timestamp": 600, "input_length": 9, "output_length": 2, "hash_ids": [3]}]
    trace = _trace(tmp_path, lines)
    main(["bench", "serve", "--base-url", live.url, "--dataset-name", "timed_trace", "--dataset-path", str(trace),
          "--timed-trace-sec-multiplier", "0.001", "--save-detailed"])
    result = _result(capsys)
    assert result["completed"] == 3 and result["self_timed"] is True and result["ignore_eos"] is True
    assert result["input_lens"] == [20, 12, 9] and result["output_lens"] == [3, 4, 2]  # each to the trace's length
    # No request leaves before its timestamp (the bound holds whatever the machine's speed).
    assert all(start >= line["timestamp"] / 1000 for start, line in zip(result["start_times"], lines))
    assert result["duration"] >= 0.6
    main(["bench", "serve", "--base-url", live.url, "--dataset-name", "timed_trace", "--dataset-path", str(trace),
          "--no-self-timed", "--num-prompts", "2"])
    result = _result(capsys)  # at --request-rate (inf): all at once
    assert result["completed"] == 2 and result["self_timed"] is False and result["total_output_tokens"] == 7
    wait_until_idle(async_engine.engine)


def test_bench_serve_loads_a_tokenizer_of_its_own_code_only_with_trust_remote_code(live, async_engine, tokenizer_dir,
                                                                                   tmp_path, capsys):
    from tests.tiny_models import make_remote_code_tokenizer

    custom = make_remote_code_tokenizer(tokenizer_dir, tmp_path / "custom")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["a text prompt", "another one"]))  # text: counted with the tokenizer
    argv = ["bench", "serve", "--base-url", live.url, "--dataset-name", "json", "--dataset-path", str(prompts),
            "--num-prompts", "2", "--output-len", "3", "--ignore-eos", "--tokenizer", str(custom)]
    with pytest.raises(SystemExit, match="--trust-remote-code"):
        main(argv)
    main(argv + ["--trust-remote-code"])
    assert _result(capsys)["completed"] == 2
    wait_until_idle(async_engine.engine)


def test_bench_serve_counts_failed_requests(live, async_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7], [5, 10**7], [8, 9, 10, 11]]))  # the second is outside the vocabulary
    main(["bench", "serve", "--base-url", live.url, "--dataset-name", "json", "--dataset-path", str(prompts),
          "--num-prompts", "3", "--output-len", "4", "--ignore-eos"])
    result = _result(capsys)
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["total_output_tokens"] == 2 * 4 and result["total_input_tokens"] == 3 + 4
    assert len(result["errors"]) == 1 and result["errors"][0].startswith("HTTP 400")
    # Every request refused (prompts past max_model_len): the result is printed, then a clear exit.
    with pytest.raises(SystemExit, match="every request failed"):
        main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--input-len", "600",
              "--output-len", "4"])
    result = _result(capsys)
    assert result["completed"] == 0 and result["failed"] == 2 and result["total_output_tokens"] == 0
    wait_until_idle(async_engine.engine)


def test_bench_serve_sharegpt_through_the_chat_endpoint(live, async_engine, model_dirs, tmp_path, capsys):
    from jaxengine import bench_data
    from jaxengine.engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(model_dirs["qwen2"])
    path, _ = _sharegpt(tmp_path, tokenizer)
    saved = tmp_path / "results"
    saved.mkdir()
    main(["bench", "serve", "--base-url", live.url, "--backend", "openai-chat", "--tokenizer",
          str(model_dirs["qwen2"]), "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3",
          "--ignore-eos", "--request-rate", "50", "--burstiness", "0.5", "--percentile-metrics", "ttft,e2el",
          "--metric-percentiles", "50,90", "--save-result", "--result-dir", str(saved), "--result-filename", "r.json"])
    result = _result(capsys)
    reqs = bench_data.sharegpt_requests(str(path), tokenizer, 3, seed=0)
    assert result["endpoint"] == "/v1/chat/completions" and result["completed"] == 3
    assert result["total_output_tokens"] == sum(r.output_len for r in reqs)  # each answer's length
    # The prompt tokens the server counted: each prompt in the chat template.
    assert result["total_input_tokens"] == sum(len(tokenizer.apply_chat_template(
        [{"role": "user", "content": r.prompt}], tokenize=True, add_generation_prompt=True, return_dict=False))
        for r in reqs) > sum(r.prompt_len for r in reqs)
    assert {"p50_ttft_ms", "p90_ttft_ms", "p50_e2el_ms", "std_e2el_ms"} <= result.keys()
    assert not any("itl" in key or "tpot" in key for key in result)
    assert json.loads((saved / "r.json").read_text()) == result
    wait_until_idle(async_engine.engine)


def test_bench_serve_through_the_responses_endpoint(live, async_engine, model_dirs, tmp_path, capsys):
    # Greedy, the tiny model answers the second prompt with ids past the tokenizer's vocabulary, which decode to no
    # text: a response without a text delta has no first token to time and fails, as in vLLM's client.
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["the quick brown fox", "a lazy dog jumps over", "fox and dog"]))
    main(["bench", "serve", "--base-url", live.url, "--backend", "openai-responses", "--tokenizer",
          str(model_dirs["qwen2"]), "--dataset-name", "json", "--dataset-path", str(prompts), "--num-prompts", "3",
          "--output-len", "5", "--ignore-eos", "--save-detailed"])
    result = _result(capsys)
    assert result["endpoint"] == "/v1/responses" and result["completed"] == 2 and result["failed"] == 1
    assert result["errors"] == ["", "the stream carried no text delta to time the first token by", ""]
    # The token counts are the final event's usage; each text delta is an arrival (the tokens that decode to no
    # text send none, so fewer gaps than tokens here).
    assert result["output_lens"] == [5, 0, 5] and all(len(result["itls"][i]) < 5 for i in (0, 2))
    assert result["input_lens"][0] > 4  # the server's count: the prompt in the chat template
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"] and result["mean_tpot_ms"] >= 0
    with pytest.raises(SystemExit, match="--backend openai-responses sends text"):
        main(["bench", "serve", "--base-url", live.url, "--backend", "openai-responses", "--num-prompts", "2"])
    with pytest.raises(SystemExit, match="--logprobs applies to the completions and chat backends"):
        main(["bench", "serve", "--base-url", live.url, "--backend", "openai-responses", "--logprobs", "2"])
    wait_until_idle(async_engine.engine)


def test_bench_serve_takes_vllm_bench_serve_options(live, async_engine, tmp_path, capsys):
    """--extra-body (merged last), --logprobs, --header, --served-model-name, --goodput, --label, --metadata,
    --save-detailed, --append-result and --disable-tqdm, as `vllm bench serve` reads them."""
    argv = ["bench", "serve", "--base-url", live.url, "--num-prompts", "4", "--input-len", "6", "--output-len", "5",
            "--ignore-eos", "--extra-body", '{"max_tokens": 3, "temperature": 0.5, "seed": 1}', "--logprobs", "2",
            "--header", "x-bench=1", "--served-model-name", MODEL, "--request-rate", "200", "--burstiness", "inf",
            "--label", "mine", "--metadata", "tp=1", "note=a b", "--save-detailed", "--disable-tqdm",
            "--append-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "r.json"]
    main(argv + ["--goodput", "ttft:100000", "tpot:100000", "e2el:100000"])
    result = _result(capsys)
    assert result["completed"] == 4 and result["total_output_tokens"] == 4 * 3  # the body's max_tokens won
    assert result["sampling"] == {"temperature": 0.0}
    assert result["extra_body"] == {"max_tokens": 3, "temperature": 0.5, "seed": 1}
    assert result["label"] == "mine" and result["tp"] == "1" and result["note"] == "a b"
    assert result["request_goodput"] == result["request_throughput"]  # every request met the objectives
    assert result["output_lens"] == [3] * 4 and result["errors"] == [""] * 4 and len(result["itls"]) == 4
    assert all(len(itl) == 2 for itl in result["itls"]) and all(0 < t for t in result["ttfts"])
    # Seeded: an unseeded draw of 3 tokens from the tiny model now and then decodes to no text at all.
    assert result["input_lens"] == [6] * 4 and all(isinstance(t, str) and t for t in result["generated_texts"])
    starts = result["start_times"]  # evenly spaced at 200 req/s: the first after one gap
    assert starts == sorted(starts) and starts[0] >= 0.004 and starts[-1] >= 0.019
    main(argv + ["--goodput", "ttft:0"])  # no first token comes in 0 ms
    second = _result(capsys)
    assert second["request_goodput"] == 0 and second["goodput"] == {"ttft": 0.0}
    lines = (tmp_path / "out" / "r.json").read_text().splitlines()
    assert [json.loads(line) for line in lines if line] == [result, second]
    assert "it/s" not in capsys.readouterr().err  # --disable-tqdm
    wait_until_idle(async_engine.engine)


def test_bench_serve_sends_the_api_key_and_waits_for_the_server(live_with_key, async_engine, monkeypatch, capsys):
    argv = ["bench", "serve", "--base-url", live_with_key.url, "--num-prompts", "2", "--input-len", "5",
            "--output-len", "2", "--ignore-eos", "--ready-check-timeout-sec", "5"]
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with pytest.raises(SystemExit, match="--base-url"):  # /v1/models refused the key: asked again for 5 s
        main(argv)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # as vLLM's client: a bearer token on every request
    main(argv)
    assert _result(capsys)["completed"] == 2
    wait_until_idle(async_engine.engine)


def test_bench_serve_ready_check_timeout_bounds_both_waits_together(live, monkeypatch):
    """/v1/models and then the first request are retried against one deadline, not one timeout each."""
    from jaxengine import bench

    deadlines = []
    models = bench._models

    def asked_models(base_url, headers, deadline, verify=True):
        deadlines.append(deadline)
        return models(base_url, headers, deadline, verify)

    async def never_ready(client, url, chat, body, headers, deadline):
        deadlines.append(deadline)
        return {"success": False, "error": "still starting"}

    monkeypatch.setattr(bench, "_models", asked_models)
    monkeypatch.setattr(bench, "_wait_until_ready", never_ready)
    with pytest.raises(SystemExit, match="--ready-check-timeout-sec: the first request did not succeed.*starting"):
        main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--input-len", "5", "--output-len", "2",
              "--ready-check-timeout-sec", "30"])
    assert len(deadlines) == 2 and deadlines[0] == deadlines[1]


def test_bench_serve_random_ids_where_detokenize_bounds_nothing(live, async_engine, model_dirs, monkeypatch,
                                                                capsys):
    """vLLM's /detokenize decodes any id, so the probe finds no bound: the ids then come from the tokenizer's range
    (the range vLLM's server accepts): --tokenizer, else the model's directory where /v1/models names it as the
    model's root (as ours and vLLM's do), or the tool asks for --tokenizer / --vocab-size."""
    from jaxengine import bench
    from jaxengine.engine.llm_engine import load_tokenizer

    assert bench._vocab_from_detokenize(live.url) == async_engine.engine.model_config.vocab_size  # ours bounds it
    monkeypatch.setattr(bench, "_vocab_from_detokenize", lambda url, headers=None, verify=True: bench.PROBE_LIMIT)
    argv = ["bench", "serve", "--base-url", live.url, "--num-prompts", "3", "--input-len", "6", "--output-len", "2",
            "--ignore-eos"]
    main(argv)  # the tokenizer of /v1/models' root, the served model's directory
    assert _result(capsys)["completed"] == 3
    models = bench._models

    def rootless(*args, **kwargs):
        return [{"id": m["id"]} for m in models(*args, **kwargs)]

    monkeypatch.setattr(bench, "_models", rootless)
    with pytest.raises(SystemExit, match="--tokenizer.*--vocab-size|--vocab-size.*--tokenizer"):
        main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2"])
    capsys.readouterr()
    main(argv + ["--tokenizer", str(model_dirs["qwen2"])])
    assert _result(capsys)["completed"] == 3
    assert max(load_tokenizer(model_dirs["qwen2"]).get_vocab().values()) + 1 < async_engine.engine.model_config.vocab_size
    wait_until_idle(async_engine.engine)


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5"], "top_p"),
    (["--burstiness", "0"], "--burstiness"),
    (["--request-rate", "0"], "--request-rate"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics"),
    (["--metric-percentiles", "0,50"], "--metric-percentiles"),
    (["--backend", "openai-chat"], "openai-chat"),  # the random dataset's prompts are token ids
    (["--random-range-ratio", "2"], "--random-range-ratio"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:-1"], "--goodput"),
    (["--goodput", "ttft"], "--goodput"),
    (["--header", "no-value"], "--header"),
    (["--metadata", "=x"], "--metadata"),
    (["--logprobs", "-1"], "--logprobs"),
    (["--ready-check-timeout-sec", "-1"], "--ready-check-timeout-sec"),
    (["--ramp-up-strategy", "linear"], "--ramp-up-start-rps"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4", "--request-rate", "2"],
     "--request-rate"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "5", "--ramp-up-end-rps", "2"], "--ramp-up-end-rps"),
    (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "2"],
     "--ramp-up-start-rps"),
    (["--ramp-up-end-rps", "2"], "--ramp-up-strategy"),
    (["--self-timed"], "--self-timed .* timed_trace dataset only"),
    (["--dataset-name", "timed_trace", "--dataset-path", "t.jsonl", "--backend", "openai-chat"], "--backend openai"),
    (["--dataset-name", "timed_trace", "--dataset-path", "t.jsonl", "--request-rate", "4"], "--no-self-timed"),
])
def test_bench_serve_refuses_bad_flags_before_sending(live, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", *argv])


def test_bench_serve_says_when_no_server_answers(live):
    from jaxengine.bench import _free_port

    with pytest.raises(SystemExit, match="--base-url: no OpenAI-compatible server answered"):
        main(["bench", "serve", "--base-url", f"http://127.0.0.1:{_free_port()}", "--num-prompts", "2"])
    with pytest.raises(SystemExit, match="--base-url: no OpenAI-compatible server answered"):
        main(["bench", "serve", "--base-url", live.url + "/nothing-here", "--num-prompts", "2"])  # a 404


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a self-signed certificate")
def test_bench_serve_insecure_drives_an_https_server_with_a_self_signed_certificate(async_engine, tmp_path, capsys):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-days", "1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = LiveServer(build_app(async_engine, MODEL), tls=(str(cert), str(key)))
    try:
        argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--input-len", "4", "--output-len",
                "3", "--ignore-eos", "--disable-tqdm"]
        with pytest.raises(SystemExit, match="CERTIFICATE_VERIFY_FAILED"):  # verified unless told
            main(argv)
        main(argv + ["--insecure"])
        result = _result(capsys)
        assert result["base_url"].startswith("https://") and result["completed"] == 2
    finally:
        server.stop()
    wait_until_idle(async_engine.engine)
