"""Engine arguments: one dataclass, loadable from YAML (`configs/`), overridden by CLI flags."""

import dataclasses
import os
from pathlib import Path

import yaml

from jaxengine.reasoning import REASONING_PARSERS
from jaxengine.validation import check_field_types, field_error

SCHEDULING_POLICIES = ("fcfs", "priority")
LAYER_LOOPS = ("auto", "scan", "unrolled")
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "native")  # see jaxengine/layers/attention.py
DTYPES = ("auto", "float32", "bfloat16", "float16")  # see jaxengine/models/loader.py: resolve_dtypes
# vLLM's names (fp8 is fp8_e4m3: float8 e4m3fn); see LLMEngine._kv_cache_dtype
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
RUNNERS = ("auto", "generate", "pooling")  # see LLMEngine._runner_type
# vLLM's names of the quantization methods served (models/quantization.py)
QUANTIZATION_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "mxfp4")
CONVERTS = ("auto", "embed")  # vLLM's --convert: what a pooling runner makes of the model (embeddings only here)


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None  # local HF directory or hub id; None = the built-in demo model
    tokenizer: str | None = None  # defaults to the model directory
    trust_remote_code: bool = False  # a tokenizer's own code (auto_map) may run, as vLLM's; the model's is ours
    revision: str | None = None  # a hub id's branch, tag or commit (default: main), as vLLM's --revision
    download_dir: str | None = None  # where a hub id's files go (default: the Hugging Face cache)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # As vLLM's --quantization: None takes the checkpoint's (config.json's quantization_config); a method named
    # must be the checkpoint's. Served: compressed-tensors W8A8 int8, W4A16 and FP8, GPTQ and AWQ 4-bit, FP8
    # (models/quantization.py).
    quantization: str | None = None
    # auto | float32 | bfloat16 | float16 | fp8 (= fp8_e4m3) | fp8_e5m2; auto: see LLMEngine._kv_cache_dtype
    kv_cache_dtype: str = "auto"
    # As vLLM's --mamba-ssm-cache-dtype: the recurrent state of models with state layers (Mamba, Gated DeltaNet, ...),
    # auto | float32 | bfloat16; auto: float32 (vLLM's auto is the model's dtype unless the model overrides it, as
    # it does for Nemotron-H); bfloat16 halves the state's memory and a decode step's traffic through it, rounding it
    # at each step (computed in float32 either way)
    mamba_ssm_cache_dtype: str = "auto"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    min_token_bucket: int = 1  # smallest token bucket: what a lone decoding request pays for
    kv_cache_memory_fraction: float = 0.9  # of free accelerator memory after the weights
    kv_cache_gib: float = 1.0  # KV pool size per device on CPU, where free memory is not measurable
    num_kv_blocks: int | None = None  # explicit pool size; overrides both of the above
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # launch step N + 1 before reading step N back (see LLMEngine.step)
    scheduling_policy: str = "fcfs"
    seed: int = 0
    attention_backend: str = "auto"  # auto | reference | pallas | native (see jaxengine/layers/attention.py)
    layer_loop: str = "auto"  # auto | scan | unrolled; auto = scan, but unrolled on CPU without the native matmul
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_logprobs: int = 20  # the most `logprobs` a request may ask for
    # Where compiled programs are kept across starts (its executables/; each process of a multi-process engine
    # keeps its own). None or "" turns that off; by default $JAXENGINE_COMPILATION_CACHE or ~/.cache/jaxengine/xla
    compilation_cache_dir: str | None = os.environ.get("JAXENGINE_COMPILATION_CACHE", "~/.cache/jaxengine/xla")
    # Where start_profile()/stop_profile() write jax.profiler traces (jaxengine/profiler.py); None: profiling off
    # (and the server has no /start_profile, /stop_profile routes), as vLLM without --profiler-config.
    profiler_dir: str | None = None
    # The stored programs' size cap: past it the least recently used go (0: no cap). Each process counts the
    # directory's entries, another process's on a shared disk too.
    compilation_cache_max_gib: float = 4.0
    warmup: bool = True
    # Default sampling parameters for requests that leave them unset, as vLLM's --generation-config: "auto" takes
    # them from the model's generation_config.json (temperature, top_p, top_k, min_p, the repetition, presence and
    # frequency penalties, max_new_tokens), "vllm" uses none (the OpenAI defaults), a directory takes its file.
    generation_config: str = "auto"
    override_generation_config: dict | None = None  # merged over the above, e.g. {"temperature": 0.5}
    # As vLLM's --runner: "generate" (text), "pooling" (embeddings: LLM.embed, /v1/embeddings); "auto" picks pooling
    # for a base model's checkpoint (Qwen2Model, ...) and generate for the rest.
    runner: str = "auto"
    convert: str = "auto"  # vLLM's --convert; a pooling runner makes embeddings ("embed"), nothing else yet
    # The pooler's settings over the model's (jaxengine.pooling_params.PoolerConfig): {"pooling_type": "MEAN",
    # "use_activation": false, "dimensions": 256}
    pooler_config: dict | None = None
    # Speculative decoding, as vLLM's: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 2} guesses greedy sequences' next tokens from their context (jaxengine.engine.speculative)
    speculative_config: dict | None = None
    # Over the model's config.json keys, as vLLM's --hf-overrides: {"max_position_embeddings": 4096}, or a
    # causal LM served as a classifier from two of its tokens (Qwen3-Reranker: see jaxengine/engine/pooler.py)
    hf_overrides: dict | None = None
    # As vLLM's --reasoning-parser (jaxengine.reasoning: deepseek_r1, deepseek_v3, qwen3, glm45, gemma4,
    # openai_gptoss): a structured output starts after the model's reasoning; the server splits chat answers into
    # `reasoning` and `content`.
    reasoning_parser: str | None = None
    # LoRA adapters, as vLLM's: requests name one (LoRARequest; the server's --lora-modules), up to max_loras at
    # once on the device, of rank up to max_lora_rank (jaxengine/lora.py)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in host memory (least recently used go; None: max_loras)

    def __post_init__(self):
        check_field_types(
            self, bools=("trust_remote_code", "enable_prefix_caching", "async_scheduling", "warmup", "enable_lora"),
            integers=("block_size", "max_num_seqs", "max_num_batched_tokens", "min_token_bucket", "seed",
                      "tensor_parallel_size", "data_parallel_size", "max_logprobs", "max_loras", "max_lora_rank"),
            optional_integers=("max_model_len", "num_kv_blocks", "max_cpu_loras"),
            finite_reals=("kv_cache_memory_fraction", "kv_cache_gib", "compilation_cache_max_gib"),
            strings=("dtype", "kv_cache_dtype", "mamba_ssm_cache_dtype", "scheduling_policy", "attention_backend",
                     "layer_loop", "runner", "convert"),
            optional_strings=("revision", "reasoning_parser", "quantization"),
            optional_paths=("model", "tokenizer", "download_dir", "compilation_cache_dir", "profiler_dir",
                            "generation_config"))
        if self.generation_config is None:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory, got None")
        for name in ("override_generation_config", "pooler_config", "speculative_config", "hf_overrides"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise field_error(self, name, "a dict or None")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {', '.join(CONVERTS)} (embeddings are the one pooling task "
                             f"supported), got {self.convert!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None (the "
                             f"checkpoint's), got {self.quantization!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.speculative_config is not None:
            from jaxengine.engine.speculative import SpeculativeConfig

            SpeculativeConfig.of(self.speculative_config)  # its errors now, not after the model loads
        if self.convert != "auto" and self.runner == "generate":
            raise ValueError(f"convert={self.convert!r} makes a pooling model: use runner 'pooling' or 'auto'")
        if self.model is None and (self.revision is not None or self.download_dir is not None):
            raise ValueError("revision and download_dir apply to a hub id given as model")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "min_token_bucket", "tensor_parallel_size",
                    "data_parallel_size", "max_loras", "max_lora_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}, got "
                             f"{self.mamba_ssm_cache_dtype!r}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {self.layer_loop!r}")
        if self.max_logprobs < 1:
            raise ValueError(f"max_logprobs must be >= 1, got {self.max_logprobs}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.compilation_cache_max_gib < 0:
            raise ValueError(f"compilation_cache_max_gib must be >= 0 (0: no cap), got {self.compilation_cache_max_gib}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running request needs a token each step")

    @classmethod
    def of(cls, where: str = "engine settings", **values) -> "EngineConfig":
        """The config of these settings; a ValueError names any it does not know (with what to use instead where
        it is a vLLM setting of another name or one we do not support), where a dataclass raises a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            hints = "; ".join(f"{name}: {VLLM_SETTINGS[name]}" for name in unknown if name in VLLM_SETTINGS)
            raise ValueError(f"{where}: unknown engine settings {unknown}" + (f" ({hints})" if hints else "")
                             + f"; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "EngineConfig":
        values = yaml.safe_load(Path(path).read_text()) or {}
        return cls.of(str(path), **(values | {k: v for k, v in overrides.items() if v is not None}))


# vLLM engine settings users carry over that have another name here, or no counterpart.
VLLM_SETTINGS = {
    "gpu_memory_utilization": "the KV cache takes kv_cache_memory_fraction of the accelerator memory left after the "
                              "weights (kv_cache_gib on CPU)",
    "num_gpu_blocks_override": "use num_kv_blocks",
    "swap_space": "preempted requests are recomputed, never swapped to host memory",
    "cpu_offload_gb": "weights are not offloaded to host memory",
    "enforce_eager": "there are no CUDA graphs to turn off: every step runs compiled XLA programs",
    "tokenizer_mode": "the tokenizer is always transformers' AutoTokenizer (a fast one where it exists)",
    "pipeline_parallel_size": "not supported; use tensor_parallel_size and data_parallel_size",
    "task": "use runner='pooling' for embeddings (convert='embed')",
    "override_pooler_config": "use pooler_config",
}
