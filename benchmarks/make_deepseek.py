#!/usr/bin/env python3
"""A DeepSeek V2 checkpoint scaled to this 2-core CPU, for benchmarks/deepseek.sh: DeepSeek-V2-Lite's layer
(multi-head latent attention with a 512-wide latent, 16 heads of 128 unrotated + 64 rotated query/key dimensions and
128 value ones, queries straight from the hidden state; a dense first layer, then a mixture of experts with 2 shared
ones, softmax top 4) at width 1024, 12 layers and 16 experts of 512 (~0.35 B parameters, ~0.1 B active), random
bfloat16 weights (seed 0), with the shared model's tokenizer (its vocabulary of 49152), so that the shared workload's
prompts (random token ids) run on it.

  python benchmarks/make_deepseek.py MODELS_DIR   # writes MODELS_DIR/deepseek-mini from MODELS_DIR/llama-135m
"""

from scaled_checkpoint import save_random, target  # before transformers (see there)

import transformers


def main() -> None:
    _, out, tokenizer, token_fields = target("deepseek-mini")
    config = transformers.DeepseekV2Config(
        **token_fields, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707, mscale_all_dim=0.707,
                             beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=1024))
    save_random(transformers.DeepseekV2ForCausalLM, config, out, tokenizer)  # the experts' [experts, out, in]
    print(out)


if __name__ == "__main__":
    main()
