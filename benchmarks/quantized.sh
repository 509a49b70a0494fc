#!/usr/bin/env bash
# The shared workload on quantized checkpoints of the shared model (`jaxengine quantize`: compressed-tensors W8A8
# int8, per-channel weights and dynamic per-token activations; W4A16, symmetric int4 weights in groups of 64
# inputs; AWQ, int4 weights with zero points in groups of 64; FP8, e4m3 weights in blocks of 128 x 128), our
# engine then vLLM's CPU build when PEER_VENV is set, one after the other in the same run, for each scheme: offline
# throughput and single-request latency. One JSON line each (the peer's an error line where it cannot serve the
# checkpoint: its FP8 kernel needs AMX).
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 [SCHEMES="w8a8 w4a16 awq fp8"] \
#     bash benchmarks/quantized.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
schemes="${SCHEMES:-w8a8 w4a16 awq fp8}"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env (vLLM's environment)
peer_env+=(VLLM_ENABLE_V1_MULTIPROCESSING=0)  # offline in-process, as cpu_shared_workload.sh runs it
for scheme in $schemes; do
    model="$models/llama-135m-$scheme"
    # group 64: the shared model's widths (576, 1536) are multiples of it, not of 128
    flags=(--scheme "$scheme"); case "$scheme" in w4a16|awq) flags+=(--group-size 64);; esac
    [ -d "$model" ] || jaxengine quantize --model "$models/llama-135m" --output "$model" "${flags[@]}" >&2
    engine=(--model "$model" "${engine_settings[@]}")
    jaxengine bench throughput "${engine[@]}" --runs "$runs"
    jaxengine bench latency "${engine[@]}" --batch-size 1 --num-iters 5
    if [ -n "${PEER_VENV:-}" ]; then
        env "${peer_env[@]}" "$PEER_VENV/bin/python" "$peers/bench_vllm_offline.py" "$model" --runs "$runs" ||
            echo "{\"engine\": \"vllm-cpu\", \"model\": \"$(basename "$model")\", \"error\": \"it did not serve the checkpoint (its stderr says why)\"}"
    fi
done
