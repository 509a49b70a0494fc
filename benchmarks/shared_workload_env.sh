# Sourced by the shared-workload scripts (with `here`, their folder, set): the settings they share. `peers`,
# `models` (the shared model made there if missing) and `runs` from PEERS, MODELS and RUNS; `engine_settings`, our
# engine's flags for the workload (`--model` aside); `peer_env`, the environment vLLM's CPU build runs in, and
# PEER_VENV made absolute where it is set. The peer's fastest settings (../shared/peers/README.md): no CPUs
# reserved, a 2 GiB KV cache, and, each where present, tcmalloc (Debian's libtcmalloc-minimal4) and the venv's
# libiomp5 preloaded; `ours_then_peer MODEL_DIR`, the runs a model's script makes on it, and `made MAKER NAME`, a
# checkpoint scaled to this CPU (below).
peers="${PEERS:-$here/../../shared/peers}"
models="${MODELS:-/tmp/jaxengine-peer-models}"
runs="${RUNS:-3}"
[ -d "$models/llama-135m" ] || python "$peers/make_models.py" "$models" --only llama-135m >&2
engine_settings=(--max-model-len 1024 --max-num-seqs 64 --max-num-batched-tokens 512 --kv-cache-gib 2)
peer_env=(VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2)
if [ -n "${PEER_VENV:-}" ]; then
    PEER_VENV="$(readlink -f "$PEER_VENV")"
    preload=()
    tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    [ -f "$tcmalloc" ] && preload+=("$tcmalloc")
    [ -f "$PEER_VENV/lib/libiomp5.so" ] && preload+=("$PEER_VENV/lib/libiomp5.so")
    [ ${#preload[@]} -gt 0 ] && peer_env+=(LD_PRELOAD="${preload[*]}")
fi

# The checkpoint $models/$2, made by $here/$1 where missing; its path.
made() {
    [ -d "$models/$2" ] || python "$here/$1" "$models" >&2 || return
    echo "$models/$2"
}

# Ours then vLLM's CPU build (where PEER_VENV is set) on the shared workload, greedy, over the checkpoint $1; then our
# single-request latency. One JSON line each.
ours_then_peer() {
    jaxengine bench throughput --model "$1" "${engine_settings[@]}" --runs "$runs"
    if [ -n "${PEER_VENV:-}" ]; then
        env "${peer_env[@]}" VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PEER_VENV/bin/python" "$here/vllm_offline_sampled.py" \
            "$1" --peers "$peers" --runs "$runs" --temperature 0
    fi
    jaxengine bench latency --model "$1" "${engine_settings[@]}" --batch-size 1 --num-iters 5
}
