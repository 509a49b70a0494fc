"""The offline API: `jaxengine.LLM`, used like `vllm.LLM`."""

import dataclasses
import itertools

from tqdm.auto import tqdm

from jaxengine import profiler
from jaxengine.config import EngineConfig
from jaxengine.engine.dp_engine import create_engine
from jaxengine.engine.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all,
                                          beam_step_params, live_prompts)
from jaxengine.engine.pooler import check_cross_encoder, cosine_similarity, cross_encoder_ids, score_pairs
from jaxengine.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                               RequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxengine.lora import LoRARequest
from jaxengine.pooling_params import POOLING_TASKS, PoolingParams
from jaxengine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, progress: bool = True,
                 **engine_args):
        if config is not None and (model is not None or engine_args):
            raise ValueError("LLM takes a config or model and engine settings, not both")
        config = config or EngineConfig.of("LLM", model=model, **engine_args)
        self.engine = create_engine(config, progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, as vLLM's `LLM.reset_prefix_cache` (e.g. between benchmark runs); False if
        requests are still running (nothing is changed then)."""
        return self.engine.reset_prefix_cache()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Starts a jax.profiler trace of what the engine runs until `stop_profile()`, as vLLM's `LLM.start_profile`:
        into the engine's `profiler_dir` (its subfolder `profile_prefix` where given); see jaxengine/profiler.py."""
        profiler.start(self.engine.config.profiler_dir, profile_prefix)

    def stop_profile(self) -> None:
        """Stops the trace and writes it."""
        profiler.stop()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: the model's generation config defaults (see
        EngineConfig.generation_config), else SamplingParams()."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, a dict, or a list of those. Outputs come back in input order.
        `lora_request`: the LoRA adapter every prompt (or each prompt: a list) runs with (enable_lora)."""
        params = sampling_params or self.get_default_sampling_params()
        prompts, params = self._per_prompt(prompts, params, "sampling_params")
        _, loras = self._per_prompt(prompts, lora_request, "lora_request")
        final = [SamplingParams(**{**p.__dict__, "output_kind": RequestOutputKind.FINAL_ONLY}) for p in params]
        return self._run(self._submit(prompts, final, priority, loras), use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool = False,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's `LLM.beam_search` (jaxengine.engine.beam_search): each prompt's best
        `beam_width` sequences (`tokens` the prompt's and the beam's, `text` their decoding), best first.
        `lora_request`: the LoRA adapter every prompt (or each prompt: a list) searches with."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts, _ = self._per_prompt(prompts, params, "params")
        _, loras = self._per_prompt(prompts, lora_request, "lora_request")
        step = beam_step_params(params, self.engine.config.max_logprobs)
        searches = []
        for prompt in prompts:
            _, ids = self.engine.tokenize_prompt(prompt)
            self.engine.validate(ids, step)
            searches.append(BeamSearch(ids, params, self.engine.eos_token_ids, self.engine.max_model_len))
        lora_of = {id(search): lora for search, lora in zip(searches, loras)}
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            live = live_prompts(searches)
            if not live:
                break
            outputs = self._run(self._submit([{"prompt_token_ids": t} for _, t in live], [step] * len(live), None,
                                             [lora_of[id(search)] for search, _ in live]), use_tqdm=False)
            advance_all(searches, live, [out.outputs[0].logprobs[0] for out in outputs])
        decode = self.get_tokenizer().decode
        return [search.result(lambda ids: decode(ids, skip_special_tokens=params.skip_special_tokens), True)
                for search in searches]

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
               use_tqdm: bool = True, pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
               priority: list[int] | None = None) -> list[PoolingRequestOutput]:
        """A pooling engine's (runner 'pooling') outputs for the prompts (as `generate` takes them), in input
        order: each `outputs.data` the prompt's embedding, or a classifier's probabilities (float32).
        `pooling_task`: "embed" or "classify", the model's (default: the model's). `truncate_prompt_tokens` over
        every PoolingParams' own, as vLLM's."""
        if pooling_task not in POOLING_TASKS + (None,):
            raise ValueError(f"pooling_task {pooling_task!r} is not supported; supported: {', '.join(POOLING_TASKS)}")
        task = self.engine.pooling_task
        if pooling_task is not None and task is not None and pooling_task != task:
            use = {"embed": "LLM.embed", "classify": "LLM.classify"}[task]
            raise ValueError(f"pooling_task {pooling_task!r}: this model's task is {task!r} (use {use})")
        prompts, params = self._per_prompt(prompts, pooling_params or PoolingParams(), "pooling_params")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._run(self._submit(prompts, params, priority), use_tqdm, desc="Embedding")

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              priority: list[int] | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, a list of floats), as vLLM's `LLM.embed`."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                              priority=priority, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def classify(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
                 priority: list[int] | None = None) -> list[ClassificationRequestOutput]:
        """A sequence classifier's probabilities for each prompt (`outputs.probs`), as vLLM's `LLM.classify`."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                              priority=priority, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def score(self, data_1: str | list[str], data_2: str | list[str], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Texts' similarity, as vLLM's `LLM.score`, pairing one text with each of the others (1:N) or the two lists
        in order (N:N): an embedding model's cosine of each pair's embeddings, or a one-label classifier's score of
        the pair (a cross-encoder: the tokenizer's encoding of the two texts together)."""
        first, second = ([d] if isinstance(d, str) else list(d) for d in (data_1, data_2))
        for name, texts in (("data_1", first), ("data_2", second)):
            if not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{name} must be a text or a list of texts")
        pairs = score_pairs(len(first), len(second))
        if self.engine.pooling_task == "classify":
            check_cross_encoder(self.engine.classifier)
            tok = self.get_tokenizer()
            outputs = self.encode([cross_encoder_ids(tok, first[i], second[j]) for i, j in pairs], pooling_params,
                                  use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for o in outputs]
        outputs = self.encode(first + second, pooling_params, use_tqdm=use_tqdm,
                              truncate_prompt_tokens=truncate_prompt_tokens, pooling_task="embed")
        return [ScoringRequestOutput(f"{outputs[i].request_id}_{outputs[len(first) + j].request_id}",
                                     ScoringOutput(cosine_similarity(outputs[i].outputs.data,
                                                                     outputs[len(first) + j].outputs.data)),
                                     outputs[i].prompt_token_ids + outputs[len(first) + j].prompt_token_ids)
                for i, j in pairs]

    @staticmethod
    def _per_prompt(prompts, params, name: str) -> tuple[list, list]:
        """The prompts as a list (one prompt: a string, token ids or a dict) and their parameters, one each."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} {name} for {len(prompts)} prompts")
        return prompts, params

    def _submit(self, prompts: list, params: list, priority: list[int] | None,
                loras: list | None = None) -> dict[str, int]:
        """Adds a request per prompt, every prompt (and LoRA adapter) checked before any is scheduled; returns each
        request's index."""
        priority = priority or [0] * len(prompts)
        loras = loras or [None] * len(prompts)
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        tokenized = [(text, self.engine.truncate_prompt(ids, p)) for (text, ids), p in zip(tokenized, params)]
        for (_, ids), p in zip(tokenized, params):
            self.engine.validate(ids, p)
        for lora in loras:
            if lora is not None:
                self.engine.add_lora(lora)
        order = {}
        for (text, ids), p, prio, lora in zip(tokenized, params, priority, loras):
            rid = str(next(self._ids))
            order[rid] = len(order)
            self.engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, p, priority=prio,
                                    lora_request=lora)
        return order

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of conversations. A message's content is a
        string, None or a list of text parts ({"type": "text", "text": ...}, joined); other parts are refused.
        `continue_final_message`: the last message is continued (no generation prompt after it), as in vLLM.
        `tools` (OpenAI tool definitions) are rendered by the chat template, as in vLLM; the calls an output
        writes stay in its text (the server's --tool-call-parser parses them)."""
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a conversation (a list of {{role, content}} dicts) or a list of "
                             f"them, got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            conversation = _chat_messages(conversation)
            try:
                ids = chat_prompt_ids(tok, conversation, chat_template=chat_template,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template_kwargs=chat_template_kwargs, tools=tools)
            except Exception as e:  # the template's own errors (roles it refuses, unknown kwargs)
                raise ValueError(f"messages: could not apply the chat template: {e}") from None
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, order: dict[str, int], use_tqdm: bool, desc: str = "Generating") -> list:
        results: list = [None] * len(order)
        with tqdm(total=len(order), desc=desc, disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return results


def chat_prompt_ids(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
    """A conversation's prompt token ids, as vLLM makes them (LLM.chat and the server's chat route): the chat
    template's text (`chat_template` over the tokenizer's own; with continue_final_message the last message is
    continued, so no generation prompt follows it; `tools`, OpenAI tool definitions, rendered by it), tokenized
    with `add_special_tokens` (default False: the template writes them). The template's errors are raised as
    they are."""
    kwargs = (chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
    text = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _chat_messages(conversation) -> list[dict]:
    """A conversation's messages as the chat template takes them: text content only (a list of text parts is
    joined, as the server does); a ValueError naming messages for anything else."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"messages: a conversation must be a non-empty list of {{role, content}} dicts, "
                         f"got {conversation!r:.100}")
    out = []
    for message in conversation:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages: each message must be a dict with a string role, got {message!r:.100}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content})
                raise ValueError(f"messages: only text content parts are supported, got parts of type {kinds}")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages: a message's content must be a string, a list of text parts or None, "
                             f"got {type(content).__name__}")
        out.append(message | {"content": content})
    return out
