#!/usr/bin/env bash
# Nemotron-H (Mamba2 mixers: a state per sequence) on this CPU: the shared workload (64 prompts x 128 random tokens ->
# 128, greedy) on a Nemotron-H checkpoint scaled to 2 cores (make_nemotron_h.py: 6 Mamba2 mixers and 2 attention
# layers at width 768, ReLU^2 MLP blocks after all but one mixer; bfloat16), ours then vLLM's CPU build (when PEER_VENV
# is set) in the same run, and our single-request latency. One JSON line per measurement.
#   MODELS=/tmp/jaxengine-peer-models PEER_VENV=/path/.venv-vllm RUNS=3 bash benchmarks/nemotron_h.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # peers, models, runs, engine_settings, peer_env, made, ours_then_peer
model="$(made make_nemotron_h.py nemotron-h-mini)"
ours_then_peer "$model"
