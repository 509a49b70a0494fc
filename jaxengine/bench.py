"""`jaxengine bench throughput|latency|serve|startup`: benchmarks that print one JSON object (and a table on
stderr). Flags mirror `vllm bench` so scripts carry over; engine flags are those of `jaxengine serve`.

The random dataset is the shared peer workload: token ids drawn uniformly from [4, vocab) with
numpy's default_rng(seed), so every engine sees the same prompts.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from jaxengine.bench_data import (FIRST_ID, ID_DATASETS, BenchRequest, add_dataset_flags, at_least, load_requests,
                                  random_lengths, random_requests)
from jaxengine.cli import add_engine_flags, engine_config, json_object
from jaxengine.compile_counter import compile_count

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PROBE_LIMIT = 1 << 22  # ids /detokenize is probed below (the largest vocabularies are ~260k)
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def source_commit(directory: str | None = None) -> str | None:
    """The commit of the checkout holding `directory` (default: this code's), with "-dirty" where tracked files
    differ from it; None outside a git checkout."""
    def git(*command):
        return subprocess.run(["git", *command], capture_output=True, text=True,
                              cwd=directory or os.path.dirname(__file__))

    commit = git("rev-parse", "--short", "HEAD").stdout.strip()
    if not commit:
        return None
    return commit + ("-dirty" if git("diff", "--quiet", "HEAD").returncode == 1 else "")


def _context(config=None) -> dict:
    out = {"commit": source_commit(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                 "python": platform.python_version()}}
    if config is not None:
        out["config"] = dataclasses.asdict(config)
    return out


def _memory() -> dict:
    """This process's memory, GiB: its peak resident set (file-backed pages included: a checkpoint's memory map while
    it loads) and its anonymous resident memory now (weights, KV cache, runtime; Linux only, else None)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** (30 if sys.platform == "darwin" else 20)
    anon = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return {"peak_rss_gib": round(peak, 2), "rss_anon_gib": None if anon is None else round(anon, 2)}


def _emit(result: dict, path: str | None) -> str:
    """Prints the result (a table on stderr, the JSON line on stdout), writes the line to `path` where given, and
    returns it."""
    for key, value in result.items():
        if not isinstance(value, (dict, list)):
            print(f"{key:>28}: {value}", file=sys.stderr)
    line = json.dumps(result)
    print(line)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    return line


def random_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    return [r.prompt for r in random_requests(vocab_size, num_prompts, input_len, 1, seed)]


def _dataset_seed(args) -> int:
    return 0 if args.seed is None else args.seed


def _sampling(args) -> dict:
    """The sampling flags (spelled as `vllm bench serve` spells them) that were given, as SamplingParams fields;
    greedy (temperature 0) by default, as the shared workload. A bad value raises ValueError naming it."""
    from jaxengine.sampling_params import SamplingParams

    fields = {"temperature": args.temperature} | {name: getattr(args, name) for name in SAMPLING_FLAGS
                                                  if getattr(args, name) is not None}
    SamplingParams(**fields)
    return fields


def _offline_config(args):
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = False  # as the peer scripts: repeated runs must not skip prefill
    return engine_config(args)


def _check_profile(args, config) -> None:
    if args.profile and not config.profiler_dir:
        raise ValueError("--profile writes a jax.profiler trace into the engine's --profiler-dir DIR: give one")


def throughput(args) -> None:
    from jaxengine import LLM, SamplingParams

    at_least("--runs", args.runs)
    config = _offline_config(args)
    _check_profile(args, config)
    sampling = _sampling(args)
    start = time.perf_counter()
    llm = LLM(config=config, progress=False)
    init_s = time.perf_counter() - start
    requests = load_requests(args, vocab_size=llm.engine.model_config.vocab_size, get_tokenizer=llm.get_tokenizer,
                             seed=_dataset_seed(args))
    prompts = [r.prompt for r in requests]
    detokenize = not args.disable_detokenize
    params = [SamplingParams(**sampling, n=args.n, max_tokens=r.output_len, ignore_eos=True, detokenize=detokenize)
              for r in requests]
    llm.generate(prompts[:4], SamplingParams(**sampling, max_tokens=8, ignore_eos=True, detokenize=detokenize),
                 use_tqdm=False)
    compiles = compile_count()
    managers = [r.block_manager for r in getattr(llm.engine, "replicas", [llm.engine])]
    looked_up = [(m.query_tokens, m.hit_tokens) for m in managers]
    runs = []
    if args.profile:  # as vLLM's --profile: a trace of the timed runs (which it slows)
        llm.start_profile()
    for _ in range(args.runs):
        llm.reset_prefix_cache()  # each run shares only what its own prompts share (and not the warm-up's)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        runs.append((wall, generated, prompt_tokens))
    if args.profile:
        llm.stop_profile()
    wall, generated, prompt_tokens = sorted(runs)[len(runs) // 2]
    queries = sum(m.query_tokens - q for m, (q, _) in zip(managers, looked_up))
    hits = sum(m.hit_tokens - h for m, (_, h) in zip(managers, looked_up))
    input_len, output_len = random_lengths(args) if args.dataset_name == "random" else (None, args.output_len)
    _emit({"benchmark": "throughput", "dataset_name": args.dataset_name, "dataset_path": args.dataset_path,
           "num_prompts": len(prompts), "input_len": input_len, "output_len": output_len, "n": args.n,
           "detokenize": detokenize, "sampling": sampling, "init_s": round(init_s, 2), "wall_s": round(wall, 3),
           "total_prompt_tokens": prompt_tokens, "total_output_tokens": generated,
           "requests_per_s": round(len(prompts) / wall, 3), "output_tok_s": round(generated / wall, 2),
           "total_tok_s": round((generated + prompt_tokens) / wall, 2),
           "runs_output_tok_s": [round(g / w, 2) for w, g, _ in runs],
           # Prompt tokens the prefix cache served, of those looked up, over the timed runs (0 with it off).
           "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
           "compiles_during_runs": compile_count() - compiles, "profiled": args.profile} | _memory()
          | _context(config), args.output_json)


def latency(args) -> None:
    from jaxengine import LLM, SamplingParams

    for name, low in (("batch_size", 1), ("input_len", 1), ("output_len", 2), ("num_iters", 1),
                      ("num_iters_warmup", 0), ("n", 1)):
        at_least("--" + name.replace("_", "-"), getattr(args, name), low)
    config = _offline_config(args)
    _check_profile(args, config)
    sampling = _sampling(args)
    llm = LLM(config=config, progress=False)
    prompts = random_prompts(llm.engine.model_config.vocab_size, args.batch_size, args.input_len, _dataset_seed(args))

    generated = []
    decode_times = []  # each request's time from its first token to its last, per token after the first
    detokenize = not args.disable_detokenize

    def timed(max_tokens):
        start = time.perf_counter()
        params = SamplingParams(**sampling, n=args.n, max_tokens=max_tokens, ignore_eos=True, detokenize=detokenize)
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        generated.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
        if max_tokens > 1:
            for o in outs:
                tokens = max(len(c.token_ids) for c in o.outputs)
                if tokens > 1:
                    decode_times.append((o.metrics.finished_time - o.metrics.first_token_time) / (tokens - 1))
        return wall

    for _ in range(args.num_iters_warmup):
        timed(2)
    head = {"benchmark": "latency", "batch_size": args.batch_size, "n": args.n, "detokenize": detokenize,
            "input_len": args.input_len, "output_len": args.output_len}
    if args.profile:  # as vLLM's: one traced batch after the warm-up, and no timings (the trace slows it)
        llm.start_profile()
        timed(args.output_len)
        llm.stop_profile()
        _emit(head | {"profiled": True, "output_tokens_per_iter": generated[-1], "sampling": sampling}
              | _context(config), args.output_json)
        return
    ttft = float(np.median([timed(1) for _ in range(args.num_iters)]))
    decode_times.clear()  # (the warm-up's)
    latencies = np.array([timed(args.output_len) for _ in range(args.num_iters)])
    e2e = float(np.median(latencies))
    percents = (10, 25, 50, 75, 90, 99)  # vLLM's latency keys: avg_latency, latencies, percentiles (seconds)
    _emit(head | {"profiled": False, "output_tokens_per_iter": generated[-1], "sampling": sampling,
                  "ttft_ms": round(ttft * 1e3, 2), "e2e_ms": round(e2e * 1e3, 2),
                  "tpot_ms": round(float(np.median(decode_times)) * 1e3, 3),
                  "avg_latency": float(latencies.mean()), "latencies": latencies.tolist(),
                  "percentiles": dict(zip(map(str, percents), np.percentile(latencies, percents).tolist()))}
          | _memory() | _context(config), args.output_json)


def _failure(message: str, start: float) -> dict:
    return {"success": False, "error": message, "start": start}


class _Failed(Exception):
    """A streamed request that failed: an HTTP error status, a dropped connection, a line that is not JSON."""


async def _stream(client, url: str, body: dict, headers: dict):
    """The JSON of each server-sent `data:` line of a streamed POST (but [DONE]); _Failed where the request fails."""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise _Failed(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        raise _Failed(f"{type(e).__name__}: {e}") from None


def _timed(start: float, stamps: list[float], tokens: int, prompt_tokens: int | None, text: str) -> dict:
    """A streamed request's result: its tokens' arrival times give the TTFT, the ITLs and its latency."""
    return {"success": True, "start": start, "ttft": stamps[0] - start, "e2e": stamps[-1] - start, "tokens": tokens,
            "prompt_tokens": prompt_tokens, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "text": text}


async def _one_request(client, url: str, kind: str, body: dict, headers: dict):
    """One streamed request (`kind` "completions" or "chat"; "responses": `_one_responses_request`; "embeddings":
    one response, its latency the TTFT and the end-to-end latency alike, as vLLM's embeddings client times it).
    Returns its timings, token count and text,
    or its failure (an HTTP status, an error event in the stream, a dropped connection, a stream without a choice)
    without raising: vLLM's client counts failed requests the same way. As in vLLM's client, every chunk that
    carries a choice is a token's arrival (the first one's time is the TTFT, the gaps between them the ITLs), and
    the request's latency ends at the last one."""
    if kind == "embeddings":
        return await _one_embedding_request(client, url, body, headers)
    if kind == "responses":
        return await _one_responses_request(client, url, body, headers)
    chat = kind == "chat"
    start = time.perf_counter()
    stamps, texts, tokens, prompt_tokens = [], [], None, None
    try:
        async with contextlib.aclosing(_stream(client, url, body, headers)) as chunks:
            async for chunk in chunks:
                if chunk.get("error"):
                    return _failure(f"error in the stream: {json.dumps(chunk['error'])[:300]}", start)
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
                    choice = chunk["choices"][0]
                    texts.append(((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or "")
                elif chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                    prompt_tokens = chunk["usage"].get("prompt_tokens")
    except _Failed as e:
        return _failure(str(e), start)
    if not stamps:
        return _failure("the stream carried no choice to time the first token by", start)
    return _timed(start, stamps, sum(map(bool, texts)) if tokens is None else tokens, prompt_tokens, "".join(texts))


RESPONSES_TOKEN_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta")
RESPONSES_END_EVENTS = ("response.completed", "response.incomplete")


async def _one_responses_request(client, url: str, body: dict, headers: dict):
    """A streamed /v1/responses request, timed as vLLM's client times it: each output or reasoning text delta is a
    token's arrival, and the output and input token counts are the final event's usage; an `error` or
    `response.failed` event, or a stream that ends without response.completed or response.incomplete, fails it."""
    start = time.perf_counter()
    stamps, texts, usage, ended = [], [], {}, False
    try:
        async with contextlib.aclosing(_stream(client, url, body, headers)) as events:
            async for event in events:
                kind = event.get("type")
                if kind in RESPONSES_TOKEN_EVENTS:
                    stamps.append(time.perf_counter())
                    if kind == "response.output_text.delta":
                        texts.append(event.get("delta") or "")
                elif kind in RESPONSES_END_EVENTS:
                    ended, usage = True, (event.get("response") or {}).get("usage") or {}
                elif kind in ("error", "response.failed") or event.get("error"):
                    return _failure(f"error in the stream: {json.dumps(event.get('error') or event)[:300]}", start)
    except _Failed as e:
        return _failure(str(e), start)
    if not stamps:
        return _failure("the stream carried no text delta to time the first token by", start)
    if not ended:
        return _failure("the stream ended without response.completed or response.incomplete", start)
    return _timed(start, stamps, usage.get("output_tokens", len(stamps)), usage.get("input_tokens"), "".join(texts))


async def _one_embedding_request(client, url: str, body: dict, headers: dict):
    start = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers)
        latency = time.perf_counter() - start
        if response.status_code != 200:
            return _failure(f"HTTP {response.status_code}: {response.text[:300]}", start)
        usage = response.json().get("usage") or {}
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return _failure(f"{type(e).__name__}: {e}", start)
    return {"success": True, "start": start, "ttft": latency, "e2e": latency, "tokens": 0,
            "prompt_tokens": usage.get("prompt_tokens"), "itl": [], "text": ""}


def send_times(count: int, request_rate: float, burstiness: float, seed: int, ramp_up=None) -> np.ndarray:
    """When each request is sent, in seconds from the start, as `vllm bench serve` schedules them. The gaps are
    gamma-distributed with shape `burstiness` and mean 1/rate (1: a Poisson process; below 1 burstier, above more
    regular; inf: every gap 1/rate), at `request_rate` or, with `ramp_up` = (strategy, start, end), at request i's
    rate on a linear or exponential ramp from start to end req/s; a rate of inf sends at once. Request i leaves
    after the first i + 1 gaps; at a fixed rate the times are scaled so that the last is at count / rate, as vLLM's
    client scales them (the load's length then does not depend on the seed). With the same --seed, vLLM 0.32's
    client sends at the same times."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive (inf: evenly spaced), got {burstiness}")
    if ramp_up is None:
        if not request_rate > 0:
            raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
        rates = np.full(count, float(request_rate))
    else:
        strategy, first, last = ramp_up
        progress = np.arange(count) / max(count - 1, 1)
        rates = first + (last - first) * progress if strategy == "linear" else first * (last / first) ** progress
    gaps = np.zeros(count)
    finite = np.isfinite(rates)
    if math.isinf(burstiness):
        gaps[finite] = 1.0 / rates[finite]
    else:
        # numpy's legacy generator, seeded as vLLM's client seeds it: the same draws, so the same arrival times.
        gaps[finite] = np.random.RandomState(seed).gamma(burstiness, 1.0 / (rates[finite] * burstiness))
    times = np.cumsum(gaps)
    if ramp_up is None and count and times[-1] > 0:
        times *= count / request_rate / times[-1]
    return times


def _ramp_up(args):
    """(strategy, start, end) from the --ramp-up-* flags, or None; checked as vLLM's client checks them."""
    if args.ramp_up_strategy is None:
        if args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps take effect with --ramp-up-strategy")
        return None
    if not math.isinf(args.request_rate):
        raise ValueError("--ramp-up-strategy sets the request rate: leave out --request-rate")
    if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    at_least("--ramp-up-start-rps", args.ramp_up_start_rps)
    at_least("--ramp-up-end-rps", args.ramp_up_end_rps, args.ramp_up_start_rps)
    return args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps


def _self_timed(args, kind: str, ramp_up) -> bool:
    """Whether requests leave at the trace's timestamps (--self-timed, the timed_trace dataset's default, as in
    vLLM's client) rather than at the request rate."""
    if args.dataset_name != "timed_trace":
        if args.self_timed is not None:
            raise ValueError("--self-timed / --no-self-timed apply to the timed_trace dataset only")
        return False
    if kind != "completions":
        raise ValueError("the timed_trace dataset's prompts are token ids: use --backend openai or vllm "
                         "(/v1/completions)")
    if args.self_timed is False:
        return False
    if ramp_up or not math.isinf(args.request_rate) or args.burstiness != 1.0:
        raise ValueError("the trace's timestamps set when its requests leave: --request-rate, --burstiness and "
                         "--ramp-up-* apply with --no-self-timed")
    return True


def _key_values(flag: str, items, separator: str = "=") -> dict[str, str]:
    out = {}
    for item in items or ():
        key, found, value = item.partition(separator)
        if not found or not key.strip():
            raise ValueError(f"{flag} takes KEY{separator}VALUE pairs, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _goodput(args) -> dict[str, float]:
    """--goodput's service-level objectives (milliseconds) by metric: ttft, tpot, e2el."""
    objectives = {}
    for name, value in _key_values("--goodput", args.goodput, ":").items():
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        try:
            objectives[name] = float(value)
        except ValueError:
            objectives[name] = math.nan
        if not objectives[name] >= 0:
            raise ValueError(f"--goodput: {name} takes a number of milliseconds >= 0, got {value!r}")
    return objectives


def _headers(args) -> dict[str, str]:
    """Every request's headers: OPENAI_API_KEY as a bearer token (as vLLM's client sends it), then --header."""
    key = os.environ.get("OPENAI_API_KEY")
    return ({"Authorization": f"Bearer {key}"} if key else {}) | _key_values("--header", args.header)


def _request_body(args, model: str, kind: str, req: BenchRequest, extra: dict) -> dict:
    """What vLLM's client sends, then --extra-body (the sampling flags are part of it, as in vLLM's client)."""
    if kind == "embeddings":
        return {"model": model, "input": req.prompt} | extra
    if kind == "responses":  # not stored: a server that keeps responses would hold every one of the load's
        body = {"model": model, "input": req.prompt, "max_output_tokens": req.output_len, "stream": True,
                "store": False}
        return body | ({"ignore_eos": True} if args.ignore_eos else {}) | extra
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        body |= {"messages": [{"role": "user", "content": req.prompt}], "max_completion_tokens": req.output_len}
        if args.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": args.logprobs}
    else:
        body |= {"prompt": req.prompt, "max_tokens": req.output_len, "repetition_penalty": 1.0,
                 "logprobs": args.logprobs}
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body | extra


async def _wait_until_ready(client, url: str, kind: str, body: dict, headers: dict, deadline: float) -> dict:
    """--ready-check-timeout-sec: the first request, sent until it succeeds (the server may still be starting) or
    `deadline` (time.monotonic) passes; the /v1/models wait before it spent part of the same time."""
    while True:
        result = await _one_request(client, url, kind, body, headers)
        if result["success"] or time.monotonic() > deadline:
            return result
        await asyncio.sleep(1.0)


async def _profile_call(client, base_url: str, action: str, headers: dict) -> None:
    """--profile: POST /start_profile or /stop_profile, as vLLM's client; a server that refuses fails the run."""
    try:
        response = await client.post(f"{base_url}/{action}", headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"--profile: POST {base_url}/{action} failed: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        hint = " (start the server with --profiler-dir DIR)" if response.status_code == 404 else ""
        raise ValueError(f"--profile: POST {base_url}/{action} answered HTTP {response.status_code}{hint}: "
                         f"{response.text[:300]}")


async def _serve_load(args, base_url, url, kind, bodies, headers, times, ready_deadline):
    limit = asyncio.Semaphore(args.max_concurrency or len(bodies))
    bar = tqdm(total=len(bodies), disable=args.disable_tqdm, file=sys.stderr)

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None),
                                 verify=not args.insecure) as client:
        async def guarded(body, index=None):
            named = {} if index is None else {"x-request-id": f"{args.request_id_prefix}{index}"}
            async with limit:
                result = await _one_request(client, url, kind, body, headers | named)
            if index is not None:
                bar.update(1)
            return result

        if args.ready_check_timeout_sec > 0:
            first = await _wait_until_ready(client, url, kind, bodies[0], headers, ready_deadline)
            if not first["success"]:
                raise ValueError(f"--ready-check-timeout-sec: the first request did not succeed within "
                                 f"{args.ready_check_timeout_sec} s; the last error: {first['error']}")
        # As vLLM's client: the warm-ups send the first request, at most --max-concurrency at a time.
        await asyncio.gather(*(guarded(bodies[0]) for _ in range(args.num_warmups)))
        if args.profile:
            await _profile_call(client, base_url, "start_profile", headers)
        tasks = []
        start = time.perf_counter()
        for index, (body, at) in enumerate(zip(bodies, times)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(guarded(body, index)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        if args.profile:
            await _profile_call(client, base_url, "stop_profile", headers)
    bar.close()
    for result in results:
        result["start"] -= start
    return results, wall


def _percentile_flags(args) -> tuple[list[str], list[float]]:
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = set(metrics) - set(METRICS)
    if unknown or not metrics:
        raise ValueError(f"--percentile-metrics takes a comma-separated subset of {','.join(METRICS)}, "
                         f"got {args.percentile_metrics!r}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], "
                         f"got {args.metric_percentiles!r}")
    return metrics, percentiles


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    ms = np.asarray(values_s) * 1e3 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{int(p) if p == int(p) else p}_{name}_ms"] = float(np.percentile(ms, p))
    return {key: round(value, 2) for key, value in out.items()}


def _serve_tokenizer(args, models: list[dict], why: str):
    from jaxengine.engine.llm_engine import load_tokenizer

    name = args.tokenizer or args.model or models[0].get("root") or models[0]["id"]
    try:
        return load_tokenizer(name, args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loader failure means the same thing to the user
        raise ValueError(f"--tokenizer: {why}, and {name!r} did not load one ({type(e).__name__}: {e}); pass "
                         "--tokenizer DIR") from None


def _random_vocab(args, base_url: str, models: list[dict], headers: dict) -> int:
    """The id range for random prompts: --vocab-size; else the largest id the server's /detokenize accepts (ours
    refuses ids past the model's vocabulary); else, where /detokenize decodes any id (vLLM's) or is missing, the
    tokenizer's largest id + 1 (the range vLLM's server accepts)."""
    if args.vocab_size:
        return args.vocab_size
    probed = _vocab_from_detokenize(base_url, headers, verify=not args.insecure)
    if FIRST_ID < probed < PROBE_LIMIT:
        return probed
    tokenizer = _serve_tokenizer(args, models, "the server's /detokenize does not bound the vocabulary for random "
                                 "prompts (or pass --vocab-size)")
    return max(tokenizer.get_vocab().values()) + 1


def _models(base_url: str, headers: dict, deadline: float, verify: bool = True) -> list[dict]:
    """The server's /v1/models list; asked again until `deadline` (time.monotonic; --ready-check-timeout-sec)."""
    while True:
        try:
            response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30, verify=verify)
            response.raise_for_status()
            return response.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            if time.monotonic() > deadline:
                raise ValueError(f"--base-url: no OpenAI-compatible server answered {base_url}/v1/models "
                                 f"({type(e).__name__}: {e})") from None
        time.sleep(1.0)


def _finite_or_text(value: float):
    """inf as the text "inf" (vLLM's client records an infinite request rate so): JSON has no infinity."""
    return "inf" if math.isinf(value) else value


def _result_path(args, model: str) -> str | None:
    """Where --save-result / --append-result write, named as vLLM's client names it."""
    if not (args.save_result or args.append_result):
        return None
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    rate = (f"ramp-up-{args.ramp_up_strategy}-{args.ramp_up_start_rps}qps-{args.ramp_up_end_rps}qps"
            if args.ramp_up_strategy else f"{args.request_rate}qps")
    name = args.result_filename or (f"{args.label or args.backend}-{rate}{concurrency}-"
                                    f"{model.rstrip('/').split('/')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        return os.path.join(args.result_dir, name)
    return name


def serve(args) -> None:
    metrics, percentiles = _percentile_flags(args)
    goodput = _goodput(args)
    metadata = _key_values("--metadata", args.metadata)
    headers = _headers(args)
    sampling = _sampling(args)
    extra = sampling | (args.extra_body or {})
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    kind = {"openai-chat": "chat", "openai-responses": "responses",
            "openai-embeddings": "embeddings"}.get(args.backend, "completions")
    endpoint = args.endpoint or {"chat": "/v1/chat/completions", "responses": "/v1/responses",
                                 "embeddings": "/v1/embeddings"}.get(kind, "/v1/completions")
    if kind == "embeddings":
        given = [f"--{name.replace('_', '-')}" for name in SAMPLING_FLAGS if getattr(args, name) is not None]
        given += ["--temperature"] * (args.temperature != 0.0) + ["--ignore-eos"] * args.ignore_eos
        given += ["--logprobs"] * (args.logprobs is not None)
        if given:
            raise ValueError(f"--backend openai-embeddings generates nothing: {', '.join(given)} do not apply")
        sampling, extra = {}, args.extra_body or {}
        if args.percentile_metrics == ",".join(METRICS):  # the default: only the latency means anything here
            metrics = ["e2el"]
    ramp_up = _ramp_up(args)
    send_times(0, args.request_rate, args.burstiness, args.seed, ramp_up)  # checks the flags before anything is sent
    self_timed = _self_timed(args, kind, ramp_up)
    if args.dataset_name == "timed_trace":  # a trace's requests run to its output lengths, as vLLM's client sends them
        args.ignore_eos = True
    at_least("--num-warmups", args.num_warmups, 0)
    at_least("--ready-check-timeout-sec", args.ready_check_timeout_sec, 0)
    if args.max_concurrency is not None:
        at_least("--max-concurrency", args.max_concurrency)
    if args.logprobs is not None:
        at_least("--logprobs", args.logprobs, 0)
        if kind == "responses":
            raise ValueError("--logprobs applies to the completions and chat backends (vLLM's client sends none "
                             "to /v1/responses)")
    # --ready-check-timeout-sec bounds both waits together: /v1/models, then the first request.
    ready_deadline = time.monotonic() + args.ready_check_timeout_sec
    models = _models(base_url, headers, ready_deadline, verify=not args.insecure)
    model = args.model or models[0]["id"]
    vocab = _random_vocab(args, base_url, models, headers) if args.dataset_name in ID_DATASETS else 0
    why = f"the {args.dataset_name} dataset needs the model's tokenizer to count tokens"
    requests = load_requests(args, vocab_size=vocab, get_tokenizer=lambda: _serve_tokenizer(args, models, why),
                             seed=args.seed)
    if kind in ("chat", "responses") and any(not isinstance(r.prompt, str) for r in requests):
        raise ValueError(f"--backend {args.backend} sends text, and this dataset's prompts are token ids: use a text "
                         "dataset (sharegpt, custom, spec_bench, or json with string prompts)")
    bodies = [_request_body(args, args.served_model_name or model, kind, req, extra) for req in requests]
    if self_timed:  # as vLLM's client: each at its timestamp from the start (none before it)
        times = np.maximum([r.timestamp for r in requests], 0.0)
    else:
        times = send_times(len(requests), args.request_rate, args.burstiness, args.seed, ramp_up)
    results, wall = asyncio.run(_serve_load(args, base_url, base_url + endpoint, kind, bodies, headers, times,
                                             ready_deadline))
    done = [(req, r) for req, r in zip(requests, results) if r["success"]]
    errors = [r["error"] for r in results if not r["success"]]
    out_tokens = sum(r["tokens"] for _, r in done)
    # As vLLM's client: the prompt tokens the server reports (a chat template's included), else the dataset's count.
    for req, r in done:
        r["prompt_len"] = req.prompt_len if r["prompt_tokens"] is None else r["prompt_tokens"]
    in_tokens = sum(r["prompt_len"] for _, r in done)
    # TPOT is counted for requests of more than one token; for goodput a shorter one's is 0 (as in vLLM's client).
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) if r["tokens"] > 1 else None for _, r in done]
    values = {"ttft": [r["ttft"] for _, r in done], "e2el": [r["e2e"] for _, r in done],
              "tpot": [t for t in tpot if t is not None], "itl": [x for _, r in done for x in r["itl"]]}
    good = sum(all(measured * 1e3 <= goodput[name] for name, measured in
                   (("ttft", r["ttft"]), ("tpot", t or 0.0), ("e2el", r["e2e"])) if name in goodput)
               for (_, r), t in zip(done, tpot))
    result = {"benchmark": "serve", "backend": args.backend, "label": args.label or args.backend,
              "base_url": base_url, "endpoint": endpoint, "model": model,
              "served_model_name": args.served_model_name or model, "dataset_name": args.dataset_name,
              "dataset_path": args.dataset_path, "num_prompts": len(requests), "input_len": args.input_len,
              "output_len": args.output_len, "ignore_eos": args.ignore_eos, "sampling": sampling,
              "extra_body": args.extra_body, "request_rate": _finite_or_text(args.request_rate),
              "burstiness": _finite_or_text(args.burstiness), "self_timed": self_timed,
              "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups, "profiled": args.profile}
    if ramp_up:
        result |= dict(zip(("ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps"), ramp_up))
    result |= metadata | {
        "duration": round(wall, 3), "completed": len(done), "failed": len(errors), "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens, "request_throughput": round(len(done) / wall, 3),
        "request_goodput": round(good / wall, 3) if goodput else None, "goodput": goodput or None,
        "output_throughput": round(out_tokens / wall, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / wall, 2)}
    for name in metrics:
        result |= _stats(name, values[name], percentiles)
    result["errors"] = sorted(set(errors))[:10]
    if args.save_detailed:  # vLLM's per-request lists, in the order the requests were sent
        result |= {"input_lens": [r.get("prompt_len", req.prompt_len) for req, r in zip(requests, results)],
                   "output_lens": [r["tokens"] if r["success"] else 0 for r in results],
                   "start_times": [round(r["start"], 6) for r in results],
                   "ttfts": [r["ttft"] if r["success"] else 0.0 for r in results],
                   "itls": [r["itl"] if r["success"] else [] for r in results],
                   "generated_texts": [r["text"] if r["success"] else "" for r in results],
                   "errors": ["" if r["success"] else r["error"] for r in results]}
    result |= _context()
    line = _emit(result, args.output_json)
    path = _result_path(args, model)
    if path:
        with open(path, "a" if args.append_result else "w") as f:
            if args.append_result and f.tell():
                f.write("\n")
            f.write(line + "\n")
    if errors:
        print(f"{len(errors)} of {len(requests)} requests failed; the first: {errors[0]}", file=sys.stderr)
    if not done:
        sys.exit(f"error: every request failed; the first: {errors[0]}")


def _vocab_from_detokenize(base_url: str, headers: dict | None = None, verify: bool = True) -> int:
    """The largest id + 1 that /detokenize accepts, by binary search below PROBE_LIMIT (PROBE_LIMIT: it accepts
    them all; 1: it accepts none, or is missing)."""
    lo, hi = 1, PROBE_LIMIT
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = httpx.post(base_url + "/detokenize", json={"tokens": [mid - 1]}, headers=headers, timeout=30,
                        verify=verify).status_code == 200
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    return lo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_to_ready(argv: list[str], cache_dir: str, timeout: float) -> float:
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxengine.cli", "serve", "--port", str(port), "--compilation-cache-dir", cache_dir,
           *argv]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            while time.perf_counter() - start < timeout:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip().splitlines()[-15:]
                    sys.exit(f"error: the server exited with {proc.returncode} before it was ready: "
                             f"{' '.join(cmd)}\n" + "\n".join(tail))
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
    at_least("--runs", args.runs)
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
    for name in SAMPLING_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int if name == "top_k" else float, default=None)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve, startup); one JSON line each")
    kinds = bench.add_subparsers(dest="bench", required=True)
    p = kinds.add_parser("throughput", help="offline: a dataset's requests through `LLM.generate`")
    add_engine_flags(p)
    add_dataset_flags(p, seed=False)  # the dataset's seed is the engine's --seed (default 0)
    p.add_argument("--n", type=int, default=1, help="sequences per prompt")
    p.add_argument("--disable-detokenize", action="store_true", help="token ids only: no text is made")
    p.add_argument("--runs", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--profile", action="store_true", help="a jax.profiler trace of the timed runs into --profiler-dir")
    p.add_argument("--output-json", default=None)
    _add_sampling_flags(p)
    p.set_defaults(run=throughput)
    p = kinds.add_parser("latency", help="offline: one batch of random prompts, its TTFT and TPOT")
    add_engine_flags(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--n", type=int, default=1, help="sequences per prompt")
    p.add_argument("--disable-detokenize", action="store_true", help="token ids only: no text is made")
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="trace one batch after the warm-up into --profiler-dir, and time nothing (as vLLM's)")
    p.add_argument("--output-json", default=None)
    _add_sampling_flags(p)
    p.set_defaults(run=latency)
    p = kinds.add_parser("serve", help="a client for any OpenAI-compatible server")
    p.add_argument("--backend", choices=("openai", "vllm", "openai-chat", "openai-responses", "openai-embeddings"),
                   default="openai",
                   help="openai (and vllm): /v1/completions; openai-chat: /v1/chat/completions; openai-responses: "
                        "/v1/responses; openai-embeddings: /v1/embeddings (latency only: e2el)")
    p.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default: the backend's")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="for text datasets' token counts (default: --model, else the server's model root)")
    p.add_argument("--trust-remote-code", action="store_true", help="let a tokenizer of its own code load")
    add_dataset_flags(p, seed=True, trace=True)
    p.add_argument("--self-timed", action=argparse.BooleanOptionalAction, default=None,
                   help="send a trace's requests at its timestamps (the timed_trace dataset's default; "
                        "--no-self-timed: at --request-rate)")
    p.add_argument("--served-model-name", default=None, help="the model name sent in requests (default: --model)")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, below 1 burstier, inf evenly spaced")
    p.add_argument("--ramp-up-strategy", choices=("linear", "exponential"), default=None,
                   help="raise the request rate from --ramp-up-start-rps to --ramp-up-end-rps over the load")
    p.add_argument("--ramp-up-start-rps", type=int, default=None)
    p.add_argument("--ramp-up-end-rps", type=int, default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0, help="untimed copies of the first request sent first")
    p.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="send the first request until it succeeds, for up to this long, before the load (0: don't)")
    p.add_argument("--ignore-eos", action="store_true", help="generate every request's output length")
    p.add_argument("--logprobs", type=int, default=None, help="log probabilities of this many top tokens a token")
    p.add_argument("--extra-body", type=json_object, default=None,
                   help="JSON merged into every request body (after the sampling flags)")
    p.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE", help="extra HTTP headers")
    p.add_argument("--insecure", action="store_true", help="do not verify an https server's certificate")
    p.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                   help="request i is sent with the header x-request-id: PREFIX + i")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="service-level objectives (ttft, tpot, e2el in ms) for request_goodput")
    p.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help=f"the metrics to report statistics of, a subset of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,99")
    p.add_argument("--vocab-size", type=int, default=None, help="for random ids (default: asked from the server)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar on stderr")
    p.add_argument("--profile", action="store_true",
                   help="POST /start_profile before the load and /stop_profile after (a server with --profiler-dir)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--save-result", action="store_true", help="also write the JSON to --result-dir")
    p.add_argument("--append-result", action="store_true", help="append the JSON to the result file")
    p.add_argument("--save-detailed", action="store_true",
                   help="add per-request lists (lengths, start times, TTFTs, ITLs, texts, errors)")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None, help="the result's label and file name prefix (default: --backend)")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="recorded in the result")
    _add_sampling_flags(p)
    p.set_defaults(run=serve)
    p = kinds.add_parser("startup", help="process start to ready, cold and warm compilation cache; "
                                          "other arguments go to `jaxengine serve`")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--output-json", default=None)
    p.set_defaults(run=startup, passthrough=True)
