"""Outputs shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

import dataclasses

import numpy


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


@dataclasses.dataclass
class PoolingOutput:
    data: numpy.ndarray | None  # float32 [hidden] (or [dimensions]); None where the request was aborted


@dataclasses.dataclass
class PoolingRequestOutput:
    """A pooling request's result, as vLLM's (`LLM.encode`)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class _TaskRequestOutput:
    """A PoolingRequestOutput read for one task, as vLLM's `from_base`: its data wrapped in the task's output."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput):
        return cls(output.request_id, cls.wrap(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclasses.dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    """An embedding, as vLLM's `LLM.embed` returns it."""

    outputs: EmbeddingOutput
    wrap = EmbeddingOutput


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """A pair's score, as vLLM's `LLM.score` returns it: an embedding model's cosine similarity of the two texts'
    embeddings (`prompt_token_ids`: the first's, then the second's), or a one-label classifier's score of the pair
    (`prompt_token_ids`: the pair's joint encoding)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # per label: the classifier's activation of its logits (the logits without use_activation)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    """A sequence classifier's output, as vLLM's `LLM.classify` returns it."""

    outputs: ClassificationOutput
    wrap = ClassificationOutput
