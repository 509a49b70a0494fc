#!/usr/bin/env bash
# The float8 KV cache (`--kv-cache-dtype fp8` / `fp8_e5m2`) against the default (bfloat16 for the shared bfloat16
# model on CPU): the shared workload's offline throughput, ours then vLLM's CPU build (when PEER_VENV is set) with
# the same cache dtype, one after the other in the same run; and our decode at a long context (16 requests x 1920
# prompt tokens, 64 output tokens each: TTFT and TPOT), where the attention reads the most cache. One JSON line
# per measurement; the KV cache's size in blocks is in our engine's log (stderr).
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 [DTYPES="auto fp8 fp8_e5m2"] \
#     bash benchmarks/kv_cache_dtype.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dtypes="${DTYPES:-auto fp8 fp8_e5m2}"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env (vLLM's environment)
peer_env+=(VLLM_ENABLE_V1_MULTIPROCESSING=0)  # offline in-process, as cpu_shared_workload.sh runs it
model="$models/llama-135m"
for dtype in $dtypes; do
    jaxengine bench throughput --model "$model" "${engine_settings[@]}" --kv-cache-dtype "$dtype" --runs "$runs"
    if [ -n "${PEER_VENV:-}" ]; then
        env "${peer_env[@]}" "$PEER_VENV/bin/python" "$here/vllm_offline_sampled.py" "$model" --peers "$peers" \
            --runs "$runs" --temperature 0 --kv-cache-dtype "$dtype"
    fi
done
for dtype in $dtypes; do
    jaxengine bench latency --model "$model" --max-model-len 2048 --max-num-seqs 16 --max-num-batched-tokens 512 \
        --kv-cache-gib 2 --kv-cache-dtype "$dtype" --batch-size 16 --input-len 1920 --output-len 64 --num-iters 2
done
