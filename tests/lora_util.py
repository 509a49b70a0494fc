"""LoRA adapters for tests: random PEFT adapters of the tiny models, and transformers with them merged (the
oracle)."""

import json

import numpy as np
import torch
from safetensors.numpy import save_file

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapter(out, config: dict, rank: int, targets, seed: int, alpha: float = 16.0, rslora: bool = False,
                 std: float = 0.3, **extra_config) -> dict:
    """A PEFT LoRA adapter of random A and B (normal, `std`) for `targets` in every layer of the model of
    `config` (its config.json); returns {tensor name: array}. benchmarks/lora.py makes its adapter here too."""
    rng = np.random.default_rng(seed)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    D, I = config["hidden_size"], config["intermediate_size"]
    shapes = {"q_proj": (D, heads * head_dim), "k_proj": (D, kv * head_dim), "v_proj": (D, kv * head_dim),
              "o_proj": (heads * head_dim, D), "gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for t in targets:
            n_in, n_out = shapes[t]
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[t]}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, std, (rank, n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, std, (n_out, rank)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
         "use_rslora": rslora} | extra_config))
    return tensors


def merged_hf(model_dir, tensors, scale):
    """transformers' model with each adapter update merged: W + scale * B A."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                b = tensors[name.replace("lora_A", "lora_B")]
                weight = params[name.replace("base_model.model.", "").replace(".lora_A", "")]
                weight += torch.tensor(scale * (b @ a))
    return hf.eval()


def make_adapters(model_dir, root) -> dict:
    """Three adapters of the tiny Llama ("all" projections rank 8, "attn" q/v rank 4 with rsLoRA, "mlp" gate/down
    rank 2), each (LoRARequest, transformers with it merged); None: (None, the base model)."""
    from jaxengine import LoRARequest

    config = json.loads((model_dir / "config.json").read_text())
    made = {}
    for name, rank, targets, seed, rslora in (("all", 8, tuple(TARGETS), 1, False),
                                              ("attn", 4, ("q_proj", "v_proj"), 2, True),
                                              ("mlp", 2, ("gate_proj", "down_proj"), 3, False)):
        tensors = make_adapter(root / name, config, rank, targets, seed, rslora=rslora)
        scale = 16.0 / (rank ** 0.5 if rslora else rank)
        made[name] = (LoRARequest(name, len(made) + 1, str(root / name)), merged_hf(model_dir, tensors, scale))
    made[None] = (None, merged_hf(model_dir, {}, 0.0))
    return made
