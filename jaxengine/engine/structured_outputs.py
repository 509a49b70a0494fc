"""Structured outputs: a grammar matcher per sequence (llguidance) whose next-token bitmask becomes the sequence's
allowed tokens on the device before each step that samples it (one call for all such rows), and which takes each
sampled token."""

import dataclasses
import functools
import json
import re

import numpy as np

from jaxengine.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """Turns a request's StructuredOutputsParams into matchers over one tokenizer (wrapped once, on first use:
    llguidance's tokenizer takes ~1 s to build)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled = functools.lru_cache(maxsize=64)(self._compile)

    def _wrapped(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids or None)
            except Exception as e:  # llguidance reads fast (Rust) tokenizers only
                raise ValueError(f"structured_outputs need the model's tokenizer as a fast tokenizer; this one "
                                 f"({type(self.tokenizer).__name__}) could not be read: {e}") from None
        return self._ll_tokenizer

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of `spec`, checked: a ValueError naming the field where it does not compile.
        Kept for the last 64 specs (the server checks a request's before it submits it, the engine again)."""
        return self._compiled(json.dumps(dataclasses.asdict(spec), sort_keys=True))

    def _compile(self, key: str) -> str:
        import llguidance

        spec = StructuredOutputsParams(**json.loads(key))
        kind = spec.kind
        field = f"structured_outputs.{kind}"
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": not spec.disable_any_whitespace})
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
            elif kind == "choice":
                grammar = llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
        except (ValueError, TypeError) as e:  # a JSON text that does not parse, a schema llguidance refuses
            raise ValueError(f"{field} is not valid: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._wrapped())
        if error:
            raise ValueError(f"{field} is not valid: {error.strip()}")
        return grammar

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(self._wrapped(), grammar, self.vocab_size)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, ll_tokenizer, grammar: str, vocab_size: int):
        import llguidance
        import llguidance.numpy

        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)  # i32[1, ceil(vocab / 32)]

    def allowed_bits(self) -> np.ndarray:  # u32[ceil(vocab / 32)]
        """The tokens the grammar allows next (EOS among them where it may end here): bit t % 32 of word t // 32
        (layers.sampler.set_allowed's layout)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return self._bitmask[0].view(np.uint32)

    def accept(self, token: int) -> None:
        """Takes the sampled token (one the mask allowed)."""
        self._matcher.consume_token(token)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and takes nothing more (its EOS taken, or none possible after it), or it
        could not take a token (which the mask makes impossible; the sequence ends rather than run on)."""
        return self._matcher.is_stopped() or self._matcher.is_error()
