"""`SamplingParams` with vLLM's argument names, so code written for vLLM runs after changing the import."""

import dataclasses
import enum
import math
import numbers

from jaxengine.validation import check_field_types, field_error, is_integer

FLOAT32_MAX = 3.4028234663852886e38  # the device holds temperature and repetition_penalty as float32
MAX_N = 1024  # the most sequences one request may ask for: each is built when the request is added
INT32_MAX = 2**31 - 1


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
          "detokenize")
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTEGERS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTEGERS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_TOKEN_LISTS = ("stop_token_ids", "allowed_token_ids")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the output is held to exactly one of a JSON schema (`json`, a dict or its JSON
    text), a regular expression (`regex`), one of several strings (`choice`), a Lark grammar (`grammar`) or any
    JSON object (`json_object=True`). `disable_any_whitespace`: JSON without optional whitespace."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(self.KINDS)}, got "
                             f"{given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def _given(self) -> list[str]:
        return [k for k in self.KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop: str | list[str] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only (empty text, logprobs without their decoded tokens), as vLLM
    # k: the prompt's last k tokens only (left truncation); -1: as many as the engine's max_model_len lets a
    # request generate after (max_model_len - 1). Applied by the engine, which knows max_model_len.
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self._check_types()
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not 0 <= self.temperature <= FLOAT32_MAX:  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                            or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an integer >= 1, got "
                             f"{self.truncate_prompt_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logit_bias:  # clamped to [-100, 100] as in vLLM and the OpenAI API
            if any(math.isnan(float(b)) for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be numbers, got NaN")
            self.logit_bias = {int(t): max(-100.0, min(100.0, float(b))) for t, b in self.logit_bias.items()}
        self.bad_words = list(self.bad_words or [])
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        self.top_k = min(self.top_k, INT32_MAX)  # the device's int32; a top_k of the vocabulary or more keeps all
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not self.detokenize and self.stop:
            raise ValueError("stop strings are matched in the text: they need detokenize=True (stop_token_ids do not)")

    def _check_types(self) -> None:
        check_field_types(self, bools=_BOOLS, integers=_INTEGERS, optional_integers=_OPTIONAL_INTEGERS,
                          reals=_NUMBERS)

        def fail(name, what):
            raise field_error(self, name, what)

        for name in _TOKEN_LISTS:
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                    fail(name, "a list of token ids")
                value = list(value)
                if not all(is_integer(t) for t in value):
                    fail(name, "a list of token ids")
                setattr(self, name, [int(t) for t in value])
        if self.bad_words is not None and (isinstance(self.bad_words, str) or not hasattr(self.bad_words, "__iter__")
                                           or not all(isinstance(w, str) for w in self.bad_words)):
            fail("bad_words", "a list of strings")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_integer(t) and isinstance(b, numbers.Real) and not isinstance(b, bool)
                    for t, b in self.logit_bias.items()):
                fail("logit_bias", "a dict of token id -> bias")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "a StructuredOutputsParams (or a dict of its fields)")

    @property
    def needs_slot_state(self) -> bool:
        """Penalties, allowed_token_ids and structured outputs need per-sequence state on the device."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.allowed_token_ids is not None or self.structured_outputs is not None)
