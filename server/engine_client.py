"""Runs an LLMEngine on a background thread and streams its outputs to asyncio request handlers."""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams
from server.metrics import EngineMetrics, StatsLogger

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("jaxengine.requests")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    """Many concurrent handlers submit requests; one thread steps the engine, so the scheduler batches them."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None,
                 log_stats_interval: float | None = 10.0, log_requests: bool = False, max_log_len: int | None = None):
        """`log_stats_interval`: seconds between the stats log lines (needs `metrics`; None: no log lines).
        `log_requests` (vLLM's --enable-log-requests): a log line when each request arrives (its prompt and token
        ids cut to `max_log_len` characters and ids, its sampling parameters), finishes or is aborted."""
        self.check_max_log_len(max_log_len)
        self.engine = engine
        self.metrics = metrics
        self.log_requests, self.max_log_len = log_requests, max_log_len
        self.stats = StatsLogger(metrics, log_stats_interval) if metrics and log_stats_interval else None
        self.error: BaseException | None = None
        self._submissions: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn) to run on the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxengine-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def check_max_log_len(max_log_len: int | None) -> None:
        """ValueError unless `max_log_len` is None or >= 0 (the CLI checks it before the model loads)."""
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {max_log_len}")

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # --- handler side -----------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: dict, params: SamplingParams, *, priority: int = 0,
                       cache_salt: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes; leaving early (a disconnect) aborts it."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        if self.log_requests:
            cut = slice(self.max_log_len)
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            request_logger.info("Received request %s: prompt: %r, prompt_token_ids: %s, params: %s", request_id,
                                text[cut] if text is not None else None, ids[cut] if ids is not None else None,
                                params)
        self._submissions.put((request_id, prompt, params, priority, cache_salt, lora_request))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished and self.log_requests:
                    request_logger.info("Finished request %s: finish_reason: %s, prompt_tokens: %d, "
                                        "completion_tokens: %d", request_id,
                                        ",".join(str(c.finish_reason) for c in item.outputs),
                                        len(item.prompt_token_ids), sum(len(c.token_ids) for c in item.outputs))
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort_request(request_id)
                self._wakeup.set()
                if self.log_requests:
                    request_logger.info("Aborted request %s", request_id)

    async def call(self, fn):
        """fn() run on the engine thread between steps (what must not race the scheduler: adding or removing a
        LoRA adapter); its result, or its exception raised here."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        future = asyncio.get_running_loop().create_future()
        self._calls.put((future, fn))
        self._wakeup.set()
        return await future

    # --- engine side ------------------------------------------------------------------------------------

    def _run_calls(self) -> None:
        while True:
            try:
                future, fn = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            loop = future.get_loop()
            loop.call_soon_threadsafe(_settle, future, result, error)

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items) -> None:
        """Hands each (request_id, output or error) to its handler's stream: one wake-up per event loop, not
        one per item (a step's outputs all go at once)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _admit_submissions(self) -> None:
        while True:
            try:
                request_id, prompt, params, priority, cache_salt, lora_request = self._submissions.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                        lora_request=lora_request)
            except ValueError as e:  # validated before submission; anything left is the caller's fault
                self._deliver(request_id, e)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._run_calls()
                self._admit_submissions()
                if self.stats is not None:
                    self.stats.maybe_log()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._deliver_all([(out.request_id, out) for out in outputs])
                if self.metrics is not None:
                    self.metrics.after_step(self.engine, outputs)
        except BaseException as e:  # noqa: BLE001 - any fault kills the loop; handlers must hear of it
            logger.exception("engine loop died")
            self.error = e
            with self._lock:
                streams = list(self._streams)
            self._deliver_all([(request_id, EngineDeadError(f"the engine loop died: {e!r}")) for request_id in streams])


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(batch) -> None:
    for stream, item in batch:
        stream.put_nowait(item)
