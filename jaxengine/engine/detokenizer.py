"""Incremental detokenization that never emits half of a multi-byte character.

Text is decoded over a short window of tokens: the new text is what decoding `[prefix_offset:]` adds to
decoding `[prefix_offset:read_offset]`, and it is held back while it ends in U+FFFD (an incomplete UTF-8
sequence split across tokens).
"""

_CONTEXT_TOKENS = 5


def _backend_decoder(tokenizer):
    """The Rust tokenizer's own decode, where the transformers tokenizer's `decode` is exactly that call: a
    `tokenizers`-backed class that overrides neither `decode` nor `_decode`, without clean-up of
    tokenization spaces (its `_decode` then returns the backend's text as it is). Two decodes a token through
    transformers' wrapper cost ~12 us of the host's time; the backend's, ~3 us. Else None."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or backend is None
            or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # context so the first word decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self._backend = _backend_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def flush(self) -> str:
        """At the end of a sequence: emits held-back text even if it ends in an incomplete character."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new = self._decode(self.tokens[self.prefix_offset:])[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += new
        return new

    def add(self, token_id: int) -> str:
        """Appends a token and returns the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += new
        return new
