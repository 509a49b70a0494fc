#!/usr/bin/env bash
# DeepSeek (multi-head latent attention) on this CPU: the shared workload (64 prompts x 128 random tokens -> 128,
# greedy) on a DeepSeek V2 checkpoint scaled to 2 cores (make_deepseek.py: DeepSeek-V2-Lite's layer at width 1024, 12
# layers, 16 experts, top 4; bfloat16), ours then vLLM's CPU build (when PEER_VENV is set) in the same run, and our
# single-request latency. One JSON line per measurement.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/deepseek.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env, made, ours_then_peer
model="$(made make_deepseek.py deepseek-mini)"
ours_then_peer "$model"
