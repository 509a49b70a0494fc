#!/usr/bin/env bash
# The shared CPU workload (see ../shared/peers/README.md) with our tools, then the vLLM peer if available.
#   MODELS=/tmp/peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/cpu_shared_workload.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
peers="${PEERS:-$here/../../shared/peers}"
models="${MODELS:-/tmp/jaxengine-peer-models}"
runs="${RUNS:-3}"
[ -d "$models/llama-135m" ] || python "$peers/make_models.py" "$models" --only llama-135m >&2
engine=(--model "$models/llama-135m" --max-model-len 1024 --max-num-seqs 64 --max-num-batched-tokens 512
        --min-token-bucket 64 --kv-cache-gib 2)
jaxengine bench throughput "${engine[@]}" --runs "$runs"
jaxengine bench latency "${engine[@]}" --batch-size 1 --num-iters 5
jaxengine bench startup "${engine[@]}" --runs 2
port=8765
jaxengine serve "${engine[@]}" --port "$port" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
jaxengine bench serve --base-url "http://127.0.0.1:$port" --num-prompts 64 --input-len 128 --output-len 128
kill $server
if [ -n "${PEER_VENV:-}" ]; then
    "$PEER_VENV/bin/python" "$peers/bench_vllm_offline.py" "$models/llama-135m" --runs "$runs"
fi
