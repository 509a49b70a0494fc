"""A pooling sequence's embedding, made on the host from the final hidden states of its prompt's chunks."""

import numpy as np

from jaxengine.pooling_params import PoolerConfig, PoolingParams


class PoolState:
    """The pooled state of one prompt as its chunks land (in order; a recomputation after preemption starts again
    at position 0). LAST keeps the last position's row, CLS the first's, MEAN a running sum; once the prompt's
    last position has landed, `embedding` holds the result: the first `dimensions` values, normalised to unit
    length where `use_activation` (each the request's, else the pooler's)."""

    def __init__(self, pooler: PoolerConfig, params: PoolingParams, prompt_len: int):
        self.kind = pooler.pooling_type
        self.normalize = pooler.use_activation if params.use_activation is None else params.use_activation
        self.dimensions = pooler.dimensions if params.dimensions is None else params.dimensions
        self.prompt_len = prompt_len
        self.pooled: np.ndarray | None = None  # CLS's row or MEAN's sum so far
        self.next = 0  # the position the next chunk starts at (CLS, MEAN)
        self.embedding: np.ndarray | None = None

    @property
    def reads_prefix_cache(self) -> bool:
        """LAST needs only the last position's state, which is always computed; MEAN and CLS need every
        position's (or the first's), which a cached prefix skips."""
        return self.kind == "LAST"

    def add(self, rows: np.ndarray, start: int) -> None:
        """`rows`: the final hidden states of prompt positions [start, start + len(rows))."""
        end = start + len(rows)
        if self.kind != "LAST":
            if start == 0:
                self.pooled, self.next = None, 0
            if start != self.next:
                raise AssertionError(f"a pooled prompt's chunk starts at {start}, expected {self.next}")
            self.next = end
            if self.kind == "CLS" and start == 0:
                self.pooled = np.asarray(rows[0], np.float32)
            elif self.kind == "MEAN":
                total = rows.sum(axis=0, dtype=np.float64)
                self.pooled = total if self.pooled is None else self.pooled + total
        if end < self.prompt_len:
            return
        if self.kind == "LAST":
            vector = np.asarray(rows[-1], np.float32)
        elif self.kind == "MEAN":
            vector = (self.pooled / self.prompt_len).astype(np.float32)
        else:
            vector = self.pooled
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        self.embedding = np.asarray(vector, np.float32)


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The (first, second) index pairs that a score request of `num_first` and `num_second` texts compares, as
    vLLM pairs them: 1:1, 1:N (the one with each) or N:N (in order); a ValueError for anything else."""
    if num_first == 0 or num_second == 0:
        raise ValueError("score needs at least one text on each side")
    if num_first > 1 and num_first != num_second:
        raise ValueError(f"score inputs must pair 1:1, 1:N or N:N, got {num_first}:{num_second}")
    return [(0 if num_first == 1 else i, i) for i in range(num_second)]


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """As torch's: each norm clamped below at 1e-8."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (max(np.linalg.norm(a), 1e-8) * max(np.linalg.norm(b), 1e-8)))
