"""Rotary frequencies for every supported scaling type against transformers' own initialisers."""

import numpy as np
import pytest
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxengine.models.config import parse_rope, rope_inv_freq

HEAD_DIM = 32
CASES = {
    "default": dict(rope_type="default", rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "yarn": dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768),
    "yarn-beta": dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, beta_fast=16, beta_slow=2,
                      original_max_position_embeddings=4096),
    # Gemma 4's full-attention layers: a quarter of the pairs rotating at the whole head's frequencies, the rest not
    "proportional": dict(rope_type="proportional", rope_theta=1000000.0, partial_rotary_factor=0.25),
    "proportional-factor": dict(rope_type="proportional", rope_theta=10000.0, partial_rotary_factor=0.5, factor=2.0),
}


def hf_config(rope):
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=131072,
                       rope_parameters=dict(rope))


@pytest.mark.parametrize("name", CASES)
def test_inverse_frequencies_match_transformers(name):
    config = hf_config(CASES[name])
    rope_type = CASES[name]["rope_type"]
    if rope_type == "default":
        want, want_scale = 1.0 / (CASES[name]["rope_theta"] ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)), 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        want = want.numpy()
    got, scale = rope_inv_freq(parse_rope(config.to_dict()), HEAD_DIM, config.max_position_embeddings)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert scale == pytest.approx(want_scale)


def test_legacy_rope_scaling_and_rope_theta_fields_are_read():
    rope = parse_rope({"rope_theta": 123.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (rope.theta, rope.rope_type, rope.param("factor")) == (123.0, "linear", 2.0)


@pytest.mark.parametrize("rope_type", ["dynamic", "axial"])
def test_unsupported_rope_type_is_refused_by_name(rope_type):
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported.*llama3.*yarn.*longrope"):
        parse_rope({"rope_parameters": {"rope_type": rope_type, "factor": 2.0}})


@pytest.mark.parametrize("head_dim, factor", [(16, 0.75), (128, 0.75), (64, 0.5), (32, 0.25), (16, 1.0)])
def test_partial_rotation_through_the_head_layout_is_transformers(head_dim, factor):
    """transformers' partial rotary embedding (the first rotary_dim dimensions rotated in pairs (i, i + r/2),
    the rest passed through, cos and sin times the attention factor) equals our whole-head rotation with padded
    tables on q and k laid out by partial_rotary_layout, and their dot products (attention scores) are
    transformers' own."""
    import jax.numpy as jnp
    import torch
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from jaxengine.layers.rope import apply_rope, partial_rotary_layout, rope_tables

    rotary = int(head_dim * factor)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 5, 3, head_dim)).astype(np.float32)  # [T, heads, head_dim]
    positions = np.array([0, 1, 7, 100, 511])
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    scaling = 1.19
    freqs = positions[:, None].astype(np.float32) * inv_freq[None, :]  # as rope_tables rounds them
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = (torch.tensor(np.cos(emb) * scaling)[None].float(), torch.tensor(np.sin(emb) * scaling)[None].float())
    # transformers' layout: [batch, heads, T, head_dim]
    q_t, k_t = (torch.tensor(x).transpose(0, 1)[None] for x in (q, k))
    want_q, want_k = (x[0].transpose(0, 1).numpy() for x in apply_rotary_pos_emb(q_t, k_t, cos, sin))

    order = partial_rotary_layout(head_dim, rotary)
    assert sorted(order) == list(range(head_dim))
    c, s = rope_tables(jnp.asarray(positions), jnp.asarray(inv_freq), scaling, jnp.float32, head_dim)
    got_q, got_k = (np.asarray(apply_rope(jnp.asarray(x[..., order]), c, s)) for x in (q, k))
    np.testing.assert_allclose(got_q, want_q[..., order], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.einsum("thd,shd->hts", got_q, got_k), np.einsum("thd,shd->hts", want_q, want_k),
                               rtol=1e-4, atol=1e-4)


def test_partial_rotary_factor_is_read_and_checked():
    from jaxengine.models.config import model_config_from_hf

    assert parse_rope({"partial_rotary_factor": 0.5}).rotary_dim(64) == 32  # older configs: beside the rope dict
    assert parse_rope({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}).rotary_dim(64) == 16
    assert parse_rope({}).rotary_dim(64) == 64 and parse_rope({}).params == ()
    for factor in (0, 1.5, -0.5, "half"):
        with pytest.raises(ValueError, match="partial_rotary_factor must be in \\(0, 1\\]"):
            parse_rope({"partial_rotary_factor": factor})
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=40, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.25 of head_dim=20 rotates 5 dimensions; it must "
                                         "rotate an even number"):
        model_config_from_hf(base | {"partial_rotary_factor": 0.25})


def test_phi3_long_factors_past_the_original_length_match_transformers(engines, model_dirs):
    """max_model_len past LongRoPE's original length (512 here; the model's 1024, vLLM's default) runs the long
    factors at every position, as vLLM does: a 600-token prompt's log-probabilities are transformers' (which uses
    the long factors for a sequence past the original length). Within it, the short ones stay."""
    import torch
    import transformers

    from jaxengine import EngineConfig, LLMEngine, SamplingParams
    from tests.engine_util import run_to_completion

    engine = engines("phi3", max_model_len=1024, num_kv_blocks=60)
    assert engine.model_config.rope.long and engine.max_model_len == 1024
    assert not engines("phi3").model_config.rope.long  # the fixture's max_model_len=512
    config = engine.model_config
    assert LLMEngine._long_rope(EngineConfig(), config)  # max_model_len None: max_position_embeddings, 1024
    assert not LLMEngine._long_rope(EngineConfig(max_model_len=512), config)
    prompt = list(np.random.default_rng(3).integers(3, config.vocab_size, 600))
    out = run_to_completion(engine, [("long", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))])
    ours = np.array([entry[t].logprob for entry, t in zip(out["long"].prompt_logprobs[1:], prompt[1:])])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["phi3"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    ref = ref[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.abs(ours - ref).max() < 1e-4
