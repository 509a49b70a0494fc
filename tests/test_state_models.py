"""The state-space and linear-attention families of sessions 37-38 beyond SPECS' Qwen3.5 (Nemotron-H, Bamba, Mamba2,
Falcon-H1, Kimi Linear, Mamba, FalconMamba, Jamba) against transformers: one prefill each and the same prompts in
chunks, their bfloat16 native path, and bfloat16 state pools. A file of their own, so that the suite's workers
(`--dist loadfile`) share them with test_models.py's."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxengine.models import load_model
from jaxengine.models.loader import native_matmul_applies
from tests import tiny_models
from tests.test_models import (DECODE_STEPS, bfloat16_within_transformers_error, prefill_and_decode,
                               prefill_matches_transformers, sequences)


@pytest.mark.parametrize("spec, overrides", [
    # Bamba and Mamba2 (tiny_models.LIGHT_SPECS): Mamba2 mixers around a half-rotating attention layer, and alone
    ("bamba", dict(cls="BambaForCausalLM")),
    ("mamba2", dict(cls="Mamba2ForCausalLM")),
    # Falcon-H1 (tiny_models.LIGHT_SPECS: a mixer beside every attention layer, every muP multiplier, the mixers'
    # output unnormed); its output normed per group after the gate, with biases on every projection and tied
    # embeddings (normed before the gate: test_state_hybrids_native_bfloat16_within_twice_transformers_error)
    ("falcon_h1", dict(cls="FalconH1ForCausalLM")),
    ("falcon_h1", dict(cls="FalconH1ForCausalLM", mamba_rms_norm=True, mamba_norm_before_gate=False,
                       attention_bias=True, mamba_proj_bias=True, projectors_bias=True, mlp_bias=True,
                       tie_word_embeddings=True)),
    # Mamba (1), FalconMamba (its weightless norms on dt, B and C) and Jamba (tiny_models.LIGHT_SPECS: Mamba1 mixers
    # with weighted norms, NoPE attention, experts in every other layer)
    ("mamba", dict(cls="MambaForCausalLM")),
    ("mamba", dict(cls="FalconMambaForCausalLM", mixer_rms_eps=1e-6)),
    ("jamba", dict(cls="JambaForCausalLM")),
    # Kimi Linear (tiny_models.LIGHT_SPECS: Kimi Delta Attention around NoPE latent attention, DeepSeek V3's experts)
    ("kimi_linear", dict(cls="KimiLinearForCausalLM")),
    # Nemotron-H (tiny_models.LIGHT_SPECS: the mixers' and MLP blocks' pairs, a mixer without one; its experts:
    # test_state_hybrids_native_bfloat16_within_twice_transformers_error, in float32 first)
    ("nemotron_h", dict(cls="NemotronHForCausalLM")),
])
def test_state_model_relatives_match_transformers(tmp_path, tokenizer_dir, spec, overrides):
    """test_llama_layer_relatives_match_transformers' check (one prefill, unrolled, and for state models the same
    prompts again in 7-token chunks) on these families."""
    out = tiny_models.make_model(spec, tmp_path / "model", tokenizer_dir, **overrides)
    assert prefill_matches_transformers(out).architecture == overrides["cls"]


@pytest.mark.skipif(not native_matmul_applies(),
                    reason="the native bfloat16 matmul needs a CPU with AVX-512 BF16 or AVX2")
@pytest.mark.parametrize("spec, overrides", [
    ("nemotron_h", dict(hybrid_override_pattern="ME*EM-", n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                        routed_scaling_factor=2.0, moe_latent_size=24)),
    ("falcon_h1", dict(mamba_rms_norm=True)),
    ("kimi_linear", {}),
    ("jamba", {})])
def test_state_hybrids_native_bfloat16_within_twice_transformers_error(tmp_path, tokenizer_dir, spec, overrides):
    """In bfloat16 on the native kernels (test_bfloat16_error_is_within_twice_transformers_own_bfloat16_error's
    check), state layers on the native recurrence: Nemotron 3 Super's form, its experts (ungated, packed apart) over
    a latent of 24 (the projections in and out packed too, the router reading the hidden state) in 2 groups (the
    best 1), a dense MLP block after the last mixer; Falcon-H1's mixers beside the attention (fused q/k/v), its
    multipliers folded into the packed weights; Kimi Linear's delta attention (its decay per key row, its four input
    projections packed as one, the low-rank halves after them); Jamba's Mamba1 mixers (each channel's state a head
    of one column, several to a kernel item). Nemotron-H's experts also in float32 against transformers first (the
    others': test_llama_layer_relatives_match_transformers)."""
    out = tiny_models.make_model(spec, tmp_path / spec, tokenizer_dir, **overrides)
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
          for dtype in (torch.float32, torch.bfloat16)}
    if spec == "nemotron_h":
        prefill_matches_transformers(out)
    bfloat16_within_transformers_error(out, True, hf.__getitem__)


def test_bfloat16_states_stay_within_their_rounding(model_dirs):
    """A bfloat16 state pool (the engine's mamba_ssm_cache_dtype; here Mamba2's states; Gated DeltaNet's rounding:
    tests/test_linear_attention.py::test_bfloat16_state_rows_round_as_xla_rounds_them): the prefill's logits those
    of float32 states (one chunk: its states rounded only as they are stored), the decode steps' off by the
    rounding's ~2^-8 of the states carried into them (under 2% of the logits' scale), argmax agreeing almost
    everywhere."""
    model, cfg = load_model(model_dirs["mamba2"], "float32", progress=False)
    seqs = sequences(cfg.vocab_size, extra=DECODE_STEPS, seed=2)
    exact = prefill_and_decode(model, seqs)
    model.state_dtype = jnp.bfloat16
    rounded = prefill_and_decode(model, seqs)
    agree = total = 0
    for pre, dec, pre16, dec16 in zip(*exact, *rounded):
        np.testing.assert_allclose(pre16, pre, atol=1e-5)
        assert np.abs(dec16 - dec).max() <= 0.02 * np.abs(dec).max()
        agree, total = agree + (dec16.argmax(-1) == dec.argmax(-1)).sum(), total + len(dec)
    assert agree >= 0.9 * total
