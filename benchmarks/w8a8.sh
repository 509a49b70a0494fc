#!/usr/bin/env bash
# The shared workload on a W8A8 int8 checkpoint of the shared model (`jaxengine quantize`: compressed-tensors,
# per-channel weights, dynamic per-token activations), our engine then vLLM's CPU build when PEER_VENV is set,
# one after the other in the same run: offline throughput and single-request latency. One JSON line each.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/w8a8.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
peers="${PEERS:-$here/../../shared/peers}"
models="${MODELS:-/tmp/jaxengine-peer-models}"
runs="${RUNS:-3}"
[ -d "$models/llama-135m" ] || python "$peers/make_models.py" "$models" --only llama-135m >&2
[ -d "$models/llama-135m-w8a8" ] || jaxengine quantize --model "$models/llama-135m" --output "$models/llama-135m-w8a8" >&2
engine=(--model "$models/llama-135m-w8a8" --max-model-len 1024 --max-num-seqs 64 --max-num-batched-tokens 512
        --kv-cache-gib 2)
jaxengine bench throughput "${engine[@]}" --runs "$runs"
jaxengine bench latency "${engine[@]}" --batch-size 1 --num-iters 5
if [ -n "${PEER_VENV:-}" ]; then
    PEER_VENV="$(readlink -f "$PEER_VENV")"
    # the peer's fastest settings, as cpu_shared_workload.sh runs it offline
    preload=()
    tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    [ -f "$tcmalloc" ] && preload+=("$tcmalloc")
    [ -f "$PEER_VENV/lib/libiomp5.so" ] && preload+=("$PEER_VENV/lib/libiomp5.so")
    peer_env=(VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=0)
    [ ${#preload[@]} -gt 0 ] && peer_env+=(LD_PRELOAD="${preload[*]}")
    env "${peer_env[@]}" "$PEER_VENV/bin/python" "$peers/bench_vllm_offline.py" "$models/llama-135m-w8a8" --runs "$runs"
fi
