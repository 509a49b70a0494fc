"""Speculative decoding by n-gram lookup (vLLM's `speculative_config={"method": "ngram", ...}`).

A sequence's next tokens are guessed from its own context: the longest suffix of it (between
prompt_lookup_min and prompt_lookup_max tokens) that occurred before, and the tokens that followed that earlier
occurrence. The step computes the sequence's last token and the guesses together, as one chunk; the
model's choice after each position (greedy, or drawn with the key of that token) verifies the guess there, so a
step yields every guess up to the first wrong one plus the model's own next token: the same tokens as decoding one
at a time, in fewer steps. For a sampled sequence this is speculative sampling with a point-mass draft: a guess
is taken with the probability the model gives it, else the token comes from the model's distribution without it.
"""

import dataclasses

import numpy as np

from jaxengine.validation import is_integer

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None  # no guesses while this many sequences or more are running

    @classmethod
    def of(cls, settings: dict) -> "SpeculativeConfig":
        """From EngineConfig.speculative_config, as vLLM reads it: method "ngram"; the lookup bounds default to
        each other, or both to 5."""
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        method = settings.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)} (n-gram lookup; draft "
                             f"models and EAGLE are not supported yet), got {method!r}")
        values = {}
        for name in known - {"method"}:
            value = settings.get(name)
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
            values[name] = value
        if values["num_speculative_tokens"] is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        low, high = values["prompt_lookup_min"], values["prompt_lookup_max"]
        low, high = (low or high or 5), (high or low or 5)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        return cls(values["num_speculative_tokens"], low, high, values["disable_by_batch_size"])


def propose(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens` (of lookup_min to
    lookup_max tokens) that occurred before: the latest that k tokens follow, else the earliest; [] where none
    did."""
    n = len(tokens)
    if k < 1 or n < lookup_min + 1:
        return []
    context = np.asarray(tokens, np.int64)
    for size in range(min(lookup_max, n - 1), lookup_min - 1, -1):
        suffix = context[n - size:]
        # windows starting at 0 .. n - size - 1 (not the suffix itself): where each equals the suffix
        windows = np.lib.stride_tricks.sliding_window_view(context[:n - 1], size)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:  # the latest occurrence followed by k tokens, else the earliest (the most follow it)
            full = hits[hits + size + k <= n]
            start = int(full[-1] if full.size else hits[0]) + size
            return context[start:start + k].tolist()
    return []
