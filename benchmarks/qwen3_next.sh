#!/usr/bin/env bash
# Qwen3-Next (Gated DeltaNet linear-attention layers: a state per sequence) on this CPU: the shared workload (64
# prompts x 128 random tokens -> 128, greedy) on a Qwen3-Next checkpoint scaled to 2 cores (make_qwen3_next.py: 6
# linear-attention and 2 gated full-attention layers at width 768, top 4 of 32 experts and a shared expert; bfloat16),
# ours then vLLM's CPU build (when PEER_VENV is set) in the same run, and our single-request latency. One JSON line
# per measurement.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/qwen3_next.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env, made, ours_then_peer
model="$(made make_qwen3_next.py qwen3-next-mini)"
ours_then_peer "$model"
