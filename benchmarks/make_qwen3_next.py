#!/usr/bin/env python3
"""A Qwen3-Next checkpoint scaled to this 2-core CPU, for benchmarks/qwen3_next.sh: Qwen3-Next's layers (three Gated
DeltaNet linear-attention layers to one gated full-attention layer; linear heads of 128 x 128 states, a causal
convolution 4 wide; full attention over 256-wide heads, a quarter rotated; a mixture of experts with a gated shared
expert in every layer) at width 768, 8 layers (6 linear, 2 full), 6 key / 6 value linear heads, 4 query heads and 1 KV
head, the top 4 of 32 experts of 256 and a shared expert of 512 (~0.05 B parameters active per token, ~0.2 B in all),
random bfloat16 weights (seed 0), with the shared model's tokenizer (its vocabulary of 32000), so that the shared
workload's prompts (random token ids) run on it.

Qwen3-Next rather than a dense Qwen3.5: vLLM's CPU build imports its Qwen3.5 classes only with torchvision (which has
no CPU build for its torch on the index) and its Qwen3-Next class needs experts; the linear-attention layers are the
same (Qwen3-Next's checkpoint fuses their projections per key head, split apart at load).

  python benchmarks/make_qwen3_next.py MODELS_DIR   # writes MODELS_DIR/qwen3-next-mini from MODELS_DIR/llama-135m
"""

from scaled_checkpoint import save_random, target  # before transformers (see there)

import transformers


def main() -> None:
    _, out, tokenizer, token_fields = target("qwen3-next-mini")
    config = transformers.Qwen3NextConfig(
        **token_fields, hidden_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, linear_num_key_heads=6, linear_num_value_heads=6, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=256, shared_expert_intermediate_size=512, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))
    # the norms at 0 (they scale by 1 + weight) but the linear layers' gated norms (plain weights: 1)
    save_random(transformers.Qwen3NextForCausalLM, config, out, tokenizer,
                lambda name, p: 0.05 if "embed" in name else 0.0 if "norm" in name and "linear_attn" not in name
                else None)
    print(out)


if __name__ == "__main__":
    main()
