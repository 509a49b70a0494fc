"""Maps `architectures[0]` of a Hugging Face config to our implementation and its config reading."""

from collections.abc import Callable
import dataclasses

from jaxengine.models.config import GEMMA_ARCHITECTURES, ModelConfig, gemma_config_from_hf, model_config_from_hf
from jaxengine.models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_class: type
    read_config: Callable[[dict], ModelConfig]


_REGISTRY = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, model_config_from_hf),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, model_config_from_hf),
    # Qwen2 hard-wires bias on q/k/v and none on o_proj, whatever attention_bias says.
    "Qwen2ForCausalLM": Architecture(
        LlamaForCausalLM, lambda hf: model_config_from_hf(hf, qkv_bias=True, o_bias=False)),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, lambda hf: model_config_from_hf(hf, qk_norm=True)),
} | {name: Architecture(LlamaForCausalLM, gemma_config_from_hf) for name in GEMMA_ARCHITECTURES}

SUPPORTED_ARCHITECTURES = tuple(sorted(_REGISTRY))


def get_architecture(hf_config: dict) -> Architecture:
    names = hf_config.get("architectures") or []
    if not names:
        raise ValueError(f"config.json has no 'architectures'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if names[0] not in _REGISTRY:
        raise ValueError(
            f"architecture {names[0]!r} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return _REGISTRY[names[0]]
