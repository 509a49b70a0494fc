#!/usr/bin/env python3
"""A checkpoint of gpt-oss-20b's shape, as the hub ships it (MXFP4 experts, every other tensor bfloat16), with random
weights (seed 0) and the shared model's tokenizer, for benchmarks/gpt_oss_20b.sh: its config.json is gpt-oss-20b's
(2880 wide, 24 layers, 64 query heads to 8 KV heads of 64, sinks, alternate 128-token windows, YaRN; 32 experts of
2880, top 4; a vocabulary of 201088) and its tensors have gpt-oss-20b's names, shapes and dtypes (~13 GB in 6 shards).
Nothing is downloaded: the numbers are random (experts: every float4 code, a power of two per 32 inputs from 2^-7
to 2^-5; others fan-in scaled), so its text means nothing; its work per token is gpt-oss-20b's.

  python benchmarks/make_gpt_oss_20b.py MODELS_DIR   # writes MODELS_DIR/gpt-oss-20b-shape from MODELS_DIR/llama-135m
"""

import json
import sys

from scaled_checkpoint import copy_tokenizer, target  # before transformers (see there)

import numpy as np
import torch
from safetensors.torch import save_file

LAYERS, HIDDEN, INTER, EXPERTS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 24, 2880, 2880, 32, 64, 8, 64, 201088
LAYERS_PER_SHARD = 5


def config(token_fields: dict) -> dict:
    """gpt-oss-20b's config.json (the hub's), with the shared tokenizer's special token ids."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "experts_per_token": 4, "num_experts_per_tok": 4, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": INTER, "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
        "max_position_embeddings": 131072, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS, "num_local_experts": EXPERTS, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": VOCAB,
        "bos_token_id": token_fields["bos_token_id"], "eos_token_id": token_fields["eos_token_id"],
        "pad_token_id": token_fields["pad_token_id"],
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }


def main() -> None:
    _, out, tokenizer, token_fields = target("gpt-oss-20b-shape")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    def dense(*shape, fan_in=None):  # bfloat16, fan-in scaled
        return (torch.randn(*shape) * (fan_in or shape[-1]) ** -0.5).to(torch.bfloat16)

    def small(*shape):  # biases, sinks
        return (torch.randn(*shape) * 0.1).to(torch.bfloat16)

    def mxfp4(out_features, in_features):  # blocks, scales of [EXPERTS, out, in]
        blocks = rng.integers(0, 256, (EXPERTS, out_features, in_features // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 123, (EXPERTS, out_features, in_features // 32), dtype=np.uint8)
        return torch.from_numpy(blocks), torch.from_numpy(scales)

    def shards():  # one at a time: only one shard's tensors are in memory
        yield {"model.embed_tokens.weight": dense(VOCAB, HIDDEN), "lm_head.weight": dense(VOCAB, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
        for first in range(0, LAYERS, LAYERS_PER_SHARD):
            shard = {}
            for i in range(first, min(first + LAYERS_PER_SHARD, LAYERS)):
                p = f"model.layers.{i}."
                shard |= {p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                          p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                          p + "self_attn.q_proj.weight": dense(HEADS * HEAD_DIM, HIDDEN),
                          p + "self_attn.k_proj.weight": dense(KV_HEADS * HEAD_DIM, HIDDEN),
                          p + "self_attn.v_proj.weight": dense(KV_HEADS * HEAD_DIM, HIDDEN),
                          p + "self_attn.o_proj.weight": dense(HIDDEN, HEADS * HEAD_DIM),
                          p + "self_attn.q_proj.bias": small(HEADS * HEAD_DIM),
                          p + "self_attn.k_proj.bias": small(KV_HEADS * HEAD_DIM),
                          p + "self_attn.v_proj.bias": small(KV_HEADS * HEAD_DIM),
                          p + "self_attn.o_proj.bias": small(HIDDEN), p + "self_attn.sinks": small(HEADS),
                          p + "mlp.router.weight": dense(EXPERTS, HIDDEN), p + "mlp.router.bias": small(EXPERTS),
                          p + "mlp.experts.gate_up_proj_bias": small(EXPERTS, 2 * INTER),
                          p + "mlp.experts.down_proj_bias": small(EXPERTS, HIDDEN)}
                for name, shape in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
                    shard[p + f"mlp.experts.{name}_blocks"], shard[p + f"mlp.experts.{name}_scales"] = mxfp4(*shape)
            yield shard

    count = 1 + -(-LAYERS // LAYERS_PER_SHARD)
    weight_map = {}
    for n, shard in enumerate(shards()):
        name = f"model-{n + 1:05d}-of-{count:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        print(f"wrote {name}", file=sys.stderr)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config(token_fields), indent=2))
    copy_tokenizer(tokenizer, out)
    print(out)


if __name__ == "__main__":
    main()
