"""`jaxengine bench serve`, the client that drives any OpenAI-compatible server, against ours: its counts and
its sampling flags (sent in each request, recorded in the result), failed requests counted (not fatal), text
datasets through the chat endpoint, the statistics asked for, and bad flags refused before any load."""

import json

import pytest

from jaxengine.cli import main
from tests.server.conftest import wait_until_idle
from tests.test_bench_tools import _sharegpt


def _result(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_serve_reports_the_load_it_sent(live, async_engine, capsys):
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


def test_bench_serve_random_ids_where_detokenize_bounds_nothing(live, async_engine, model_dirs, monkeypatch,
                                                                capsys):
    """vLLM's /detokenize decodes any id, so the probe finds no bound: the ids then come from the tokenizer's range
    (the range vLLM's server accepts), or the tool asks for --tokenizer / --vocab-size."""
    from jaxengine import bench
    from jaxengine.engine.llm_engine import load_tokenizer

    assert bench._vocab_from_detokenize(live.url) == async_engine.engine.model_config.vocab_size  # ours bounds it
    monkeypatch.setattr(bench, "_vocab_from_detokenize", lambda url: bench.PROBE_LIMIT)
    with pytest.raises(SystemExit, match="--tokenizer.*--vocab-size|--vocab-size.*--tokenizer"):
        main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2"])
    capsys.readouterr()
    main(["bench", "serve", "--base-url", live.url, "--num-prompts", "3", "--input-len", "6", "--output-len", "2",
          "--tokenizer", str(model_dirs["qwen2"]), "--ignore-eos"])
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
