#!/usr/bin/env python3
"""A Gemma 4 checkpoint scaled to this 2-core CPU, for benchmarks/gemma4.sh: Gemma 4 E2B's layer (sliding-window
layers of 256-wide heads beside full-attention ones of 512 with proportional rope, one KV head; per-layer embeddings
256 wide; the last layers reading earlier layers' KV cache through MLPs twice as wide) at width 768, 10 layers (4
sliding to 1 full; the last 4 sharing K/V), 4 query heads and an MLP of 3072 (~0.16 B parameters that compute, and a
per-layer embedding table of ~0.13 B that is only read by token), random bfloat16 weights (seed 0), with the shared
model's tokenizer (its vocabulary of 32000), so that the shared workload's prompts (random token ids) run on it.

  python benchmarks/make_gemma4.py MODELS_DIR   # writes MODELS_DIR/gemma4-mini from MODELS_DIR/llama-135m
"""

from scaled_checkpoint import save_random, target  # before transformers (see there)

import transformers


def main() -> None:
    _, out, tokenizer, token_fields = target("gemma4-mini")
    config = transformers.Gemma4TextConfig(
        **token_fields, hidden_size=768, intermediate_size=3072, num_hidden_layers=10, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=token_fields["vocab_size"], num_kv_shared_layers=4, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, max_position_embeddings=4096, tie_word_embeddings=True)
    save_random(transformers.Gemma4ForCausalLM, config, out, tokenizer,
                lambda name, p: 0.05 if "embed" in name and "norm" not in name else None)
    print(out)


if __name__ == "__main__":
    main()
