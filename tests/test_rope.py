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


@pytest.mark.parametrize("rope_type", ["dynamic", "proportional"])
def test_unsupported_rope_type_is_refused_by_name(rope_type):
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported.*llama3.*yarn.*longrope"):
        parse_rope({"rope_parameters": {"rope_type": rope_type, "factor": 2.0}})
