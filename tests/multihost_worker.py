"""One process of a two-process engine (run by tests/test_multihost.py): 2 CPU devices each, TP = 4; the engine's
compilation cache in $MULTIHOST_CACHE_DIR (none without it). In "once" mode each process's last line is how many
of the runner's programs its warm-up loaded from that cache, how many programs there are, and how many XLA
compiles the process ran after its warm-up."""

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

from jaxengine.parallel.multihost import initialize  # noqa: E402


def main(process_id: int, port: int, model_dir: str, mode: str) -> None:
    initialize(f"127.0.0.1:{port}", 2, process_id, heartbeat_timeout_s=5)
    from jaxengine import SamplingParams, StructuredOutputsParams
    from jaxengine.compile_counter import compile_count
    from jaxengine.config import EngineConfig
    from jaxengine.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=512, max_num_seqs=8,
                                    max_num_batched_tokens=32, min_token_bucket=32, kv_cache_gib=0.01,
                                    tensor_parallel_size=4,
                                    compilation_cache_dir=os.environ.get("MULTIHOST_CACHE_DIR"), warmup=False),
                       progress=False)
    hits = engine.runner._cache.hits  # the loader's own programs come from the cache too
    engine.runner.warmup(progress=False)
    loaded, programs, warm = engine.runner._cache.hits - hits, len(engine.runner.shapes()) + 1, compile_count()
    if process_id != 0:
        engine.runner.follow()
        print("@@ follower stopped", flush=True)
        print("@@", json.dumps([loaded, programs, compile_count() - warm]), flush=True)
        return
    prompts, specs = json.loads(sys.stdin.readline())  # specs: each prompt's structured outputs (or None)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(**s) if s else None) for s in specs]
    print("@@ ready", flush=True)
    rounds = 0
    while True:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{rounds}-{i}", p, params[i])
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        if rounds == 0:
            print("@@", json.dumps([finals[f"r0-{i}"].outputs[0].token_ids for i in range(len(prompts))]), flush=True)
        rounds += 1
        if mode == "once":
            engine.runner.stop_followers()
            print("@@", json.dumps([loaded, programs, compile_count() - warm]), flush=True)
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
