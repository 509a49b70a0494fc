"""Our Flax models against Hugging Face transformers on tiny random checkpoints."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxengine.models import load_model
from jaxengine.models.llama import layer_groups
from jaxengine.models.loader import native_matmul_applies
from tests import tiny_models
from tests.conftest import ARCHS
from tests.paged import PagedModel

needs_native_matmul = pytest.mark.skipif(not native_matmul_applies(),
                                         reason="the native bfloat16 matmul needs a CPU with AVX-512 BF16 or AVX2")

PROMPT_LENS = (1, 37, 100, 64)
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    cache = {}

    def get(arch, dtype=torch.float32):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=dtype).eval()
        return cache[arch, dtype]

    return get


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().numpy()


def sequences(vocab_size, extra=0, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n + extra).tolist() for n in PROMPT_LENS]


def prefill_and_decode(model, seqs):
    """Prefills every prompt as one ragged batch, then decodes DECODE_STEPS tokens for all of them."""
    paged = PagedModel(model)
    paged.add_sequences(len(seqs))
    prompts = [s[: len(s) - DECODE_STEPS] for s in seqs]
    prefill = paged.step(prompts, num_tokens=256, all_logits=True)
    decoded = [[] for _ in seqs]
    for i in range(DECODE_STEPS):
        pos = [len(p) + i for p in prompts]
        for out, logits in zip(decoded, paged.step([[s[p]] for s, p in zip(seqs, pos)], num_tokens=16)):
            out.append(logits)
    return prefill, [np.stack(d) for d in decoded]


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_prefill_logits_match_transformers(arch, model_dirs, hf_models):
    model, cfg = load_model(model_dirs[arch], "float32", progress=False)
    prompts = sequences(cfg.vocab_size)
    paged = PagedModel(model)
    paged.add_sequences(len(prompts))
    ours = paged.step(prompts, num_tokens=256, all_logits=True)
    for prompt, logits in zip(prompts, ours):
        np.testing.assert_allclose(logits, hf_logits(hf_models(arch), prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention,layers", [("auto", "stacked"), ("reference", "unstacked")])
@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_through_scattered_pages_matches_transformers(arch, attention, layers, model_dirs,
                                                                          hf_models):
    """Both CPU attention bodies (native under `auto`, and the pure-JAX reference) and both layer loops
    (lax.scan over stacked weights, the unrolled loop over per-layer arrays)."""
    model, cfg = load_model(model_dirs[arch], "float32", progress=False, attention_backend=attention)
    if layers == "unstacked":
        model.unstack_layers()
        assert model.layers_unstacked and sum(len(getattr(model, name)) for name, _, _ in layer_groups(cfg)) == \
            cfg.num_layers
    seqs = sequences(cfg.vocab_size, extra=DECODE_STEPS, seed=1)
    prefill, decoded = prefill_and_decode(model, seqs)
    for seq, pre, dec in zip(seqs, prefill, decoded):
        ref = hf_logits(hf_models(arch), seq)
        np.testing.assert_allclose(pre, ref[: len(pre)], atol=1e-4, rtol=0)
        np.testing.assert_allclose(dec, ref[len(pre):], atol=1e-4, rtol=0)


@pytest.mark.parametrize("matmul", ["xla", pytest.param("native", marks=needs_native_matmul)])
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_error_is_within_twice_transformers_own_bfloat16_error(arch, matmul, model_dirs, hf_models):
    """bfloat16 keeps 8 mantissa bits, so both engines drift from the float32 result by rounding that depends on
    the order of operations; a fixed tolerance would be arbitrary. Instead we measure transformers' own bfloat16
    drift from its float32 logits on the same inputs and require ours to stay within twice that (plus one bf16
    ulp at the logits' scale), and greedy choices to agree on almost every position. Both bfloat16 matmul
    paths: XLA's dot over a float32 KV cache, and the engine's CPU default for a bfloat16 checkpoint: the native
    matmul (which also gives a tied model its own head copy) with a bfloat16 KV cache written and read by the
    native kernels (transformers keeps its K/V in bfloat16 too). A mixture of experts' router takes each token's
    top experts by probabilities that bfloat16 rounding can reorder (transformers' own bfloat16 run moves some
    tokens to other experts, logits then off by units): there at most 5% of the tokens may exceed the bound."""
    bfloat16_within_transformers_error(model_dirs[arch], matmul == "native", lambda dtype: hf_models(arch, dtype))


def bfloat16_within_transformers_error(model_dir, native: bool, hf_model):
    """test_bfloat16_error_is_within_twice_transformers_own_bfloat16_error's check of the checkpoint at `model_dir`
    (`hf_model(dtype)`: transformers' model of it in that dtype)."""
    model, cfg = load_model(model_dir, "bfloat16", progress=False, native_matmul=native)
    assert model.native_matmul == native
    if native:
        model.kv_dtype = jnp.bfloat16
    seqs = sequences(cfg.vocab_size, extra=DECODE_STEPS, seed=2)
    prefill, decoded = prefill_and_decode(model, seqs)
    agree = total = over = 0
    for seq, pre, dec in zip(seqs, prefill, decoded):
        ours = np.concatenate([pre, dec])
        exact = hf_logits(hf_model(torch.float32), seq)
        hf_bf16 = hf_logits(hf_model(torch.bfloat16), seq)
        hf_error = np.abs(hf_bf16 - exact).max()
        ulp = np.abs(exact).max() * 2.0 ** -8
        errors = np.abs(ours - exact).max(-1)  # per token
        if cfg.num_experts:
            over += (errors > 2 * hf_error + ulp).sum()
        else:
            assert errors.max() <= 2 * hf_error + ulp
        agree += (ours.argmax(-1) == exact.argmax(-1)).sum()
        total += len(seq)
    assert over <= 0.05 * total
    assert agree >= 0.9 * total


@needs_native_matmul
@pytest.mark.parametrize("name,overrides", [("minimax_m2", {}), ("hunyuanmoe", {}), ("hy_v3", {}), ("afmoe", {}),
                                            ("phimoe", dict(router_jitter_noise=0.01)), ("mistral4", {}), ("olmo", {})])
def test_bfloat16_native_error_of_newer_families(name, overrides, tmp_path):
    """The check above on the native matmul for families whose tiny models are not among ARCHS: their routers
    (sigmoid with a correction bias, Phi-3.5-MoE's sparsemixer, Mistral 4's softmax over all experts) and layers
    (latent attention, norms after the rotation, weightless LayerNorms) through the grouped and plain bfloat16
    kernels and a bfloat16 KV cache."""
    model_dir = tiny_models.make_model(name, tmp_path / name, **overrides)
    cls = getattr(transformers, tiny_models.read_config(model_dir)["architectures"][0])
    hf_model = lambda dtype: cls.from_pretrained(model_dir, dtype=dtype).eval()  # noqa: E731
    bfloat16_within_transformers_error(model_dir, True, hf_model)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory, tokenizer_dir):
    """Llama with attention biases (q/k/v and o) and an intermediate size of whole 32-column panels, so that the
    native path packs gate/up together and runs the gated MLP as the down matmul's prologue."""
    out = tmp_path_factory.mktemp("llama-bias")
    return tiny_models.make_model("llama", out, tokenizer_dir, attention_bias=True, intermediate_size=128)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_native_matmul)])
def test_attention_biases_and_the_fused_native_layer_match_transformers(dtype, biased_llama):
    """float32: XLA's dots with o_proj's bias and the residual. bfloat16 (native): every matmul of the layer
    fused as on the peer model: the norms as prologues of the packed q/k/v and gate/up matmuls, silu(gate) * up
    as the down matmul's prologue, the residual (plus o's bias) added by the o and down matmuls."""
    model, cfg = load_model(biased_llama, dtype, progress=False, native_matmul=dtype == "bfloat16")
    assert cfg.qkv_bias and cfg.o_bias
    if dtype == "bfloat16":
        assert hasattr(model.layers, "qkv_proj") and hasattr(model.layers, "gate_up_proj")
        model.kv_dtype = jnp.bfloat16
    seqs = sequences(cfg.vocab_size, extra=DECODE_STEPS, seed=3)
    prefill, decoded = prefill_and_decode(model, seqs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.bfloat16).eval()
    for seq, pre, dec in zip(seqs, prefill, decoded):
        ours, exact = np.concatenate([pre, dec]), hf_logits(hf, seq)
        if dtype == "float32":
            np.testing.assert_allclose(ours, exact, atol=1e-4, rtol=0)
        else:  # the bfloat16 criterion of the test above
            hf_error = np.abs(hf_logits(hf_bf16, seq) - exact).max()
            assert np.abs(ours - exact).max() <= 2 * hf_error + np.abs(exact).max() * 2.0 ** -8


@needs_native_matmul
@pytest.mark.parametrize("activation,post_norm", [("silu", False), ("gelu_tanh", True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_mlp_over_a_pack_gated_weight(dtype, activation, post_norm):
    """The layer's MLP over packed gate/up weights: float32 rows take the native gated products (activation in
    registers, the down projection's input handed over rounded); bfloat16 rows split the packed products back
    into gate and up for XLA's activation. Both against the formula over the unpacked weights; SwiGLU with the
    residual added by the down matmul, and Gemma's tanh-GELU gate with a norm on the MLP's output."""
    from jaxengine.layers.activations import ACTIVATIONS
    from jaxengine.layers.norms import rms_norm
    from jaxengine.models.llama import _gated_mlp
    from pallas_kernels import cpu

    rng = np.random.default_rng(5)
    T, D, I = 9, 64, 48
    gate, up, down = (jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[0])).astype(jnp.bfloat16)
                      for s in ((D, I), (D, I), (I, D)))
    norm = jnp.asarray(rng.standard_normal(D, np.float32)).astype(jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((T, D), np.float32)).astype(dtype)
    dot = lambda a, w: jnp.dot(a.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)  # noqa: E731
    out_norm = jnp.asarray(rng.uniform(0.5, 1.5, D), np.float32) if post_norm else None
    x = rms_norm(h, norm, 1e-6)
    out = dot(ACTIVATIONS[activation](dot(x, gate)) * dot(x, up), down)
    expected = h.astype(jnp.float32) + (out if out_norm is None else rms_norm(out, out_norm, 1e-6))
    mlp = functools.partial(_gated_mlp, eps=1e-6, n=D, activation=activation)
    got = jax.jit(mlp)(h, norm, gate_up=cpu.pack_gated(gate, up), down=cpu.pack_bf16(down), live_rows=jnp.int32(T),
                       out_norm=out_norm)
    assert got.dtype == dtype
    tol = 1e-3 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), rtol=tol, atol=tol)


def prefill_matches_transformers(out, prompts=slice(0, 2), num_tokens=64, hf_class=transformers.AutoModelForCausalLM):
    """One ragged prefill of a one-off checkpoint (unrolled, so that it compiles quickly) against transformers' logits
    on `sequences()[prompts]`; returns the model's config. A model with state layers (`linear_layers`) also runs the
    prompts again in chunks of 7 tokens, step after step in the same program (each chunk's state from the one
    before, a decode step's one token at the end), against the same logits."""
    model, cfg = load_model(out, "float32", progress=False, unstacked=True)
    chosen = sequences(cfg.vocab_size)[prompts]
    paged = PagedModel(model)
    paged.add_sequences(len(chosen))
    hf = hf_class.from_pretrained(out, dtype=torch.float32).eval()
    expected = [hf_logits(hf, prompt) for prompt in chosen]
    for logits, want in zip(paged.step(chosen, num_tokens=num_tokens, all_logits=True), expected):
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)
    if cfg.linear_layers:
        paged = PagedModel(model)
        paged.add_sequences(len(chosen))
        chunks = [[] for _ in chosen]  # a prompt that has ended takes empty chunks
        for start in range(0, max(map(len, chosen)), 7):
            step = paged.step([p[start:start + 7] for p in chosen], num_tokens=num_tokens, all_logits=True)
            for logits, got in zip(step, chunks):
                got.append(logits)
        for got, want in zip(chunks, expected):
            np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)
    return cfg


def test_exact_gelu_gate_matches_transformers(tmp_path, tokenizer_dir):
    """`hidden_act: gelu` (the exact GELU; Gemma configs read it as the tanh approximation, as transformers
    does) on a Llama layer."""
    out = tiny_models.make_model("mistral", tmp_path / "gelu", tokenizer_dir, hidden_act="gelu")
    assert prefill_matches_transformers(out).hidden_act == "gelu"


@pytest.mark.parametrize("spec, overrides", [
    # GLM-4-9B: GLM-4-0414's layer without the norms on the attention's and MLP's outputs
    ("glm4", dict(cls="GlmForCausalLM")),
    # Llama with biases on its gate, up and down projections (mlp_bias)
    ("llama", dict(cls="LlamaForCausalLM", mlp_bias=True)),
    # Arcee (AFM): the Llama layer with an ungated ReLU^2 MLP (and here its biases)
    ("llama", dict(cls="ArceeForCausalLM", hidden_act="relu2", mlp_bias=True)),
    # Seed-OSS: q/k/v biases and (here) o_proj's
    ("llama", dict(cls="SeedOssForCausalLM", attention_bias=True, attention_out_bias=True)),
    # OLMo 3: OLMo 2's layer, a sliding-window layer beside a full one
    ("olmo2", dict(cls="Olmo3ForCausalLM", sliding_window=20, layer_types=["sliding_attention", "full_attention"])),
    # Ministral 3: queries scaled with the position past the rope's original length (32 here, as the prompts pass it)
    ("mistral", dict(cls="Ministral3ForCausalLM", rope_parameters=tiny_models.MINISTRAL3_ROPE)),
    # Qwen3 MoE with a dense middle layer (mlp_only_layers): three layer stacks
    ("qwen3moe", dict(cls="Qwen3MoeForCausalLM", num_hidden_layers=3, mlp_only_layers=[1])),
    # dots.llm1: GLM-4.5's experts under Qwen3's attention, with q/k/v/o biases and a sliding-window layer
    ("glm4moe", dict(cls="Dots1ForCausalLM", norm_topk_prob=False, sliding_window=20, use_sliding_window=True,
                     layer_types=["full_attention", "sliding_attention", "full_attention"],
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # Granite, GLM-4-0414, SmolLM3, EXAONE 4, OLMoE, DeepSeek V2, GLM-4.7-Flash, ERNIE 4.5 MoE, MiniMax-M2, HunYuan
    # (dense, MoE), Hy3, AFMoE, Phi-3.5-MoE, OLMo, Llama 4
    # (tiny_models.LIGHT_SPECS)
    ("granite", dict(cls="GraniteForCausalLM")),
    ("glm4", dict(cls="Glm4ForCausalLM")),
    ("smollm3", dict(cls="SmolLM3ForCausalLM")),
    ("exaone4", dict(cls="Exaone4ForCausalLM")),
    ("olmoe", dict(cls="OlmoeForCausalLM")),
    ("deepseekv2", dict(cls="DeepseekV2ForCausalLM")),
    ("glm4moelite", dict(cls="Glm4MoeLiteForCausalLM")),
    ("ernie45moe", dict(cls="Ernie4_5_MoeForCausalLM")),
    ("minimax_m2", dict(cls="MiniMaxM2ForCausalLM")),
    ("hunyuan", dict(cls="HunYuanDenseV1ForCausalLM")),
    ("hunyuanmoe", dict(cls="HunYuanMoEV1ForCausalLM")),
    ("hy_v3", dict(cls="HYV3ForCausalLM")),
    ("afmoe", dict(cls="AfmoeForCausalLM")),
    ("phimoe", dict(cls="PhimoeForCausalLM")),
    ("phimoe", dict(cls="PhimoeForCausalLM", router_jitter_noise=0.01)),  # Phi-3.5-MoE's own jitter
    ("olmo", dict(cls="OlmoForCausalLM")),
    ("olmo", dict(cls="OlmoForCausalLM", attention_bias=False, tie_word_embeddings=True)),
    ("llama4", dict(cls="Llama4ForCausalLM")),
    # Granite 3.x mixtures of experts: with a shared expert, and without (GraniteMoe)
    ("granitemoe", dict(cls="GraniteMoeSharedForCausalLM")),
    ("granitemoe", dict(cls="GraniteMoeForCausalLM", shared_intermediate_size=0)),
    # StarCoder2, StableLM 2 (and StableLM-3B's parallel block after one norm, no q/k norms), GPT-NeoX (and its
    # sequential block: use_parallel_residual false), Command R7B (tiny_models.LIGHT_SPECS)
    ("starcoder2", dict(cls="Starcoder2ForCausalLM")),
    ("stablelm", dict(cls="StableLmForCausalLM")),
    ("stablelm", dict(cls="StableLmForCausalLM", use_parallel_residual=True, qk_layernorm=False, use_qkv_bias=False)),
    ("gpt_neox", dict(cls="GPTNeoXForCausalLM")),
    ("gpt_neox", dict(cls="GPTNeoXForCausalLM", use_parallel_residual=False)),
    ("cohere2", dict(cls="Cohere2ForCausalLM")),
    # GPT-2 and OPT: learned absolute positions (OPT's offset), Conv1D weights
    ("gpt2", dict(cls="GPT2LMHeadModel")),
    ("opt", dict(cls="OPTForCausalLM")),
    ("gpt_bigcode", dict(cls="GPTBigCodeForCausalLM")),
    ("gptj", dict(cls="GPTJForCausalLM")),
    ("nemotron", dict(cls="NemotronForCausalLM")),
    # Falcon: 40B's grouped layout, 7B's (one KV head, one norm), and the sequential layout with biases
    ("falcon", dict(cls="FalconForCausalLM")),
    ("falcon", dict(cls="FalconForCausalLM", new_decoder_architecture=False, multi_query=True, num_kv_heads=None,
                    num_ln_in_parallel_attn=None)),
    ("falcon", dict(cls="FalconForCausalLM", new_decoder_architecture=False, multi_query=False, parallel_attn=False,
                    bias=True, num_kv_heads=None, num_ln_in_parallel_attn=None)),
    ("gpt_bigcode", dict(cls="GPTBigCodeForCausalLM", multi_query=False)),
    # Gemma 4 31B's layout (SPECS' gemma4 without its experts), and one whose sliding layers have one KV head, the
    # full ones projecting their values (no attention_k_eq_v)
    ("gemma4dense", dict(cls="Gemma4ForCausalLM")),
    ("gemma4dense", dict(cls="Gemma4ForCausalLM", attention_k_eq_v=False, num_key_value_heads=1)),
    # Ministral-8B (Mistral's layer, a sliding-window layer by layer_types), CWM (the Llama layer, its default layer
    # types: full attention at every fourth from the first) and Helium (interleaved rotary pairs, q/k/v biases)
    ("mistral", dict(cls="MinistralForCausalLM", head_dim=16, layer_types=["sliding_attention", "full_attention"])),
    ("llama", dict(cls="CwmForCausalLM", sliding_window=24)),
    ("llama", dict(cls="HeliumForCausalLM", head_dim=16, attention_bias=True)),
    # EXAONE MoE (K-EXAONE): EXAONE 4's attention (a sliding layer rotating, the full one not) under input norms,
    # a dense first layer, then top 2 of 8 experts by DeepSeek V3's router (its correction bias beside it) in 2 groups
    # and a shared expert
    ("exaone4", dict(cls="ExaoneMoeForCausalLM", num_hidden_layers=3, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)),
    ("solar_open", dict(cls="SolarOpenForCausalLM")),
    # Apertus: per-head q/k norms, an ungated MLP through xIELU (each layer's parameters its own), norms of its names
    ("llama", dict(cls="ApertusForCausalLM", rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                                  original_max_position_embeddings=32))),
    # Jais 2: LayerNorms with biases, an ungated ReLU^2 MLP, biases on every projection
    ("nemotron", dict(cls="Jais2ForCausalLM", layer_norm_eps=1e-5, attention_bias=True, mlp_bias=True,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # HyperCLOVA X SEED: Granite's multipliers (the logits' a multiplier) with post-norms on the attention's and MLP's
    # outputs (Peri-LN), and without them
    ("granite", dict(cls="HyperCLOVAXForCausalLM")),
    ("granite", dict(cls="HyperCLOVAXForCausalLM", use_post_norm=False)),
    # VaultGemma: Gemma 2's layer without the norms on the attention's and MLP's outputs
    ("gemma2", dict(cls="VaultGemmaForCausalLM")),
    # ERNIE 4.5: interleaved pairs rotated over the whole head
    ("qwen2", dict(cls="Ernie4_5ForCausalLM", head_dim=16, tie_word_embeddings=True,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # Granite 4.0-H and LFM2 (tiny_models.LIGHT_SPECS): Mamba2 mixers, and gated short convolutions, around an
    # attention layer
    ("granite4h", dict(cls="GraniteMoeHybridForCausalLM")),
    ("lfm2", dict(cls="Lfm2ForCausalLM")),
    # Granite 4.0-H-Tiny's form: tiny_models.LIGHT_SPECS' Granite 4.0-H with the top 2 of 4 experts beside the shared
    # MLP, the embeddings' and residual multipliers too (the latter folded into the mixers' output), here rotating
    # (rope) and with biases on the mixers' projections
    ("granite4h", dict(cls="GraniteMoeHybridForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=48, position_embedding_type="rope", mamba_proj_bias=True,
                       embedding_multiplier=3.0, residual_multiplier=0.6)),
    # LFM2-MoE: LFM2's layers (tiny_models.LIGHT_SPECS), a dense first layer, then the top 2 of 4 experts by sigmoid
    # scores chosen with their bias, renormalised, times 2
    ("lfm2", dict(cls="Lfm2MoeForCausalLM", intermediate_size=80, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=2.0)),
    # Qwen3.5 MoE: SPECS' Qwen3.5 over the top 2 of 4 experts (renormalised) and a gated shared expert
    ("qwen3_5", dict(cls="Qwen3_5MoeForCausalLM", config_cls="Qwen3_5MoeTextConfig", num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    # Qwen3-Next: Qwen3.5's layers with each linear layer's projections fused per key head in the checkpoint
    # (in_proj_qkvz, in_proj_ba), experts in the first and last layers, a dense one between (mlp_only_layers)
    ("qwen3_5", dict(cls="Qwen3NextForCausalLM", config_cls="Qwen3NextConfig", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
])
def test_llama_layer_relatives_match_transformers(tmp_path, tokenizer_dir, spec, overrides):
    """Architectures made of parts that SPECS' models check in depth, each checked on one prefill (unrolled, so
    that the one-off model compiles quickly): their settings, and prompts long enough for their sliding windows and
    rotations."""
    out = tiny_models.make_model(spec, tmp_path / "model", tokenizer_dir, **overrides)
    assert prefill_matches_transformers(out).architecture == overrides["cls"]


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, tokenizer_dir):
    """Gemma3ForConditionalGeneration (Gemma 3 4B-27B): a text config as sparse as the hub's, the language
    model's tensors under their prefix, the vision tower left unloaded; against transformers' multimodal model
    on text (ids below the image tokens)."""
    out = tiny_models.make_gemma3_multimodal(tmp_path / "gemma3-mm", tokenizer_dir)
    model, cfg = load_model(out, "float32", progress=False)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.sliding_windows == (20, 0, 20)
    seqs = sequences(cfg.vocab_size - 3, extra=DECODE_STEPS, seed=4)
    prefill, decoded = prefill_and_decode(model, seqs)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    for seq, pre, dec in zip(seqs, prefill, decoded):
        np.testing.assert_allclose(np.concatenate([pre, dec]), hf_logits(hf, seq), atol=1e-4, rtol=0)


def test_gemma4_multimodal_checkpoint_serves_its_language_model(tmp_path, tokenizer_dir):
    """Gemma4ForConditionalGeneration (Gemma 4 31B / 26B-A4B as the hub ships them): a sparse text config giving the
    full-attention layers' shape by global_head_dim, the language model's tensors under their prefix, the vision and
    audio towers left unloaded; prefill and decode against transformers' multimodal model on text (ids below its
    image and audio tokens)."""
    out = tiny_models.make_gemma4_multimodal(tmp_path / "gemma4-mm", tokenizer_dir)
    model, cfg = load_model(out, "float32", progress=False)
    assert cfg.architecture == "Gemma4ForConditionalGeneration" and cfg.full_attention_heads == (32, 1, True)
    seqs = sequences(cfg.vocab_size - 6, extra=DECODE_STEPS, seed=4)
    prefill, decoded = prefill_and_decode(model, seqs)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    for seq, pre, dec in zip(seqs, prefill, decoded):
        np.testing.assert_allclose(np.concatenate([pre, dec]), hf_logits(hf, seq), atol=1e-4, rtol=0)


@pytest.mark.parametrize("text_model", ["mistral", "ministral3", "mistral4"])
def test_mistral3_multimodal_checkpoint_serves_its_language_model(tmp_path, tokenizer_dir, text_model):
    """Mistral3ForConditionalGeneration (Mistral Small 3.1/3.2, Ministral 3, Mistral Small 4): its text model
    (Mistral; Ministral 3 with its scaled queries; Mistral 4: DeepSeek V3's latent attention with Llama 4's scaled
    queries, experts stacked per layer) from the language model's tensors, the vision tower left unloaded; against
    transformers' multimodal model on text."""
    out = tiny_models.make_mistral3_multimodal(tmp_path / "mistral3", tokenizer_dir, text_model)
    cfg = prefill_matches_transformers(out, slice(1, 3), 256, transformers.AutoModelForImageTextToText)
    assert cfg.architecture == "Mistral3ForConditionalGeneration"
    assert cfg.sliding_windows == ((0,) * 3 if text_model == "mistral4" else (24, 24))
    assert cfg.q_position_scale == {"mistral": (), "ministral3": (0.5, 32, 0, False),
                                    "mistral4": (0.1, 16, 0, False)}[text_model]


def test_mistral4_text_checkpoint_matches_transformers(tmp_path, tokenizer_dir):
    """Mistral Small 4's text model as a checkpoint of its own (`Mistral4ForCausalLM`, which transformers builds but
    AutoModelForCausalLM does not name)."""
    out = tiny_models.make_model("mistral4", tmp_path / "mistral4", tokenizer_dir)
    cfg = prefill_matches_transformers(out, slice(1, 3), 256, transformers.Mistral4ForCausalLM)
    assert cfg.latent_attention and cfg.rope_interleaved and cfg.routed_scaling == 1.5 and cfg.dense_mlp_layers == (0,)


def test_llama4_multimodal_checkpoint_serves_its_language_model(tmp_path, tokenizer_dir):
    """Llama4ForConditionalGeneration (Llama 4 Scout and Maverick as the hub ships them): its text config and the
    language model's tensors (`language_model.*`), the vision model and projector left unloaded; against
    transformers' multimodal model on text."""
    out = tiny_models.make_llama4_multimodal(tmp_path / "llama4-mm", tokenizer_dir)
    cfg = prefill_matches_transformers(out, slice(1, 3), 256, transformers.AutoModelForImageTextToText)
    assert cfg.architecture == "Llama4ForConditionalGeneration" and cfg.sliding_windows == (-24, 0)
    assert cfg.num_experts == 4 and cfg.dense_mlp_layers == (0,) and cfg.rope_layers == (True, False)


def test_exaone_checkpoint_under_its_own_names_matches_transformers(tmp_path, tokenizer_dir):
    """EXAONE 3.x: the Llama layer under the checkpoint's own tensor names and config keys."""
    out = tiny_models.make_exaone(tmp_path / "exaone", tokenizer_dir)
    cfg = prefill_matches_transformers(out)
    assert cfg.architecture == "ExaoneForCausalLM" and cfg.num_layers == 2 and cfg.rope.rope_type == "llama3"


@pytest.mark.parametrize("architecture, model_type, keys", [
    # InternLM3: its own keys for the biases (q/k/v's; o_proj's and the MLP's), which transformers reads as Llama's
    ("InternLM3ForCausalLM", "internlm3", dict(qkv_bias=True, bias=True)),
    ("IQuestCoderForCausalLM", "iquestcoder", {}),
])
def test_llama_checkpoints_under_other_names_match_transformers(tmp_path, tokenizer_dir, architecture, model_type,
                                                                 keys):
    """Checkpoints of the Llama layer that name their architecture (and config keys) their own way, as transformers
    and vLLM run them."""
    out = tiny_models.make_model("llama", tmp_path / model_type, tokenizer_dir, attention_bias=bool(keys),
                                 mlp_bias=bool(keys))
    config = {k: v for k, v in tiny_models.read_config(out).items() if k not in ("attention_bias", "mlp_bias")}
    (out / "config.json").write_text(json.dumps(config | keys | {"architectures": [architecture],
                                                                 "model_type": model_type}))
    cfg = prefill_matches_transformers(out)
    assert cfg.architecture == architecture and (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (bool(keys),) * 3


@pytest.mark.parametrize("kind", list(tiny_models.QWEN_VL))
def test_qwen_vl_checkpoints_serve_their_language_model(tmp_path, tokenizer_dir, kind):
    """Qwen2.5-VL (Qwen2's layers, here under YaRN), Qwen3-VL and Qwen3-VL-MoE (its experts stacked per layer in the
    checkpoint): the language model from its tensors, the vision tower left unloaded; against transformers'
    multimodal model on text, whose M-RoPE positions are each token's own on every axis."""
    out = tiny_models.make_qwen_vl(tmp_path / kind, tokenizer_dir, kind)
    cfg = prefill_matches_transformers(out, slice(1, 3), 256, transformers.AutoModelForImageTextToText)
    assert cfg.architecture == tiny_models.QWEN_VL[kind][0] and not any(cfg.sliding_windows)
    assert cfg.linear_layers == ((0, 2) if kind == "qwen3_5" else ())
    assert cfg.num_experts == (6 if kind == "qwen3_vl_moe" else 0)


@needs_native_matmul
@pytest.mark.parametrize("intermediate, activation", [(48, "silu"), (40, "silu"), (45, "swigluoai"),
                                                      (48, "swigluoai"), (48, "relu2")])
@pytest.mark.parametrize("stacked", [True, False])
def test_packed_experts_match_the_grouped_dot_over_the_same_weights(intermediate, activation, stacked):
    """The native grouped matmul over packed experts (gate/up packed together where the width is a multiple of
    16, silu then applied in registers; each projection packed alone otherwise), from a stack of all layers'
    experts (the scanned loop's) or one layer's, against `lax.ragged_dot` over the unpacked bfloat16 weights.
    GPT-OSS's experts (swigluoai) with biases on the router and on each projection: over an odd width (packed apart:
    the pairs' extra column), and packed together (the kernel's clamped SwiGLU, the gate/up biases folded in as one
    more input row), x large enough that the clamps bind. Nemotron-H's ungated experts (relu2: act(up), no gate),
    each projection packed alone. A bucket's padding rows (the last 3) take no expert: they come out zero."""
    from jaxengine.layers.moe import moe_mlp
    from pallas_kernels import cpu

    rng = np.random.default_rng(6)
    L, E, T, D, top_k = 3, 5, 11, 64, 2

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])).astype(jnp.bfloat16)

    router, down = weight(D, E), weight(L, E, intermediate, D)
    gate, up = weight(L, E, D, intermediate), weight(L, E, D, intermediate)
    oai = activation == "swigluoai"
    x = jnp.asarray(rng.standard_normal((T, D), np.float32) * (8.0 if oai else 1.0))
    common = dict(top_k=top_k, renormalize=True, activation=activation)
    biases = {}
    if oai:
        common |= dict(swiglu=cpu.SWIGLU_OAI_CONSTANTS, router_bias=weight(1, E)[0], down_bias=weight(E, 2, D)[:, 0])
        biases = dict(gate_bias=weight(L, E, 2, intermediate)[:, :, 0], up_bias=weight(L, E, 2, intermediate)[:, :, 0])
    layer = 1
    ungated = activation == "relu2"
    want = moe_mlp(x, router, gate=None if ungated else gate[layer], up=up[layer], down=down[layer], **common,
                   **{k: b[layer] for k, b in biases.items()})
    pick = (lambda w: w) if stacked else (lambda w: w[layer])
    if ungated:
        packed = dict(up=pick(cpu.pack_bf16(up)))
    elif intermediate % cpu.GATED == 0:
        if oai:  # as the loader packs GPT-OSS's experts: each bias one more input row
            gate = jnp.concatenate([gate, biases["gate_bias"][..., None, :]], axis=-2)
            up = jnp.concatenate([up, biases.pop("up_bias")[..., None, :]], axis=-2)
            common["folded_bias"], biases = True, {}
        packed = dict(gate_up=pick(cpu.pack_gated(gate, up)))
    else:
        packed = dict(gate=pick(cpu.pack_bf16(gate)), up=pick(cpu.pack_bf16(up)))
    got = jax.jit(lambda x, i: moe_mlp(x, router, down=pick(cpu.pack_bf16(down)), layer=i, live_rows=jnp.int32(T - 3),
                                       **packed, **common, **{k: b[layer] for k, b in biases.items()}))(
        x, jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(got[:-3]), np.asarray(want[:-3]), rtol=1e-4, atol=1e-4)
    assert not np.asarray(got[-3:]).any()


@needs_native_matmul
@pytest.mark.parametrize("stacked", [True, False])
def test_mxfp4_experts_match_the_grouped_dot_over_their_dequantized_weights(stacked):
    """GPT-OSS's experts kept in MXFP4 (`Mxfp4Experts`: gate/up's codes in pack_gated's order with its biases, which
    the kernel adds; down's codes, its bias added after) from a stack of all layers' experts or one layer's, against
    `lax.ragged_dot` over the dequantized weights in bfloat16, x large enough that the clamps bind; a bucket's
    padding rows come out zero. Gate/up given apart from MXFP4 down projections is refused."""
    from jaxengine.layers.moe import Mxfp4Experts, moe_mlp
    from jaxengine.models.quantization import dequantize_mxfp4
    from pallas_kernels import cpu

    rng = np.random.default_rng(7)
    L, E, T, D, inter, top_k = 3, 5, 11, 64, 64, 2

    def mxfp4(n, k):  # blocks, scales of [L, E, k, n] weights
        return (rng.integers(0, 256, (L, E, n, k // 32, 16), dtype=np.uint8),
                rng.integers(119, 128, (L, E, n, k // 32), dtype=np.uint8))

    def bias(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.bfloat16)

    (g_blocks, g_scales), (u_blocks, u_scales), (d_blocks, d_scales) = mxfp4(inter, D), mxfp4(inter, D), mxfp4(D, inter)
    gate, up, down = (jnp.asarray(dequantize_mxfp4(b, s).swapaxes(-1, -2)).astype(jnp.bfloat16)
                      for b, s in ((g_blocks, g_scales), (u_blocks, u_scales), (d_blocks, d_scales)))
    gate_bias, up_bias = bias(L, E, inter), bias(L, E, inter)
    router = jnp.asarray(rng.standard_normal((D, E), np.float32) / 8).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((T, D), np.float32) * 8)
    layer = 1
    common = dict(top_k=top_k, renormalize=True, activation="swigluoai", swiglu=cpu.SWIGLU_OAI_CONSTANTS,
                  router_bias=bias(E), down_bias=bias(E, D))
    want = moe_mlp(x, router, gate=gate[layer], up=up[layer], down=down[layer], gate_bias=gate_bias[layer],
                   up_bias=up_bias[layer], **common)
    order = cpu.gated_columns(np.arange(inter), inter + np.arange(inter))  # gate's and up's outputs, 16 in turn
    gate_up = Mxfp4Experts(*cpu.pack_mxfp4_panels(np.concatenate([g_blocks, u_blocks], 2)[:, :, order],
                                                  np.concatenate([g_scales, u_scales], 2)[:, :, order]),
                           jnp.concatenate([gate_bias, up_bias], -1)[..., order].astype(jnp.float32))
    down_mx = Mxfp4Experts(*cpu.pack_mxfp4_panels(d_blocks, d_scales))
    pick = (lambda w: w) if stacked else (lambda w: jax.tree.map(lambda a: a[layer], w))
    got = jax.jit(lambda x, i: moe_mlp(x, router, gate_up=pick(gate_up), down=pick(down_mx), layer=i,
                                       live_rows=jnp.int32(T - 3), **common))(x, jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(got[:-3]), np.asarray(want[:-3]), rtol=1e-4, atol=1e-4)
    assert not np.asarray(got[-3:]).any()
    with pytest.raises(ValueError, match="gate_up must be Mxfp4Experts too"):
        moe_mlp(x, router, gate=gate[layer], up=up[layer], down=pick(down_mx), layer=jnp.int32(layer), **common)


@pytest.fixture(scope="module")
def gpt_oss_64(tmp_path_factory, tokenizer_dir):
    """The GPT-OSS test model with experts 64 wide (whole 32-value blocks, whole panels) and gpt-oss's own clamp, 7."""
    return tiny_models.make_model("gptoss", tmp_path_factory.mktemp("gptoss-64"), tokenizer_dir, intermediate_size=64,
                                  swiglu_limit=7.0)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, gpt_oss_64):
    """gpt_oss_64 as the hub ships gpt-oss: its experts' gate_up_proj and down_proj as MXFP4 `_blocks` and `_scales`
    (random bytes: every float4 value, scales 2^-5 to 2^0, large enough that the clamp binds; gate/up's biases on
    their products' scale), `quant_method: mxfp4` and no dtype in config.json."""
    import json

    from safetensors.numpy import load_file, save_file

    source = gpt_oss_64
    out = tmp_path_factory.mktemp("gptoss-mxfp4")
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    rng = np.random.default_rng(4)
    tensors = {}
    for name, value in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> blocks [E, out, in/32, 16]
            experts, inputs, outputs = value.shape
            tensors[name + "_blocks"] = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
            tensors[name + "_scales"] = rng.integers(122, 128, (experts, outputs, inputs // 32), dtype=np.uint8)
        elif name.endswith("experts.gate_up_proj_bias"):  # on the scale of these products: a misplaced bias shows
            tensors[name] = value * 20
        else:
            tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = tiny_models.read_config(source)
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_gpt_oss_mxfp4_checkpoint_matches_transformers_dequantizing_it(gpt_oss_mxfp4):
    """The hub's GPT-OSS form: each expert tensor's blocks and scales (held until both arrive) dequantized at load,
    then split into gate and up; transformers' own MXFP4 dequantization of the same checkpoint is the oracle.
    `dtype: auto` gives bfloat16 weights, as the hub checkpoint's other tensors are (float32 here: the oracle's)."""
    from jaxengine.models.loader import load_config

    _, cfg = load_config(gpt_oss_mxfp4)
    assert cfg.torch_dtype == "bfloat16" and cfg.quantization is None and cfg.quant_method == "mxfp4"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    model, cfg = load_model(gpt_oss_mxfp4, "float32", progress=False)
    prompts = sequences(cfg.vocab_size)
    paged = PagedModel(model)
    paged.add_sequences(len(prompts))
    for prompt, logits in zip(prompts, paged.step(prompts, num_tokens=256, all_logits=True)):
        np.testing.assert_allclose(logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_mxfp4_dequantization_matches_transformers_and_refuses_bad_shapes():
    """Every byte (both nibbles) at the scales' extremes, against transformers' own MXFP4 conversion."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxengine.models.quantization import dequantize_mxfp4

    blocks = np.arange(256, dtype=np.uint8).reshape(2, 4, 2, 16)  # [experts, out, groups, 16]
    scales = np.array([[[0, 127], [1, 250], [120, 130], [127, 127]]] * 2, np.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [experts, out, in]
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours.swapaxes(-1, -2), theirs.numpy())  # theirs: [experts, in, out]
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.astype(np.int8), scales)


def test_gpt_oss_mxfp4_blocks_without_their_scales_are_refused(gpt_oss_mxfp4, tmp_path):
    from safetensors.numpy import load_file, save_file

    for f in gpt_oss_mxfp4.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(gpt_oss_mxfp4 / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.down_proj"):
        load_model(tmp_path, "float32", progress=False)


def test_gpt_oss_mxfp4_engine_checks_the_quantization_setting_and_decodes_as_transformers(gpt_oss_mxfp4):
    """`quantization: mxfp4` (vLLM's name) names the checkpoint's method (another method's name is refused); the
    engine's greedy tokens are transformers' over the dequantized checkpoint (float32: bfloat16's own rounding is
    checked per logit by test_bfloat16_error_is_within_twice_transformers_own_bfloat16_error)."""
    from jaxengine import SamplingParams
    from jaxengine.config import EngineConfig
    from jaxengine.engine.llm_engine import LLMEngine
    from tests.engine_util import hf_greedy, random_prompts, run_to_completion

    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method 'mxfp4'"):
        LLMEngine(EngineConfig(model=str(gpt_oss_mxfp4), quantization="awq"), progress=False)
    engine = LLMEngine(EngineConfig(model=str(gpt_oss_mxfp4), quantization="mxfp4", dtype="float32",
                                    max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
                                    kv_cache_gib=0.01), progress=False)
    prompts = random_prompts(tiny_models.VOCAB_SIZE, (7, 30), seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    finals = run_to_completion(engine, [(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    for i, prompt in enumerate(prompts):
        assert finals[f"p{i}"].outputs[0].token_ids == hf_greedy(hf, prompt, 8)


@needs_native_matmul
def test_gpt_oss_mxfp4_engine_keeps_the_experts_in_mxfp4_and_decodes_as_its_model(gpt_oss_mxfp4):
    """The engine's default (dtype auto: bfloat16 on the native matmul) keeps an MXFP4 checkpoint's experts in MXFP4;
    its greedy tokens, batched, chunked and padded to the engine's buckets, are the best tokens of the same model run
    over each whole sequence at once (whose numbers test_gpt_oss_native_experts_gate_in_registers_within_bfloat16s_error
    checks against transformers), up to the last bits of XLA's own dots (the router's)."""
    from jaxengine import SamplingParams
    from jaxengine.config import EngineConfig
    from jaxengine.engine.llm_engine import LLMEngine
    from tests.engine_util import random_prompts, run_to_completion

    engine = LLMEngine(EngineConfig(model=str(gpt_oss_mxfp4), max_model_len=128, max_num_seqs=4,
                                    max_num_batched_tokens=32, min_token_bucket=32, kv_cache_gib=0.01), progress=False)
    assert engine.model_config.mxfp4_experts
    prompts = random_prompts(tiny_models.VOCAB_SIZE, (7, 40, 19, 33), seed=3)
    finals = run_to_completion(engine, [(f"p{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                                        for i, p in enumerate(prompts)])
    model, _ = load_model(gpt_oss_mxfp4, progress=False, native_matmul=True)
    model.kv_dtype = jnp.bfloat16
    for i, prompt in enumerate(prompts):
        tokens = finals[f"p{i}"].outputs[0].token_ids
        paged = PagedModel(model)
        paged.add_sequences(1)
        logits = paged.step([list(prompt) + tokens[:-1]], num_tokens=64, all_logits=True)[0][len(prompt) - 1:]
        chosen = logits[np.arange(len(tokens)), tokens]
        assert (chosen >= logits.max(-1) - 1e-2).all(), (tokens, logits.argmax(-1))


def test_gpt_oss_mxfp4_checkpoint_converts_to_orbax_with_the_same_logits(gpt_oss_mxfp4, tmp_path, capsys):
    """`jaxengine convert` writes the dequantized experts, their biases, the router's bias and the sinks; the Orbax
    checkpoint loads (nothing split or dequantized again) to the same logits."""
    from jaxengine.cli import main

    out = tmp_path / "orbax"
    main(["convert", "--model", str(gpt_oss_mxfp4), "--output", str(out), "--dtype", "float32"])
    assert "wrote an Orbax checkpoint" in capsys.readouterr().out
    prompts = sequences(tiny_models.VOCAB_SIZE)[:2]
    logits = []
    for path in (gpt_oss_mxfp4, out):
        model, _ = load_model(path, "float32", progress=False)
        paged = PagedModel(model)
        paged.add_sequences(len(prompts))
        logits.append(paged.step(prompts, num_tokens=256, all_logits=True))
    for want, got in zip(*logits):
        np.testing.assert_array_equal(got, want)


@needs_native_matmul
@pytest.mark.parametrize("form", ["bfloat16", "mxfp4"])
def test_gpt_oss_native_experts_gate_in_registers_within_bfloat16s_error(form, gpt_oss_64, gpt_oss_mxfp4):
    """With gpt-oss's own SwiGLU constants the native path packs each layer's experts' gate/up together and the
    kernel applies the clamped SwiGLU in registers: a bfloat16 checkpoint's experts packed with their gate/up biases
    folded in as one more input row; an MXFP4 checkpoint's kept in MXFP4 (uint8 codes and exponents, about a quarter
    of bfloat16's bytes), dequantized panel by panel as the kernel takes them, the biases added by the kernel.
    Against transformers in float32 (dequantizing MXFP4 itself), within twice transformers' own bfloat16 error (plus
    a bfloat16 ulp of the logits) on 90% of the tokens at least (bfloat16 rounding may send a token to other
    experts, in either engine; measured: all of them, in both forms)."""
    path = gpt_oss_mxfp4 if form == "mxfp4" else gpt_oss_64
    model, cfg = load_model(path, "bfloat16", progress=False, native_matmul=True)
    assert model.native_matmul and hasattr(model.layers, "expert_gate_up") and cfg.mxfp4_experts == (form == "mxfp4")
    assert not hasattr(model.layers, "expert_gate_bias")  # folded into expert_gate_up, or beside it (MXFP4)
    if form == "mxfp4":
        experts = [getattr(model.layers, name).get_value() for name in ("expert_gate_up", "expert_gate_up_exponents",
                                                                       "expert_down", "expert_down_exponents")]
        assert all(a.dtype == np.uint8 for a in experts)
        values = 3 * cfg.num_layers * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size
        assert sum(a.nbytes for a in experts) == values // 2 + values // 32  # 4.25 bits a weight
    model.kv_dtype = jnp.bfloat16
    quantization = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if form == "mxfp4" else {}
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **quantization).eval()
          for dtype in (torch.float32, torch.bfloat16)}
    seqs = sequences(cfg.vocab_size, extra=DECODE_STEPS, seed=5)
    prefill, decoded = prefill_and_decode(model, seqs)
    within = total = 0
    for seq, pre, dec in zip(seqs, prefill, decoded):
        exact = hf_logits(hf[torch.float32], seq)
        bound = 2 * np.abs(hf_logits(hf[torch.bfloat16], seq) - exact).max() + np.abs(exact).max() * 2.0 ** -8
        within += (np.abs(np.concatenate([pre, dec]) - exact).max(-1) <= bound).sum()
        total += len(seq)
    assert within >= 0.9 * total


def test_olmo3_legacy_rope_scaling_applies_to_its_full_attention_layers():
    """An OLMo 3 config of the hub's form (`rope_theta` and `rope_scaling` at the top) read as transformers reads
    it: the scaling for the full-attention layers, the sliding-window ones rotating by the plain theta."""
    from jaxengine.models.config import olmo2_config_from_hf

    hf = dict(architectures=["Olmo3ForCausalLM"], vocab_size=331, hidden_size=64, intermediate_size=112,
              num_hidden_layers=2, num_attention_heads=4, sliding_window=20, rope_theta=500000.0,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
              rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64))
    cfg = olmo2_config_from_hf(hf)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.param("factor")) == ("yarn", 500000.0, 8.0)
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 500000.0)
    assert cfg.sliding_windows == (20, 0) and not cfg.pre_norms and cfg.qk_norm_whole


@pytest.mark.parametrize("arch", ["glm4moe", "deepseekv3"])
def test_mtp_layers_are_skipped_and_expert_stacks_convert_to_orbax_with_the_same_logits(arch, model_dirs, tmp_path,
                                                                                         capsys):
    """GLM-4.5's and DeepSeek V3's checkpoints carry a multi-token-prediction layer numbered after the decoder's
    (transformers does not build it): its tensors are not loaded. The model's two layer stacks (the dense first layer,
    the expert ones; DeepSeek's latent attention's projections) convert to Orbax and load back to the same
    logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxengine.cli import main

    src = tmp_path / "with-mtp"
    shutil.copytree(model_dirs[arch], src)
    tensors = load_file(src / "model.safetensors")
    layers = tiny_models.SPECS[arch]["num_hidden_layers"]
    extra = {f"model.layers.{layers}.eh_proj.weight": np.ones((64, 128), np.float32),
             f"model.layers.{layers}.mlp.experts.0.up_proj.weight": np.ones((32, 64), np.float32)}
    save_file(tensors | extra, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "orbax"
    main(["convert", "--model", str(src), "--output", str(out), "--dtype", "float32"])
    assert "wrote an Orbax checkpoint" in capsys.readouterr().out
    prompts = sequences(tiny_models.VOCAB_SIZE)[:2]
    logits = []
    for path in (model_dirs[arch], src, out):
        model, cfg = load_model(path, "float32", progress=False)
        assert [name for name, _, _ in layer_groups(cfg)] == ["layers", "layers1"]
        paged = PagedModel(model)
        paged.add_sequences(len(prompts))
        logits.append(paged.step(prompts, num_tokens=256, all_logits=True))
    for want, mtp, orbax in zip(*logits):
        np.testing.assert_array_equal(mtp, want)
        np.testing.assert_array_equal(orbax, want)
