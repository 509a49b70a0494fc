"""OpenAI's harmony format (GPT-OSS) in a completion's text, kept with its special tokens: what is reasoning, what
is the answer, and which messages call a function.

An assistant completion is a run of messages, each a header and its content:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`. A header may
name a recipient (`to=functions.get_weather`, before or after the channel) and a content type (`<|constrain|>json`);
a content ends at `<|end|>`, `<|call|>` or `<|return|>` (the last two are end-of-sequence tokens: an output's text
stops before them) or where the next message starts. The channels, as vLLM reads them: `analysis` is reasoning,
`final` the answer; a message to `functions.NAME` is a call of NAME with its content as the arguments.

Decided: `commentary` without a recipient (a preamble the model writes for the user before its calls) is answer; a
message to another recipient (a built-in tool's, `browser.search`) is reasoning; text before the first header is
answer (a completion that does not follow the format stays whole), and a header that never reaches its `<|message|>`
in a finished output is answer as it stands; messages of one kind are joined with a newline.
"""

import dataclasses
import re

from jaxengine.reasoning import partial_tag

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"  # where the answer starts (structured outputs hold the tokens after it)
_CONTENT_ENDS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


@dataclasses.dataclass(frozen=True)
class Message:
    channel: str | None
    recipient: str | None
    content: str
    complete: bool  # its end was seen (or the output finished)

    @property
    def kind(self) -> str:
        """"call", "reasoning" or "answer"."""
        if self.recipient is not None:
            return "call" if self.recipient.startswith(FUNCTIONS) else "reasoning"
        return "reasoning" if self.channel == "analysis" else "answer"


def messages(text: str, final: bool = True) -> list[Message]:
    """The messages of a completion's text so far (`final`: the whole of it). A message whose header is still
    arriving is left out until its `<|message|>`; text before the first header is an answer message. Unfinished,
    text that could still become a tag is held back (each message's content only grows)."""
    out, pos = [], 0
    found = [i for tag in (START, CHANNEL) if (i := text.find(tag)) >= 0]
    first = min(found) if found else len(text)
    if first > 0:
        held = 0 if final or found else max(partial_tag(text, tag) for tag in (START, CHANNEL))
        out.append(Message(None, None, text[:first - held], bool(found) or final))
        pos = first
    while pos < len(text):
        body = text.find(MESSAGE, pos)
        if body < 0:  # a header still arriving; in a finished output, answer as it stands
            if final:
                out.append(Message(None, None, text[pos:], True))
            break
        header = text[pos:body]
        start = body + len(MESSAGE)
        ends = [(i, tag) for tag in _CONTENT_ENDS if (i := text.find(tag, start)) >= 0]
        end, tag = min(ends) if ends else (len(text), None)
        if tag is None and not final:
            end -= max(partial_tag(text[start:], t) for t in _CONTENT_ENDS)
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        out.append(Message(channel.group(1) if channel else None, recipient.group(1) if recipient else None,
                           text[start:end], tag is not None or final))
        if tag is None:
            break
        pos = end if tag == START else end + len(tag)
    return out


def missing_tokens(tokenizer) -> list[str]:
    """Harmony's tokens that a tokenizer's vocabulary lacks (none in GPT-OSS's)."""
    vocab = tokenizer.get_vocab()
    return [tag for tag in TOKENS if tag not in vocab]


def call_text(name: str, arguments: str, complete: bool) -> str:
    """A call as harmony writes it: what an answer carries for the `openai` tool-call parser to find."""
    return f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{name}{MESSAGE}{arguments}" + (CALL if complete else "")


def split(text: str, final: bool = True) -> tuple[str, str, bool]:
    """(reasoning, answer, whether the answer has started) of a completion's text so far: the reasoning messages'
    contents; the answer messages' contents, with each call in its harmony form (call_text). Both only grow as the
    text does."""
    reasoning, answer, last = [], "", None
    for m in messages(text, final):
        if m.kind == "reasoning":
            reasoning.append(m.content)
            continue
        if m.kind == "call":
            answer += call_text(m.recipient[len(FUNCTIONS):], m.content, m.complete)
        else:
            answer += ("\n" if last == "answer" else "") + m.content
        last = m.kind
    return "\n".join(reasoning), answer, last is not None


def answer_and_calls(text: str, final: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(function name, arguments)]) of a text so far: every non-call message's content (joined with a
    newline) and the calls (an unfinished one's arguments as far as they are written)."""
    content, calls = [], []
    for m in messages(text, final):
        if m.kind == "call":
            calls.append((m.recipient[len(FUNCTIONS):], m.content))
        else:
            content.append(m.content)
    return "\n".join(content), calls
