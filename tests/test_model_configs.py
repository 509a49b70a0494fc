"""Hub configs of the Gemma and mixture-of-experts families (older keys included) read as transformers reads them."""

import math

import pytest
import transformers

from jaxengine.models.config import model_config_from_hf
from jaxengine.models.quantization import parse_quantization
from jaxengine.models.registry import get_architecture

GEMMA3_1B = dict(  # google/gemma-3-1b-it's config.json (transformers 4.x keys)
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False,
    attn_logit_softcapping=None, final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    hidden_size=1152, intermediate_size=6912, max_position_embeddings=32768, num_attention_heads=4,
    num_hidden_layers=26, num_key_value_heads=1, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
    rope_local_base_freq=10000.0, rope_scaling=None, rope_theta=1000000.0, sliding_window=512,
    sliding_window_pattern=6, vocab_size=262144, bos_token_id=2, eos_token_id=[1, 106])

GEMMA_2B = dict(  # google/gemma-2b's config.json: the legacy `hidden_act: gelu` means the tanh approximation
    architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=256, hidden_act="gelu",
    hidden_activation="gelu_pytorch_tanh", hidden_size=2048, intermediate_size=16384, max_position_embeddings=8192,
    num_attention_heads=8, num_hidden_layers=18, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
    vocab_size=256000)


def read(hf: dict):
    return get_architecture(hf).read_config(hf)

def meta_model(hf: dict, drop: tuple = ()):
    """transformers' model of the hub config `hf` (its keys but `drop`), built on the meta device (no weights)."""
    import torch

    name = hf["architectures"][0]
    config = getattr(transformers, name.replace("ForCausalLM", "Config"))(
        **{k: v for k, v in hf.items() if k not in ("architectures", "model_type", *drop)})
    with torch.device("meta"):
        return getattr(transformers, name)(config)


def mamba2_heads(mixer) -> tuple:
    """A transformers Mamba2 mixer's (heads, head_dim, state size, groups, convolution width): ModelConfig.ssm_heads."""
    return mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups, mixer.conv_kernel_size



@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 8.0}])
def test_gemma3_hub_config_gets_transformers_layer_types_and_both_ropes(rope_scaling):
    hf = GEMMA3_1B | {"rope_scaling": rope_scaling}
    cfg = read(hf)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert [w > 0 for w in cfg.sliding_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert set(cfg.sliding_windows) == {0, 512}
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.param("factor")) == (
        full["rope_theta"], full["rope_type"], full.get("factor"))
    assert (cfg.local_rope.theta, cfg.local_rope.rope_type) == (local["rope_theta"], local["rope_type"])
    assert cfg.sm_scale == 256 ** -0.5 and cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset
    assert cfg.embed_scale == math.sqrt(1152) and cfg.hidden_act == "gelu_tanh" and cfg.eos_token_ids == (1, 106)
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None


# Gemma 4's multimodal checkpoints in the hub's form (text_config giving what differs from transformers' defaults,
# the full-attention layers' shape as global_head_dim / num_global_key_value_heads): 31B's and 26B-A4B's shapes
GEMMA4_31B = dict(
    architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", dtype="bfloat16", eos_token_id=[1, 106],
    text_config=dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                     num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4, global_head_dim=512,
                     attention_k_eq_v=True, sliding_window=1024, max_position_embeddings=262144,
                     final_logit_softcapping=30.0, hidden_size_per_layer_input=0),
    vision_config=dict(model_type="gemma4_vision", hidden_size=1152))
GEMMA4_26B_A4B = GEMMA4_31B | dict(text_config=GEMMA4_31B["text_config"] | dict(
    hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
    num_global_key_value_heads=2, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704))


@pytest.mark.parametrize("hf", [GEMMA4_31B, GEMMA4_26B_A4B])
def test_gemma4_hub_configs_read_both_layer_shapes_as_transformers(hf):
    """The full-attention layers' head_dim and KV heads as transformers' per-layer config gives them (and a KV cache
    of their own), its layer types, both ropes (the full layers' proportional), unscaled scores, the experts beside
    the dense MLP."""
    from jaxengine.models.llama import kv_cache_kinds

    cfg = read(hf)
    text = hf["text_config"]
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    full = [i for i, t in enumerate(theirs.layer_types) if t == "full_attention"]
    assert [i for i, w in enumerate(cfg.sliding_windows) if w == 0] == full and set(cfg.sliding_windows) == {0, 1024}
    sliding, layer = theirs.per_layer_config[0], theirs.per_layer_config[full[0]]
    assert (cfg.head_dim, cfg.num_kv_heads) == (sliding.head_dim, sliding.num_key_value_heads)
    assert cfg.full_attention_heads == (layer.head_dim, layer.num_key_value_heads, True)
    layers = len(theirs.layer_types)
    assert kv_cache_kinds(cfg) == ((layers - len(full), sliding.num_key_value_heads, sliding.head_dim),
                                   (len(full), layer.num_key_value_heads, layer.head_dim))
    rope = theirs.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.param("partial_rotary_factor")) == (
        "proportional", rope["full_attention"]["rope_theta"], rope["full_attention"]["partial_rotary_factor"])
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", rope["sliding_attention"]["rope_theta"])
    assert cfg.sm_scale == 1.0 and cfg.v_norm and cfg.layer_scale and not cfg.norm_offset and cfg.qk_norm
    assert (cfg.embed_scale, cfg.final_logit_softcap, cfg.hidden_act) == (text["hidden_size"] ** 0.5, 30.0, "gelu_tanh")
    assert (cfg.architecture, cfg.torch_dtype, cfg.eos_token_ids) == ("Gemma4ForConditionalGeneration", "bfloat16",
                                                                       (1, 106))
    moe = text.get("enable_moe_block", False)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.experts_beside_mlp) == (
        (128, 8, 704, True) if moe else (0, 0, 0, False))
    assert cfg.intermediate_size == text["intermediate_size"]


GEMMA4_E2B = dict(
    architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", dtype="bfloat16",
    text_config=dict(model_type="gemma4_text", hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
                     num_attention_heads=8, num_key_value_heads=1, global_head_dim=512, sliding_window=512,
                     layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, num_kv_shared_layers=20,
                     hidden_size_per_layer_input=256, use_double_wide_mlp=True, final_logit_softcapping=30.0))


def test_gemma4_e2b_hub_config_shares_kv_as_transformers_and_has_per_layer_inputs():
    """E2B's form: per-layer embeddings, and the last 20 of 35 layers reading the KV cache of the layer transformers
    stores for their kind, through MLPs twice as wide; the caches have the other 15 layers only."""
    from jaxengine.models.llama import kv_cache_kinds, layer_groups

    cfg = read(GEMMA4_E2B)
    text = GEMMA4_E2B["text_config"]
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (256, 262144)
    assert (cfg.kv_shared_layers, cfg.kv_cache_layers, cfg.double_wide_mlp) == (20, 15, True)
    kinds = theirs.layer_types
    stores = {kinds[i]: kinds[:i].count(kinds[i]) for i, mode in enumerate(theirs.kv_sharing_modes) if mode == "store"}
    for _, first, group in layer_groups(cfg):  # each stack's kind, its cache, the layer it reads there
        (kind,) = {kinds[i] for i in range(first, first + group.num_layers)}
        reuse = {theirs.kv_sharing_modes[i] == "reuse" for i in range(first, first + group.num_layers)}
        assert group.kv_source == (stores[kind] if reuse == {True} else -1)
        assert group.kv_cache_index == (kind == "full_attention")
        assert group.intermediate_size == (2 if reuse == {True} else 1) * 6144
    # a KV cache for the 12 sliding layers before the shared ones (1 KV head of 256), one for the 3 full ones (of 512)
    assert cfg.full_attention_heads == (512, 1, False) and kv_cache_kinds(cfg) == ((12, 1, 256), (3, 1, 512))


@pytest.mark.parametrize("change, match", [
    (dict(num_kv_shared_layers=55), "must include one of each kind"),
    (dict(use_bidirectional_attention="all"), "bidirectional"),
    (dict(num_global_key_value_heads=3), "not a multiple"),
])
def test_gemma4_settings_we_do_not_run_are_refused(change, match):
    """Shared KV layers without an earlier layer of their kind, bidirectional attention, full-attention KV heads that
    do not divide the query heads: refused by name."""
    hf = GEMMA4_31B | dict(text_config=GEMMA4_31B["text_config"] | change)
    with pytest.raises(ValueError, match=match):
        read(hf)


def test_gemma4_quantized_checkpoint_is_refused():
    with pytest.raises(ValueError, match="quantized checkpoints of Gemma 4"):
        read(GEMMA4_31B | dict(quantization_config=dict(quant_method="fp8")))


def test_cwm_hub_config_defaults_are_transformers():
    """CWM's config without layer_types, sliding_window or rope: transformers' CwmConfig defaults (every fourth layer
    from the first full attention, 8192-token windows, llama3 rope)."""
    hf = dict(architectures=["CwmForCausalLM"], hidden_size=6144, intermediate_size=21504, num_hidden_layers=8,
              num_attention_heads=48, num_key_value_heads=8, head_dim=128, vocab_size=128256)
    cfg = read(hf)
    theirs = transformers.CwmConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert [w > 0 for w in cfg.sliding_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert set(cfg.sliding_windows) == {0, theirs.sliding_window} and not (cfg.qkv_bias or cfg.o_bias)
    rope = theirs.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.param("factor")) == ("llama3", rope["rope_theta"],
                                                                              rope["factor"])


def test_gemma_legacy_gelu_is_the_tanh_approximation_and_has_no_gemma2_parts():
    cfg = read(GEMMA_2B)
    assert cfg.hidden_act == "gelu_tanh" and cfg.embed_scale == math.sqrt(2048) and cfg.norm_offset
    assert not (cfg.sandwich_norms or cfg.qk_norm) and cfg.sm_scale == 256 ** -0.5
    assert cfg.sliding_windows == (0,) * 18 and cfg.local_rope is None


def test_gemma2_without_layer_types_alternates_sliding_layers_from_the_first():
    hf = dict(architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_hidden_layers=4, vocab_size=100, head_dim=16, sliding_window=4096, query_pre_attn_scalar=144,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    cfg = read(hf)
    theirs = transformers.Gemma2Config(**{k: v for k, v in hf.items() if k != "architectures"})
    assert [w > 0 for w in cfg.sliding_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.sm_scale) == (50.0, 30.0, 144 ** -0.5)


def test_bidirectional_gemma3_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        read(GEMMA3_1B | {"use_bidirectional_attention": True})


def test_unknown_activation_is_refused_with_the_supported_ones():
    hf = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_hidden_layers=2, vocab_size=100, hidden_act="quick_gelu")
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported.*silu.*gelu_pytorch_tanh"):
        model_config_from_hf(hf)


def test_gemma3_multimodal_hub_config_is_read_as_its_language_model():
    """google/gemma-3-4b-it's config.json: the text_config lists only what differs from transformers' defaults;
    the token ids and dtype are at the top level."""
    hf = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", eos_token_id=[1, 106],
              torch_dtype="bfloat16", mm_tokens_per_image=256, image_token_index=262144,
              text_config=dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text",
                               num_hidden_layers=34, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                               sliding_window=1024),
              vision_config=dict(hidden_size=1152, model_type="siglip_vision_model"))
    cfg = read(hf)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert [i for i, w in enumerate(cfg.sliding_windows) if w == 0] == [5, 11, 17, 23, 29]
    assert set(cfg.sliding_windows) == {0, 1024}
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.param("factor")) == (1_000_000.0, "linear", 8.0)
    assert cfg.local_rope.theta == 10_000.0 and cfg.local_rope.rope_type == "default"
    assert (cfg.torch_dtype, cfg.eos_token_ids, cfg.architecture) == ("bfloat16", (1, 106), hf["architectures"][0])


QWEN3_30B_A3B = dict(  # Qwen/Qwen3-30B-A3B's config.json (the hub's key `num_experts`)
    architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=48, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
    rope_theta=1000000.0, use_sliding_window=False, max_window_layers=48, hidden_act="silu", rms_norm_eps=1e-6)


def test_qwen3_moe_hub_config_has_experts_and_no_dense_mlp():
    cfg = read(QWEN3_30B_A3B)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.intermediate_size == 0 and not cfg.shared_expert_gate


def test_qwen2_moe_shared_expert_is_the_dense_mlp_and_mixtral_renormalises():
    qwen2 = dict(QWEN3_30B_A3B, architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=5632)
    cfg = read(qwen2)
    assert cfg.intermediate_size == 5632 and cfg.shared_expert_gate and cfg.qkv_bias and not cfg.qk_norm
    mixtral = dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                   num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, num_local_experts=8,
                   num_experts_per_tok=2, vocab_size=32000)
    cfg = read(mixtral)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (8, 2, 14336)
    assert cfg.intermediate_size == 0
    assert cfg.norm_topk_prob


@pytest.mark.parametrize("dense, layers", [(dict(mlp_only_layers=[0, 3]), (0, 3)),
                                           (dict(decoder_sparse_step=2), tuple(range(0, 48, 2))),
                                           (dict(mlp_only_layers=[1], decoder_sparse_step=2),
                                            (0, 1) + tuple(range(2, 48, 2)))])
def test_moe_with_dense_layers_among_the_expert_ones_runs_them_in_stacks_of_their_own(dense, layers):
    """As transformers builds Qwen MoE: a layer in mlp_only_layers, or not a multiple of decoder_sparse_step, has a
    dense MLP of intermediate_size; each run of alike layers is a stack (llama.layer_groups)."""
    from jaxengine.models.llama import layer_groups

    cfg = read(QWEN3_30B_A3B | dense)
    assert cfg.dense_mlp_layers == layers and cfg.dense_intermediate_size == 6144
    groups = layer_groups(cfg)
    ends = [first + group.num_layers for _, first, group in groups]
    assert [first for _, first, _ in groups] == [0] + ends[:-1] and ends[-1] == 48
    kinds = [group.num_experts == 0 for _, _, group in groups]
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # runs of alike layers: dense and expert ones in turn
    for _, first, group in groups:
        in_run = set(range(first, first + group.num_layers))
        dense = in_run <= set(layers)
        assert dense == (group.num_experts == 0) and (dense or not in_run & set(layers))
        assert group.intermediate_size == (6144 if first in layers else 0)


PHI35_MINI = dict(  # microsoft/Phi-3.5-mini-instruct's config.json (rope_scaling in the older keys)
    architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu", hidden_size=3072,
    intermediate_size=8192, max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=32,
    num_key_value_heads=32, original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    sliding_window=262144, tie_word_embeddings=False, vocab_size=32064, bos_token_id=1, eos_token_id=32000,
    rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 100 for i in range(48)],
                  "long_factor": [1.0 + i for i in range(48)]})


def test_phi3_hub_config_reads_its_longrope_as_transformers():
    """Phi-3.5-mini's LongRoPE (its original length beside the rope dict): our short-factor frequencies and
    attention factor equal transformers' for a sequence within the original length."""
    import numpy as np
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxengine.models.config import rope_inv_freq

    cfg = read(PHI35_MINI)
    assert cfg.rope.rope_type == "longrope" and cfg.rope.param("original_max_position_embeddings") == 4096
    assert cfg.head_dim == 96 and cfg.sliding_windows == (262144,) * 32
    theirs = transformers.Phi3Config(**{k: v for k, v in PHI35_MINI.items() if k != "architectures"})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](theirs, torch.device("cpu"), seq_len=4096)
    ours, our_scaling = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert math.isclose(our_scaling, scaling, rel_tol=1e-9)


PHI4_MINI = PHI35_MINI | dict(  # microsoft/Phi-4-mini-instruct's config.json: 0.75 of a 128-dimension head rotates
    num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75, tie_word_embeddings=True,
    vocab_size=200064, bos_token_id=199999, eos_token_id=199999, pad_token_id=199999, lm_head_bias=False,
    rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 50 for i in range(48)],
                  "long_factor": [1.0 + 2 * i for i in range(48)]})


def test_phi4_mini_hub_config_reads_its_partial_longrope_as_transformers():
    """Phi-4-mini's partial rotary embedding (96 of 128 dimensions, 48 LongRoPE factors): our frequencies and
    attention factor equal transformers'."""
    import numpy as np
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxengine.models.config import rope_inv_freq

    cfg = read(PHI4_MINI)
    assert (cfg.head_dim, cfg.rope.rotary_dim(cfg.head_dim), cfg.num_kv_heads) == (128, 96, 8)
    theirs = transformers.Phi3Config(**{k: v for k, v in PHI4_MINI.items() if k != "architectures"})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](theirs, torch.device("cpu"), seq_len=4096)
    ours, our_scaling = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    assert ours.shape == (48,)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert math.isclose(our_scaling, scaling, rel_tol=1e-9)


def test_longrope_factors_follow_max_model_len(model_dirs, caplog):
    """As vLLM: the default max_model_len is the model's max_position_embeddings, past LongRoPE's original length,
    so the long factors apply at every position (logged); a max_model_len within the original length keeps the
    short ones, one past it (600) the long ones."""
    import logging

    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    small = dict(model=str(model_dirs["phi3"]), dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
                 kv_cache_gib=0.01, warmup=False)
    with caplog.at_level(logging.INFO, logger="jaxengine.engine.llm_engine"):
        engine = LLMEngine(EngineConfig(**small), progress=False)
    assert engine.max_model_len == 1024 and engine.model_config.rope.long
    assert "the long factors apply at every position" in caplog.text
    for length, long in ((512, False), (600, True)):
        engine = LLMEngine(EngineConfig(**small, max_model_len=length), progress=False)
        assert engine.max_model_len == length and engine.model_config.rope.long == long


def test_partial_rotary_layout_is_loaded_once(model_dirs, tmp_path, capsys):
    """The loader lays each head's q/k dimensions out for the partial rotation (layers.rope.partial_rotary_layout)
    from the Hugging Face checkpoint; the converted Orbax checkpoint keeps that layout (not laid out again)."""
    import numpy as np
    from safetensors.numpy import load_file

    from jaxengine.cli import main
    from jaxengine.layers.rope import partial_rotary_layout
    from jaxengine.models.loader import load_model

    out = tmp_path / "orbax"
    main(["convert", "--model", str(model_dirs["phi3"]), "--output", str(out)])
    capsys.readouterr()
    (model, cfg), (restored, _) = (load_model(path, "float32", progress=False) for path in (model_dirs["phi3"], out))
    fused = load_file(str(model_dirs["phi3"] / "model.safetensors"))["model.layers.1.self_attn.qkv_proj.weight"]
    q = fused[: cfg.num_heads * cfg.head_dim].reshape(cfg.num_heads, cfg.head_dim, -1)
    order = partial_rotary_layout(cfg.head_dim, 12)
    want = q[:, order].reshape(cfg.num_heads * cfg.head_dim, -1).T  # ours: [hidden, heads * head_dim]
    for loaded in (model, restored):
        np.testing.assert_array_equal(np.asarray(loaded.layers.q_proj[...][1]), want)


GPT_OSS_20B = dict(  # openai/gpt-oss-20b's config.json (transformers 4.55 keys: rope_scaling, experts_per_token)
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, attention_dropout=0.0,
    eos_token_id=200002, experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880,
    initial_context_length=4096, intermediate_size=2880, max_position_embeddings=131072, num_attention_heads=64,
    num_experts_per_tok=4, num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, pad_token_id=199999,
    rms_norm_eps=1e-5, rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
    tie_word_embeddings=False, vocab_size=201088,
    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                  "rope_type": "yarn", "truncate": False},
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def test_gpt_oss_hub_config_reads_its_experts_sinks_and_untruncated_yarn_as_transformers():
    """gpt-oss-20b: every layer 4 of 32 experts (biased, the clamped SwiGLU at 7.0 with transformers' default
    alpha), sinks, q/k/v/o biases, alternate 128-token windows from the first layer; its YaRN without truncation
    (transformers' frequencies and attention factor); MXFP4 experts read as bfloat16 weights (no torch_dtype)."""
    import numpy as np
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxengine.models.config import rope_inv_freq
    from jaxengine.models.quantization import parse_quantization

    cfg = read(GPT_OSS_20B)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.intermediate_size == 0
    assert cfg.hidden_act == "swigluoai" and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.moe_bias and cfg.attn_sinks and cfg.norm_topk_prob and cfg.qkv_bias and cfg.o_bias
    assert cfg.sliding_windows == (128, 0) * 12 and cfg.torch_dtype == "bfloat16" and cfg.quant_method == "mxfp4"
    assert parse_quantization(GPT_OSS_20B) is None  # the experts are dequantized as they load
    theirs = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items()
                                          if k not in ("architectures", "quantization_config")})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](theirs, torch.device("cpu"))
    ours, our_scaling = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert math.isclose(our_scaling, scaling, rel_tol=1e-9)


@pytest.mark.parametrize("field, value", [("swiglu_limit", 0), ("swiglu_alpha", "1.7")])
def test_gpt_oss_bad_swiglu_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive number"):
        read(GPT_OSS_20B | {field: value})


def test_mxfp4_is_refused_outside_gpt_oss():
    from jaxengine.models.quantization import parse_quantization

    llama = dict(GEMMA_2B, architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is supported for GPT-OSS checkpoints only"):
        parse_quantization(llama)


GRANITE_33_8B = dict(  # ibm-granite/granite-3.3-8b-instruct's config.json
    architectures=["GraniteForCausalLM"], model_type="granite", attention_multiplier=0.0078125,
    embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=32.0, hidden_size=4096, intermediate_size=12800,
    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=40, vocab_size=49159, rope_theta=10000000.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")


def test_granite_hub_config_reads_its_multipliers_and_refuses_quantized_checkpoints():
    cfg = read(GRANITE_33_8B)
    assert (cfg.embed_scale, cfg.sm_scale, cfg.residual_scale, cfg.logits_scaling) == (12.0, 0.0078125, 0.22, 32.0)
    with pytest.raises(ValueError, match="quantized Granite"):
        read(GRANITE_33_8B | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="residual_multiplier must be a positive number"):
        read(GRANITE_33_8B | {"residual_multiplier": 0})


SMOLLM3_3B = dict(  # HuggingFaceTB/SmolLM3-3B's config.json: every 4th layer without rotary embedding
    architectures=["SmolLM3ForCausalLM"], model_type="smollm3", hidden_size=2048, intermediate_size=11008,
    num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=36, vocab_size=128256, rope_theta=5000000.0,
    max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    sliding_window=None, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)])


@pytest.mark.parametrize("given", [True, False])
def test_smollm3_nope_layers_are_transformers(given):
    hf = SMOLLM3_3B if given else {k: v for k, v in SMOLLM3_3B.items() if k != "no_rope_layers"}
    cfg = read(hf)
    theirs = transformers.SmolLM3Config(**{k: v for k, v in hf.items() if k != "architectures"})
    assert cfg.rope_layers == tuple(bool(v) for v in theirs.no_rope_layers) and cfg.rope_layers.count(False) == 9
    assert cfg.sliding_windows == (0,) * 36
    with pytest.raises(ValueError, match="no_rope_layers must hold a 0 or 1 for each of the 36 layers"):
        read(SMOLLM3_3B | {"no_rope_layers": [1, 0]})


EXAONE4_32B = dict(  # LGAI-EXAONE/EXAONE-4.0-32B's config.json (sliding_window_pattern as a number of layers)
    architectures=["Exaone4ForCausalLM"], model_type="exaone4", hidden_size=5120, intermediate_size=27392,
    num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_hidden_layers=64, vocab_size=102400,
    rope_theta=1000000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=4096,
    sliding_window_pattern=4, tie_word_embeddings=False)


def test_exaone4_sliding_layers_rotate_and_full_ones_do_not():
    cfg = read(EXAONE4_32B)
    theirs = transformers.Exaone4Config(**{k: v for k, v in EXAONE4_32B.items() if k != "architectures"})
    assert [w > 0 for w in cfg.sliding_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert cfg.rope_layers == tuple(w > 0 for w in cfg.sliding_windows) and cfg.sliding_windows[3] == 0
    assert not cfg.pre_norms and cfg.sandwich_norms and cfg.qk_norm and not cfg.qk_norm_whole
    no_window = read(EXAONE4_32B | {"sliding_window": None})
    assert no_window.sliding_windows == (0,) * 64 and no_window.rope_layers == ()
    lettered = read(EXAONE4_32B | {"sliding_window_pattern": "LLLG"})
    assert lettered.sliding_windows == cfg.sliding_windows


OLMO2_7B = dict(  # allenai/OLMo-2-1124-7B's config.json
    architectures=["Olmo2ForCausalLM"], model_type="olmo2", hidden_size=4096, intermediate_size=11008,
    num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=32, vocab_size=100352, rope_theta=500000.0,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)


def test_olmo2_has_output_norms_only_and_whole_qk_norms():
    cfg = read(OLMO2_7B)
    assert not cfg.pre_norms and cfg.sandwich_norms and cfg.qk_norm and cfg.qk_norm_whole
    assert cfg.rope.theta == 500000.0 and cfg.local_rope is None


@pytest.mark.parametrize("arch, head_dim, factor", [("Glm4ForCausalLM", 128, 0.5), ("Ernie4_5ForCausalLM", 128, 1.0),
                                                    ("Glm4ForCausalLM", 24, 0.5)])
def test_interleaved_rotary_layout_gives_transformers_rotation(arch, head_dim, factor):
    """GLM's and ERNIE's rotation of interleaved pairs over (part of) each head, through the loader's layout
    (layers.rope.rotary_layout) and our half-split rotation, against transformers' own on the same q and k: the
    rotated vectors agree dimension for dimension once laid out alike, so every score does."""
    import numpy as np
    import torch

    from jaxengine.layers.rope import apply_rope, rope_tables, rotary_layout
    from jaxengine.models.config import rope_inv_freq

    module = {"Glm4ForCausalLM": transformers.models.glm4.modeling_glm4,
              "Ernie4_5ForCausalLM": transformers.models.ernie4_5.modeling_ernie4_5}[arch]
    hf = dict(architectures=[arch], hidden_size=256, intermediate_size=64, num_attention_heads=2,
              num_key_value_heads=2, head_dim=head_dim, num_hidden_layers=1, vocab_size=64, rope_theta=10000.0,
              partial_rotary_factor=factor)
    cfg = read(hf)
    rotary = cfg.rope.rotary_dim(head_dim)
    assert rotary == int(head_dim * factor) and cfg.rope_interleaved
    order = rotary_layout(head_dim, rotary, True)
    rng = np.random.default_rng(0)
    positions = np.arange(0, 70, 7)
    q = rng.normal(size=(len(positions), 2, head_dim)).astype(np.float32)
    inv_freq, scaling = rope_inv_freq(cfg.rope, head_dim, cfg.max_position_embeddings)
    cos, sin = rope_tables(positions, inv_freq, scaling, np.float32, head_dim)
    ours = np.asarray(apply_rope(q[..., order], cos, sin))
    freqs = positions[:, None] * inv_freq[None, :].astype(np.float64)
    emb = np.concatenate([freqs, freqs], -1)  # transformers' tables over the rotary dimensions
    theirs_cos, theirs_sin = (torch.tensor(f(emb), dtype=torch.float32)[None] for f in (np.cos, np.sin))
    t = torch.tensor(q).transpose(0, 1)[None]  # [1, heads, T, head_dim]
    rotated, passed = t[..., :rotary], t[..., rotary:]
    theirs, _ = module.apply_rotary_pos_emb(rotated, rotated, theirs_cos, theirs_sin)
    theirs = torch.cat([theirs, passed], -1)[0].transpose(0, 1).numpy()
    np.testing.assert_allclose(ours, theirs[..., order], atol=1e-5)


DEEPSEEK_V3 = dict(  # deepseek-ai/DeepSeek-V3's config.json (its quantization_config apart)
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, vocab_size=129280, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False, num_nextn_predict_layers=1, attention_bias=False,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"))

DEEPSEEK_V2_LITE = dict(  # deepseek-ai/DeepSeek-V2-Lite-Chat's config.json
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
    num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax", hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, vocab_size=102400, bos_token_id=100000,
    eos_token_id=100001, tie_word_embeddings=False, attention_bias=False,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096, type="yarn"))


@pytest.mark.parametrize("hf, config_class", [(DEEPSEEK_V3, "DeepseekV3Config"), (DEEPSEEK_V2_LITE, "DeepseekV2Config")])
def test_deepseek_hub_configs_read_their_latent_attention_and_routers_as_transformers(hf, config_class):
    """DeepSeek V3 (sigmoid router in 4 of 8 groups, times 2.5; queries through a latent) and V2-Lite (plain softmax
    top 6; queries from the hidden state): the KV cache's one row per token of the latent and the rotary key, the
    scores' scale with YaRN's mscale_all_dim squared and the rotary frequencies over the rotated dimensions as
    transformers computes them, the dense first layers."""
    import numpy as np
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from jaxengine.models.config import rope_inv_freq

    cfg = read(hf)
    v3 = config_class == "DeepseekV3Config"
    assert cfg.latent_attention and (cfg.num_kv_heads, cfg.head_dim, cfg.rope_head_dim) == (1, 576, 64)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim) == (1536 if v3 else 0, 512, 128,
                                                                                        128)
    assert cfg.rope_interleaved and cfg.router_float32
    theirs = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k != "architectures"})
    assert math.isclose(cfg.sm_scale, yarn_apply_mscale(theirs.rope_parameters, 192 ** -0.5), rel_tol=1e-12)
    assert cfg.sm_scale > 192 ** -0.5
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](theirs, torch.device("cpu"))
    ours, our_scaling = rope_inv_freq(cfg.rope, cfg.rope_head_dim, cfg.max_position_embeddings)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert math.isclose(our_scaling, scaling, rel_tol=1e-9)
    experts = (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size)
    if v3:
        assert experts == (256, 8, 2048, 2048) and cfg.dense_mlp_layers == (0, 1, 2)
        assert (cfg.router_scoring, cfg.router_groups, cfg.routed_scaling, cfg.norm_topk_prob) == (
            "sigmoid", (8, 4), 2.5, True)
    else:
        assert experts == (64, 6, 1408, 2 * 1408) and cfg.dense_mlp_layers == (0,)
        assert (cfg.router_scoring, cfg.router_groups, cfg.routed_scaling, cfg.norm_topk_prob) == (
            "softmax", (), 1.0, False)
    assert cfg.dense_intermediate_size == hf["intermediate_size"]


@pytest.mark.parametrize("hf, change, match", [
    (DEEPSEEK_V3, dict(topk_method="greedy"), "only the sigmoid router"),
    (DEEPSEEK_V2_LITE, dict(scoring_func="sigmoid"), "only the softmax router"),
    (DEEPSEEK_V2_LITE, dict(topk_method="group_limited_greedy", n_group=5), "n_group=5 must divide"),
    (DEEPSEEK_V3, dict(attention_bias=True), "attention_bias=true is not supported"),
    (DEEPSEEK_V3, dict(kv_lora_rank=None), "kv_lora_rank must be a positive integer"),
    (DEEPSEEK_V2_LITE, dict(qk_rope_head_dim=63), "qk_rope_head_dim must be even"),
])
def test_deepseek_settings_we_do_not_run_are_refused(hf, change, match):
    with pytest.raises(ValueError, match=match):
        read(hf | change)


def test_deepseek_v2_group_limited_router_and_kimi_k2_s_single_group():
    """DeepSeek V2's group_limited_greedy (V2 and V2.5: the 3 of 8 groups of the best single scores, times 16) and
    Kimi K2 (DeepSeek V3's layout in one group)."""
    v2 = read(DEEPSEEK_V2_LITE | dict(topk_method="group_limited_greedy", n_group=8, topk_group=3,
                                      routed_scaling_factor=16.0, q_lora_rank=1536))
    assert (v2.router_scoring, v2.router_groups, v2.routed_scaling, v2.q_lora_rank) == ("softmax", (8, 3), 16.0, 1536)
    kimi = read(DEEPSEEK_V3 | dict(n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1,
                                   num_attention_heads=64, routed_scaling_factor=2.827))
    assert (kimi.router_groups, kimi.routed_scaling, kimi.num_heads, kimi.dense_mlp_layers) == ((), 2.827, 64, (0,))


def test_deepseek_quantized_checkpoint_is_refused(tmp_path):
    """DeepSeek V3's hub checkpoint is block-wise FP8, its latent attention's projections too: refused with the
    reason."""
    import json

    from jaxengine.models.loader import load_config

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3 | {"quantization_config": dict(
        activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=[128, 128])}))
    with pytest.raises(ValueError, match="quantized multi-head latent attention is not supported"):
        load_config(tmp_path)


LLAMA4_SCOUT = dict(  # meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json (its vision_config apart)
    architectures=["Llama4ForConditionalGeneration"], model_type="llama4", boi_token_index=200080,
    eoi_token_index=200081, image_token_index=200092, tie_word_embeddings=False, torch_dtype="bfloat16",
    text_config=dict(
        attention_bias=False, attention_chunk_size=8192, attention_dropout=0.0, attn_scale=0.1,
        attn_temperature_tuning=True, bos_token_id=200000, eos_token_id=[200001, 200007, 200008], floor_scale=8192,
        for_llm_compressor=False, head_dim=128, hidden_act="silu", hidden_size=5120, interleave_moe_layer_step=1,
        intermediate_size=8192, intermediate_size_mlp=16384, max_position_embeddings=10485760, model_type="llama4_text",
        no_rope_layers=[], num_attention_heads=40, num_experts_per_tok=1, num_hidden_layers=48, num_key_value_heads=8,
        num_local_experts=16, rms_norm_eps=1e-05, rope_theta=500000.0, use_qk_norm=True, vocab_size=202048,
        rope_scaling=dict(factor=16.0, high_freq_factor=1.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                          rope_type="llama3")))


@pytest.mark.parametrize("maverick", [False, True])
def test_llama4_hub_config_reads_its_layers_as_transformers_derives_them(maverick):
    """Llama 4 Scout (every layer experts, q/k norms) and Maverick (experts every other layer, dense ones between, no
    q/k norms): every 4th layer NoPE with full attention and the attention temperature, the others rotating
    (interleaved pairs, llama3 scaling) in chunks of 8192; the top expert by sigmoid with its input weighted, a
    shared expert."""
    hf = LLAMA4_SCOUT
    if maverick:
        hf = hf | {"text_config": hf["text_config"] | dict(interleave_moe_layer_step=2, num_local_experts=128,
                                                            use_qk_norm=False)}
    cfg = read(hf)
    nope = tuple((i + 1) % 4 == 0 for i in range(48))
    assert cfg.rope_layers == tuple(not n for n in nope) and cfg.rope_interleaved
    assert cfg.sliding_windows == tuple(0 if n else -8192 for n in nope)
    assert cfg.q_position_scale == (0.1, 8192, 1, True) and cfg.qk_l2_norm == (not maverick)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.eos_token_ids == (200001, 200007, 200008)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == (
        128 if maverick else 16, 1, 8192, 8192)
    assert cfg.router_scoring == "sigmoid" and cfg.moe_input_scaled and not cfg.router_correction
    assert cfg.dense_mlp_layers == (tuple(range(0, 48, 2)) if maverick else ())
    assert cfg.dense_intermediate_size == 16384 and cfg.torch_dtype == "bfloat16"


# LayerNorm models' hub configs (their config.json, keys as the hub has them)
COMMAND_R_PLUS = dict(  # CohereForAI/c4ai-command-r-plus
    architectures=["CohereForCausalLM"], model_type="cohere", hidden_size=12288, intermediate_size=33792,
    num_attention_heads=96, num_key_value_heads=8, num_hidden_layers=64, vocab_size=256000, layer_norm_eps=1e-5,
    logit_scale=0.8333333333333334, max_position_embeddings=131072, rope_theta=75000000.0, use_qk_norm=True,
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, bos_token_id=5, eos_token_id=255001)
COMMAND_R7B = dict(  # CohereForAI/c4ai-command-r7b-12-2024 (its layer pattern as a number)
    architectures=["Cohere2ForCausalLM"], model_type="cohere2", hidden_size=4096, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=256000, layer_norm_eps=1e-5,
    logit_scale=0.25, max_position_embeddings=8192, rope_theta=50000.0, sliding_window=4096, sliding_window_pattern=4,
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False)
PHI_2 = dict(  # microsoft/phi-2
    architectures=["PhiForCausalLM"], model_type="phi", hidden_size=2560, intermediate_size=10240,
    num_attention_heads=32, num_key_value_heads=None, num_hidden_layers=32, vocab_size=51200, layer_norm_eps=1e-5,
    partial_rotary_factor=0.4, qk_layernorm=False, rope_theta=10000.0, hidden_act="gelu_new",
    max_position_embeddings=2048, tie_word_embeddings=False)
STARCODER2_3B = dict(  # bigcode/starcoder2-3b
    architectures=["Starcoder2ForCausalLM"], model_type="starcoder2", hidden_size=3072, intermediate_size=12288,
    num_attention_heads=24, num_key_value_heads=2, num_hidden_layers=30, vocab_size=49152, norm_epsilon=1e-5,
    rope_theta=999999.4420358813, sliding_window=4096, use_bias=True, hidden_act="gelu_pytorch_tanh",
    max_position_embeddings=16384)
STABLELM_2_1_6B = dict(  # stabilityai/stablelm-2-1_6b
    architectures=["StableLmForCausalLM"], model_type="stablelm", hidden_size=2048, intermediate_size=5632,
    num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=24, vocab_size=100352, layer_norm_eps=1e-5,
    partial_rotary_factor=0.25, rope_theta=10000, use_qkv_bias=True, qk_layernorm=False, use_parallel_residual=False,
    hidden_act="silu", max_position_embeddings=4096, tie_word_embeddings=False)
PYTHIA_1B = dict(  # EleutherAI/pythia-1b (GPT-NeoX's older rotary keys)
    architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", hidden_size=2048, intermediate_size=8192,
    num_attention_heads=8, num_hidden_layers=16, vocab_size=50304, layer_norm_eps=1e-5, rotary_emb_base=10000,
    rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu", max_position_embeddings=2048,
    tie_word_embeddings=False)


@pytest.mark.parametrize("hf, config_class, parallel, mlp", [
    (COMMAND_R_PLUS, "CohereConfig", 1, "gated"), (COMMAND_R7B, "Cohere2Config", 1, "gated"),
    (PHI_2, "PhiConfig", 1, "ungated"), (STARCODER2_3B, "Starcoder2Config", 0, "ungated"),
    (STABLELM_2_1_6B, "StableLmConfig", 0, "gated"), (PYTHIA_1B, "GPTNeoXConfig", 2, "ungated")])
def test_layer_norm_hub_configs_read_as_transformers(hf, config_class, parallel, mlp):
    """Each LayerNorm family's hub config against transformers' reading of it: the rotary dimensions and base
    (GPT-NeoX's rotary_pct and rotary_emb_base, Phi's and StableLM's partial factors), the epsilon, the sliding-window
    layers and the layers that rotate (Command R7B's every 4th layer: full attention without rotary embedding), with the
    block's layout each family's modelling code hard-wires."""
    cfg = read(hf)
    theirs = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k != "architectures"})
    rope = theirs.rope_parameters
    head_dim = theirs.hidden_size // theirs.num_attention_heads
    assert cfg.layer_norm and cfg.head_dim == head_dim and cfg.parallel_block == parallel
    assert cfg.rope.rotary_dim(head_dim) == int(head_dim * rope.get("partial_rotary_factor", 1.0))
    assert cfg.rope.theta == rope["rope_theta"]
    assert cfg.rms_norm_eps == getattr(theirs, "layer_norm_eps", getattr(theirs, "norm_epsilon", None))
    assert cfg.gated_mlp == (mlp == "gated")
    assert cfg.num_kv_heads == (getattr(theirs, "num_key_value_heads", None) or cfg.num_heads)
    layer_types = getattr(theirs, "layer_types", None)
    if config_class == "Cohere2Config":
        assert [w > 0 for w in cfg.sliding_windows] == [t == "sliding_attention" for t in layer_types]
        assert cfg.rope_layers == tuple(w > 0 for w in cfg.sliding_windows) and cfg.rope_layers.count(False) == 8
    else:
        assert cfg.rope_layers == () and cfg.sliding_windows == (getattr(theirs, "sliding_window", None) or 0,) * \
            cfg.num_layers
    if config_class in ("CohereConfig", "Cohere2Config"):
        assert cfg.rope_interleaved and math.isclose(cfg.logits_scaling, 1 / theirs.logit_scale)
        assert cfg.qk_norm == cfg.qk_norm_per_head == bool(getattr(theirs, "use_qk_norm", False))
    assert cfg.norm_bias == (config_class not in ("CohereConfig", "Cohere2Config"))
    assert cfg.lm_head_bias == (config_class == "PhiConfig")


@pytest.mark.parametrize("hf", [PHI_2, STARCODER2_3B])
def test_quantized_layer_norm_checkpoints_are_refused(hf):
    with pytest.raises(ValueError, match=f"quantized {hf['architectures'][0]} checkpoints are not supported"):
        read(hf | {"quantization_config": {"quant_method": "awq", "bits": 4}})


GRANITE_31_3B_A800M = dict(  # ibm-granite/granite-3.1-3b-a800m-instruct
    architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", hidden_size=1536, intermediate_size=512,
    num_attention_heads=24, num_key_value_heads=8, num_hidden_layers=32, num_local_experts=40, num_experts_per_tok=8,
    vocab_size=49155, rms_norm_eps=1e-6, rope_theta=10000000.0, max_position_embeddings=131072,
    attention_multiplier=0.015625, embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
    tie_word_embeddings=True)


def test_granite_moe_hub_config_reads_its_experts_and_multipliers():
    cfg = read(GRANITE_31_3B_A800M)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == (40, 8, 512, 0)
    assert cfg.norm_topk_prob and cfg.router_scoring == "softmax" and not cfg.shared_expert_gate
    assert (cfg.embed_scale, cfg.sm_scale, cfg.residual_scale, cfg.logits_scaling) == (12.0, 0.015625, 0.22, 6.0)
    shared = read(GRANITE_31_3B_A800M | {"architectures": ["GraniteMoeSharedForCausalLM"],
                                         "shared_intermediate_size": 1024})
    assert shared.intermediate_size == 1024 and not shared.shared_expert_gate


GPT2 = dict(  # openai-community/gpt2
    architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=768, n_head=12, n_layer=12, n_positions=1024,
    n_ctx=1024, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5, vocab_size=50257,
    bos_token_id=50256, eos_token_id=50256, scale_attn_weights=True)
OPT_125M = dict(  # facebook/opt-125m
    architectures=["OPTForCausalLM"], model_type="opt", hidden_size=768, ffn_dim=3072, num_attention_heads=12,
    num_hidden_layers=12, max_position_embeddings=2048, word_embed_proj_dim=768, do_layer_norm_before=True,
    activation_function="relu", enable_bias=True, vocab_size=50272, bos_token_id=2, eos_token_id=2, pad_token_id=1)


def test_gpt2_and_opt_hub_configs_have_learned_positions_and_no_rotation():
    gpt2, opt = read(GPT2), read(OPT_125M)
    assert (gpt2.hidden_size, gpt2.intermediate_size, gpt2.num_layers, gpt2.num_heads, gpt2.head_dim) == \
        (768, 3072, 12, 12, 64)
    assert gpt2.max_position_embeddings == 1024 and gpt2.tie_word_embeddings and gpt2.hidden_act == "gelu_tanh"
    assert opt.intermediate_size == 3072 and opt.hidden_act == "relu" and opt.tie_word_embeddings
    for cfg, offset in ((gpt2, 0), (opt, 2)):
        assert cfg.learned_positions and cfg.position_offset == offset and cfg.rope_layers == (False,) * 12
        assert cfg.layer_norm and cfg.norm_bias and not cfg.gated_mlp and cfg.qkv_bias and cfg.o_bias
    assert read(GPT2 | {"scale_attn_weights": False}).sm_scale == 1.0


@pytest.mark.parametrize("hf, change, match", [
    (OPT_125M, dict(do_layer_norm_before=False, word_embed_proj_dim=512), "do_layer_norm_before=false"),
    (OPT_125M, dict(word_embed_proj_dim=512), "word_embed_proj_dim=512"),
    (GPT2, dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=true")])
def test_gpt2_and_opt_layouts_we_do_not_run_are_refused(hf, change, match):
    with pytest.raises(ValueError, match=match):
        read(hf | change)


QWEN2_5_VL_7B = dict(  # Qwen/Qwen2.5-VL-7B-Instruct: the text model's keys at the top level, M-RoPE as rope_scaling
    architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", hidden_size=3584,
    intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000, sliding_window=32768,
    use_sliding_window=False, max_window_layers=28, tie_word_embeddings=False,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, bos_token_id=151643, eos_token_id=151645,
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, torch_dtype="bfloat16",
    vision_config={"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584, "num_heads": 16})
QWEN3_VL_30B_A3B = dict(  # Qwen/Qwen3-VL-30B-A3B-Instruct: a text_config, interleaved M-RoPE
    architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe", tie_word_embeddings=False,
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    text_config={"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "rms_norm_eps": 1e-6, "rope_theta": 5000000, "vocab_size": 151936,
                 "max_position_embeddings": 262144, "tie_word_embeddings": False,
                 "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
    vision_config={"depth": 27, "hidden_size": 1152, "out_hidden_size": 2048, "deepstack_visual_indexes": [8, 16, 24]})


def test_qwen_vl_hub_configs_read_as_their_language_models():
    """Qwen2.5-VL's top-level text keys and Qwen3-VL-MoE's text_config, each as its language model (Qwen2's
    attention with q/k/v biases; Qwen3 MoE's q/k norms and renormalised experts), M-RoPE as the plain rotary
    embedding it is on text."""
    vl = read(QWEN2_5_VL_7B)
    assert vl.architecture == "Qwen2_5_VLForConditionalGeneration" and vl.qkv_bias and not vl.o_bias
    assert (vl.hidden_size, vl.num_layers, vl.num_heads, vl.num_kv_heads, vl.head_dim) == (3584, 28, 28, 4, 128)
    assert vl.rope.rope_type == "default" and vl.rope.theta == 1000000.0 and vl.rope.params == ()
    assert vl.sliding_windows == (0,) * 28 and not vl.tie_word_embeddings and vl.eos_token_ids == (151645,)
    moe = read(QWEN3_VL_30B_A3B)
    assert (moe.num_experts, moe.experts_per_token, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.qk_norm and moe.head_dim == 128 and moe.rope.theta == 5000000
    assert moe.dense_mlp_layers == () and moe.rope.params == ()


GLM_4_7_FLASH = dict(  # zai-org/GLM-4.7-Flash
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240,
    moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20,
    n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768,
    qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
    norm_topk_prob=True, first_k_dense_replace=1, topk_method="noaux_tc", rope_theta=1000000,
    max_position_embeddings=202752, rms_norm_eps=1e-5, vocab_size=154880, num_nextn_predict_layers=1,
    tie_word_embeddings=False)


def test_glm_4_7_flash_hub_config_reads_its_latent_attention_and_dense_layers_as_transformers():
    cfg = read(GLM_4_7_FLASH)
    theirs = transformers.Glm4MoeLiteConfig(**{k: v for k, v in GLM_4_7_FLASH.items() if k != "architectures"})
    assert cfg.dense_mlp_layers == tuple(i for i, t in enumerate(theirs.mlp_layer_types) if t == "dense") == (0,)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (512, 768, 192, 64, 256)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size, cfg.dense_intermediate_size) == \
        (64, 4, 1536, 10240)
    assert cfg.router_scoring == "sigmoid" and cfg.router_correction and cfg.routed_scaling == 1.8
    assert cfg.router_groups == () and cfg.rope_interleaved and cfg.sm_scale == (192 + 64) ** -0.5
    layered = read(GLM_4_7_FLASH | {"num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
    assert layered.dense_mlp_layers == (0, 2)
    with pytest.raises(ValueError, match="mlp_layer_types must give each of the 4 layers"):
        read(GLM_4_7_FLASH | {"num_hidden_layers": 4, "mlp_layer_types": ["dense", "moe", "dense", "sparse"]})


ERNIE_4_5_21B_A3B = dict(  # baidu/ERNIE-4.5-21B-A3B-PT
    architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", hidden_size=2560, intermediate_size=12288,
    num_hidden_layers=28, num_attention_heads=20, num_key_value_heads=4, moe_num_experts=64, moe_k=6,
    moe_intermediate_size=1536, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=27,
    moe_layer_interval=1, rope_theta=500000, max_position_embeddings=131072, vocab_size=103424, rms_norm_eps=1e-5,
    tie_word_embeddings=True, use_bias=False)


def test_ernie_4_5_moe_hub_config_reads_its_expert_layers_as_transformers():
    cfg = read(ERNIE_4_5_21B_A3B)
    assert cfg.dense_mlp_layers == (0,) and cfg.rope_interleaved and cfg.rope.theta == 500000
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (64, 6, 1536, 3072)
    assert cfg.router_scoring == "softmax" and cfg.router_correction and cfg.norm_topk_prob and cfg.router_float32
    every_other = read(ERNIE_4_5_21B_A3B | {"moe_layer_interval": 2, "moe_layer_end_index": -1})
    assert every_other.dense_mlp_layers == tuple(i for i in range(28) if i % 2 == 0)
    with pytest.raises(ValueError, match="use_bias=true"):
        read(ERNIE_4_5_21B_A3B | {"use_bias": True})


MINIMAX_M2 = dict(  # MiniMaxAI/MiniMax-M2 (M2.1 and M2.5 have its shape)
    architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", attn_type_list=[1] * 62, head_dim=128,
    hidden_act="silu", hidden_size=3072, intermediate_size=1536, max_position_embeddings=196608,
    mlp_intermediate_size=8192, num_attention_heads=48, num_experts_per_tok=8, num_hidden_layers=62,
    num_key_value_heads=8, num_local_experts=256, num_mtp_modules=3, qk_norm_type="per_layer", rms_norm_eps=1e-6,
    rope_theta=5000000, rotary_dim=64, scoring_func="sigmoid", shared_intermediate_size=0, tie_word_embeddings=False,
    use_mtp=True, use_qk_norm=True, use_routing_bias=True, vocab_size=200064, bos_token_id=200019,
    eos_token_id=200020, quantization_config=dict(activation_scheme="dynamic", fmt="float8_e4m3fn", quant_method="fp8",
                                                  weight_block_size=[128, 128],
                                                  modules_to_not_convert=["gate", "e_score_correction_bias",
                                                                          "lm_head"]))


def test_minimax_m2_hub_config_reads_as_transformers_builds_it():
    cfg = read(MINIMAX_M2)
    model = meta_model(MINIMAX_M2 | {"num_hidden_layers": 1}, drop=("quantization_config",))
    attention = model.model.layers[0].self_attn
    assert cfg.qk_norm and cfg.qk_norm_whole and attention.q_norm.weight.shape == (cfg.num_heads * cfg.head_dim,)
    assert cfg.rope.rotary_dim(cfg.head_dim) == 2 * model.model.rotary_emb.inv_freq.shape[0] == 64
    assert cfg.rope.theta == 5e6 and (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (62, 48, 8)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (256, 8, 1536, 0)
    assert not cfg.dense_mlp_layers and cfg.norm_topk_prob and cfg.router_float32
    assert cfg.router_scoring == "sigmoid" and cfg.router_correction and not cfg.router_groups
    assert parse_quantization(MINIMAX_M2)[:3] == ("w8a16_fp8", 128, "fp8")  # its FP8 blocks, routers left in float


@pytest.mark.parametrize("change, match", [
    ({"attn_type_list": [0] + [1] * 61}, "lightning attention"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
    ({"shared_intermediate_size": 1024}, "shared_intermediate_size=1024"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
])
def test_minimax_m2_settings_we_do_not_run_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        read(MINIMAX_M2 | change)


HUNYUAN_A13B = dict(  # tencent/Hunyuan-A13B-Instruct (its per-layer lists one value each)
    architectures=["HunYuanMoEV1ForCausalLM"], model_type="hunyuan_v1_moe", attention_bias=False,
    attention_head_dim=128, head_dim=128, bos_token_id=1, eos_token_id=127960, eod_token_id=127967,
    cla_share_factor=2, hidden_act="silu", hidden_size=4096, intermediate_size=3072, max_position_embeddings=32768,
    moe_intermediate_size=[3072] * 32, moe_layer_num_skipped=0, moe_topk=[8] * 32, num_attention_heads=32,
    num_experts=64, num_hidden_layers=32, num_key_value_heads=8, num_shared_expert=[1] * 32, rms_norm_eps=1e-5,
    rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "type": "dynamic"},
    rope_theta=10000.0, tie_word_embeddings=True, use_cla=False, use_mixed_mlp_moe=True, use_qk_norm=True,
    vocab_size=128167)


def test_hunyuan_hub_configs_read_their_alpha_rope_and_experts_as_transformers_builds_them():
    import numpy as np

    from jaxengine.models.config import rope_inv_freq

    cfg = read(HUNYUAN_A13B)
    hf = meta_model(HUNYUAN_A13B | {"num_hidden_layers": 1}, drop=("moe_topk", "moe_intermediate_size",
                                                                    "num_shared_expert"))
    inv_freq, scaling = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    rotary = hf.model.rotary_emb  # on the meta device: its frequencies computed again on the CPU
    assert rotary.rope_type == "ntk_alpha"
    np.testing.assert_allclose(inv_freq, rotary.compute_ntk_alpha_rope_parameters(hf.config)[0].numpy(), rtol=1e-6)
    assert scaling == 1.0 and cfg.rope.rope_type == "default"
    assert cfg.qk_norm and cfg.qk_norm_after_rope and not cfg.qk_norm_whole and cfg.tie_word_embeddings
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (64, 8, 3072, 3072)  # the shared MLP as wide as each expert
    assert cfg.norm_topk_prob and cfg.router_float32 and cfg.router_scoring == "softmax" and not cfg.router_correction
    dense = read(HUNYUAN_A13B | {"architectures": ["HunYuanDenseV1ForCausalLM"], "intermediate_size": 14336})
    assert not dense.num_experts and dense.intermediate_size == 14336 and dense.qk_norm_after_rope
    assert dense.rope.theta == cfg.rope.theta


@pytest.mark.parametrize("change, match", [
    ({"use_cla": True}, "use_cla=true"),
    ({"num_shared_expert": [2] * 32}, r"num_shared_expert=\[2, "),
    ({"moe_topk": [8] * 31 + [4]}, "a value per layer that differs"),
    ({"moe_intermediate_size": 1536}, "moe_intermediate_size=1536"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
])
def test_hunyuan_settings_we_do_not_run_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        read(HUNYUAN_A13B | change)


def test_hy3_config_reads_its_dense_first_layer_and_scaled_router():
    """tencent/Hy3-preview's shape (transformers' HYV3Config defaults, as its documentation gives them)."""
    hf = transformers.HYV3Config().to_dict() | {"architectures": ["HYV3ForCausalLM"]}
    cfg = read(hf)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (80, 64, 8, 128)
    assert cfg.qk_norm and not cfg.qk_norm_whole and cfg.dense_mlp_layers == (0,)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size,
            cfg.dense_intermediate_size) == (192, 8, 1536, 1536, 13312)
    assert cfg.router_scoring == "sigmoid" and cfg.router_correction and cfg.norm_topk_prob and not cfg.router_groups
    assert cfg.routed_scaling == 2.826 and cfg.router_float32
    assert read(hf | {"mlp_layer_types": ["sparse"] * 80}).dense_mlp_layers == ()


def test_afmoe_config_rotates_its_sliding_layers_only_and_routes_as_deepseek_v3():
    """Arcee Trinity's shape (transformers' AfmoeConfig defaults): every fourth layer full attention, unrotated."""
    cfg = read(transformers.AfmoeConfig(mup_enabled=True).to_dict() | {"architectures": ["AfmoeForCausalLM"]})
    assert cfg.rope_layers == tuple(bool((i + 1) % 4) for i in range(32))
    assert cfg.sliding_windows == tuple(1024 if (i + 1) % 4 else 0 for i in range(32))
    assert cfg.qk_norm and cfg.attn_output_gate and cfg.sandwich_norms and cfg.pre_norms
    assert cfg.embed_scale == 2048 ** 0.5 and cfg.dense_mlp_layers == (0,)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size, cfg.dense_intermediate_size) == \
        (64, 6, 2 * 1408, 6144)
    assert cfg.router_scoring == "sigmoid" and cfg.router_correction and cfg.norm_topk_prob and cfg.routed_scaling == 1


def test_mistral_small_4_config_reads_its_latent_attention_temperature_and_router():
    """mistralai/Mistral-Small-4-119B-2603's shape (transformers' Mistral4Config defaults), as the text model of its
    multimodal checkpoint."""
    text = transformers.Mistral4Config().to_dict()
    cfg = read({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": text})
    assert cfg.architecture == "Mistral3ForConditionalGeneration" and cfg.latent_attention
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim) == (256, 1024, 64, 64)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.param("partial_rotary_factor") is None
    assert cfg.q_position_scale == (0.1, 8192, 0, False) and cfg.rope_interleaved
    assert (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size) == (128, 4, 2048)
    assert cfg.router_scoring == "softmax" and cfg.norm_topk_prob and not cfg.router_correction
    assert not cfg.dense_mlp_layers
    with pytest.raises(ValueError, match="n_group=4 with topk_group=2"):
        read(text | {"architectures": ["Mistral4ForCausalLM"], "n_group": 4, "topk_group": 2})


PHI_3_5_MOE = dict(  # microsoft/Phi-3.5-MoE-instruct (its LongRoPE factors shortened to their count)
    architectures=["PhiMoEForCausalLM"], model_type="phimoe", attention_bias=True, lm_head_bias=True, hidden_size=4096,
    intermediate_size=6400, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=16,
    num_experts_per_tok=2, router_jitter_noise=0.01, input_jitter_noise=0.01, rms_norm_eps=1e-5, vocab_size=32064,
    max_position_embeddings=131072, original_max_position_embeddings=4096, sliding_window=131072, rope_theta=10000.0,
    rope_scaling={"type": "longrope", "long_factor": [1.5] * 64, "short_factor": [1.0] * 64, "long_mscale": 1.24,
                  "short_mscale": 1.0, "original_max_position_embeddings": 4096},
    tie_word_embeddings=False, hidden_act="silu")


def test_phi_3_5_moe_hub_config_reads_its_biases_longrope_and_sparsemixer_router():
    cfg = read(PHI_3_5_MOE)
    assert cfg.layer_norm and cfg.norm_bias and cfg.qkv_bias and cfg.o_bias and cfg.lm_head_bias
    assert cfg.rope.rope_type == "longrope" and cfg.sliding_windows == (131072,) * 32
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (16, 2, 6400, 0)
    assert cfg.router_scoring == "sparsemixer" and cfg.router_jitter_eps == 0.01
    with pytest.raises(ValueError, match="num_experts_per_tok=4 is not supported"):
        read(PHI_3_5_MOE | {"num_experts_per_tok": 4})


OLMO_1B = dict(  # allenai/OLMo-1B-hf
    architectures=["OlmoForCausalLM"], model_type="olmo", attention_bias=False, clip_qkv=None, hidden_act="silu",
    hidden_size=2048, intermediate_size=8192, max_position_embeddings=2048, num_attention_heads=16,
    num_hidden_layers=16, num_key_value_heads=16, rope_theta=10000.0, tie_word_embeddings=True, vocab_size=50304,
    pad_token_id=1, eos_token_id=50279)


def test_olmo_hub_config_reads_weightless_layer_norms_and_refuses_clamped_qkv():
    cfg = read(OLMO_1B)
    assert cfg.layer_norm and not cfg.norm_bias and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert not (cfg.qkv_bias or cfg.o_bias) and cfg.gated_mlp and cfg.num_kv_heads == 16
    with pytest.raises(ValueError, match="clip_qkv=8.0 is not supported"):
        read(OLMO_1B | {"clip_qkv": 8.0})


STARCODERBASE_1B = dict(  # bigcode/starcoderbase-1b
    architectures=["GPTBigCodeForCausalLM"], model_type="gpt_bigcode", n_embd=2048, n_head=16, n_layer=24,
    n_positions=8192, n_inner=8192, activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-5,
    multi_query=True, scale_attn_weights=True, vocab_size=49152, bos_token_id=0, eos_token_id=0)


def test_gpt_bigcode_hub_config_has_one_kv_head_and_learned_positions():
    cfg = read(STARCODERBASE_1B)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (16, 1, 128, 8192)
    assert cfg.learned_positions and cfg.position_offset == 0 and cfg.max_position_embeddings == 8192
    assert cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings and cfg.layer_norm and not cfg.gated_mlp
    assert read(STARCODERBASE_1B | {"multi_query": False}).num_kv_heads == 16


GPT_J_6B = dict(  # EleutherAI/gpt-j-6b
    architectures=["GPTJForCausalLM"], model_type="gptj", n_embd=4096, n_head=16, n_layer=28, n_positions=2048,
    n_inner=None, rotary_dim=64, activation_function="gelu_new", layer_norm_epsilon=1e-5, vocab_size=50400,
    tie_word_embeddings=False, bos_token_id=50256, eos_token_id=50256)


def test_gptj_hub_config_rotates_a_quarter_of_each_head_in_interleaved_pairs():
    cfg = read(GPT_J_6B)
    assert (cfg.head_dim, cfg.rope.rotary_dim(cfg.head_dim), cfg.intermediate_size) == (256, 64, 16384)
    assert cfg.rope_interleaved and cfg.parallel_block == 1 and cfg.lm_head_bias and not cfg.qkv_bias
    with pytest.raises(ValueError, match="rotary_dim must be a positive number of each head's 256 dimensions"):
        read(GPT_J_6B | {"rotary_dim": None})


FALCON_7B = dict(  # tiiuae/falcon-7b
    architectures=["FalconForCausalLM"], model_type="falcon", hidden_size=4544, num_attention_heads=71,
    num_hidden_layers=32,
    multi_query=True, parallel_attn=True, bias=False, alibi=False, new_decoder_architecture=False, vocab_size=65024,
    layer_norm_epsilon=1e-5, bos_token_id=11, eos_token_id=11)
FALCON_40B = dict(  # tiiuae/falcon-40b in RefinedWeb's keys (n_head, n_head_kv, n_layer)
    architectures=["FalconForCausalLM"], model_type="falcon", hidden_size=8192, n_head=128, n_head_kv=8, n_layer=60,
    parallel_attn=True, bias=False, alibi=False, new_decoder_architecture=True, vocab_size=65024,
    layer_norm_epsilon=1e-5, bos_token_id=11, eos_token_id=11)


def test_falcon_hub_configs_read_their_kv_heads_and_norms_as_transformers():
    seven, forty = read(FALCON_7B), read(FALCON_40B)
    assert (seven.num_heads, seven.num_kv_heads, seven.head_dim, seven.num_layers) == (71, 1, 64, 32)
    assert seven.parallel_block == 1 and seven.intermediate_size == 4 * 4544 and seven.hidden_act == "gelu"
    assert (forty.num_heads, forty.num_kv_heads, forty.num_layers, forty.parallel_block) == (128, 8, 60, 2)
    assert seven.tie_word_embeddings and not (seven.qkv_bias or seven.mlp_bias) and seven.norm_bias
    with pytest.raises(ValueError, match="alibi=true"):
        read(FALCON_7B | {"alibi": True})


MINITRON_8B = dict(  # nvidia/Minitron-8B-Base
    architectures=["NemotronForCausalLM"], model_type="nemotron", hidden_size=4096, intermediate_size=16384,
    num_attention_heads=48, num_key_value_heads=8, head_dim=128, num_hidden_layers=32, vocab_size=256000,
    hidden_act="relu2", norm_eps=1e-5, partial_rotary_factor=0.5, rope_theta=10000, max_position_embeddings=4096,
    tie_word_embeddings=False)


def test_nemotron_hub_config_rotates_half_of_each_head_under_biased_layer_norms():
    cfg = read(MINITRON_8B)
    assert (cfg.head_dim, cfg.rope.rotary_dim(cfg.head_dim), cfg.num_kv_heads) == (128, 64, 8)
    assert cfg.layer_norm and cfg.norm_bias and not cfg.gated_mlp and cfg.hidden_act == "relu2"
    assert not (cfg.qkv_bias or cfg.mlp_bias) and cfg.parallel_block == 0


# Qwen3.5 in the hub's form (a multimodal checkpoint: text_config with Qwen3.5's keys, M-RoPE, the MTP layer's count),
# 27B's and 35B-A3B's shapes, and Qwen3-Next-80B-A3B's (a causal LM)
QWEN3_5_27B = dict(
    architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", tie_word_embeddings=False,
    image_token_id=248056, video_token_id=248057,
    text_config=dict(model_type="qwen3_5_text", attn_output_gate=True, dtype="bfloat16", eos_token_id=248044,
                     full_attention_interval=4, head_dim=256, hidden_act="silu", hidden_size=5120,
                     intermediate_size=17408, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                     linear_num_key_heads=16, linear_num_value_heads=48, linear_value_head_dim=128,
                     max_position_embeddings=262144,
                     mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, num_attention_heads=24,
                     num_hidden_layers=64, num_key_value_heads=4, rms_norm_eps=1e-6, vocab_size=248320,
                     rope_parameters=dict(mrope_interleaved=True, mrope_section=[11, 11, 10], rope_type="default",
                                          rope_theta=10000000, partial_rotary_factor=0.25)),
    vision_config=dict(model_type="qwen3_5", depth=27, hidden_size=1152, out_hidden_size=5120))
QWEN3_5_35B_A3B = QWEN3_5_27B | dict(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                                     text_config={k: v for k, v in QWEN3_5_27B["text_config"].items()
                                                  if k != "intermediate_size"} | dict(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512))
QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", decoder_sparse_step=1, eos_token_id=151645,
    full_attention_interval=4, head_dim=256, hidden_size=2048, intermediate_size=5120, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, linear_value_head_dim=128,
    max_position_embeddings=262144, mlp_only_layers=[], moe_intermediate_size=512, norm_topk_prob=True,
    num_attention_heads=16, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48, num_key_value_heads=2,
    partial_rotary_factor=0.25, rms_norm_eps=1e-6, rope_theta=10000000, shared_expert_intermediate_size=512,
    tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=151936)


@pytest.mark.parametrize("hf", [QWEN3_5_27B, QWEN3_5_35B_A3B, QWEN3_NEXT_80B])
def test_qwen3_5_hub_configs_read_their_linear_layers_as_transformers(hf):
    """Every fourth layer full attention (transformers' layer types from full_attention_interval), the others Gated
    DeltaNet with their heads; stacks alternating between the two, the KV cache for the full layers only; M-RoPE as the
    plain rope on a quarter of each head; gated attention output, 1 + weight norms; the MoE's experts."""
    from jaxengine.models.llama import layer_groups

    cfg = read(hf)
    text = hf.get("text_config", hf)
    config_class = {"qwen3_5_text": transformers.Qwen3_5TextConfig, "qwen3_next": transformers.Qwen3NextConfig,
                    "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig}[text["model_type"]]
    theirs = config_class(**{k: v for k, v in text.items() if k != "model_type"})
    assert cfg.linear_layers == tuple(i for i, t in enumerate(theirs.layer_types) if t == "linear_attention")
    assert len(cfg.linear_layers) == 3 * cfg.num_layers // 4 and cfg.kv_cache_layers == cfg.num_layers // 4
    assert cfg.linear_heads == (16, text["linear_num_value_heads"], 128, 128, 4)
    groups = layer_groups(cfg)
    assert len(groups) == cfg.num_layers // 2 and [g.linear_attention for _, _, g in groups[:2]] == [True, False]
    assert [(first, g.num_layers, g.kv_first) for _, first, g in groups[:4]] == [(0, 3, 0), (3, 1, 0), (4, 3, 3),
                                                                                 (7, 1, 1)]
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.rotary_dim(cfg.head_dim)) == ("default", 10000000, 64)
    assert cfg.attn_output_gate and cfg.norm_offset and cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (256, text["num_attention_heads"],
                                                               text["num_key_value_heads"])
    assert cfg.eos_token_ids == (text["eos_token_id"],) and cfg.torch_dtype == "bfloat16"
    experts = (text.get("num_experts", 0), text.get("num_experts_per_tok", 0), text.get("moe_intermediate_size", 0))
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == experts
    if cfg.num_experts:
        assert cfg.shared_expert_gate and cfg.norm_topk_prob and cfg.intermediate_size == 512
        assert cfg.dense_mlp_layers == ()


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["linear_attention"] * 63 + ["sliding_attention"]), "sliding_attention"),
    (dict(sliding_window=4096), "sliding_window"),
    (dict(linear_num_value_heads=40, linear_num_key_heads=16), "not a multiple"),
])
def test_qwen3_5_settings_we_do_not_run_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        read(QWEN3_5_27B | dict(text_config=QWEN3_5_27B["text_config"] | change))


def test_quantized_qwen3_5_checkpoints_are_refused():
    with pytest.raises(ValueError, match="quantized Qwen3_5ForConditionalGeneration checkpoints are not supported"):
        read(QWEN3_5_27B | dict(quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128])))


def test_tensor_parallelism_over_linear_attention_is_refused():
    from jaxengine.parallel.sharding import check_layout

    with pytest.raises(ValueError, match="linear-attention layers run on one device"):
        check_layout(read(QWEN3_5_27B), 2, 1, 8)


# LFM2 in the hub's form: LFM2-1.2B's (transformers 4.x keys: full_attn_idxs, rope_theta, norm_eps) and LFM2-8B-A1B's
LFM2_1_2B = dict(
    architectures=["Lfm2ForCausalLM"], model_type="lfm2", block_auto_adjust_ff_dim=True, block_dim=2048,
    block_ff_dim=12288, block_ffn_dim_multiplier=1.0, block_multiple_of=256, block_norm_eps=1e-5, conv_L_cache=3,
    conv_bias=False, eos_token_id=7, full_attn_idxs=[2, 5, 8, 10, 12, 14], hidden_size=2048, intermediate_size=12288,
    max_position_embeddings=128000, norm_eps=1e-5, num_attention_heads=32, num_heads=32, num_hidden_layers=16,
    num_key_value_heads=8, rope_theta=1000000.0, torch_dtype="bfloat16", vocab_size=65536, tie_embedding=True)
LFM2_8B_A1B = dict(
    architectures=["Lfm2MoeForCausalLM"], model_type="lfm2_moe", conv_L_cache=3, conv_bias=False, eos_token_id=7,
    hidden_size=2048, intermediate_size=7168, layer_types=["conv", "conv", "full_attention"] * 8,
    moe_intermediate_size=1792, norm_eps=1e-5, norm_topk_prob=True, num_attention_heads=32, num_dense_layers=2,
    num_experts=32, num_experts_per_tok=4, num_hidden_layers=24, num_key_value_heads=8, routed_scaling_factor=1.0,
    rope_theta=1000000.0, use_expert_bias=True, vocab_size=65536, dtype="bfloat16")


@pytest.mark.parametrize("hf", [LFM2_1_2B, LFM2_8B_A1B])
def test_lfm2_hub_configs_read_as_transformers_builds_them(hf):
    """The convolution layers where transformers puts them (its layer types, from full_attn_idxs in LFM2-1.2B's), the
    MLP's width as transformers adjusts it (built on the meta device), LFM2-MoE's dense layers and sigmoid router."""
    import torch

    from jaxengine.models.llama import layer_groups

    cfg = read(hf)
    config_class, model_class = {"lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
                                 "lfm2_moe": (transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM)}[
        hf["model_type"]]
    theirs = config_class(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert cfg.linear_layers == tuple(i for i, t in enumerate(theirs.layer_types) if t == "conv")
    assert cfg.short_conv_width == 3 and cfg.kv_cache_layers == cfg.num_layers - len(cfg.linear_layers)
    with torch.device("meta"):
        layers = model_class(theirs).model.layers
    mlp = layers[0].feed_forward
    width = cfg.dense_intermediate_size if cfg.num_experts else cfg.intermediate_size
    assert width == mlp.w1.out_features
    assert (cfg.head_dim, cfg.rope.theta, cfg.rms_norm_eps, cfg.qk_norm) == (64, 1000000.0, 1e-5, True)
    assert [g.linear_attention for _, _, g in layer_groups(cfg)][:2] == [True, False]
    if cfg.num_experts:
        moe = layers[-1].feed_forward
        assert cfg.dense_mlp_layers == (0, 1) and cfg.moe_intermediate_size == moe.experts.intermediate_dim
        assert (cfg.num_experts, cfg.experts_per_token, cfg.router_scoring, cfg.router_correction) == (
            32, 4, "sigmoid", True)
        assert cfg.norm_topk_prob and cfg.router_renorm_eps == 1e-6 and cfg.intermediate_size == 0


# Granite 4.0 in the hub's form: 4.0-H-Tiny's (Mamba2 mixers and 4 attention layers of 40, 64 experts beside a shared
# MLP, NoPE) and 4.0-H-Micro's (dense)
_GRANITE4_TYPES = (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4
GRANITE4_H_TINY = dict(
    architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", attention_multiplier=0.0078125,
    embedding_multiplier=12, hidden_size=1536, intermediate_size=512, layer_types=_GRANITE4_TYPES, logits_scaling=6,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=64, mamba_d_state=128, mamba_expand=2,
    mamba_n_groups=1, mamba_n_heads=48, mamba_proj_bias=False, max_position_embeddings=131072, num_attention_heads=12,
    num_experts_per_tok=6, num_hidden_layers=40, num_key_value_heads=4, num_local_experts=64,
    position_embedding_type="nope", residual_multiplier=0.22, rms_norm_eps=1e-5, rope_theta=10000,
    shared_intermediate_size=1024, tie_word_embeddings=True, vocab_size=100352, torch_dtype="bfloat16",
    eos_token_id=100257)
GRANITE4_H_MICRO = GRANITE4_H_TINY | dict(hidden_size=2048, intermediate_size=8192, shared_intermediate_size=8192,
                                          num_local_experts=0, mamba_n_heads=64, num_attention_heads=32,
                                          num_key_value_heads=8)


@pytest.mark.parametrize("hf", [GRANITE4_H_TINY, GRANITE4_H_MICRO])
def test_granite4_hub_configs_read_as_transformers_builds_them(hf):
    """The Mamba2 mixers where transformers puts them and of the shape it builds (on the meta device), NoPE attention
    layers, Granite's multipliers, the experts beside the shared MLP (or the shared MLP alone)."""
    import torch

    cfg = read(hf)
    theirs = transformers.GraniteMoeHybridConfig(**{k: v for k, v in hf.items() if k not in ("architectures",
                                                                                               "model_type")})
    with torch.device("meta"):
        layers = transformers.GraniteMoeHybridForCausalLM(theirs).model.layers
    assert cfg.linear_layers == tuple(i for i, layer in enumerate(layers) if layer.mamba is not None)
    mixer = layers[0].mamba
    assert cfg.ssm_heads == (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups,
                             mixer.conv_kernel_size)
    assert cfg.ssm_conv_bias and not cfg.ssm_proj_bias and cfg.ssm_dt_limit == ()
    assert cfg.rope_layers == (False,) * 40 and cfg.kv_cache_layers == 4
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logits_scaling) == (12, 0.0078125, 0.22, 6)
    shared = layers[0].shared_mlp.output_linear.in_features
    if hf["num_local_experts"]:
        assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == (
            64, 6, layers[0].block_sparse_moe.experts.intermediate_dim, shared)
    else:
        assert cfg.num_experts == 0 and cfg.intermediate_size == shared


# Nemotron-H in the hub's form: NVIDIA Nemotron Nano 9B v2 (Mamba2 mixers, 4 attention layers, ReLU^2 MLP blocks, two
# mixers in a row twice) and Nemotron 3 Nano 30B-A3B (each mixer followed by a mixture of experts)
NEMOTRON_NANO_9B_V2 = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h", attention_bias=False, attention_head_dim=128,
    chunk_size=128, conv_kernel=4, expand=2, hidden_size=4480, intermediate_size=15680,
    hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-", layer_norm_epsilon=1e-5,
    mamba_head_dim=80, mamba_hidden_act="silu", mamba_num_heads=128, mamba_proj_bias=False,
    max_position_embeddings=131072, mlp_bias=False, mlp_hidden_act="relu2", n_groups=8, num_attention_heads=40,
    num_hidden_layers=56, num_key_value_heads=8, ssm_state_size=128, tie_word_embeddings=False,
    time_step_limit=[0.0, float("inf")], use_bias=False, use_conv_bias=True, vocab_size=131072,
    torch_dtype="bfloat16", eos_token_id=12)
NEMOTRON3_NANO = NEMOTRON_NANO_9B_V2 | dict(
    attention_head_dim=None, head_dim=128, hidden_size=2688, intermediate_size=1856,
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", mamba_head_dim=64,
    mamba_num_heads=64, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1,
    n_routed_experts=128, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=32, num_experts_per_tok=6,
    num_hidden_layers=52, num_key_value_heads=2, routed_scaling_factor=2.5, topk_group=1)


@pytest.mark.parametrize("hf", [NEMOTRON_NANO_9B_V2, NEMOTRON3_NANO])
def test_nemotron_h_hub_configs_read_as_transformers_builds_them(hf):
    """Each of our layers a mixer block and the MLP block after it (none where another mixer follows), the Mamba2
    mixers of the shape transformers builds (on the meta device), attention without rotary embedding, the ungated
    MLPs, and Nemotron 3 Nano's experts (DeepSeek V3's router, a shared expert)."""
    cfg = read(hf)
    layers = meta_model(hf, drop=("attention_head_dim",)).model.layers
    kinds = [layer.block_type for layer in layers]
    mixers = [i for i, kind in enumerate(kinds) if kind in ("linear_attention", "full_attention")]
    assert cfg.num_layers == len(mixers) and [m for m, _ in cfg.layer_sources] == mixers
    assert cfg.linear_layers == tuple(j for j, i in enumerate(mixers) if kinds[i] == "linear_attention")
    assert cfg.no_mlp_layers == tuple(j for j, i in enumerate(mixers) if i + 1 >= len(kinds) or i + 1 in mixers)
    assert cfg.ssm_heads == mamba2_heads(layers[0].mixer)
    attention = layers[kinds.index("full_attention")].mixer
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (
        attention.head_dim, attention.q_proj.out_features // attention.head_dim,
        attention.k_proj.out_features // attention.head_dim)
    assert cfg.rope_layers == (False,) * cfg.num_layers and cfg.kv_cache_layers == 4 + 2 * bool(cfg.num_experts)
    assert not cfg.gated_mlp and cfg.hidden_act == "relu2" and cfg.ssm_activation == "silu"
    assert cfg.ssm_conv_bias and not cfg.ssm_proj_bias and cfg.ssm_dt_limit == () and cfg.rms_norm_eps == 1e-5
    if "E" in hf["hybrid_override_pattern"]:
        moe = layers[kinds.index("moe")].mixer
        assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.intermediate_size) == (
            128, 6, moe.experts.intermediate_dim, moe.shared_experts.up_proj.out_features)
        assert (cfg.router_scoring, cfg.router_correction, cfg.router_groups, cfg.routed_scaling) == (
            "sigmoid", True, (), 2.5)
        assert cfg.norm_topk_prob and cfg.dense_mlp_layers == () and cfg.moe_latent_size == 0
    else:
        assert cfg.num_experts == 0 and cfg.intermediate_size == layers[1].mixer.up_proj.out_features


def test_nemotron_h_refuses_mlp_blocks_without_a_mixer_before_them():
    """An MLP block after another MLP block (or first) has no layer of ours to join: refused by name."""
    with pytest.raises(ValueError, match="layer 2's mlp block follows another MLP block"):
        read(NEMOTRON_NANO_9B_V2 | dict(hybrid_override_pattern="M--M", num_hidden_layers=4))
    with pytest.raises(ValueError, match="layer 0's moe block follows no mixer"):
        read(NEMOTRON3_NANO | dict(hybrid_override_pattern="EM", num_hidden_layers=2))
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        read(NEMOTRON_NANO_9B_V2 | dict(hybrid_override_pattern="M-X"))


# Bamba-9B v2 in the hub's form
BAMBA_9B = dict(
    architectures=["BambaForCausalLM"], model_type="bamba", attn_layer_indices=[9, 18, 27], attention_bias=False,
    hidden_act="silu", hidden_size=4096, intermediate_size=14336, mamba_chunk_size=256, mamba_conv_bias=True,
    mamba_d_conv=4, mamba_d_head=64, mamba_d_state=128, mamba_expand=2, mamba_n_groups=1, mamba_n_heads=128,
    mamba_proj_bias=False, max_position_embeddings=262144, num_attention_heads=32, num_hidden_layers=32,
    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, vocab_size=128256,
    torch_dtype="bfloat16")


def test_bamba_hub_config_reads_as_transformers_builds_it():
    """The Mamba2 mixers where transformers puts them and of the shape it builds (on the meta device), attention
    layers rotating half of each head (transformers' hard-wired factor, which the hub's config does not give)."""
    cfg = read(BAMBA_9B)
    model = meta_model(BAMBA_9B).model
    assert cfg.linear_layers == tuple(i for i, layer in enumerate(model.layers) if layer.block_type != "full_attention")
    assert cfg.ssm_heads == mamba2_heads(model.layers[0].mamba)
    assert cfg.ssm_conv_bias and not cfg.ssm_proj_bias and cfg.ssm_dt_limit == () and cfg.ssm_activation == "silu"
    assert cfg.rope.rotary_dim(cfg.head_dim) == model.rotary_emb.inv_freq.shape[0] * 2 == 64
    assert cfg.kv_cache_layers == 3 and cfg.gated_mlp and cfg.intermediate_size == 14336


# Mamba-Codestral-7B in the hub's form
MAMBA_CODESTRAL = dict(
    architectures=["Mamba2ForCausalLM"], model_type="mamba2", chunk_size=256, conv_kernel=4, expand=2, head_dim=64,
    hidden_act="silu", hidden_size=4096, layer_norm_epsilon=1e-5, n_groups=8, num_heads=128, num_hidden_layers=64,
    residual_in_fp32=True, state_size=128, tie_word_embeddings=False, time_step_limit=[0.0, float("inf")],
    use_bias=False, use_conv_bias=True, vocab_size=32768, torch_dtype="bfloat16")


def test_mamba2_hub_config_reads_as_transformers_builds_it():
    """Mixers only, of the shape transformers builds (on the meta device): no attention layer, no MLP, no KV cache;
    num_heads and head_dim the mixers'; 2048 positions where the config gives no length (vLLM's default)."""
    cfg = read(MAMBA_CODESTRAL)
    assert cfg.ssm_heads == mamba2_heads(meta_model(MAMBA_CODESTRAL).backbone.layers[0].mixer)
    assert cfg.linear_layers == cfg.no_mlp_layers == tuple(range(64)) and cfg.kv_cache_layers == 0
    assert cfg.ssm_conv_bias and not cfg.ssm_proj_bias and cfg.ssm_activation == "silu"
    assert cfg.max_position_embeddings == 2048 and not cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="num_heads x head_dim must be expand x hidden_size"):
        read(MAMBA_CODESTRAL | dict(num_heads=64))


# Falcon-H1-0.5B in the hub's form
FALCON_H1_05B = dict(
    architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", attention_bias=False, attention_in_multiplier=1.0,
    attention_out_multiplier=0.9375, embedding_multiplier=5.656854249492381, head_dim=64, hidden_act="silu",
    hidden_size=1024, intermediate_size=2048, key_multiplier=0.39062499999999994, lm_head_multiplier=0.0390625,
    mamba_chunk_size=128, mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=64, mamba_d_ssm=1536, mamba_d_state=128,
    mamba_expand=2, mamba_n_groups=1, mamba_n_heads=24, mamba_norm_before_gate=False, mamba_proj_bias=False,
    mamba_rms_norm=False, max_position_embeddings=16384, mlp_bias=False,
    mlp_multipliers=[0.8838834764831844, 0.5859375], num_attention_heads=8, num_hidden_layers=36,
    num_key_value_heads=2, projectors_bias=False, rms_norm_eps=1e-5, rope_theta=100000000000.0,
    ssm_in_multiplier=1.25, ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    ssm_out_multiplier=0.23570226039551587, tie_word_embeddings=False, vocab_size=32784, torch_dtype="bfloat16")


def test_falcon_h1_hub_config_reads_as_transformers_builds_it():
    """A mixer beside the attention in every layer (the KV cache has every layer, the state too), of the shape
    transformers builds (on the meta device: its inner width mamba_d_ssm, not expand x hidden), no output norm, the
    multipliers kept for the load (the embeddings' and the logits' as the model's own scales)."""
    cfg = read(FALCON_H1_05B)
    mixer = meta_model(FALCON_H1_05B).model.layers[0].mamba
    assert cfg.ssm_heads == mamba2_heads(mixer) and mixer.intermediate_size == 1536
    assert cfg.ssm_parallel and cfg.linear_layers == tuple(range(36)) and cfg.kv_cache_layers == 36
    assert cfg.ssm_norm == "" and cfg.ssm_activation == "silu" and cfg.rope.theta == 1e11
    assert cfg.embed_scale == FALCON_H1_05B["embedding_multiplier"] and cfg.logits_scaling == 1 / 0.0390625
    multipliers = dict(cfg.mup_multipliers)
    assert multipliers["ssm"] == tuple(FALCON_H1_05B["ssm_multipliers"]) and multipliers["key_multiplier"] == (
        FALCON_H1_05B["key_multiplier"])
    with pytest.raises(ValueError, match="mamba_proj_bias=True and projectors_bias=False differ"):
        read(FALCON_H1_05B | dict(mamba_proj_bias=True))


# Kimi-Linear-48B-A3B in the hub's form
_KIMI_FULL = [4, 8, 12, 16, 20, 24, 27]
KIMI_LINEAR_48B = dict(
    architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=163840, hidden_size=2304,
    intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27, num_attention_heads=32,
    num_key_value_heads=32, head_dim=72, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, num_experts=256, num_experts_per_token=8,
    num_shared_experts=1, moe_renormalize=True, moe_router_activation_func="sigmoid", routed_scaling_factor=2.446,
    num_expert_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True,
    hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, model_max_length=1048576,
    bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, torch_dtype="bfloat16",
    linear_attn_config=dict(full_attn_layers=_KIMI_FULL, kda_layers=[i for i in range(1, 28) if i not in _KIMI_FULL],
                            head_dim=128, num_heads=32, short_conv_kernel_size=4))


def test_kimi_linear_hub_config_reads_as_transformers_builds_it():
    """The delta attention layers where transformers puts them (the hub's 1-based lists) and of the shape it builds
    (on the meta device), NoPE latent attention scaled by the query head's width, DeepSeek V3's experts after one
    dense layer; another router, or rotary latent attention, refused by name."""
    cfg = read(KIMI_LINEAR_48B)
    layers = meta_model(KIMI_LINEAR_48B).model.layers
    kinds = [layer.block_type for layer in layers]
    assert cfg.linear_layers == tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    assert cfg.kv_cache_layers == 7 and cfg.linear_kda and cfg.rope_layers == (False,) * 27
    delta = layers[0].self_attn
    assert cfg.linear_heads == (delta.num_heads, delta.num_heads, delta.head_dim, delta.head_dim,
                                delta.conv_kernel_size)
    latent = layers[3].self_attn
    assert cfg.sm_scale == latent.scaling and cfg.kv_lora_rank == 512 and cfg.max_position_embeddings == 1048576
    assert (cfg.num_experts, cfg.experts_per_token, cfg.dense_mlp_layers, cfg.router_scoring, cfg.routed_scaling) == (
        256, 8, (0,), "sigmoid", 2.446)
    assert cfg.intermediate_size == layers[1].mlp.shared_experts.up_proj.out_features
    with pytest.raises(ValueError, match="moe_router_activation_func='softmax'"):
        read(KIMI_LINEAR_48B | dict(moe_router_activation_func="softmax"))
    with pytest.raises(ValueError, match="mla_use_nope=false"):
        read(KIMI_LINEAR_48B | dict(mla_use_nope=False))


# mamba-2.8b-hf, falcon-mamba-7b and Jamba Mini 1.6 in the hub's form
MAMBA_28B = dict(
    architectures=["MambaForCausalLM"], model_type="mamba", conv_kernel=4, expand=2, hidden_act="silu",
    hidden_size=2560, intermediate_size=5120, layer_norm_epsilon=1e-5, num_hidden_layers=64, residual_in_fp32=True,
    state_size=16, time_step_rank=160, use_bias=False, use_conv_bias=True, vocab_size=50280, torch_dtype="float32",
    tie_word_embeddings=True)
FALCON_MAMBA_7B = MAMBA_28B | dict(
    architectures=["FalconMambaForCausalLM"], model_type="falcon_mamba", hidden_size=4096, intermediate_size=8192,
    time_step_rank=256, vocab_size=65024, mixer_rms_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16")
JAMBA_MINI = dict(
    architectures=["JambaForCausalLM"], model_type="jamba", attn_layer_offset=4, attn_layer_period=8,
    expert_layer_offset=1, expert_layer_period=2, hidden_act="silu", hidden_size=4096, intermediate_size=14336,
    mamba_conv_bias=True, mamba_d_conv=4, mamba_d_state=16, mamba_dt_rank=256, mamba_expand=2, mamba_proj_bias=False,
    max_position_embeddings=262144, num_attention_heads=32, num_experts=16, num_experts_per_tok=2,
    num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-6, tie_word_embeddings=False, vocab_size=65536,
    torch_dtype="bfloat16")


@pytest.mark.parametrize("hf", [MAMBA_28B, FALCON_MAMBA_7B, JAMBA_MINI])
def test_mamba1_hub_configs_read_as_transformers_builds_them(hf):
    """Mamba1 mixers of the shape transformers builds (on the meta device): inner width, state size, time-step rank,
    convolution; FalconMamba's weightless and Jamba's weighted norms on dt, B and C; Jamba's attention every 8th layer
    (NoPE) and experts every other one (not renormalised), Mamba's and FalconMamba's no attention nor KV cache."""
    cfg = read(hf)
    model = meta_model(hf)
    layers = (model.model if hasattr(model, "model") else model.backbone).layers
    mixer = next(getattr(layer, "mamba", None) or getattr(layer, "mixer", None) for layer in layers)
    assert cfg.mamba1 == (mixer.intermediate_size, mixer.ssm_state_size, mixer.time_step_rank,
                          mixer.conv_kernel_size)
    assert cfg.ssm_conv_bias and not cfg.ssm_proj_bias and cfg.ssm_activation == "silu" and not cfg.ssm_heads
    if hf["model_type"] == "jamba":
        assert cfg.linear_layers == tuple(i for i, layer in enumerate(layers) if hasattr(layer, "mamba"))
        assert cfg.kv_cache_layers == 4 and cfg.rope_layers == (False,) * 32 and cfg.ssm_bcdt_norm == (True, 1e-6)
        assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.moe_intermediate_size) == (
            16, 2, False, 14336)
        assert cfg.dense_mlp_layers == tuple(range(0, 32, 2)) and cfg.intermediate_size == 0
    else:
        assert cfg.linear_layers == cfg.no_mlp_layers == tuple(range(64)) and cfg.kv_cache_layers == 0
        assert cfg.ssm_bcdt_norm == ((False, 1e-6) if hf["model_type"] == "falcon_mamba" else ())
