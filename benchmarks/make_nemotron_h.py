#!/usr/bin/env python3
"""A Nemotron-H checkpoint scaled to this 2-core CPU, for benchmarks/nemotron_h.sh: Nemotron Nano 2's blocks (Mamba2
mixers with heads of 64 and states of 128 in 8 groups, a convolution 4 wide; GQA attention without rotary embedding;
ungated ReLU^2 MLP blocks, one after each mixer but where two mixers follow each other) at width 768, the pattern
M-M-M*-M-M-M*- (8 mixers: 6 Mamba2, 2 attention, 6 MLP blocks of 3072), 24 mixer heads, 6 attention heads of 128 and
2 KV heads (~0.11 B parameters), random bfloat16 weights (seed 0), with the shared model's tokenizer (its vocabulary
of 32000), so that the shared workload's prompts (random token ids) run on it.

  python benchmarks/make_nemotron_h.py MODELS_DIR   # writes MODELS_DIR/nemotron-h-mini from MODELS_DIR/llama-135m
"""

from scaled_checkpoint import save_random, target  # before transformers (see there)

import transformers


def main() -> None:
    _, out, tokenizer, token_fields = target("nemotron-h-mini")
    config = transformers.NemotronHConfig(
        **token_fields, hidden_size=768, intermediate_size=3072, hybrid_override_pattern="M-M-M*-M-M-M*-",
        num_attention_heads=6, num_key_value_heads=2, head_dim=128, mamba_num_heads=24, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, max_position_embeddings=4096, tie_word_embeddings=False)
    # the mixers' A_log, D and dt_bias as Nemotron-H initialises them (A in 1..heads, D 1, small time steps)
    save_random(transformers.NemotronHForCausalLM, config, out, tokenizer,
                lambda name, p: 0.05 if "embed" in name else 0.0 if name.endswith(("A_log", "D", "dt_bias")) else None)
    print(out)


if __name__ == "__main__":
    main()
