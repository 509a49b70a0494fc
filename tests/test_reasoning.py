"""Reasoning parsers (vLLM's --reasoning-parser): the split of an output into reasoning and answer, whole and
streamed, and structured outputs that start after the reasoning."""

import re

import pytest
from transformers import AutoTokenizer

from jaxengine import EngineConfig, SamplingParams, StructuredOutputsParams
from jaxengine.reasoning import ReasoningParser
from tests.engine_util import run_to_completion


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("text, want", [
    ("<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.", True)),
    ("Let me see.</think>It is 4.", ("Let me see.", "It is 4.", True)),  # <think> opened by the template
    ("\n<think>\nhmm</think>", ("\nhmm", "", True)),
    ("Still thinking", ("Still thinking", "", False)),  # never closed: all reasoning
    ("<think>a</think>b</think>c", ("a", "b</think>c", True)),
])
def test_deepseek_r1_splits_at_the_end_tag(tokenizer, text, want):
    assert ReasoningParser.of("deepseek_r1", tokenizer).split(text) == want


def test_qwen3_ends_reasoning_at_a_tool_call_and_may_not_think(tokenizer):
    parser = ReasoningParser.of("qwen3", tokenizer)
    assert parser.split("<think>call it<tool_call>{}</tool_call>") == ("call it", "<tool_call>{}</tool_call>", True)
    assert parser.split("<think>a</think>b<tool_call>x") == ("a", "b<tool_call>x", True)
    assert parser.thinks(None) and parser.thinks({"enable_thinking": True})
    assert not parser.thinks({"enable_thinking": False})
    assert parser.split("plain answer", thinks=False) == ("", "plain answer", True)
    assert ReasoningParser.of("deepseek_r1", tokenizer).split("x<tool_call>y") == ("x<tool_call>y", "", False)


def test_deepseek_v3_thinks_only_where_the_request_asks(tokenizer):
    """DeepSeek V3.1's template thinks where `chat_template_kwargs` has `thinking: true` (its prompt then ends in
    <think>): the output is reasoning up to </think> as deepseek_r1 splits it; otherwise all answer."""
    parser = ReasoningParser.of("deepseek_v3", tokenizer)
    assert parser.thinks({"thinking": True})
    assert not any(parser.thinks(kwargs) for kwargs in (None, {}, {"thinking": False}, {"enable_thinking": True}))
    assert parser.split("Let me see.</think>It is 4.", thinks=True) == ("Let me see.", "It is 4.", True)
    assert parser.split("It is 4.</think>", thinks=False) == ("", "It is 4.</think>", True)
    stream, answer = parser.stream(thinks=False), ""
    for end in range(1, 10):
        answer += stream.feed("It is 4."[:end], final=end == 9)[1]
    assert answer == "It is 4."


@pytest.mark.parametrize("text, want", [
    ("<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4.", True)),
    (" <think>\nhmm", ("\nhmm", "", False)),  # opened, never closed: all reasoning
    ("It is 4.", ("", "It is 4.", True)),  # not opened (thinking off): all answer
    ("Let me see.</think>It is 4.", ("", "Let me see.</think>It is 4.", True)),
])
def test_glm45_reasons_only_where_the_output_opens_the_tag(tokenizer, text, want):
    assert ReasoningParser.of("glm45", tokenizer).split(text) == want


@pytest.fixture(scope="module")
def gemma4_tokenizer(tokenizer_dir):
    """The test tokenizer with Gemma 4's thought channel tags as special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|channel>", "<channel|>"]})
    return tokenizer


@pytest.mark.parametrize("text, want", [
    ("<|channel>thought\nLet me see.<channel|>It is 4.", ("Let me see.", "It is 4.", True)),
    ("<|channel>thought\n2 + 2", ("2 + 2", "", False)),  # opened, never closed: all reasoning
    ("<|channel>no label<channel|>4", ("no label", "4", True)),
    ("It is 4.", ("", "It is 4.", True)),  # not opened (thinking off): all answer
    ("thought\nIt is 4.<channel|>", ("", "thought\nIt is 4.<channel|>", True)),
])
def test_gemma4_reasons_in_its_thought_channel(gemma4_tokenizer, text, want):
    parser = ReasoningParser.of("gemma4", gemma4_tokenizer)
    assert parser.special_tokens and parser.split(text) == want
    assert parser.end_token_id == gemma4_tokenizer.convert_tokens_to_ids("<channel|>")
    with pytest.raises(ValueError, match=re.escape("the tokenizer has no <|channel> or <channel|> token")):
        ReasoningParser.of("gemma4", AutoTokenizer.from_pretrained(gemma4_tokenizer.name_or_path))


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3", "glm45", "gemma4"])
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_split_is_the_whole_split_whatever_the_chunks(tokenizer, gemma4_tokenizer, name, step):
    parser = ReasoningParser.of(name, gemma4_tokenizer if name == "gemma4" else tokenizer)
    texts = ["<think>Let me see: 2 + 2.</think>\n\nIt is <b>4</b>.", "  <thi", "ab</thi", "r</think>",
             "<think>x<tool_call>{\"a\": 1}</tool_call>", "<think>a < b</think> <thinking>"]
    if name == "gemma4":  # its tags in those texts, and its label arriving in pieces
        texts = [t.replace("<think>", "<|channel>thought\n").replace("</think>", "<channel|>") for t in texts] + [
            "<|channel>thou", "<|channel>thoughtful<channel|>x", "<|channel>thought\n<channel|>"]
    for text in texts:
        stream, reasoning, answer = parser.stream(), "", ""
        ends = list(range(step, len(text), step)) + [len(text)]
        for end in ends:
            r, a = stream.feed(text[:end], final=end == len(text))
            assert not any(tag in r + a for tag in (parser.start_tag, parser.end_tag))
            reasoning, answer = reasoning + r, answer + a
        whole = parser.split(text)
        assert (reasoning, answer) == whole[:2] and stream.answer == whole[1], text


def test_prompt_that_closed_the_reasoning(tokenizer):
    parser = ReasoningParser.of("deepseek_r1", tokenizer)
    start, end = parser.start_token_id, parser.end_token_id
    assert parser.ended_in_prompt([5, start, 6, end, 7]) and not parser.ended_in_prompt([5, end, start, 6])
    assert not parser.ended_in_prompt([5, 6])


def test_unknown_parser_and_a_vocabulary_without_the_tags_are_refused():
    with pytest.raises(ValueError, match="must be one of deepseek_r1, deepseek_v3, qwen3, glm45, gemma4, "
                                         "openai_gptoss, got 'granite'"):
        EngineConfig(reasoning_parser="granite")
    class Vocab:  # a tokenizer's vocabulary without </think>
        def get_vocab(self):
            return {"<think>": 5}

    with pytest.raises(ValueError, match="the tokenizer has no </think> token"):
        ReasoningParser.of("qwen3", Vocab())


CHOICE = StructuredOutputsParams(choice=["yes", "no"])


def _first_output(engine, prompt, params):
    return run_to_completion(engine, [("r", prompt, params)])["r"].outputs[0]


def test_structured_output_starts_after_the_reasoning(engines):
    """With a reasoning parser a grammar holds the tokens after the reasoning's end token: here the model, biased to
    it, ends its reasoning at once (a token the grammar would not allow), then answers in the grammar; without the
    parser, or where the prompt closed the reasoning, the grammar holds from the first token."""
    engine = engines("llama", reasoning_parser="deepseek_r1")
    plain = engines("llama")
    end = engine.reasoning.end_token_id
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={end: 100.0}, structured_outputs=CHOICE)
    prompt = [5, 6, 7, engine.reasoning.start_token_id]
    out = _first_output(engine, prompt, params)
    assert out.token_ids[0] == end and out.text.startswith("</think>")
    assert out.text[len("</think>"):] in ("yes", "no") and out.finish_reason == "stop"
    for eng, prompt in ((plain, prompt), (engine, [5, 6, 7, engine.reasoning.start_token_id, 9, end])):
        out = _first_output(eng, prompt, params)
        assert end not in out.token_ids and out.text in ("yes", "no")
    for eng in (engine, plain):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# GPT-OSS's harmony completions (jaxengine.harmony), as the text keeps its special tokens
ANALYSIS = "<|channel|>analysis<|message|>The user wants 2 + 2.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


def call_text(name, arguments):
    return f'<|start|>assistant<|channel|>commentary to=functions.{name}<|message|>{arguments}<|call|>'


@pytest.mark.parametrize("text, want", [
    (ANALYSIS + FINAL, ("The user wants 2 + 2.", "It is 4.", True)),
    (ANALYSIS + CALL, ("The user wants 2 + 2.", call_text("get_weather", '{"city": "Paris"}'), True)),
    # the recipient before the channel; a preamble before the call; two analysis messages
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     + '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}',
     ("The user wants 2 + 2.", "Checking." + call_text("f", "{}"), True)),
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL,
     ("The user wants 2 + 2.\nMore.", "It is 4.", True)),
    # a built-in tool's call is reasoning; text before any header, and a header never finished, are answer
    (ANALYSIS + "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>",
     ("The user wants 2 + 2.\n{\"q\": 1}", "", False)),
    ("Plain text.", ("", "Plain text.", True)),
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", "", False)),
    (ANALYSIS + "<|start|>assistant<|channel|>fin", ("The user wants 2 + 2.", "<|start|>assistant<|channel|>fin",
                                                     True)),
])
def test_openai_gptoss_splits_harmony_messages(tokenizer, text, want):
    parser = ReasoningParser.of("openai_gptoss", tokenizer)
    assert parser.special_tokens and parser.thinks(None)
    assert parser.split(text) == want


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_openai_gptoss_streamed_split_is_the_whole_split_and_the_tool_parser_finds_the_calls(tokenizer, step):
    """Streamed a few characters at a time (a special token may arrive cut where text is streamed by characters),
    the reasoning and answer deltas join to the whole split; the `openai` tool-call parser then finds the calls in
    the answer (and in the raw text, where the reasoning stays content), whole and streamed (each call's header,
    then its arguments' text in pieces, which join to the whole)."""
    from server.tool_parsers import PARSERS

    parser, tools = ReasoningParser.of("openai_gptoss", tokenizer), PARSERS["openai"]
    assert tools.special_tokens
    for text, calls in [(ANALYSIS + FINAL, []), (ANALYSIS + CALL, [("get_weather", '{"city": "Paris"}')]),
                        (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>One moment.<|end|>" + CALL,
                         [("get_weather", '{"city": "Paris"}')]), ("Plain <|st", [])]:
        stream, reasoning, answer = parser.stream(), "", ""
        tool_stream, content, found = tools.Stream(), "", []
        ends = list(range(step, len(text), step)) + [len(text)]
        for end in ends:
            final = end == len(text)
            r, a = stream.feed(text[:end], final=final)
            reasoning, answer = reasoning + r, answer + a
            c, new = tool_stream.feed(stream.answer, final=final)
            content = content + c
            for delta in new:  # joined by index, as clients join them
                if delta.call is not None:
                    found.append([delta.call.name, ""])
                found[delta.index][1] += delta.arguments
        whole = parser.split(text)
        assert (reasoning, answer) == whole[:2], text
        want_content, want_calls = tools.parse(whole[1])
        assert [(t.name, t.arguments) for t in want_calls] == calls
        assert content == (want_content or "") and [tuple(t) for t in found] == calls
        raw_content, raw_calls = tools.parse(text)  # no reasoning parser: the analysis stays in the content
        assert [(t.name, t.arguments) for t in raw_calls] == calls
        assert raw_content == "\n".join(filter(None, [whole[0], want_content]))


def test_openai_gptoss_reasoning_ends_at_the_final_channel_header(tokenizer):
    parser = ReasoningParser.of("openai_gptoss", tokenizer)
    header = tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)
    assert parser.end_ids == tuple(header) and len(header) > 2
    assert parser.ends_reasoning([5, 6, *header]) and not parser.ends_reasoning(header[:-1])
    assert parser.ended_in_prompt([7, *header]) and not parser.ended_in_prompt([*header, 9])

    class Vocab:  # a vocabulary without harmony's tokens
        def get_vocab(self):
            return {"<|end|>": 5}

    with pytest.raises(ValueError, match="openai_gptoss': the tokenizer has no <\\|start\\|>"):
        ReasoningParser.of("openai_gptoss", Vocab())


def test_openai_gptoss_structured_output_waits_for_the_final_channel(engines):
    """GPT-OSS's reasoning ends where its final channel opens (a header of several tokens): a prompt that opened it
    (a continued final message) has the grammar hold from the first token, a token biased outside it notwithstanding;
    before the header the output is the model's own (here the biased token)."""
    engine = engines("gptoss", reasoning_parser="openai_gptoss")
    header = list(engine.reasoning.end_ids)
    outside = 9  # a token the grammar does not allow first
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={outside: 100.0}, structured_outputs=CHOICE)
    out = _first_output(engine, [5, 6, 7, *header], params)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    out = _first_output(engine, [5, 6, 7], params)
    assert out.token_ids[0] == outside
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_gpt_oss_gets_the_harmony_parser_unless_one_is_named(engines):
    """As vLLM: a GPT-OSS engine without --reasoning-parser reads its harmony output (openai_gptoss); other models
    get none, and a named parser is kept."""
    assert engines("gptoss").reasoning.name == "openai_gptoss"
    assert engines("llama").reasoning is None
    assert engines("gptoss", reasoning_parser="deepseek_r1").reasoning.name == "deepseek_r1"
