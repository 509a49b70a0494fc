"""`jaxengine bench throughput|latency|serve|startup`: benchmarks that print one JSON object (and a table on
stderr). Flags mirror `vllm bench` so scripts carry over; engine flags are those of `jaxengine serve`.

The random dataset is the shared peer workload: token ids drawn uniformly from [4, vocab) with
numpy's default_rng(seed), so every engine sees the same prompts.
"""

import asyncio
import dataclasses
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxengine.cli import add_engine_flags, engine_config
from jaxengine.compile_counter import compile_count

FIRST_ID = 4


def _context(config=None) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    out = {"commit": commit or None, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                 "python": platform.python_version()}}
    if config is not None:
        out["config"] = dataclasses.asdict(config)
    return out


def _emit(result: dict, output_json: str | None) -> None:
    for key, value in result.items():
        if not isinstance(value, (dict, list)):
            print(f"{key:>28}: {value}", file=sys.stderr)
    line = json.dumps(result)
    print(line)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")


def random_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(FIRST_ID, vocab_size, size=(num_prompts, input_len)).tolist()


def _dataset_seed(args) -> int:
    return 0 if args.seed is None else args.seed


def _dataset(args, vocab_size: int) -> list:
    if args.dataset_name == "random":
        return random_prompts(vocab_size, args.num_prompts, args.input_len, _dataset_seed(args))
    with open(args.dataset_path) as f:  # a JSON list of prompts (strings or token-id lists)
        return json.load(f)[: args.num_prompts]


def _sampling(args) -> dict:
    """The sampling flags (spelled as `vllm bench serve` spells them) that were given, as SamplingParams fields;
    greedy (temperature 0) by default, as the shared workload. A bad value raises ValueError naming it."""
    from jaxengine.sampling_params import SamplingParams

    fields = {"temperature": args.temperature} | {name: getattr(args, name) for name in ("top_p", "top_k", "min_p")
                                                  if getattr(args, name) is not None}
    SamplingParams(**fields)
    return fields


def _offline_config(args):
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = False  # as the peer scripts: repeated runs must not skip prefill
    return engine_config(args)


def throughput(args) -> None:
    from jaxengine import LLM, SamplingParams

    config = _offline_config(args)
    start = time.perf_counter()
    llm = LLM(config=config, progress=False)
    init_s = time.perf_counter() - start
    prompts = _dataset(args, llm.engine.model_config.vocab_size)
    sampling = _sampling(args)
    params = SamplingParams(**sampling, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(**sampling, max_tokens=8, ignore_eos=True), use_tqdm=False)
    compiles = compile_count()
    runs = []
    for _ in range(args.runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        runs.append((wall, generated, prompt_tokens))
    wall, generated, prompt_tokens = sorted(runs)[len(runs) // 2]
    _emit({"benchmark": "throughput", "num_prompts": len(prompts), "input_len": args.input_len,
           "output_len": args.output_len, "sampling": sampling, "init_s": round(init_s, 2),
           "wall_s": round(wall, 3),
           "requests_per_s": round(len(prompts) / wall, 3), "output_tok_s": round(generated / wall, 2),
           "total_tok_s": round((generated + prompt_tokens) / wall, 2),
           "runs_output_tok_s": [round(g / w, 2) for w, g, _ in runs],
           "compiles_during_runs": compile_count() - compiles} | _context(config), args.output_json)


def latency(args) -> None:
    from jaxengine import LLM, SamplingParams

    config = _offline_config(args)
    llm = LLM(config=config, progress=False)
    prompts = random_prompts(llm.engine.model_config.vocab_size, args.batch_size, args.input_len, _dataset_seed(args))
    sampling = _sampling(args)

    def timed(max_tokens):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(**sampling, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(2)
    ttft = float(np.median([timed(1) for _ in range(args.num_iters)]))
    e2e = float(np.median([timed(args.output_len) for _ in range(max(2, args.num_iters // 2))]))
    _emit({"benchmark": "latency", "batch_size": args.batch_size, "input_len": args.input_len,
           "output_len": args.output_len, "sampling": sampling, "ttft_ms": round(ttft * 1e3, 2),
           "e2e_ms": round(e2e * 1e3, 2),
           "tpot_ms": round((e2e - ttft) / (args.output_len - 1) * 1e3, 3)} | _context(config), args.output_json)


async def _one_request(client, url, model, prompt, output_len, sampling):
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}} | sampling
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": stamps[0] - start if stamps else end - start, "e2e": end - start, "tokens": tokens,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def _serve_load(args, prompts, model, sampling):
    import httpx

    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = np.random.default_rng(args.seed)

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        async def guarded(prompt):
            async with limit:
                return await _one_request(client, args.base_url, model, prompt, args.output_len, sampling)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(guarded(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s) * 1e3 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": round(float(ms.mean()), 2), f"median_{name}_ms": round(float(np.median(ms)), 2),
            f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 2)}


def serve(args) -> None:
    import httpx

    sampling = _sampling(args)
    models = httpx.get(args.base_url + "/v1/models", timeout=30).json()["data"]
    model = args.model or models[0]["id"]
    vocab = args.vocab_size or _vocab_from_tokenize(args.base_url)
    prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    results, wall = asyncio.run(_serve_load(args, prompts, model, sampling))
    out_tokens = sum(r["tokens"] for r in results)
    tpots = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    result = {"benchmark": "serve", "base_url": args.base_url, "model": model, "num_prompts": len(prompts),
              "input_len": args.input_len, "output_len": args.output_len, "sampling": sampling,
              "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, "duration_s": round(wall, 3),
              "request_throughput": round(len(prompts) / wall, 3), "output_throughput": round(out_tokens / wall, 2),
              "total_output_tokens": out_tokens}
    result |= _stats("ttft", [r["ttft"] for r in results]) | _stats("tpot", tpots)
    result |= _stats("itl", [x for r in results for x in r["itl"]]) | _stats("e2el", [r["e2e"] for r in results])
    _emit(result | _context(), args.output_json)


def _vocab_from_tokenize(base_url: str) -> int:
    """The vocabulary size, from the largest id /detokenize accepts (binary search; our server's 400 says it)."""
    import httpx

    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = httpx.post(base_url + "/detokenize", json={"tokens": [mid - 1]}, timeout=30).status_code == 200
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    return lo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_to_ready(argv: list[str], cache_dir: str, timeout: float) -> float:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "jaxengine.cli", "serve", "--port", str(port), "--compilation-cache-dir", cache_dir,
           *argv]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def startup(args, engine_argv: list[str]) -> None:
    cache = tempfile.mkdtemp(prefix="jaxengine-startup-cache-")
    try:
        cold = _time_to_ready(engine_argv, cache, args.timeout)
        warm = [_time_to_ready(engine_argv, cache, args.timeout) for _ in range(args.runs)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    _emit({"benchmark": "startup", "cold_cache_s": round(cold, 2), "warm_cache_s": round(float(np.median(warm)), 2),
           "warm_runs_s": [round(w, 2) for w in warm], "engine_args": engine_argv} | _context(), args.output_json)


def _add_sampling_flags(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the shared workload)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve, startup); one JSON line each")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, run in (("throughput", throughput), ("latency", latency)):
        p = kinds.add_parser(name)
        add_engine_flags(p)
        p.add_argument("--dataset-name", choices=("random", "json"), default="random")
        p.add_argument("--dataset-path", default=None)
        p.add_argument("--num-prompts", type=int, default=64)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--batch-size", type=int, default=1)
        p.add_argument("--num-iters", type=int, default=5)
        p.add_argument("--runs", type=int, default=3)
        p.add_argument("--output-json", default=None)
        _add_sampling_flags(p)
        p.set_defaults(run=run)
    p = kinds.add_parser("serve", help="a client for any OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--dataset-name", choices=("random",), default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="for random ids (default: asked from the server)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    _add_sampling_flags(p)
    p.set_defaults(run=serve)
    p = kinds.add_parser("startup", help="process start to ready, cold and warm compilation cache; "
                                          "other arguments go to `jaxengine serve`")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--output-json", default=None)
    p.set_defaults(run=startup, passthrough=True)
