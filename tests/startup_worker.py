"""One engine start-up with an executable cache (run by tests/test_executable_cache.py). JAX's own
persistent cache stays off, as in `jaxengine serve`. Prints one JSON line: what the warm-up loaded and
compiled, and what the engine generated."""

import json
import sys

from jaxengine import SamplingParams
from jaxengine.compile_counter import compile_count
from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine
from tests.engine_util import run_to_completion


def main(model_dir: str, cache_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=176, max_num_seqs=3,
                                    max_num_batched_tokens=16, min_token_bucket=8, kv_cache_gib=0.01,
                                    compilation_cache_dir=cache_dir, warmup=False), progress=False)
    before = compile_count()
    engine.runner.warmup(progress=False)
    compiles = compile_count() - before
    kv_before = engine.runner.kv_cache
    finals = run_to_completion(engine, [
        ("greedy", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        ("seeded", [30, 31, 32], SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)),
        ("logprobs", [40, 41, 42, 43], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                      prompt_logprobs=2, repetition_penalty=1.3)),
    ])
    out = finals["logprobs"]
    print(json.dumps({
        "programs": len(engine.runner.shapes()) + 1, "loaded": engine.runner._cache.hits,
        "compiles_in_warmup": compiles, "kv_cache_donated": kv_before.is_deleted(),
        "tokens": {rid: list(final.outputs[0].token_ids) for rid, final in finals.items()},
        "prompt_logprobs": [None if p is None else {str(k): round(v.logprob, 5) for k, v in p.items()}
                            for p in out.prompt_logprobs],
        "logprobs": [{str(k): round(v.logprob, 5) for k, v in p.items()} for p in out.outputs[0].logprobs],
    }), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
