#!/usr/bin/env python3
"""Offline embedding throughput: a model served by the pooling runner (`runner="pooling"`, LAST pooling,
normalised: both engines' default), N prompts of random token ids (the shared workload's prompts,
../shared/peers/workload.py), embedded all at once, medians of several runs. `--engine vllm`, run in vLLM's venv,
measures vLLM's CPU build on the same prompts (bfloat16, max_model_len 1024, prefix caching off, as the peers'
scripts set it):

  python benchmarks/embeddings.py --model DIR --save ours.npy
  VENV/bin/python benchmarks/embeddings.py --engine vllm --model DIR --save theirs.npy --compare ours.npy

`--save` writes the embeddings (float32 [N, hidden]); `--compare` adds the cosine similarities of this run's
embeddings with a saved run's (min and median) to the result. One JSON line on stdout.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _jaxengine(args, prompts):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxengine import LLM
    from jaxengine.bench import source_commit

    llm = LLM(args.model, runner="pooling", max_model_len=1024, max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, progress=False)

    def embed(batch):
        return [o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)]

    return embed, {"commit": source_commit(), "max_num_batched_tokens": args.max_num_batched_tokens}


def _vllm(args, prompts):
    # This directory's kernels.py would shadow the `kernels` package that vLLM imports.
    sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, runner="pooling", dtype="bfloat16", max_model_len=1024, seed=0,
              enable_prefix_caching=False)

    def embed(batch):
        return [o.outputs.embedding for o in llm.embed([TokensPrompt(prompt_token_ids=p) for p in batch],
                                                       use_tqdm=False)]

    return embed, {"vllm_version": vllm.__version__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", choices=("jaxengine", "vllm"), default="jaxengine")
    parser.add_argument("--peers", default=str(Path(__file__).resolve().parents[2] / "shared" / "peers"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--save", help="write the embeddings here (.npy)")
    parser.add_argument("--compare", help="a saved run's embeddings (.npy) to compare with")
    args = parser.parse_args()
    sys.path.insert(0, args.peers)
    from workload import make_prompts

    prompts = make_prompts(args.model, args.num_prompts, args.input_len, 0)
    embed, engine_info = (_vllm if args.engine == "vllm" else _jaxengine)(args, prompts)
    embed(prompts[:4])  # warm-up
    rates, vectors = [], None
    for run in range(args.runs):
        start = time.perf_counter()
        vectors = embed(prompts)
        wall = time.perf_counter() - start
        rates.append(sum(map(len, prompts)) / wall)
        print(f"[{args.engine}] embeddings run {run}: {rates[-1]:.1f} prompt tok/s", file=sys.stderr, flush=True)
    vectors = np.asarray(vectors, np.float32)
    result = {"engine": args.engine, "benchmark": "embeddings", "model": args.model, "num_prompts": args.num_prompts,
              "input_len": args.input_len, **engine_info,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "prompt_tok_s": round(statistics.median(rates), 1), "runs_prompt_tok_s": [round(r, 1) for r in rates],
              "requests_s": round(statistics.median(rates) / args.input_len, 2)}
    if args.save:
        np.save(args.save, vectors)
    if args.compare:
        other = np.load(args.compare)
        cosine = (vectors * other).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(other, axis=1)
        result |= {"cosine_min": round(float(cosine.min()), 6), "cosine_median": round(float(np.median(cosine)), 6)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
