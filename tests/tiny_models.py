"""Tiny random-initialised Hugging Face checkpoints and a locally trained tokenizer for tests.

Shapes chosen to catch mistakes: GQA ratios 3 and 4 (and MQA), head_dim 16 and 24 (not hidden/heads for
Qwen3), an odd vocabulary, sliding windows shorter than the test prompts, tied and untied embeddings, every
supported rope type, and one checkpoint sharded over several safetensors files with an index.
"""

import json
from pathlib import Path

VOCAB_SIZE = 331  # odd on purpose

COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

SPECS = {
    "llama": dict(
        cls="LlamaForCausalLM", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=False, shard=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32)),
    "mistral": dict(
        cls="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=1, sliding_window=24,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000.0)),
    "qwen2": dict(
        cls="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=64)),
    "qwen3": dict(
        cls="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=1, head_dim=24,
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=20, max_window_layers=1,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    # Gemma 2 in its hub form (no layer_types: alternate sliding layers), soft-capped scores and logits, a
    # query scale that is not head_dim's; Gemma 3 with a rope of its own on the sliding layers and q/k norms.
    "gemma": dict(
        cls="GemmaForCausalLM", num_attention_heads=2, num_key_value_heads=2, head_dim=32, hidden_act="gelu",
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "gemma2": dict(
        cls="Gemma2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
        query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        drop_config_keys=("layer_types",)),
    "gemma3": dict(
        cls="Gemma3ForCausalLM", config_cls="Gemma3TextConfig", num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, sliding_window=20, sliding_window_pattern=2, query_pre_attn_scalar=24,
        tie_word_embeddings=True,
        rope_parameters=dict(full_attention=dict(rope_type="linear", rope_theta=100000.0, factor=4.0),
                             sliding_attention=dict(rope_type="default", rope_theta=1000.0))),
    # Gemma 4 (26B-A4B's layout): full-attention layers of their own shape and KV cache (head_dim 32, one KV head whose
    # values are its keys) around a sliding-window one (4 KV heads of 16), proportional rope (4 of the 16 pairs
    # rotating) on the full ones, plain-weight norms, values normed, a scalar per layer, and
    # top 2 of 4 experts beside each dense MLP (their router's own scaled norm, a scale per expert)
    "gemma4": dict(
        cls="Gemma4ForCausalLM", config_cls="Gemma4TextConfig", num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=20, layer_types=["full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        rope_parameters=dict(full_attention=dict(rope_type="proportional", rope_theta=10000.0,
                                                 partial_rotary_factor=0.25),
                             sliding_attention=dict(rope_type="default", rope_theta=1000.0))),
    # Gemma 4 E2B/E4B's layout: per-layer embeddings (16 wide), the last 2 of 5 layers reading the K/V of the last
    # earlier layer of their kind (the second sliding one; sliding: 1 KV head of 16, full: one of 32, which projects
    # its values) through MLPs twice as wide
    "gemma4e": dict(
        cls="Gemma4ForCausalLM", config_cls="Gemma4TextConfig", num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=20,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB_SIZE, num_kv_shared_layers=2,
        use_double_wide_mlp=True, final_logit_softcapping=30.0, tie_word_embeddings=True,
        rope_parameters=dict(full_attention=dict(rope_type="proportional", rope_theta=10000.0,
                                                 partial_rotary_factor=0.25),
                             sliding_attention=dict(rope_type="default", rope_theta=1000.0))),
    # Qwen3.5: Gated DeltaNet linear-attention layers (2 key heads of 16, each serving 2 of the 4 value heads of 16;
    # a causal convolution 4 wide: a state per sequence) on both sides of a full-attention layer whose q_proj also
    # gates its output per head; q/k norms, norms of 1 + weight, a quarter of each head rotated
    "qwen3_5": dict(
        cls="Qwen3_5ForCausalLM", config_cls="Qwen3_5TextConfig", num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # Phi-3 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint, LongRoPE (its short factors, and the attention
    # factor of a context twice the original) over a partial rotary embedding (Phi-4-mini's 0.75: 12 of 16
    # dimensions), a sliding window.
    "phi3": dict(
        cls="Phi3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
        max_position_embeddings=1024, original_max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=512,
                             partial_rotary_factor=0.75, short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                             long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0])),
    # OLMo 2: norms on the attention's and MLP's outputs only, q/k norms over whole projections.
    "olmo2": dict(
        cls="Olmo2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Mixtures of experts: Mixtral (renormalised top 2 of 4), Qwen2 MoE (plain top 2 of 4 and a gated shared
    # expert, qkv bias), Qwen3 MoE (renormalised top 3 of 6, q/k norms).
    "mixtral": dict(
        cls="MixtralForCausalLM", num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen2moe": dict(
        cls="Qwen2MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen3moe": dict(
        cls="Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=1, head_dim=24, num_experts=6,
        num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=True, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # GLM-4.5: a dense first layer before two expert ones (two layer stacks), top 3 of 8 experts by sigmoid scores
    # plus a correction bias within the best 2 of 4 groups, times 2.5, a shared expert, q/k norms, half of each head
    # rotated (half-split)
    "glm4moe": dict(
        cls="Glm4MoeForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                       partial_rotary_factor=0.5)),
    # DeepSeek V3: multi-head latent attention (queries through a latent, interleaved rotary pairs, YaRN whose
    # mscale_all_dim scales the scores), a dense first layer before two expert ones, GLM-4.5's router (top 3 of 8
    # by sigmoid scores plus a correction bias within the best 2 of 4 groups, times 2.5) and a shared expert
    "deepseekv3": dict(
        cls="DeepseekV3ForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0)),
    # GPT-OSS: q/k/v/o biases and sinks, alternate sliding-window layers, YaRN without truncation, renormalised top
    # 2 of 4 experts with biases and the clamped SwiGLU (a clamp low enough to bind on these weights).
    "gptoss": dict(
        cls="GptOssForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=24, swiglu_limit=1.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64)),
    # LayerNorm models: Cohere (Command R+: a parallel attention and gated MLP after one norm without bias, q/k norms
    # with weights per head, interleaved rotary pairs, a logit scale); Phi (Phi-2: a parallel attention and ungated
    # MLP after one norm, biases on every projection, the norms and the logits, half of each head rotated, here its
    # q/k LayerNorms too)
    "cohere": dict(
        cls="CohereForCausalLM", num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.25,
        layer_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "phi": dict(
        cls="PhiForCausalLM", num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu_new", qk_layernorm=True,
        layer_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
}

# Checked on one prefill each (tests/test_models.py: test_llama_layer_relatives_match_transformers; Granite's and
# GLM-4's also with LoRA adapters), their parts being those of SPECS' models: Granite's four multipliers (embeddings,
# scores, residual branches, logits); GLM-4-0414's norms after attention and MLP under other names than Gemma's,
# q/k/v biases, a fused gate/up, half of each head rotated in interleaved pairs; SmolLM3's NoPE layer (the 2nd,
# no_rope_layer_interval 2) beside a rotating one; EXAONE 4's output-only norms with per-head q/k norms, a
# sliding-window layer and the full-attention one without rotary embedding; OLMoE's whole-projection q/k norms over
# renormalised top 3 of 6 experts; DeepSeek V2's latent attention with queries straight from the hidden state and its
# softmax router (top 3 within the 2 of 4 groups of the best single scores, times 2.0; two shared experts); Llama 4's
# layers (tests/test_engine.py also decodes it through the engine); the LayerNorm models StarCoder2, StableLM 2,
# GPT-NeoX and Command R7B (SPECS' Cohere and Phi check their parts in depth).
LIGHT_SPECS = {
    # Solar Open: Llama's attention (q/k/v biases) over top 3 of 8 experts by DeepSeek V3's router in 4 groups (the
    # best 2), times 2.5, and a shared expert, in every layer
    "solar_open": dict(
        cls="SolarOpenForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # LFM2: gated short convolutions (3 wide) on both sides of an attention layer with per-head q/k norms; the MLP's
    # width adjusted as transformers adjusts it (112: two thirds, rounded up to a multiple of 32: 96)
    "lfm2": dict(
        cls="Lfm2ForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5,
        layer_types=["conv", "full_attention", "conv"], block_multiple_of=32, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Granite 4.0-H: Mamba2 mixers (8 heads of 16, states of 8 per row, B and C in 2 groups, a convolution 4 wide) on
    # both sides of an attention layer without rotary embedding, Granite's scores' scale and logits' divisor, a dense
    # shared MLP
    "granite4h": dict(
        cls="GraniteMoeHybridForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=2, mamba_d_conv=4, num_local_experts=0, shared_intermediate_size=112,
        position_embedding_type="nope", attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=False),
    # Nemotron-H (the hub's pattern form): Mamba2 mixers (8 heads of 16, states of 8, B and C in 2 groups) and an
    # attention layer without rotary embedding, each block its own layer: ungated ReLU^2 MLP blocks after three of
    # the mixers, none after the third mixer (another follows it)
    "nemotron_h": dict(
        cls="NemotronHForCausalLM", hybrid_override_pattern="M-*-MM-", num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layer_norm_epsilon=1e-5, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
        conv_kernel=4, tie_word_embeddings=False),
    # Bamba: Mamba2 mixers (4 heads of 32: mamba_expand 2 x hidden, states of 8, B and C in 2 groups) around an
    # attention layer rotating half of each head (transformers' hard-wired partial_rotary_factor), gated MLPs
    "bamba": dict(
        cls="BambaForCausalLM", num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Mamba2: mixers only (8 heads of 16, states of 8, B and C in 2 groups), tied embeddings: a model with no
    # attention layer, so no KV cache
    "mamba2": dict(
        cls="Mamba2ForCausalLM", num_hidden_layers=3, num_heads=8, head_dim=16, state_size=8, n_groups=2,
        conv_kernel=4, layer_norm_epsilon=1e-5, tie_word_embeddings=True),
    # Falcon-H1: a Mamba2 mixer (4 heads of 16 over mamba_d_ssm 64, states of 8, B and C in 2 groups) beside the
    # attention in every layer, every muP multiplier other than 1 (ssm_multipliers' five apart), the mixers' output
    # unnormed (mamba_rms_norm false, the default)
    "falcon_h1": dict(
        cls="FalconH1ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
        mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, attention_in_multiplier=0.7,
        attention_out_multiplier=1.3, key_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], mlp_multipliers=[0.6, 1.4], embedding_multiplier=2.0,
        lm_head_multiplier=0.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0)),
    # Kimi Linear in the hub's form (linear_attn_config): Kimi Delta Attention (4 heads of 16, q/k/v convolved 4 wide)
    # around a latent attention layer without rotary embedding, a dense first layer, then the top 2 of 4 experts by
    # DeepSeek V3's router beside a shared expert
    "kimi_linear": dict(
        cls="KimiLinearForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, tie_word_embeddings=False,
        linear_attn_config=dict(full_attn_layers=[2], kda_layers=[1, 3], head_dim=16, num_heads=4,
                                short_conv_kernel_size=4)),
    # Mamba (1): mixers only (128 inner channels, states of 8, a time-step rank of 8, a convolution 4 wide)
    "mamba": dict(
        cls="MambaForCausalLM", state_size=8, expand=2, conv_kernel=4, time_step_rank=8, layer_norm_epsilon=1e-5,
        tie_word_embeddings=True),
    # Jamba: Mamba1 mixers (with their norms on dt, B and C) and attention layers without rotary embedding in turn
    # (attn_layer_period 2), the top 2 of 4 experts (not renormalised) in the mixers' layers, dense MLPs in the others
    "jamba": dict(
        cls="JambaForCausalLM", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2, mamba_d_conv=4,
        tie_word_embeddings=False),
    # Gemma 4 31B's layout: SPECS["gemma4"] without its experts
    "gemma4dense": {k: v for k, v in SPECS["gemma4"].items()
                    if k not in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")},
    "granite": dict(
        cls="GraniteForCausalLM", num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
        attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "glm4": dict(
        cls="Glm4ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                       partial_rotary_factor=0.5)),
    "smollm3": dict(
        cls="SmolLM3ForCausalLM", num_attention_heads=4, num_key_value_heads=1, no_rope_layer_interval=2,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=2000.0)),
    "exaone4": dict(
        cls="Exaone4ForCausalLM", num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=20,
        sliding_window_pattern=2, tie_word_embeddings=True, rope_parameters=dict(rope_type="default",
                                                                                 rope_theta=10000.0)),
    "deepseekv2": dict(
        cls="DeepseekV2ForCausalLM", num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        first_k_dense_replace=1, routed_scaling_factor=2.0, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # GLM-4.7-Flash: DeepSeek V3's latent attention (queries through a latent) and router, without groups here, its
    # dense layer in the middle (mlp_layer_types: three layer stacks)
    "glm4moelite": dict(
        cls="Glm4MoeLiteForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.8, mlp_layer_types=["sparse", "dense", "sparse"],
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # ERNIE 4.5 MoE: a dense first layer, then the top 3 of 8 experts by softmax chosen with a correction bias,
    # renormalised, two shared experts; interleaved rotary pairs
    "ernie45moe": dict(
        cls="Ernie4_5_MoeForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        moe_intermediate_size=32, moe_num_experts=8, moe_k=3, moe_num_shared_experts=2, moe_layer_start_index=1,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Llama 4: a dense first layer that rotates (interleaved pairs, llama3 scaling), q/k-normed without weights and
    # attends in chunks of 24, then a NoPE expert layer (full attention, its queries' temperature growing every 8
    # positions): the top 1 of 4 experts by sigmoid, its input weighted, beside a shared expert
    "llama4": dict(
        cls="Llama4ForCausalLM", config_cls="Llama4TextConfig", num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=24, floor_scale=8, attn_scale=0.5,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=32)),
    "olmoe": dict(
        cls="OlmoeForCausalLM", num_attention_heads=4, num_key_value_heads=2, intermediate_size=40, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # MiniMax-M2: q/k norms over the whole projections, half of each head rotated, the top 2 of 6 experts by a
    # sigmoid router's scores with its correction bias, renormalised (Mixtral's names in the checkpoint)
    "minimax_m2": dict(
        cls="MiniMaxM2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    # HunYuan (dense and MoE): per-head q/k norms on the rotated q and k, the rope's base stretched by NTK alpha (the
    # hub's "dynamic" with an alpha); MoE: the top 2 of 4 experts by a float32 softmax router, renormalised, beside a
    # shared MLP
    "hunyuan": dict(
        cls="HunYuanDenseV1ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=50.0,
                                                       factor=1.0)),
    "hunyuanmoe": dict(
        cls="HunYuanMoEV1ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_experts=4, moe_topk=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=50.0, factor=1.0)),
    # Hy3: per-head q/k norms, a dense first layer, then the top 2 of 6 experts by sigmoid scores chosen with their
    # correction bias, renormalised, times 2.8, beside a shared expert
    "hy_v3": dict(
        cls="HYV3ForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, num_shared_experts=1,
        router_scaling_factor=2.8, tie_word_embeddings=False, rope_parameters=dict(rope_type="default",
                                                                                   rope_theta=10000.0)),
    # AFMoE (Arcee Trinity): a dense first layer, then the top 2 of 6 experts by sigmoid scores with their bias,
    # renormalised, times 1.5, beside a shared expert; a sliding-window layer that rotates before a full-attention
    # one that does not, per-head q/k norms, gated head outputs, norms around both blocks, muP embeddings
    "afmoe": dict(
        cls="AfmoeForCausalLM", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
        route_scale=1.5, global_attn_every_n_layers=2, sliding_window=20, mup_enabled=True,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Mistral Small 4: DeepSeek V3's latent attention (interleaved pairs, YaRN) with Llama 4's attention temperature
    # past 16 positions, a dense first layer, then the softmax router's top 3 of 8 experts, renormalised, times 1.5,
    # beside a shared expert
    "mistral4": dict(
        cls="Mistral4ForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0,
                             llama_4_scaling_beta=0.1)),
    # Phi-3.5-MoE: LayerNorms with biases, q/k/v/o and logit biases, the top 2 of 4 experts by the sparsemixer router
    # (its jitter wide enough here that some experts fall within it and some outside)
    "phimoe": dict(
        cls="PhimoeForCausalLM", num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.3, attention_bias=True, lm_head_bias=True,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # OLMo: LayerNorms without weights or biases, q/k/v/o biases
    "olmo": dict(
        cls="OlmoForCausalLM", num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # GraniteMoeShared: Granite's multipliers over the top 2 of 4 experts (softmax of the top logits) beside a shared
    # expert
    "granitemoe": dict(
        cls="GraniteMoeSharedForCausalLM", num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
        attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # StarCoder2: LayerNorms and projections with biases in turn, an ungated tanh-GELU MLP, a sliding window
    "starcoder2": dict(
        cls="Starcoder2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, sliding_window=20, use_bias=True,
        hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # StableLM 2: q/k/v biases, per-head q/k LayerNorms (one checkpoint tensor per head), a quarter of each head rotated
    "stablelm": dict(
        cls="StableLmForCausalLM", num_attention_heads=4, num_key_value_heads=2, use_qkv_bias=True, qk_layernorm=True,
        use_parallel_residual=False, layer_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # GPT-NeoX (Pythia): q/k/v fused head by head, the attention and the exact-GELU MLP side by side after norms of
    # their own, a quarter of each head rotated
    "gpt_neox": dict(
        cls="GPTNeoXForCausalLM", num_attention_heads=4, hidden_act="gelu", use_parallel_residual=True,
        layer_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # GPT-2 (Conv1D projections, q/k/v fused) and OPT (positions offset by 2, ReLU): learned absolute positions
    "gpt2": dict(cls="GPT2LMHeadModel", config_cls="GPT2Config", n_head=4, n_inner=112, n_positions=512,
                 activation_function="gelu_new", tie_word_embeddings=True),
    # GPT-BigCode (StarCoder): GPT-2's layer with Linear weights and one KV head
    "gpt_bigcode": dict(cls="GPTBigCodeForCausalLM", config_cls="GPTBigCodeConfig", n_head=4, n_inner=112,
                        n_positions=512, multi_query=True, activation_function="gelu_pytorch_tanh",
                        tie_word_embeddings=True),
    # GPT-J: a parallel block after one norm, interleaved pairs rotated over 8 of each head's 16 dimensions, biases on
    # the MLP and the head only
    "gptj": dict(cls="GPTJForCausalLM", config_cls="GPTJConfig", n_head=4, n_inner=112, n_positions=512, rotary_dim=8,
                 activation_function="gelu_new", tie_word_embeddings=False),
    # Falcon-40B/180B's layer: q/k/v fused per KV group (2 queries a group), the attention and MLP side by side after
    # norms of their own (tests/test_models.py also runs Falcon-7B's and the sequential layout)
    "falcon": dict(cls="FalconForCausalLM", num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                   parallel_attn=True, num_ln_in_parallel_attn=2, bias=False, ffn_hidden_size=112,
                   tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Nemotron: LayerNorms of 1 + weight, an ungated ReLU^2 MLP, half of each head rotated
    "nemotron": dict(cls="NemotronForCausalLM", num_attention_heads=4, num_key_value_heads=2, hidden_act="relu2",
                     norm_eps=1e-5, tie_word_embeddings=False,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    "opt": dict(cls="OPTForCausalLM", num_attention_heads=4, ffn_dim=112, word_embed_proj_dim=64,
                activation_function="relu", do_layer_norm_before=True, tie_word_embeddings=True),
    # Command R7B / A: sliding-window layers that rotate beside full-attention ones that do not
    "cohere2": dict(
        cls="Cohere2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, sliding_window=20,
        layer_types=["sliding_attention", "full_attention"], logit_scale=0.5, layer_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


def make_tokenizer(out_dir: Path) -> None:
    """The demo's tokenizer, with a reasoning model's <think> and </think> (added tokens that are not special,
    as Qwen3's and DeepSeek-R1's: their text stays in outputs) for the reasoning parsers, and GPT-OSS's harmony
    tokens (special, as its: <|end|> is the demo's own) for its reasoning and tool-call parsers."""
    from transformers import AutoTokenizer

    from jaxengine import harmony
    from jaxengine.demo import make_tokenizer as train

    train(out_dir, VOCAB_SIZE - 11)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.add_tokens([t for t in harmony.TOKENS if t != harmony.END], special_tokens=True)
    assert len(tokenizer) <= VOCAB_SIZE
    tokenizer.save_pretrained(out_dir)


def make_model(name: str, out_dir: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> Path:
    """SPECS[name] (config fields replaced by `overrides`) saved with random weights."""
    import torch
    import transformers

    spec = dict(COMMON) | dict((SPECS | LIGHT_SPECS)[name]) | overrides
    cls_name, shard = spec.pop("cls"), spec.pop("shard", False)
    config_cls = getattr(transformers, spec.pop("config_cls", cls_name.replace("ForCausalLM", "Config")))
    drop_config_keys = spec.pop("drop_config_keys", ())
    config = config_cls(**spec)
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    _randomise(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="100KB" if shard else "1GB")
    if drop_config_keys:
        saved = read_config(out_dir)
        (out_dir / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in drop_config_keys}))
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def make_gemma3_multimodal(out_dir: Path, tokenizer_dir: Path) -> Path:
    """Gemma3ForConditionalGeneration with SPECS["gemma3"]'s language model and a one-layer vision tower, its
    config.json's text_config cut, as the hub's are, to what differs from Gemma3TextConfig's defaults."""
    import transformers

    text = {k: v for k, v in (dict(COMMON) | SPECS["gemma3"]).items() if k not in ("cls", "config_cls")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB_SIZE - 1, boi_token_index=VOCAB_SIZE - 3,
                                       eoi_token_index=VOCAB_SIZE - 2)
    _save_random(transformers.Gemma3ForConditionalGeneration, config, out_dir, tokenizer_dir)
    saved = read_config(out_dir)
    defaults = transformers.Gemma3TextConfig().to_dict()
    saved["text_config"] = {k: v for k, v in saved["text_config"].items() if defaults.get(k, object()) != v}
    (out_dir / "config.json").write_text(json.dumps(saved))
    return out_dir


def make_gemma4_multimodal(out_dir: Path, tokenizer_dir: Path) -> Path:
    """Gemma4ForConditionalGeneration with LIGHT_SPECS["gemma4dense"]'s language model (31B's layout), a one-layer
    vision tower and a one-layer audio tower, its config.json's text_config cut, as the hub's are, to what differs
    from Gemma4TextConfig's defaults (and giving the full-attention layers' shape as global_head_dim /
    num_global_key_value_heads, not transformers 5's per_layer_config)."""
    import transformers

    text = {k: v for k, v in (dict(COMMON) | LIGHT_SPECS["gemma4dense"]).items() if k not in ("cls", "config_cls")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=audio,
                                       image_token_id=VOCAB_SIZE - 1, audio_token_id=VOCAB_SIZE - 2,
                                       boi_token_id=VOCAB_SIZE - 3, eoi_token_id=VOCAB_SIZE - 4,
                                       boa_token_id=VOCAB_SIZE - 5, eoa_token_id=VOCAB_SIZE - 6)
    _save_random(transformers.Gemma4ForConditionalGeneration, config, out_dir, tokenizer_dir)
    saved = read_config(out_dir)
    defaults = transformers.Gemma4TextConfig().to_dict()
    cut = {k: v for k, v in saved["text_config"].items() if defaults.get(k, object()) != v and k != "per_layer_config"}
    saved["text_config"] = cut | {"global_head_dim": text["global_head_dim"],
                                  "num_global_key_value_heads": text["num_global_key_value_heads"]}
    (out_dir / "config.json").write_text(json.dumps(saved))
    return out_dir


MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5)


def make_mistral3_multimodal(out_dir: Path, tokenizer_dir: Path, text_model: str) -> Path:
    """Mistral3ForConditionalGeneration with SPECS["mistral"]'s language model (`text_model` "mistral": Mistral Small
    3.1/3.2's form; "ministral3": Ministral 3's, with Llama 4's query scaling past 32 positions; "mistral4": Mistral
    Small 4's, LIGHT_SPECS' mistral4) and a one-layer Pixtral vision tower.""" 
    import transformers

    text = {k: v for k, v in (dict(COMMON) | SPECS["mistral"]).items() if k != "cls"}
    if text_model == "ministral3":
        text = transformers.Ministral3Config(**(text | {"rope_parameters": MINISTRAL3_ROPE}))
    elif text_model == "mistral4":  # Mistral Small 4's: LIGHT_SPECS["mistral4"]
        text = transformers.Mistral4Config(**{k: v for k, v in (dict(COMMON) | LIGHT_SPECS["mistral4"]).items()
                                              if k != "cls"})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, head_dim=16)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=VOCAB_SIZE - 1,
                                         spatial_merge_size=1)
    return _save_random(transformers.Mistral3ForConditionalGeneration, config, out_dir, tokenizer_dir)


def make_llama4_multimodal(out_dir: Path, tokenizer_dir: Path) -> Path:
    """Llama4ForConditionalGeneration with LIGHT_SPECS["llama4"]'s language model and a one-layer vision model."""
    import transformers

    text = {k: v for k, v in (dict(COMMON) | LIGHT_SPECS["llama4"]).items() if k not in ("cls", "config_cls")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    config = transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=VOCAB_SIZE - 1,
                                       boi_token_index=VOCAB_SIZE - 3, eoi_token_index=VOCAB_SIZE - 2)
    return _save_random(transformers.Llama4ForConditionalGeneration, config, out_dir, tokenizer_dir)


# Qwen's vision-language models: (their class, config class, the SPECS model of their language model, its M-RoPE
# sections: a quarter, or more, of each head's rotated pairs for each of time, height and width)
QWEN_VL = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", "qwen2", [2, 3, 3]),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", "qwen3", [4, 4, 4]),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", "qwen3moe", [4, 4, 4]),
    # Qwen3.5's interleaved M-RoPE over its quarter of each head rotated (2 pairs)
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", "qwen3_5", [1, 1, 0]),
}


def make_qwen_vl(out_dir: Path, tokenizer_dir: Path, kind: str) -> Path:
    """A Qwen vision-language model (QWEN_VL[kind]) with SPECS' Qwen2 (its YaRN rope), Qwen3 (no sliding window:
    Qwen3-VL's text model has none) or Qwen3 MoE language model under M-RoPE, and a one-block vision tower."""
    import transformers

    cls, config_cls, spec, sections = QWEN_VL[kind]
    text = {k: v for k, v in (dict(COMMON) | SPECS[spec]).items()
            if k not in ("cls", "use_sliding_window", "sliding_window", "max_window_layers")}
    text.pop("config_cls", None)
    rope = dict(text.pop("rope_parameters"), mrope_section=sections) | (
        {"mrope_interleaved": True} if kind == "qwen3_5" else {})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    if kind not in ("qwen2_5_vl", "qwen3_5"):
        vision["deepstack_visual_indexes"] = []
    config = getattr(transformers, config_cls)(
        text_config=text | {"rope_parameters": rope}, vision_config=vision, image_token_id=VOCAB_SIZE - 1,
        video_token_id=VOCAB_SIZE - 2, vision_start_token_id=VOCAB_SIZE - 3,
        tie_word_embeddings=text["tie_word_embeddings"])
    return _save_random(getattr(transformers, cls), config, out_dir, tokenizer_dir)


def make_exaone(out_dir: Path, tokenizer_dir: Path) -> Path:
    """EXAONE 3.5 (`ExaoneForCausalLM`, which transformers runs as Llama under the checkpoint's own names) with
    SPECS' Llama's shape and its llama3 rope, the config in the hub's keys (num_layers, layer_norm_epsilon,
    activation_function)."""
    import transformers

    spec = {k: v for k, v in (dict(COMMON) | SPECS["llama"]).items() if k not in ("cls", "shard")}
    config = transformers.ExaoneConfig(**spec)
    _save_random(transformers.LlamaForCausalLM, config, out_dir, tokenizer_dir)  # transformers' class for "exaone"
    hub = {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function"}
    saved = {hub.get(k, k): v for k, v in read_config(out_dir).items()} | {"architectures": ["ExaoneForCausalLM"]}
    (out_dir / "config.json").write_text(json.dumps(saved))
    return out_dir


def _save_random(model_class, config, out_dir: Path, tokenizer_dir: Path) -> Path:
    """`model_class(config)` with random weights (`_randomise`, seed 0), saved with the tokenizer."""
    import torch

    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config).eval()
    _randomise(model)
    model.save_pretrained(out_dir)
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for f in Path(tokenizer_dir).iterdir():
        (out_dir / f.name).write_bytes(f.read_bytes())


def _randomise(model) -> None:
    """Weights large enough that logits spread over several units, and non-trivial norm scales and biases
    so that a weight loaded into the wrong place cannot hide."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:  # GPT-2's norms: ln_1, ln_2, ln_f
                p.uniform_(0.5, 1.5)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's router: scales near 1
                p.uniform_(0.5, 1.5)
            elif ".act_fn." in name:  # Apertus's xIELU parameters (before their softplus)
                p.uniform_(-1.0, 1.0)
            elif name.endswith("A_log"):  # Gated DeltaNet's decay rates: slow enough that a state remembers (its
                # decay per token exp(-exp(A_log) softplus(.)) mostly above 0.8)
                p.uniform_(-3.0, -1.0)
            elif name.endswith("sinks"):  # GPT-OSS: logits beside the scores, some above them
                p.normal_(1.0, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)  # fan-in: [out, in], or [experts, out, in]
        for module in model.modules():  # GPT-2's Conv1D weights are [in, out]: the fan-in is the first axis
            if type(module).__name__ == "Conv1D":
                module.weight.normal_(0.0, 1.0 / module.weight.shape[0] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # a sigmoid router's: large enough to
                # change choices
                b.normal_(0.0, 0.3)
            elif name.endswith("layer_scalar"):  # Gemma 4's scale of each layer's output
                b.uniform_(0.5, 1.5)


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())

# Not in the default set: 8 query heads and 2 KV heads so that TP = 8 works (with KV heads repeated), and
# head_dim 64 for the TPU kernel, which supports head_dim 64/128/256.
EXTRA_SPECS = {
    "llama8": dict(cls="LlamaForCausalLM", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
                   tie_word_embeddings=False),
    "llama-hd64": dict(cls="LlamaForCausalLM", hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
}


def make_extra_model(name: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    SPECS[name] = EXTRA_SPECS[name]
    try:
        return make_model(name, out_dir, tokenizer_dir)
    finally:
        del SPECS[name]


def make_remote_code_tokenizer(tokenizer_dir: Path, out_dir: Path) -> Path:
    """A copy of a tokenizer whose class is its own code (`auto_map`, as some hub tokenizers ship): it decodes in
    capitals, so that a test sees which class loaded."""
    import shutil

    shutil.copytree(tokenizer_dir, out_dir)
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config |= {"tokenizer_class": "ShoutingTokenizer",
               "auto_map": {"AutoTokenizer": [None, "tokenization_shouting.ShoutingTokenizer"]}}
    config_file.write_text(json.dumps(config))
    (out_dir / "tokenization_shouting.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class ShoutingTokenizer(PreTrainedTokenizerFast):\n"
        "    def decode(self, *args, **kwargs):\n"
        "        return super().decode(*args, **kwargs).upper()\n")
    return out_dir
