"""`jaxengine bench serve`, the client that drives any OpenAI-compatible server, against ours: its counts and
its sampling flags (sent in each request, recorded in the result), and a bad flag refused before any load."""

import json

import pytest

from jaxengine.cli import main
from tests.server.conftest import wait_until_idle


def test_bench_serve_reports_the_load_it_sent(live, async_engine, capsys):
    main(["bench", "serve", "--base-url", live.url, "--num-prompts", "6", "--input-len", "9", "--output-len", "5",
          "--max-concurrency", "4", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.01"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["benchmark"] == "serve" and result["num_prompts"] == 6
    assert result["total_output_tokens"] == 6 * 5  # ignore_eos: every request runs to its max_tokens
    assert result["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01}
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"] and result["output_throughput"] > 0
    wait_until_idle(async_engine.engine)


def test_bench_serve_refuses_a_bad_sampling_flag_before_sending(live):
    with pytest.raises(SystemExit, match="top_p"):
        main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--top-p", "1.5"])
