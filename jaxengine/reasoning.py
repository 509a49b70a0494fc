"""Reasoning parsers, as vLLM's `--reasoning-parser`: where a thinking model's reasoning ends and its answer begins.

- `deepseek_r1` (DeepSeek-R1 and its distillations, QwQ): the output is reasoning up to `</think>`, the answer
  after it (their templates open `<think>` in the prompt; one at the start of the output is dropped). An output
  that never closes its reasoning is all reasoning.
- `qwen3` (Qwen3, thinking on by default): as deepseek_r1, and a `<tool_call>` also ends the reasoning (it belongs
  to the answer, where the tool-call parser finds it). With `chat_template_kwargs: {"enable_thinking": false}` the
  output is all answer.
- `deepseek_v3` (DeepSeek V3.1 on, whose template thinks only where asked): as deepseek_r1 with
  `chat_template_kwargs: {"thinking": true}`; otherwise the output is all answer.
- `glm45` (GLM-4.5/4.6): reasoning between `<think>` and `</think>` where the output opens with `<think>`; an
  output that does not (thinking off: the template closed an empty reasoning in the prompt) is all answer.
- `gemma4` (Gemma 4): as glm45 with its thought channel's tags, `<|channel>` and `<channel|>`, special tokens that
  requests then keep in their text (`special_tokens`); the channel's role label (`thought` and a newline) that opens
  the reasoning is dropped from it.

- `openai_gptoss` (GPT-OSS): its harmony messages (jaxengine.harmony) read from the text with special tokens kept
  (`special_tokens`: chat requests keep them, as vLLM's parser needs them too): the `analysis` channel's is the
  reasoning; the `final` channel's and preambles are the answer, with any function call in its harmony form for
  the `openai` tool-call parser.

Both tags must be tokens of the model's vocabulary (as vLLM requires): the engine starts a request's structured
output (its grammar) only after the reasoning's end (`ends_reasoning`: the end token; GPT-OSS's final channel's
header `<|channel|>final<|message|>`), where its prompt has not already closed the reasoning (Qwen3 without
thinking renders an empty `<think></think>` into the prompt).

Decided: the start tag is recognised at the start of the output only (after white space), so that a stream, which
cannot take text back, splits an output as the whole output splits.
"""

import dataclasses

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "glm45", "gemma4", "openai_gptoss")
_START, _END, _TOOL_CALL = "<think>", "</think>", "<tool_call>"
_GEMMA4 = dict(start_tag="<|channel>", end_tag="<channel|>", label="thought\n", special_tokens=True)


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    start_token_id: int
    end_token_id: int
    ends_at: tuple[str, ...]  # the tags that end the reasoning; the first is its own end tag (dropped)
    opened: bool = False  # glm45, gemma4: an output is reasoning only where it opens with the start tag (else answer)
    start_tag: str = _START
    end_tag: str = _END
    label: str = ""  # gemma4: the reasoning's opening role label, dropped
    special_tokens: bool = False  # whether the parser reads special tokens (requests then keep them in their text)

    @classmethod
    def of(cls, name: str, tokenizer) -> "ReasoningParser":
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
        if name == "openai_gptoss":
            return HarmonyReasoningParser.of(tokenizer)
        vocab = tokenizer.get_vocab()
        tags = _GEMMA4 if name == "gemma4" else {}
        start, end = tags.get("start_tag", _START), tags.get("end_tag", _END)
        missing = [tag for tag in (start, end) if tag not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser {name!r}: the tokenizer has no {' or '.join(missing)} token (a "
                             f"reasoning model's vocabulary has both {start} and {end})")
        ends_at = (_END, _TOOL_CALL) if name == "qwen3" else (end,)
        return cls(name, vocab[start], vocab[end], ends_at, opened=name in ("glm45", "gemma4"), **tags)

    def ended_in_prompt(self, prompt_ids) -> bool:
        """Whether the prompt closed the reasoning: its last start or end token is an end token (vLLM's rule)."""
        for token in reversed(prompt_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return False

    def ends_reasoning(self, output_ids) -> bool:
        """Whether an output's last token ended its reasoning (a structured output holds the tokens after it)."""
        return bool(output_ids) and output_ids[-1] == self.end_token_id

    def thinks(self, chat_template_kwargs: dict | None) -> bool:
        """Whether a request's output begins with reasoning (Qwen3: unless enable_thinking is false; DeepSeek V3.1:
        where `thinking` is true)."""
        kwargs = chat_template_kwargs or {}
        if self.name == "deepseek_v3":
            return kwargs.get("thinking") is True
        return self.name != "qwen3" or kwargs.get("enable_thinking", True) is not False

    def split(self, text: str, thinks: bool = True, final: bool = True) -> tuple[str, str, bool]:
        """(reasoning, answer, done) of an output, or of its first part (`final` false: text that may still become a
        tag is held back from both). `done`: the reasoning has ended."""
        if not thinks:
            return "", text, True
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and self.start_tag.startswith(body):  # maybe the start tag, still arriving
            return "", "", False
        elif self.opened:  # GLM-4.5 without thinking (its template closed an empty reasoning in the prompt)
            return "", text, True
        if self.label and body.startswith(self.label):
            body = body[len(self.label):]
        elif self.label and not final and self.label.startswith(body):  # maybe the label, still arriving
            return "", "", False
        ends = [(i, tag) for tag in self.ends_at if (i := body.find(tag)) >= 0]
        if ends:
            i, tag = min(ends)
            return body[:i], body[i + len(tag) if tag == self.end_tag else i:], True
        held = 0 if final else max(partial_tag(body, tag) for tag in self.ends_at)
        return body[:len(body) - held], "", False

    def stream(self, thinks: bool = True) -> "ReasoningStream":
        return ReasoningStream(self, thinks)


@dataclasses.dataclass(frozen=True)
class HarmonyReasoningParser:
    """`openai_gptoss`: GPT-OSS's harmony messages (module docstring); `end_ids`: the token ids of the final
    channel's header, after which the answer (and a structured output) starts."""

    name: str
    end_ids: tuple[int, ...]
    special_tokens = True

    @classmethod
    def of(cls, tokenizer) -> "HarmonyReasoningParser":
        from jaxengine import harmony

        missing = harmony.missing_tokens(tokenizer)
        if missing:
            raise ValueError(f"reasoning_parser 'openai_gptoss': the tokenizer has no {', '.join(missing)} token "
                             f"(GPT-OSS's harmony vocabulary has them)")
        return cls("openai_gptoss", tuple(tokenizer.encode(harmony.FINAL_HEADER, add_special_tokens=False)))

    def ends_reasoning(self, output_ids) -> bool:
        n = len(self.end_ids)
        return len(output_ids) >= n and tuple(output_ids[-n:]) == self.end_ids

    def ended_in_prompt(self, prompt_ids) -> bool:
        """Whether the prompt opened the final channel (a continued final message)."""
        return self.ends_reasoning(list(prompt_ids))

    def thinks(self, chat_template_kwargs: dict | None) -> bool:
        return True

    def split(self, text: str, thinks: bool = True, final: bool = True) -> tuple[str, str, bool]:
        from jaxengine import harmony

        return harmony.split(text, final)

    def stream(self, thinks: bool = True) -> "ReasoningStream":
        return ReasoningStream(self, thinks)


class ReasoningStream:
    """A growing output's reasoning and answer deltas: feed(text so far, final) -> (reasoning delta, answer
    delta); text that may still become a tag is held back until it cannot."""

    def __init__(self, parser: ReasoningParser, thinks: bool):
        self.parser, self.thinks = parser, thinks
        self.sent = (0, 0)
        self.answer = ""  # the answer so far (what a tool-call parser reads)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning, answer, _ = self.parser.split(text, self.thinks, final)
        sent_reasoning, sent_answer = self.sent
        self.sent, self.answer = (max(sent_reasoning, len(reasoning)), max(sent_answer, len(answer))), answer
        return reasoning[sent_reasoning:], answer[sent_answer:]


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (a stream holds them back until they can't)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
