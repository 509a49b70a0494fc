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
