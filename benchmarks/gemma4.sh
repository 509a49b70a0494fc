#!/usr/bin/env bash
# Gemma 4 on this CPU: the shared workload (64 prompts x 128 random tokens -> 128, greedy) on a Gemma 4 checkpoint
# scaled to 2 cores (make_gemma4.py: E2B's layer at width 768, 10 layers, per-layer embeddings, the last 4 layers
# sharing K/V; bfloat16), ours then vLLM's CPU build (when PEER_VENV is set) in the same run, and our single-request
# latency. One JSON line per measurement.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/gemma4.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env, made, ours_then_peer
model="$(made make_gemma4.py gemma4-mini)"
ours_then_peer "$model"
