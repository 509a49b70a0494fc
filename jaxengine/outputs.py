"""Outputs shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float  # from the model's raw distribution, before temperature and truncation
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: top-N plus the sampled token
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """time.monotonic() stamps of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None
