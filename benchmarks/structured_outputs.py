"""Offline output tokens/s with and without structured outputs on the same requests, and prints one JSON object.

    python benchmarks/structured_outputs.py --model DIR [--num-prompts 32 --input-len 128 --output-len 64]

Greedy, ignore_eos, random prompt tokens (fixed seed); the constrained runs hold every request to a JSON schema (an
object with a string and a list of strings: room for the whole output) or to a regular expression.
"""

import argparse
import json
import platform
import time

import numpy as np

from jaxengine import LLM, SamplingParams, StructuredOutputsParams
from jaxengine.bench import source_commit

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}}, "required": ["name", "tags"]}
CASES = {"none": None, "json_schema": StructuredOutputsParams(json=SCHEMA),
         "regex": StructuredOutputsParams(regex=r"[a-z ]{0,4000}")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=args.input_len + args.output_len + 1, max_num_seqs=args.num_prompts)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(4, vocab, args.input_len).tolist()} for _ in range(args.num_prompts)]
    results = {}
    for name, spec in CASES.items():
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, structured_outputs=spec)
        llm.generate(prompts[:2], params, use_tqdm=False)
        runs = []
        for _ in range(args.runs):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs.append(tokens / (time.perf_counter() - start))
        results[name] = dict(output_tok_s=round(float(np.median(runs)), 1), runs=[round(r, 1) for r in runs],
                             output_tokens=tokens)
        print(f"{name:>12}: {results[name]['output_tok_s']} output tok/s", flush=True)
    print(json.dumps(dict(benchmark="structured_outputs", commit=source_commit(), machine=platform.machine(),
                          model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, results=results)))


if __name__ == "__main__":
    main()
