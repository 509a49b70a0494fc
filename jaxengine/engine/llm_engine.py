"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduler step at a time."""

import collections
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.config import EngineConfig
from jaxengine.engine.block_manager import BlockManager
from jaxengine.engine.detokenizer import IncrementalDetokenizer
from jaxengine.engine.pooler import ClassifierHead, PoolState
from jaxengine.engine.request import Sequence
from jaxengine.engine.scheduler import Scheduler
from jaxengine.engine.speculative import SpeculativeConfig
from jaxengine.engine.structured_outputs import GrammarCompiler
from jaxengine.models.config import read_hf_config
from jaxengine.models.loader import load_config, load_model, resolve_model_dir, weight_dtypes
from jaxengine.parallel.multihost import CommandChannel, is_leader
from jaxengine.parallel.sharding import check_layout, make_mesh
from jaxengine.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                               RequestOutput)
from jaxengine import lora
from jaxengine.layers.attention import FP8_DTYPES
from jaxengine.layers.rope import rotary_layout
from jaxengine.lora import LoRAAdapter, LoRARequest, LoRASlots
from jaxengine.pooling_params import PoolerConfig, PoolingParams
from jaxengine import harmony
from jaxengine.reasoning import ReasoningParser
from jaxengine.runner.executables import ExecutableCache
from jaxengine.runner.model_runner import MAX_BANNED, MAX_LOGIT_BIAS, ModelRunner
from jaxengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str | None) -> Path | None:
    """Where the engine keeps its compiled programs across processes (`executables/` in `cache_dir`), or None.
    Each process of a multi-process engine keeps its own there (jaxengine/runner/executables.py)."""
    return Path(cache_dir).expanduser() / "executables" if cache_dir else None


_GENERIC_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


# The generation_config.json keys that vLLM takes as default sampling parameters, and the field each sets.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                       "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(directory) -> dict:
    """The directory's generation_config.json ({} without one)."""
    path = Path(directory) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def generation_defaults(model_dir, setting: str = "auto", override: dict | None = None) -> dict:
    """Default SamplingParams fields for requests that leave them unset, as vLLM's `--generation-config`: "auto"
    reads the model directory's generation_config.json, a directory path that directory's, "vllm" none; the keys
    of GENERATION_DEFAULTS that are set (not null) count, `override` merged over them (null removes one)."""
    if setting == "vllm":
        values = {}
    else:
        directory = Path(model_dir if setting == "auto" else setting)
        if not directory.is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {setting!r}")
        values = {key: value for key, value in read_generation_config(directory).items()
                  if key in GENERATION_DEFAULTS}
    unknown = sorted(set(override or {}) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {unknown}; known: {sorted(GENERATION_DEFAULTS)}")
    values = {key: value for key, value in (values | (override or {})).items() if value is not None}
    defaults = {GENERATION_DEFAULTS[key]: value for key, value in values.items()}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config: the default sampling parameters {defaults} are invalid: {e}") from None
    return defaults


def load_tokenizer(name_or_dir, trust_remote_code: bool = False):
    """AutoTokenizer's tokenizer for a local directory or hub id. A directory whose tokenizer_config.json
    names the generic fast class (Llama 3, SmolLM, ...) loads it directly, as AutoTokenizer would: resolving
    the class through AutoTokenizer imports transformers' model configs and with them torch, seconds of
    start-up on CPU. A tokenizer of its own code (`auto_map`) loads only with `trust_remote_code`, as in vLLM;
    without it the refusal is immediate (transformers would otherwise ask on the terminal)."""
    from transformers import PreTrainedTokenizerFast

    directory = Path(name_or_dir).expanduser()
    config_file = directory / "tokenizer_config.json"
    if (directory / "tokenizer.json").is_file() and config_file.is_file():
        if json.loads(config_file.read_text()).get("tokenizer_class") in _GENERIC_FAST_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_dir, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise ValueError(f"the tokenizer {str(name_or_dir)!r} runs code of its own: pass --trust-remote-code "
                             f"(trust_remote_code=True) to allow it") from None
        raise


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    emitted: list[tuple[int, int]]  # per sample: (tokens, characters) already returned (delta outputs)
    prompt_logprobs_sent: bool = False
    metrics: RequestMetrics | None = None
    pooling: PoolingParams | None = None  # a pooling request's own parameters (`params` runs its one step)

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(): this runs for every request at every step
            if not seq.is_finished:
                return False
        return True


# What a pooling request runs: its prompt, and one greedy token (the step's sample, dropped) that ends it.
_POOLING_STEP = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                               output_kind=RequestOutputKind.FINAL_ONLY)


def unrolled_by_default(backend: str, native_matmul: bool) -> bool:
    """layer_loop 'auto': a scan over stacked layers, except on CPU where XLA's dots multiply the weights (no
    native matmul: a CPU with neither AVX-512 BF16 nor AVX2, float32 weights, a mesh), whose steps the unrolled
    loop runs ~12% faster (llama-135m's float32 weights, 32 prompts x 128 -> 32: 135 against 119 tok/s), though
    it compiles slower. Where the native matmul runs the two run alike and the scan starts sooner
    (benchmarks/README, session 23)."""
    return backend == "cpu" and not native_matmul


def scan_warning(layer_loop: str, backend: str, param_dtype, native_matmul: bool) -> str | None:
    """The start-up warning where layer_loop 'scan' is a poor choice, else None (the measurements:
    benchmarks/README.md, sessions 21 and 22). The native matmul reads a scanned layer's packed weights in
    place; XLA's dots take slices, and there XLA:CPU converts the stacked weights at every step."""
    if layer_loop != "scan" or backend != "cpu" or jnp.dtype(param_dtype) != jnp.bfloat16 or native_matmul:
        return None
    return ("layer_loop 'scan' on CPU over bfloat16 weights that XLA's dots multiply (the native matmul does not "
            "run here): XLA:CPU converts the stacked weights to float32 before the layer loop at every step, so "
            "steps run ~1.8x slower than with the unrolled loop (layer_loop 'auto' or 'unrolled')")


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, devices: list | None = None):
        """`devices`: where this engine runs (default: the first tensor_parallel_size devices)."""
        self.config = config
        executables = enable_compilation_cache(config.compilation_cache_dir)
        if executables is not None:
            executables = ExecutableCache(executables, int(config.compilation_cache_max_gib * (1 << 30)) or None)
        model_dir = (resolve_model_dir(config.model, config.trust_remote_code, config.revision, config.download_dir)
                     if config.model else _demo_model_dir())
        tp = config.tensor_parallel_size
        architecture, checkpoint_config = load_config(model_dir, config.hf_overrides)
        if config.quantization is not None and checkpoint_config.quant_method is None:
            raise ValueError(f"quantization={config.quantization!r}, but {model_dir} is not a quantized checkpoint "
                             f"(its config.json has no quantization_config; quantizing at load is not supported)")
        if config.quantization not in (None, checkpoint_config.quant_method):
            raise ValueError(f"quantization={config.quantization!r} does not match the checkpoint's quant_method "
                             f"{checkpoint_config.quant_method!r}")
        hf_config = read_hf_config(model_dir, config.hf_overrides)  # the pooler's and a classifier head's keys
        self.runner_type = self._runner_type(config, architecture)
        # What a pooling engine's outputs are: "embed" (embeddings) or "classify" (a classifier's probabilities).
        self.pooling_task = (None if self.runner_type != "pooling" else
                             "classify" if architecture.classifier else "embed")
        self.pooler = self._pooler(config, model_dir, hf_config, checkpoint_config.hidden_size)
        check_layout(checkpoint_config, tp, config.data_parallel_size, len(jax.devices()))
        self.mesh = make_mesh(tp, devices)
        unrolled = config.layer_loop == "unrolled" or (config.layer_loop == "auto" and unrolled_by_default(
            jax.default_backend(), weight_dtypes(model_dir, checkpoint_config, config.dtype, self.mesh, True)[2]))
        # The tokenizer loads (importing transformers: ~0.9 s of a warm start) while the weights do.
        tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxengine-tokenizer")
        tokenizer_loaded = tokenizer.submit(load_tokenizer, config.tokenizer or model_dir, config.trust_remote_code)
        tokenizer.shutdown(wait=False)
        model, self.model_config = load_model(model_dir, config.dtype, progress=progress, mesh=self.mesh,
                                              hf_overrides=config.hf_overrides,
                                              attention_backend=self._attention_backend(config, tp),
                                              unstacked=unrolled, native_matmul=True, executables=executables,
                                              long_rope=self._long_rope(config, checkpoint_config))
        model.kv_dtype = self._kv_cache_dtype(config, model)
        model.state_dtype = jnp.bfloat16 if config.mamba_ssm_cache_dtype == "bfloat16" else jnp.float32
        if warning := scan_warning(config.layer_loop, jax.default_backend(), model.param_dtype, model.native_matmul):
            logger.warning(warning)
        self.tokenizer = tokenizer_loaded.result()
        self.classifier = self._classifier_head(model_dir, hf_config) if architecture.classifier else None
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids(model_dir)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.default_sampling = generation_defaults(model_dir, config.generation_config,
                                                    config.override_generation_config)
        if self.default_sampling:
            logger.warning("Requests that leave them unset sample with the model's generation config: %s "
                           "(--generation-config vllm turns this off)", self.default_sampling)
        num_blocks = self._num_kv_blocks(model)
        # A linear-attention model's state covers its whole sequence: a prefix's KV blocks alone cannot resume it
        # (as vLLM, no prefix caching for such models; n > 1 samples compute their prompts apart)
        self.recurrent = bool(self.model_config.linear_layers)
        if self.recurrent and config.enable_prefix_caching:
            logger.info("prefix caching is off: %s's linear-attention layers keep a state per sequence that cached KV "
                        "blocks cannot restore", self.model_config.architecture)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching and not self.recurrent)
        self.speculation = self._speculation(config)
        self.reasoning = self._reasoning(config)
        self.lora_slots = self._lora_slots(config, checkpoint_config)
        self.loras: dict[int, LoRAAdapter] = {}  # adapters read and kept (max_cpu_loras), by lora_int_id, LRU first
        self.spec_stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}  # vLLM's spec_decode counters
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   policy=config.scheduling_policy, max_model_len=self.max_model_len,
                                   speculation=self.speculation, lora_slots=self.lora_slots)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                                  max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens, mesh=self.mesh,
                                  min_token_bucket=config.min_token_bucket, max_logprobs=config.max_logprobs,
                                  channel=CommandChannel() if jax.process_count() > 1 and is_leader() else None,
                                  executable_cache=executables,
                                  lora=(config.max_loras, config.max_lora_rank) if config.enable_lora else None)
        kv_dtype = jnp.dtype(model.kv_dtype)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %s); at most %.1f requests of max_model_len=%d at "
                    "once", num_blocks, config.block_size, num_blocks * config.block_size, kv_dtype.name,
                    num_blocks * config.block_size / self.max_model_len, self.max_model_len)
        if (kv_dtype in FP8_DTYPES) != self.model_config.quant_kv_scales:
            logger.info("float8 KV cache with scales of 1 (the checkpoint has none: calibrated ones keep more of K/V's "
                        "precision where their values are far from 1)" if kv_dtype in FP8_DTYPES else
                        "the checkpoint's KV cache scales are unused: they apply to a float8 cache (kv_cache_dtype "
                        "fp8)")
        if config.warmup:
            self.runner.warmup(progress)
        self.requests: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self._abort_lock = threading.Lock()
        self._rng = np.random.default_rng(config.seed)
        self.last_step_size: tuple[int, int] | None = None  # (requests, tokens) of the latest step
        # Async scheduling (see step) in one process: across processes a launched step's collectives would run
        # beside the next command's broadcast, which gloo on CPU cannot order (ModelRunner.follow).
        self.async_scheduling = config.async_scheduling and jax.process_count() == 1
        self._in_flight: collections.deque = collections.deque()  # launched steps not finished yet, oldest first
        self._landed: list[RequestOutput] = []  # outputs of steps finished early (see launch)

    def _runner_type(self, config: EngineConfig, architecture) -> str:
        """"generate" or "pooling" (vLLM's --runner): auto is pooling for a base model's or a sequence classifier's
        checkpoint (neither has a language-model head) or with convert='embed'."""
        if config.runner == "generate" and architecture.embedding_only:
            raise ValueError(f"runner='generate': the checkpoint ({config.model}) has no language-model head (an "
                             f"embedding model or a classifier); serve it with runner 'pooling' or 'auto'")
        if config.runner == "auto":
            return "pooling" if architecture.embedding_only or config.convert == "embed" else "generate"
        return config.runner

    def _pooler(self, config: EngineConfig, model_dir: Path, hf: dict, hidden_size: int) -> PoolerConfig | None:
        """A pooling engine's pooler (None for generation), and what dimensions its requests may ask for: any
        up to the hidden size on a Matryoshka model (`is_matryoshka`, or those of `matryoshka_dimensions`, as
        vLLM reads the config), none elsewhere."""
        listed = hf.get("matryoshka_dimensions")
        self.matryoshka = bool(listed) or bool(hf.get("is_matryoshka"))
        self.matryoshka_dimensions = [int(d) for d in listed] if listed else None
        self.embedding_size = hidden_size
        if self.runner_type != "pooling":
            if config.pooler_config is not None:
                raise ValueError("pooler_config applies to runner 'pooling' (embeddings), not to a generating engine")
            return None
        pooler = PoolerConfig.of(model_dir, config.pooler_config)
        if pooler.dimensions is not None:
            self._check_dimensions(pooler.dimensions, "pooler_config: dimensions")
        return pooler

    def _speculation(self, config: EngineConfig) -> SpeculativeConfig | None:
        if config.speculative_config is None:
            return None
        if self.runner_type == "pooling":
            raise ValueError("speculative_config applies to generation; a pooling model (runner 'pooling') decodes "
                             "nothing")
        if self.recurrent:
            raise ValueError(f"speculative_config: speculative decoding on {self.model_config.architecture} "
                             f"(linear-attention layers, whose state cannot take back rejected guesses) is not "
                             f"supported yet")
        return SpeculativeConfig.of(config.speculative_config)

    def _lora_slots(self, config: EngineConfig, checkpoint_config) -> LoRASlots | None:
        if not config.enable_lora:
            return None
        if self.runner_type == "pooling":
            raise ValueError("enable_lora: LoRA adapters on a pooling model (runner 'pooling') are not supported yet")
        if jax.process_count() > 1:
            raise ValueError("enable_lora: LoRA adapters on a multi-process engine are not supported yet")
        lora.check_supported(checkpoint_config)
        self._checkpoint_kv_heads = checkpoint_config.num_kv_heads
        return LoRASlots(config.max_loras, lambda slot, adapter: self.runner.load_lora(slot, adapter))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads an adapter ahead of its requests, as vLLM's `add_lora` (a ValueError where it does not fit)."""
        self._adapter(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter no request uses (False where one does, or none has the id), as vLLM's."""
        if lora_int_id not in self.loras or lora_int_id in self._loras_in_use():
            return False
        del self.loras[lora_int_id]
        self.lora_slots.forget(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras)

    def _loras_in_use(self) -> set[int]:
        """The lora_int_ids of the adapters unfinished requests run with."""
        return {s.lora.request.lora_int_id for r in self.requests.values() for s in r.seqs if s.lora is not None}

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a request names, read on first use (a ValueError where it does not fit the model)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.lora_slots is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        known = self.loras.pop(request.lora_int_id, None)
        if known is not None:
            self.loras[request.lora_int_id] = known  # the most recently used
            if (known.request.lora_name, known.request.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} already names adapter "
                                 f"{known.request.lora_name!r} ({known.request.lora_path})")
            return known
        cfg = self.model_config
        order = rotary_layout(cfg.head_dim, cfg.rope.rotary_dim(cfg.head_dim), cfg.rope_interleaved)
        adapter = lora.load_adapter(request, cfg, self.config.max_lora_rank, order,
                                    cfg.num_kv_heads // self._checkpoint_kv_heads)
        self._evict_loras(keep=request.lora_int_id)
        self.loras[request.lora_int_id] = adapter
        return adapter

    def _evict_loras(self, keep: int) -> None:
        """Room for one more adapter within max_cpu_loras (default max_loras): the least recently used ones no
        request holds leave host memory (a later request reads its adapter again; a device slot keeps serving
        the one it holds)."""
        limit = self.config.max_cpu_loras or self.config.max_loras
        in_use = self._loras_in_use() | {keep}
        idle = [i for i in self.loras if i not in in_use]
        for lora_int_id in idle[:max(0, len(self.loras) + 1 - limit)]:
            del self.loras[lora_int_id]

    def _reasoning(self, config: EngineConfig) -> ReasoningParser | None:
        """The --reasoning-parser; for GPT-OSS (its harmony tokens in the vocabulary) openai_gptoss where none is
        named, as vLLM sets it for that model."""
        name = config.reasoning_parser
        if (name is None and self.model_config.architecture == "GptOssForCausalLM" and self.runner_type != "pooling"
                and not harmony.missing_tokens(self.tokenizer)):
            logger.info("reasoning parser: openai_gptoss (GPT-OSS's harmony messages), as vLLM sets it for GPT-OSS")
            name = "openai_gptoss"
        if name is None:
            return None
        if self.runner_type == "pooling":
            raise ValueError("reasoning_parser applies to generation; a pooling model (runner 'pooling') generates "
                             "no text")
        return ReasoningParser.of(name, self.tokenizer)

    @staticmethod
    def _speculates(params: SamplingParams) -> bool:
        """Whether a sequence's tokens may be guessed ahead: nothing that a guess would have to see per token
        (penalties, biases, bans, a grammar, min_tokens). Logprobs come from each guess's own row. Greedy or
        sampled: a guess is a point mass, so speculative sampling's rule (take it with the probability the model
        gives it, else draw from the rest) is drawing the token as usual and taking the guess where they agree;
        each row draws with the key of the token it samples, so a seed gives the tokens it gives without guesses."""
        return (params.prompt_logprobs is None and not params.needs_slot_state
                and not params.logit_bias and not params.bad_words and params.min_tokens == 0)

    def _classifier_head(self, model_dir: Path, hf: dict) -> ClassifierHead:
        from jaxengine.models import orbax_io

        if orbax_io.is_orbax_checkpoint(model_dir):
            raise ValueError("a sequence classifier loads from its Hugging Face checkpoint (its score head is not in a "
                             "converted Orbax checkpoint)")
        return ClassifierHead.load(model_dir, hf, self.tokenizer)

    def _check_dimensions(self, dimensions: int, field: str = "dimensions") -> None:
        if self.pooling_task == "classify":
            raise ValueError(f"{field}: dimensions apply to embeddings, not to a classifier's outputs")
        if not self.matryoshka:
            raise ValueError(f"{field}: the model does not support Matryoshka embeddings, so dimensions must be unset "
                             f"(got {dimensions})")
        if not 1 <= dimensions <= self.embedding_size or (
                self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions):
            allowed = self.matryoshka_dimensions or f"1 to {self.embedding_size}"
            raise ValueError(f"{field}={dimensions} is not one the model supports: {allowed}")

    @staticmethod
    def _attention_backend(config: EngineConfig, tp: int) -> str:
        """The native CPU body is one custom call that XLA cannot split over a mesh: sharded CPU engines use
        the reference body, which XLA partitions by heads like the rest of the model."""
        if tp == 1 or jax.default_backend() != "cpu" or config.attention_backend not in ("auto", "native"):
            return config.attention_backend
        if config.attention_backend == "native":
            raise ValueError("attention_backend 'native' runs on one CPU device; use 'auto' or 'reference' with "
                             f"tensor_parallel_size={tp}")
        return "reference"

    @staticmethod
    def _kv_cache_dtype(config: EngineConfig, model):
        """The KV cache's dtype. `auto`: the compute dtype, except on CPU where the native attention runs and
        the weights are bfloat16 (a bfloat16 checkpoint with the native matmul, or `dtype bfloat16`): a bfloat16
        cache there, as vLLM's CPU build keeps a bfloat16 model's cache, which halves the bytes each decode step
        reads (the native kernels round K/V to bfloat16 on write and compute in float32). `fp8` (`fp8_e4m3`) and
        `fp8_e5m2`, as vLLM's: float8 e4m3fn or e5m2 pages, K/V divided by their scales on write (the checkpoint's,
        else 1; saturated at the format's largest value) and widened exactly on read. An explicit bfloat16, float16
        or float8 cache on CPU needs the native body (bfloat16 or float8) or is refused: XLA:CPU's scatter
        converts a whole reduced-precision cache around every write."""
        setting = config.kv_cache_dtype
        dtype = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}.get(setting)
        if jax.default_backend() != "cpu":
            return model.dtype if setting == "auto" else jnp.dtype(dtype or setting)
        native = model.attention_body(config.block_size) == "cpu"
        if setting == "auto":
            return jnp.bfloat16 if native and model.param_dtype == jnp.bfloat16 else model.dtype
        if setting != "float32" and not (native and (setting == "bfloat16" or dtype is not None)):
            raise ValueError(f"kv_cache_dtype {setting!r} on CPU needs the native attention (bfloat16 and fp8 only; "
                             f"attention_backend auto or native, one device); use float32 or auto")
        return jnp.dtype(dtype or setting)

    @staticmethod
    def _long_rope(config: EngineConfig, model_config) -> bool:
        """Whether a LongRoPE model (Phi-3, Phi-4-mini) runs its long factors, at every position: where max_model_len
        (default: max_position_embeddings) exceeds its original length, as vLLM decides (transformers switches per
        sequence at that length, which a paged cache written with the other factors could not follow)."""
        rope = model_config.rope
        if rope.rope_type != "longrope":
            return False
        length = config.max_model_len or model_config.max_position_embeddings
        original = rope.param("original_max_position_embeddings")
        if length > original:
            logger.info("LongRoPE: max_model_len %d exceeds original_max_position_embeddings=%d: the long factors "
                        "apply at every position (max_model_len <= %d keeps the short ones)", length, original,
                        original)
        return length > original

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        return self.config.max_model_len

    def _eos_token_ids(self, model_dir: Path) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        eos = read_generation_config(model_dir).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _num_kv_blocks(self, model) -> int:
        cfg = self.config
        # The pool is sharded by KV head over the 'model' axis: size it per device (multi-head latent attention's one
        # row per token is replicated: whole on each).
        shape = model.kv_cache_shape(1, cfg.block_size)
        per_block = 0
        for one in shape if isinstance(shape[0], tuple) else (shape,):  # Gemma 4: a cache per kind of layer
            size = int(np.prod(one)) * np.dtype(model.kv_dtype).itemsize
            per_block += size // cfg.tensor_parallel_size if one[3] % cfg.tensor_parallel_size == 0 else size
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = int(free * cfg.kv_cache_memory_fraction)
        else:
            budget = int(cfg.kv_cache_gib * (1 << 30))
        state = model.state_shapes(cfg.max_num_seqs + 1)  # a linear-attention model's: from the same budget
        if state is not None:
            state_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in state)
            logger.info("linear-attention state: %.1f MiB for %d sequences (max_num_seqs)", state_bytes / (1 << 20),
                        cfg.max_num_seqs)
            if state_bytes >= budget:
                raise ValueError(f"the linear-attention state of max_num_seqs={cfg.max_num_seqs} sequences "
                                 f"({state_bytes / (1 << 30):.2f} GiB) leaves nothing of the KV cache budget "
                                 f"({budget / (1 << 30):.2f} GiB); lower max_num_seqs or raise kv_cache_gib / "
                                 f"kv_cache_memory_fraction")
            budget -= state_bytes
        if not per_block:  # no attention layer (Mamba2; a Nemotron-H of mixers only): blocks only count tokens
            return cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        num_blocks = budget // per_block
        if num_blocks * cfg.block_size < self.max_model_len:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {cfg.block_size} tokens) cannot hold one "
                             f"sequence of max_model_len={self.max_model_len}; raise kv_cache_gib / "
                             f"kv_cache_memory_fraction or lower max_model_len")
        return num_blocks

    # --- requests -------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A string, a list of token ids, or a dict with `prompt` or `prompt_token_ids`."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def truncate_prompt(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> list[int]:
        """The prompt as `params.truncate_prompt_tokens` keeps it: its last k tokens (-1: max_model_len - 1, the
        longest prompt that leaves room for a token; max_model_len for a pooling request, which generates none).
        A k above max_model_len is refused, as in vLLM."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={k} is greater than max_model_len={self.max_model_len}")
        if k == -1:
            k = self.max_model_len - (0 if isinstance(params, PoolingParams) else 1)
        return prompt_token_ids[-k:] if len(prompt_token_ids) > k else prompt_token_ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        vocab = self.model_config.vocab_size
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must have at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]} outside the vocabulary [0, {vocab})")
        pooling = isinstance(params, PoolingParams)
        if pooling != (self.runner_type == "pooling"):
            raise ValueError(
                "pooling_params: this engine generates text (runner 'generate'); embeddings need an engine with "
                "runner 'pooling'" if pooling else
                "sampling_params: this engine runs a pooling model (runner 'pooling'), which generates no text: use "
                "LLM.embed, LLM.classify or LLM.score")
        if pooling:
            if params.dimensions is not None:
                self._check_dimensions(params.dimensions)
            if n > self.max_model_len:
                raise ValueError(f"prompt has {n} tokens; max_model_len={self.max_model_len}")
            self._check_fits(n, 0)
            return
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(params, field)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{field}={value} exceeds max_logprobs={self.config.max_logprobs}")
        for field in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(params, field) or [] if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{field} contains {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:
            if params.allowed_token_ids is not None:
                raise ValueError("allowed_token_ids cannot be combined with structured_outputs (the grammar sets the "
                                 "allowed tokens)")
            self.grammars.grammar(params.structured_outputs)  # a ValueError naming the field if it does not compile
        if params.logit_bias and len(params.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are supported")
        banned = len(self.eos_token_ids | set(params.stop_token_ids)) if params.min_tokens else 0
        if banned + 2 * len(params.bad_words) > MAX_BANNED:  # each word is banned in two spellings
            raise ValueError(f"min_tokens' stop tokens ({banned}) plus bad_words ({len(params.bad_words)}) exceed "
                             f"the {MAX_BANNED} tokens that can be banned at once")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len={self.max_model_len} leaves no room to generate "
                             f"(the prompt must be shorter than max_model_len)")
        # As vLLM: a max_tokens past the context is not refused; the sequence stops at max_model_len ("length").
        self._check_fits(n, params.max_tokens or self.max_model_len)

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        blocks = -(-min(prompt_len + max_tokens, self.max_model_len) // self.config.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"the request needs {blocks} KV blocks but the pool has "
                             f"{self.block_manager.num_blocks}; lower max_tokens or enlarge the KV cache")

    def add_request(self, request_id: str, prompt, params: SamplingParams | PoolingParams | None = None, *,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """`params`: SamplingParams on a generating engine, PoolingParams on a pooling one (default: either's
        defaults). `lora_request`: the LoRA adapter the request runs with (an engine with enable_lora)."""
        params = params or (PoolingParams() if self.runner_type == "pooling" else SamplingParams())
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids = self.truncate_prompt(token_ids, params)  # RequestOutput.prompt keeps the text given, as vLLM
        self.validate(token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        adapter = self._adapter(lora_request) if lora_request is not None else None
        if adapter is not None:  # its K/V are the adapter's: no prefix shared with the base model or other adapters
            cache_salt = f"{cache_salt or ''}\x00lora:{adapter.request.lora_int_id}"
        pooling = None
        if isinstance(params, PoolingParams):  # its prompt runs as a one-token request whose token is dropped
            pooling, params = params, _POOLING_STEP
        bad_words = self._tokenize_bad_words(params.bad_words)
        spec = params.structured_outputs
        grammar = self.grammars.grammar(spec) if spec is not None else None
        # With a reasoning parser, a structured output starts after the reasoning (unless the prompt closed it)
        after_reasoning = (grammar is not None and self.reasoning is not None
                           and not self.reasoning.ended_in_prompt(token_ids))
        min_tokens_banned = sorted(self.eos_token_ids | set(params.stop_token_ids))
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(1 << 62))
        seqs = []
        for i in range(params.n):
            seed = int(np.random.SeedSequence([base_seed & ((1 << 63) - 1), i]).generate_state(1)[0])
            seq = Sequence(request_id, i, token_ids, params, seed, priority, arrival_time, cache_salt)
            seq.fork_parent = seqs[0] if i and not self.recurrent else None
            seq.min_tokens_banned = min_tokens_banned
            seq.bad_words = bad_words
            matcher = self.grammars.matcher(grammar) if grammar is not None else None
            seq.grammar, seq.grammar_after_reasoning = (None, matcher) if after_reasoning else (matcher, None)
            seq.pooling = (PoolState(self.pooler, pooling, len(token_ids), self.classifier) if pooling is not None
                           else None)
            seq.speculative = self.speculation is not None and self._speculates(params)
            seq.lora = adapter
            seqs.append(seq)
        detoks = [IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                         params.spaces_between_special_tokens) for _ in seqs]
        self.requests[request_id] = _Request(request_id, text, token_ids, params, seqs, detoks, [(0, 0)] * len(seqs),
                                             metrics=RequestMetrics(seqs[0].arrival_time), pooling=pooling)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it would appear at the start of the text and after a space, as vLLM does."""
        out = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Thread-safe; the request's blocks are freed at the start of the next step."""
        with self._abort_lock:
            self._aborts.update([request_ids] if isinstance(request_ids, str) else request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborts) or bool(self._in_flight)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache; False (and nothing changed) while requests are unfinished."""
        return not self.has_unfinished_requests() and self.block_manager.reset_prefix_cache()

    # --- the step --------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launches a step and returns the outputs of the steps that finished. With async scheduling (the
        default) that is the step before: each call launches step N + 1, whose decode tokens the device takes
        from step N's samples, and then waits for step N and reads it back, so the host's work for a step
        (scheduling, packing, detokenizing, stop checks) runs while the device computes the next one."""
        self.launch()
        return self.land()

    def launch(self) -> None:
        """Launches the next step (`step`'s first half; a data-parallel engine launches on every replica
        before it lands any). A step waits for the one in flight when it cannot be scheduled without that
        step's tokens on the host: a sequence with bad_words needs its last tokens to know what to ban, one with
        structured outputs its grammar's state after them to know what it allows."""
        if self._in_flight and not self._can_schedule_ahead(self._in_flight[-1]):
            self._landed += self.finish_step(self._in_flight.popleft())
        self._in_flight.append(self.start_step())

    def land(self) -> list[RequestOutput]:
        """Finishes the launched steps but (with async scheduling) the newest, and returns their outputs."""
        newest_has_work = self._in_flight and self._in_flight[-1][1]
        keep = 1 if self.async_scheduling and newest_has_work else 0
        outputs, self._landed = self._landed, []
        while len(self._in_flight) > keep:
            outputs += self.finish_step(self._in_flight.popleft())
        return outputs

    def _can_schedule_ahead(self, started) -> bool:
        """Not past a step with guesses (how many hold decides the next tokens), nor past a sequence that needs its
        last tokens on the host: to ban bad words, to advance its grammar, or to guess its next tokens (speculative
        decoding, while the steps have room for guesses: a batch that fills its sampling rows, or runs past
        disable_by_batch_size, gets none and keeps scheduling ahead)."""
        _, chunks, _ = started
        if any(c.drafts for c in chunks):
            return False
        guesses = self.speculation is not None and self.scheduler.may_add_drafts(len(chunks))
        return not any(c.completes_sequence and (c.seq.bad_words or c.seq.grammar is not None
                                                 or c.seq.grammar_after_reasoning is not None
                                                 or (guesses and c.seq.speculative)) for c in chunks)

    def start_step(self):
        """Schedules and launches a step on the device without waiting (see `finish_step`). The scheduled
        tokens count as computed from here on, and each completed sequence as one token longer (pending until
        `finish_step` reads it back)."""
        touched = self._process_aborts()
        chunks = self.scheduler.schedule()
        self.last_step_size = (len(chunks), sum(c.num_tokens for c in chunks)) if chunks else None
        launched = self.runner.dispatch(chunks) if chunks else None
        for row, chunk in enumerate(chunks):
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if chunk.completes_sequence:
                chunk.seq.num_pending_tokens += 1
                chunk.seq.pending_source = (self.runner.num_steps - 1, row)
        return touched, chunks, launched

    def finish_step(self, started) -> list[RequestOutput]:
        touched, chunks, launched = started
        if chunks:
            pooled = any(c.seq.pooling is not None for c in chunks)
            rows = len(chunks) + sum(len(c.drafts) for c in chunks)  # a sampling row per chunk, then per guess
            tokens, logprobs, prompt_logprobs, hidden = self.runner.collect(launched, rows, hidden=pooled)
            start = 0  # the chunk's first flat position
            draft_row = len(chunks)
            for row, (chunk, token) in enumerate(zip(chunks, tokens)):
                seq, offset = chunk.seq, start
                start += chunk.num_tokens
                completes = chunk.completes_sequence
                if completes:
                    seq.num_pending_tokens -= 1
                if seq.is_finished:  # stopped or aborted while this step ran: its row is dropped
                    draft_row += len(chunk.drafts)
                    continue
                if prompt_logprobs is not None and seq.prompt_logprobs is not None:
                    self._record_prompt_logprobs(seq, chunk, offset, prompt_logprobs)
                if seq.pooling is not None:
                    seq.pooling.add(hidden[offset:offset + chunk.num_tokens], chunk.start)
                self.block_manager.cache_full_blocks(seq)
                if completes and chunk.drafts:
                    k = len(chunk.drafts)
                    chosen = [int(t) for t in (token, *tokens[draft_row:draft_row + k])]
                    rows = [row, *range(draft_row, draft_row + k)]  # the sampling row each choice came from
                    self._append_verified(seq, chunk.drafts, chosen, rows, logprobs)
                    draft_row += k
                elif completes:
                    self._take_token(seq, int(token), row, logprobs)
                touched.setdefault(seq.request_id, None)
        outputs = []
        for rid in touched:
            request = self.requests.get(rid)
            if request is None:
                continue
            finished = request.finished
            if (out := self._output(request, finished)) is not None:
                outputs.append(out)
            if finished:
                del self.requests[rid]
        return outputs

    def _process_aborts(self) -> dict[str, None]:
        with self._abort_lock:
            aborts, self._aborts = self._aborts, set()
        touched = {}
        for rid in aborts:
            request = self.requests.get(rid)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            touched[rid] = None
        return touched

    def _logprob_entry(self, n: int, token: int, row, decode: bool = True) -> dict:
        """Top-n plus the given token, as vLLM returns them (`decode`: with each token's text)."""
        top_ids, top_lps, token_lp, token_rank = row

        def text(t: int) -> str | None:
            return self.tokenizer.decode([t]) if decode else None

        entry = {int(t): Logprob(float(lp), i + 1, text(int(t)))
                 for i, (t, lp) in enumerate(zip(top_ids[:n], top_lps[:n]))}
        entry[token] = Logprob(float(token_lp), int(token_rank), text(token))
        return entry

    def _record_logprobs(self, seq: Sequence, token: int, row) -> None:
        entry = self._logprob_entry(seq.params.logprobs, token, row, seq.params.detokenize)
        seq.logprobs.append(entry)
        seq.cumulative_logprob += entry[token].logprob

    def _record_prompt_logprobs(self, seq: Sequence, chunk, start: int, flat) -> None:
        """The chunk's position p predicts prompt token p + 1."""
        first = chunk.start
        for p in range(first, min(first + chunk.num_tokens, len(seq.prompt_token_ids) - 1)):
            row = [x[start + p - first] for x in flat]
            seq.prompt_logprobs[p + 1] = self._logprob_entry(seq.params.prompt_logprobs, seq.prompt_token_ids[p + 1],
                                                              row, seq.params.detokenize)

    def _append_verified(self, seq: Sequence, drafts: list[int], chosen: list[int], rows: list[int],
                         logprobs) -> None:
        """A speculative chunk's tokens: `chosen[i]`, the model's choice (greedy or drawn) after the last token and
        the first i guesses (sampling row `rows[i]`, with its logprobs where the sequence asks for them), is the next
        token; guesses are taken while they match it, then its choice where one does not (or after the last), as
        decoding one token at a time would have (stops included). The rejected guesses' K/V positions are computed
        again from the next step on."""
        accepted = 0
        while accepted < len(drafts) and chosen[accepted] == drafts[accepted]:
            accepted += 1
        seq.num_computed_tokens -= len(drafts) - accepted
        self.spec_stats["drafts"] += 1
        self.spec_stats["draft_tokens"] += len(drafts)
        self.spec_stats["accepted_tokens"] += accepted
        for token, row in zip(chosen[:accepted + 1], rows):
            self._take_token(seq, token, row, logprobs)
            if seq.is_finished:
                return

    def _take_token(self, seq: Sequence, token: int, row: int, logprobs) -> None:
        """A sampled token (from sampling row `row`, whose logprobs the sequence may ask for) joins the output."""
        if seq.logprobs is not None:
            self._record_logprobs(seq, token, [x[row] for x in logprobs])
        self._append_token(seq, token)

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        elif seq.grammar_after_reasoning is not None and self.reasoning.ends_reasoning(seq.output_token_ids):
            seq.grammar, seq.grammar_after_reasoning = seq.grammar_after_reasoning, None  # from the next token on
        detok = self.requests[seq.request_id].detokenizers[seq.index]
        finish, stop_reason = self._stop_condition(seq, token)
        # As vLLM's: the token that stops a sequence (EOS, a stop_token_id, a grammar's EOS) adds no text unless
        # include_stop_str_in_output (it stays in token_ids).
        stop_token = finish == "stop" or (seq.grammar is not None and token in self.eos_token_ids)
        shown = seq.params.detokenize and (not stop_token or seq.params.include_stop_str_in_output)
        new_text = detok.add(token) if shown else ""
        may_stop = len(seq.output_token_ids) >= seq.params.min_tokens
        if may_stop and seq.params.stop and new_text and self._match_stop_string(seq, detok, len(new_text)):
            self.scheduler.finish(seq)  # the text is already cut at the stop string
            return
        seq.finish_reason, seq.stop_reason = finish, stop_reason
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_finished:
            seq.finish_reason = "stop"  # the grammar ended (its EOS taken even under ignore_eos)
        if seq.finish_reason is not None:
            if seq.params.detokenize:
                detok.flush()
            self.scheduler.finish(seq)

    def _stop_condition(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if seq.reaches_length_limit(self.max_model_len):
            return "length", None
        return None, None

    def _match_stop_string(self, seq: Sequence, detok: IncrementalDetokenizer, num_new_chars: int) -> bool:
        """Stops at the first stop string that the new text completes (it may span tokens) and cuts the text
        there, keeping the stop string only with `include_stop_str_in_output`."""
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(detok.text) - num_new_chars - longest + 1)
        found = [(i, s) for s in seq.params.stop if (i := detok.text.find(s, search_from)) >= 0]
        if not found:
            return False
        index, stop = min(found)
        detok.text = detok.text[: index + len(stop) if seq.params.include_stop_str_in_output else index]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _output(self, request: _Request, finished: bool) -> RequestOutput | PoolingRequestOutput | None:
        self._update_metrics(request, finished)
        if request.pooling is not None:
            if not finished:
                return None
            seq = request.seqs[0]  # an aborted request has no embedding
            data = seq.pooling.data if seq.finish_reason != "abort" else None
            return PoolingRequestOutput(request.request_id, PoolingOutput(data), request.prompt_token_ids, True,
                                        max(seq.num_cached_tokens, 0), dataclasses.replace(request.metrics))
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, (seq, detok) in enumerate(zip(request.seqs, request.detokenizers)):
            tokens, text, logprobs = seq.output_token_ids, detok.text, seq.logprobs
            if seq.params.stop and not seq.is_finished:  # hold back what may be the start of a stop string
                text = text[: max(0, len(text) - max(len(s) for s in seq.params.stop) + 1)]
            if kind == RequestOutputKind.DELTA:
                done_tokens, done_chars = request.emitted[i]
                request.emitted[i] = (len(tokens), max(len(text), done_chars))
                tokens, text = tokens[done_tokens:], text[done_chars:]
                logprobs = logprobs[done_tokens:] if logprobs is not None else None
            completions.append(CompletionOutput(
                i, text, list(tokens), cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None else None, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason))
        cached = max(request.seqs[0].num_cached_tokens, 0)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, num_cached_tokens=cached,
                             prompt_logprobs=self._prompt_logprobs_output(request),
                             metrics=dataclasses.replace(request.metrics))

    @staticmethod
    def _update_metrics(request: _Request, finished: bool) -> None:
        m = request.metrics
        if m.first_token_time is not None and not finished:  # nothing to stamp (most steps)
            return
        now = time.monotonic()
        if m.first_scheduled_time is None:
            scheduled = [s.first_scheduled_time for s in request.seqs if s.first_scheduled_time is not None]
            if scheduled:
                m.first_scheduled_time = min(scheduled)
        if m.first_token_time is None and any(s.output_token_ids for s in request.seqs):
            m.first_token_time = now
        if m.finished_time is None and finished:
            m.finished_time = now

    @staticmethod
    def _prompt_logprobs_output(request: _Request) -> list | None:
        """Once the prompt is computed; in delta mode only in the first output that has them."""
        seq = request.seqs[0]
        if seq.prompt_logprobs is None or not seq.output_token_ids:
            return None
        if request.params.output_kind == RequestOutputKind.DELTA:
            if request.prompt_logprobs_sent:
                return None
            request.prompt_logprobs_sent = True
        return list(seq.prompt_logprobs)


def _demo_model_dir() -> Path:
    from jaxengine.demo import ensure_demo_model

    return ensure_demo_model()
