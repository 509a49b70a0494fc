#!/usr/bin/env bash
# The shared CPU workload (see ../shared/peers/README.md): our engine, then vLLM's CPU build when
# PEER_VENV is set, one after the other in the same run. One JSON line per measurement on stdout.
#   MODELS=/tmp/peer-models PEER_VENV=/path/.venv-vllm RUNS=3 [SAMPLED=1] [RATES="inf 4"] bash benchmarks/cpu_shared_workload.sh
# RATES: the serving request rates (default inf, the shared workload's; serve_bench.sh's own default is "inf 4").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
rates="${RATES:-inf}"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env (vLLM's environment)
engine=(--model "$models/llama-135m" "${engine_settings[@]}")

# The peer's offline runs keep its engine in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on these
# 2 cores that was 474-509 output tok/s against 435-452 with its default engine-core process (session 17, two
# alternations). Its server keeps the default.
offline_env=("${peer_env[@]}" VLLM_ENABLE_V1_MULTIPROCESSING=0)

# Offline throughput and single-request latency.
jaxengine bench throughput "${engine[@]}" --runs "$runs"
if [ -n "${PEER_VENV:-}" ]; then
    env "${offline_env[@]}" "$PEER_VENV/bin/python" "$peers/bench_vllm_offline.py" "$models/llama-135m" --runs "$runs"
fi
jaxengine bench latency "${engine[@]}" --batch-size 1 --num-iters 5

# SAMPLED=1: offline throughput again with a chat-style draw (temperature 0.8, top-p 0.95, top-k 50), ours then
# vLLM's (vllm_offline_sampled.py; the peers' script is greedy only).
if [ -n "${SAMPLED:-}" ]; then
    sampling=(--temperature 0.8 --top-p 0.95 --top-k 50)
    jaxengine bench throughput "${engine[@]}" --runs "$runs" "${sampling[@]}"
    if [ -n "${PEER_VENV:-}" ]; then
        env "${offline_env[@]}" "$PEER_VENV/bin/python" "$here/vllm_offline_sampled.py" "$models/llama-135m" \
            --peers "$peers" --runs "$runs" "${sampling[@]}"
    fi
fi

# Serving at request rate inf: vLLM's own `bench serve` client against our server, then against vLLM. Prefix
# caching off, as serve_bench.sh starts vLLM: every run sends the same prompts, and with the cache on all runs
# after the first would skip their prefill.
port=8765
jaxengine serve "${engine[@]}" --no-enable-prefix-caching --port "$port" --served-model-name llama-135m \
    >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
compiles() { curl -s "http://127.0.0.1:$port/metrics" | awk '/^jaxengine:compile_count/ {print $2}'; }
before=$(compiles)
if [ -n "${PEER_VENV:-}" ]; then
    SERVER_URL="http://127.0.0.1:$port" VLLM_VENV="$PEER_VENV" RUNS="$runs" RATES="$rates" \
        bash "$peers/serve_bench.sh" "$models/llama-135m"
else
    for rate in $rates; do
        jaxengine bench serve --base-url "http://127.0.0.1:$port" --num-prompts 64 --input-len 128 --output-len 128 \
            --ignore-eos --request-rate "$rate"
    done
fi
echo "{\"engine\": \"jaxengine-serve\", \"compiles_during_serve_benchmark\": $(python -c "print(int(float('$(compiles)') - float('$before')))")}"
kill $server; wait $server 2>/dev/null || true
if [ -n "${PEER_VENV:-}" ]; then
    env "${peer_env[@]}" VLLM_VENV="$PEER_VENV" RUNS="$runs" RATES="$rates" bash "$peers/serve_bench.sh" "$models/llama-135m"
fi

jaxengine bench startup "${engine[@]}" --runs 2
