"""Beam search as vLLM runs it: each step asks the engine for one token of every live beam (its whole context as
the prompt: the prefix cache holds what earlier steps computed) with the 2 x beam_width most likely next tokens'
log probabilities; each beam's candidates are ranked by their cumulative log probability and the best
beam_width go on, and a candidate that ends with EOS is set aside as complete. At the end the complete and
live beams are ranked by cumulative log probability over length ** length_penalty."""

import dataclasses

from jaxengine.sampling_params import MAX_N, RequestOutputKind, SamplingParams
from jaxengine.validation import check_field_types


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's: `beam_width` beams (the outputs), up to `max_tokens` each; `temperature`, each step's sampling
    temperature (its sampled token joins a beam's candidates; their log probabilities are the model's own, before
    temperature, as vLLM's); `length_penalty` divides a finished beam's cumulative log probability by its length
    to that power; `include_stop_str_in_output` keeps the EOS that ends a beam; `skip_special_tokens` in the
    beams' text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        check_field_types(self, integers=("beam_width", "max_tokens"), finite_reals=("temperature", "length_penalty"),
                          bools=("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"))
        if not 1 <= self.beam_width <= MAX_N:
            raise ValueError(f"beam_width must be in [1, {MAX_N}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's and the beam's
    logprobs: list[dict]  # per generated token: the candidates it was chosen among ({token: Logprob})
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best beam_width, best first


def beam_step_params(params: BeamSearchParams, max_logprobs: int) -> SamplingParams:
    """What a step asks of each live beam: one token and the 2 x beam_width most likely next tokens' log
    probabilities, as vLLM asks (within the engine's max_logprobs)."""
    wanted = 2 * params.beam_width
    if wanted > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} needs {wanted} logprobs a step; max_logprobs is "
                         f"{max_logprobs}")
    return SamplingParams(logprobs=wanted, max_tokens=1, temperature=params.temperature, detokenize=False,
                          ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


class BeamSearch:
    """One prompt's search: `prompts()` are the live beams' contexts for the next step, `advance()` takes each one's
    candidates, `result()` the best beams once `done`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int],
                 max_model_len: int):
        self.params, self.eos, self.max_model_len = params, eos_token_ids, max_model_len
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids), [])]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        """The live beams' tokens; a beam that filled max_model_len is complete (finish reason length) first."""
        full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
        for beam in full:
            beam.finish_reason = "length"
        self.completed += full
        self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]
        return [] if self.done else [b.tokens for b in self.beams]

    def advance(self, candidates: list[dict]) -> None:
        """`candidates[i]`: the live beam i's next tokens and their Logprobs (its step's logprobs entry)."""
        width, grown = self.params.beam_width, []
        for beam, entry in zip(self.beams, candidates):
            for token, logprob in entry.items():
                score = beam.cum_logprob + logprob.logprob
                if token in self.eos and not self.params.ignore_eos:
                    kept = beam.tokens + [token] if self.params.include_stop_str_in_output else beam.tokens
                    self.completed.append(BeamSearchSequence(kept, beam.logprobs + [entry], score, None, "stop",
                                                             token))
                else:
                    grown.append(BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], score))
        grown.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.beams = grown[:width]
        self.steps += 1

    def _score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in self.eos else 0)
        return beam.cum_logprob / (max(length, 1) ** self.params.length_penalty)

    def result(self, decode, with_prompt: bool) -> BeamSearchOutput:
        """The best beam_width beams (live ones finished by length), each with `text` = decode(its tokens): the
        prompt's too `with_prompt` (as vLLM's LLM.beam_search), else the generated ones' (its server's)."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self._score, reverse=True)[: self.params.beam_width]
        for beam in best:
            beam.text = decode(beam.tokens if with_prompt else beam.tokens[self.prompt_len:])
        return BeamSearchOutput(best)


def live_prompts(searches: list[BeamSearch]) -> list[tuple[BeamSearch, list[int]]]:
    """A step's requests for several searches run together: each live beam's context, with its search."""
    return [(search, tokens) for search in searches for tokens in search.prompts()]


def advance_all(searches: list[BeamSearch], live: list[tuple[BeamSearch, list[int]]], entries: list[dict]) -> None:
    """Each search takes its live beams' candidates: `entries[i]`, the logprobs entry of `live[i]`'s step."""
    for search in searches:
        taken = [entry for (owner, _), entry in zip(live, entries) if owner is search]
        if taken:
            search.advance(taken)
