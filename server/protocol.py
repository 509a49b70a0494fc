"""OpenAI request bodies (plus vLLM's extra sampling fields), validated with pydantic.

Unknown fields are refused rather than ignored: a parameter we do not honour must never pass silently.
"""

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxengine.sampling_params import MAX_N


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field (jaxengine.sampling_params.StructuredOutputsParams)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat; names and meanings as in the OpenAI API and vLLM."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    structured_outputs: StructuredOutputs | None = None
    use_beam_search: bool = False  # n beams (see Serving._beam_search)
    length_penalty: float = 1.0  # beam search's


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo (see Serving.completion)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and the like) around a text prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text


class ToolCallMessage(BaseModel):
    """A call an assistant message made (sent back in the conversation)."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    reasoning: str | None = None  # an assistant's reasoning (vLLM's field; templates that show it take it)
    reasoning_content: str | None = None  # the same under its older name (DeepSeek's API, vLLM before 0.11)

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # False: at most the first call is returned
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # taken only from a server started with --trust-request-chat-template
    add_special_tokens: bool = False  # vLLM's: special tokens added on top of what the template writes
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the reasoning out of the response
    # OpenAI's: given to the chat template as `reasoning_effort` (GPT-OSS's writes it into its system message;
    # chat_template_kwargs' own reasoning_effort wins)
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class StartProfileRequest(BaseModel):
    """The optional body of POST /start_profile (vLLM's `delay_iterations` / `max_iterations` are not taken)."""

    model_config = ConfigDict(extra="forbid")
    profile_prefix: str | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    tools: list[Tool] | None = None  # rendered with the messages, as chat renders them


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM's (with runtime LoRA updating allowed)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings, as OpenAI's and vLLM's: a text, texts, token ids or lists of them as `input`, or (vLLM's
    chat form) a conversation or conversations as `messages`, rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False  # the chat form's, as vLLM's (no generation prompt by default)
    continue_final_message: bool = False
    chat_template: str | None = None  # taken only from a server started with --trust-request-chat-template
    chat_template_kwargs: dict | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras
    use_activation: bool | None = None  # normalise (None: the pooler's setting)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool | None = None  # default: True for input, False for messages (as vLLM's)
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # of base64's bytes
    endianness: Literal["native", "big", "little"] = "native"  # of base64's bytes
    priority: int = 0
    request_id: str | None = None


class ScoringFields(BaseModel):
    """What /v1/score and /v1/rerank share (vLLM's names)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    user: str | None = None
    use_activation: bool | None = None  # normalise the embeddings (a cosine does not depend on it)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    request_id: str | None = None


class ScoreRequest(ScoringFields):
    """POST /v1/score: two sides of texts under one of vLLM's pairs of names."""

    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    NAMES: ClassVar[tuple] = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                              ("text_1", "text_2"))

    def sides(self) -> tuple[str, str]:
        """The names of the two sides given; a ValueError unless exactly one pair of names is."""
        given = {name for pair in self.NAMES for name in pair if getattr(self, name) is not None}
        pairs = [pair for pair in self.NAMES if set(pair) == given]
        if len(pairs) != 1:
            raise ValueError(f"give the texts to score as one of {', '.join(' and '.join(p) for p in self.NAMES)}; "
                             f"got {sorted(given) or 'none'}")
        return pairs[0]


class RerankRequest(ScoringFields):
    """POST /v1/rerank (Jina's and Cohere's API, as vLLM's): documents ordered by their score against the query."""

    query: str
    documents: str | list[str]
    top_n: int = Field(0, ge=0)  # 0: all


class ClassificationRequest(BaseModel):
    """POST /classify, as vLLM's: a sequence classifier's probabilities for each input."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    user: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    use_activation: bool | None = None  # the classifier's activation (None: the pooler's setting, on)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None


class ResponsesTextFormat(BaseModel):
    """The Responses API's `text.format`: plain text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high"] | None = None  # given to the chat template as reasoning_effort
    summary: str | None = None  # refused where set: no summaries are written


class ResponsesRequest(BaseModel):
    """POST /v1/responses, OpenAI's Responses API as vLLM serves it (server.responses): `input` (a text, or a list
    of input items: messages, function calls and their outputs, reasoning) and `tools` are read item by item there,
    each refusal naming its place."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    stream: bool = False
    store: bool | None = None  # None: stored where the server keeps responses
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None  # refused where true: responses run while their request waits
    truncation: Literal["auto", "disabled"] | None = None  # "auto" refused: no input item is ever dropped
    max_tool_calls: int | None = None  # refused where set: the server runs no tools of its own
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
