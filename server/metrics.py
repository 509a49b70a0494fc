"""Prometheus metrics. Names mirror vLLM's (`vllm:` prefix) so that existing dashboards work unchanged;
metrics vLLM has no counterpart for use the `jaxengine:` prefix."""

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxengine.compile_counter import compile_count
from jaxengine.outputs import PoolingRequestOutput, RequestOutput

logger = logging.getLogger("jaxengine.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name, doc):
            return Histogram(name, doc, list(labels), buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished prefills")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted")
        # Speculative decoding (vLLM's names): steps with guesses, the guessed tokens and those the model accepted
        self.spec = {"drafts": counter("vllm:spec_decode_num_drafts", "Speculative guesses made (a step's run)"),
                     "draft_tokens": counter("vllm:spec_decode_num_draft_tokens", "Tokens guessed"),
                     "accepted_tokens": counter("vllm:spec_decode_num_accepted_tokens", "Guessed tokens accepted")}
        self._spec_totals = dict.fromkeys(self.spec, 0)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason",
                                list(labels) + ["finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between generated tokens")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling")
        self.compiles = gauge("jaxengine:compile_count", "XLA compilations in this process")
        self.compiles.set_function(compile_count)  # read at every scrape, so it is current before any step
        self.step_tokens = Histogram("vllm:iteration_tokens_total", "Tokens scheduled per engine step", list(labels),
                                     buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
                                     registry=r).labels(**labels)
        self.step_requests = Histogram("jaxengine:step_batch_requests", "Requests batched per engine step",
                                       list(labels), buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                                       registry=r).labels(**labels)
        self._labels = labels
        # Plain totals for the periodic log line (StatsLogger): what the counters above hold, read cheaply.
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_queries": 0, "prefix_hits": 0}
        self.load = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self._seen_tokens: dict[str, tuple[int, float]] = {}  # request -> (tokens so far, time of the last)
        self._preemptions = 0

    def after_step(self, engine, outputs: list[RequestOutput]) -> None:
        """`engine`: an LLMEngine or data-parallel replicas of it (summed over replicas)."""
        replicas = getattr(engine, "replicas", [engine])
        for r in replicas:
            if r.last_step_size is not None:
                self.step_requests.observe(r.last_step_size[0])
                self.step_tokens.observe(r.last_step_size[1])
        self.load = {"running": sum(len(r.scheduler.running) for r in replicas),
                     "waiting": sum(len(r.scheduler.waiting) for r in replicas),
                     "kv_usage": sum(r.block_manager.usage for r in replicas) / len(replicas)}
        self.running.set(self.load["running"])
        self.waiting.set(self.load["waiting"])
        self.kv_usage.set(self.load["kv_usage"])
        queries = sum(r.block_manager.query_tokens for r in replicas)
        hits = sum(r.block_manager.hit_tokens for r in replicas)
        self.prefix_queries.inc(queries - self.totals["prefix_queries"])
        self.prefix_hits.inc(hits - self.totals["prefix_hits"])
        self.totals["prefix_queries"], self.totals["prefix_hits"] = queries, hits
        preemptions = sum(r.scheduler.num_preemptions for r in replicas)
        self.preemptions.inc(preemptions - self._preemptions)
        self._preemptions = preemptions
        for name, counter in self.spec.items():
            total = sum(getattr(r, "spec_stats", {}).get(name, 0) for r in replicas)
            counter.inc(total - self._spec_totals[name])
            self._spec_totals[name] = total
        for out in outputs:
            self._observe(out)

    def _observe(self, out: RequestOutput | PoolingRequestOutput) -> None:
        m = out.metrics
        if isinstance(out, PoolingRequestOutput):  # its prompt is all it computes (pooling outputs come finished)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.totals["prompt_tokens"] += len(out.prompt_token_ids)
            if m.first_scheduled_time is not None:
                self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            reason = "stop" if out.outputs.data is not None else "abort"
            self._success.labels(**self._labels, finished_reason=reason).inc()
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)  # outputs reach the server in cumulative form
        seen, last = self._seen_tokens.get(out.request_id, (0, m.arrival_time))
        new = tokens - seen
        if new > 0:
            now = m.first_token_time if seen == 0 else max(m.first_token_time, time.monotonic())
            if seen == 0:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.totals["prompt_tokens"] += len(out.prompt_token_ids)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            else:
                for _ in range(new):
                    self.itl.observe((now - last) / new)
            self.generation_tokens.inc(new)
            self.totals["generation_tokens"] += new
            self._seen_tokens[out.request_id] = (tokens, now)
        if out.finished:
            self._seen_tokens.pop(out.request_id, None)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            for c in out.outputs:
                self._success.labels(**self._labels, finished_reason=c.finish_reason or "abort").inc()



class StatsLogger:
    """vLLM's periodic engine log line (every `interval` seconds while the server has work; `--disable-log-stats`
    turns it off): prompt and generation throughput over the interval, requests running and waiting, KV cache
    usage and the prefix cache's hit rate over the interval."""

    def __init__(self, metrics: EngineMetrics, interval: float = 10.0):
        self.metrics, self.interval = metrics, interval
        self._since, self._totals = time.monotonic(), dict(metrics.totals)

    def maybe_log(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self._since
        if elapsed < self.interval:
            return
        totals, load = self.metrics.totals, self.metrics.load
        delta = {name: totals[name] - self._totals[name] for name in totals}
        self._since, self._totals = now, dict(totals)
        if not (delta["prompt_tokens"] or delta["generation_tokens"] or load["running"] or load["waiting"]):
            return  # idle: nothing to say
        hit_rate = delta["prefix_hits"] / delta["prefix_queries"] if delta["prefix_queries"] else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                    "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    delta["prompt_tokens"] / elapsed, delta["generation_tokens"] / elapsed, load["running"],
                    load["waiting"], 100 * load["kv_usage"], 100 * hit_rate)
