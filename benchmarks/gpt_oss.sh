#!/usr/bin/env bash
# GPT-OSS on this CPU: the shared workload (64 prompts x 128 random tokens -> 128, greedy) on a GPT-OSS checkpoint
# scaled to 2 cores (make_gpt_oss.py: gpt-oss-20b's layer at width 640, 12 layers, 32 experts, top 4; bfloat16),
# ours then vLLM's CPU build (when PEER_VENV is set) in the same run, and our single-request latency. One JSON line
# per measurement.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/gpt_oss.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env (vLLM's environment)
model="$models/gpt-oss-mini"
[ -d "$model" ] || python "$here/make_gpt_oss.py" "$models" >&2
jaxengine bench throughput --model "$model" "${engine_settings[@]}" --runs "$runs"
if [ -n "${PEER_VENV:-}" ]; then
    env "${peer_env[@]}" VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PEER_VENV/bin/python" "$here/vllm_offline_sampled.py" \
        "$model" --peers "$peers" --runs "$runs" --temperature 0
fi
jaxengine bench latency --model "$model" "${engine_settings[@]}" --batch-size 1 --num-iters 5
