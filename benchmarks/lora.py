#!/usr/bin/env python3
"""Offline generation with LoRA: the shared workload (N prompts of random token ids -> output_len tokens, greedy,
ignore_eos; ../shared/peers/workload.py) three ways, medians of several runs: `base` (LoRA off), `lora-on` (LoRA on,
requests without an adapter) and `adapter` (every request with one adapter). `--engine vllm`, run in vLLM's venv,
measures vLLM's CPU build the same way (bfloat16, max_model_len 1024, prefix caching off, as the peers' scripts set
it):

  python benchmarks/lora.py --model DIR --make-adapter /tmp/lora-r16      # writes a random rank-16 adapter once
  python benchmarks/lora.py --model DIR --adapter /tmp/lora-r16
  VENV/bin/python benchmarks/lora.py --engine vllm --model DIR --adapter /tmp/lora-r16

The adapter updates all seven projections of every layer (PEFT format). One JSON line on stdout.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

def make_adapter(model: str, out: Path, rank: int) -> None:
    """A random adapter of all seven projections of every layer (tests/lora_util.py's, with small weights)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.lora_util import TARGETS, make_adapter as write

    config = json.loads((Path(model) / "config.json").read_text())
    write(out, config, rank, tuple(TARGETS), seed=0, alpha=2 * rank, std=0.02, base_model_name_or_path=model,
          task_type="CAUSAL_LM")


def _jaxengine(args, lora_on: bool):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxengine import LLM, LoRARequest, SamplingParams
    from jaxengine.bench import source_commit

    llm = LLM(args.model, max_model_len=1024, max_num_seqs=args.num_prompts, enable_prefix_caching=False,
              progress=False, **(dict(enable_lora=True, max_loras=1, max_lora_rank=args.max_lora_rank)
                                 if lora_on else {}))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def generate(prompts, adapter: bool):
        lora = LoRARequest("bench", 1, args.adapter) if adapter else None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate, {"commit": source_commit()}


def _vllm(args, lora_on: bool):
    # This directory's kernels.py would shadow the `kernels` package that vLLM imports.
    sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, seed=0, enable_prefix_caching=False,
              **(dict(enable_lora=True, max_loras=1, max_lora_rank=args.max_lora_rank) if lora_on else {}))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def generate(prompts, adapter: bool):
        lora = LoRARequest("bench", 1, args.adapter) if adapter else None
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                            lora_request=lora)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate, {"vllm_version": vllm.__version__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", choices=("jaxengine", "vllm"), default="jaxengine")
    parser.add_argument("--adapter", help="a PEFT LoRA adapter of the model")
    parser.add_argument("--make-adapter", help="write a random adapter of --rank here, then stop")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--modes", default="base,lora-on,adapter")
    parser.add_argument("--peers", default=str(Path(__file__).resolve().parents[2] / "shared" / "peers"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.make_adapter:
        make_adapter(args.model, Path(args.make_adapter), args.rank)
        return
    sys.path.insert(0, args.peers)
    from workload import make_prompts

    prompts = make_prompts(args.model, args.num_prompts, args.input_len, 0)
    result = {"engine": args.engine, "benchmark": "lora", "model": args.model, "adapter_path": args.adapter,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    modes = args.modes.split(",")
    for lora_on in (False, True):
        wanted = [m for m in modes if (m != "base") == lora_on]
        if not wanted:
            continue
        generate, info = (_vllm if args.engine == "vllm" else _jaxengine)(args, lora_on)
        result |= info
        for mode in wanted:
            generate(prompts[:4], mode == "adapter")  # warm-up
            rates = []
            for run in range(args.runs):
                start = time.perf_counter()
                tokens = generate(prompts, mode == "adapter")
                rates.append(tokens / (time.perf_counter() - start))
                print(f"[{args.engine}] {mode} run {run}: {rates[-1]:.1f} output tok/s", file=sys.stderr, flush=True)
            result[mode] = {"output_tok_s": round(statistics.median(rates), 1), "runs": [round(r, 1) for r in rates]}
        del generate
    print(json.dumps(result))


if __name__ == "__main__":
    main()
