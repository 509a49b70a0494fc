"""Loading checkpoints: formats, dtypes and every error a user can meet, each with its message."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxengine.models import SUPPORTED_ARCHITECTURES, load_model


@pytest.fixture
def mistral_copy(model_dirs, tmp_path):
    out = tmp_path / "mistral"
    shutil.copytree(model_dirs["mistral"], out)
    return out


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(config))


def edit_tensors(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_sharded_checkpoint_loads_every_shard(model_dirs):
    shards = list(model_dirs["llama"].glob("model-*.safetensors"))
    assert len(shards) > 1
    model, cfg = load_model(model_dirs["llama"], progress=False)
    assert model.layers.q_proj[...].shape == (cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    assert float(jnp.abs(model.layers.down_proj[...][-1]).sum()) > 0  # the last layer's weights arrived


@pytest.mark.parametrize("dtype,expected", [("float32", jnp.float32), ("bfloat16", jnp.bfloat16),
                                            ("float16", jnp.float16)])
def test_explicit_dtype_sets_every_parameter(model_dirs, dtype, expected):
    model, _ = load_model(model_dirs["qwen2"], dtype, progress=False)
    assert model.embed[...].dtype == expected and model.layers.q_bias[...].dtype == expected


def test_auto_dtype_follows_the_config_on_accelerators_and_is_float32_on_cpu(mistral_copy):
    from jaxengine.models.loader import load_config, resolve_dtypes

    edit_config(mistral_copy, dtype="bfloat16")
    _, cfg = load_config(mistral_copy)
    assert resolve_dtypes("auto", cfg, backend="tpu") == (jnp.bfloat16, jnp.bfloat16)
    assert resolve_dtypes("auto", cfg, backend="gpu") == (jnp.bfloat16, jnp.bfloat16)
    assert resolve_dtypes("auto", cfg, backend="cpu") == (jnp.float32, jnp.float32)
    assert resolve_dtypes("bfloat16", cfg, backend="cpu") == (jnp.float32, jnp.bfloat16)
    model, _ = load_model(mistral_copy, "auto", progress=False)  # this machine is a CPU
    assert model.layers.o_proj[...].dtype == jnp.float32


def test_unknown_dtype_is_refused(model_dirs):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported; use one of auto, float32, bfloat16"):
        load_model(model_dirs["mistral"], "int8", progress=False)


def test_missing_tensor_is_named(mistral_copy):
    edit_tensors(mistral_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(mistral_copy, progress=False)


def test_unexpected_tensor_is_named(mistral_copy):
    edit_tensors(mistral_copy, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.extra\.weight"):
        load_model(mistral_copy, progress=False)


def test_shape_mismatch_is_named(mistral_copy):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:8]

    edit_tensors(mistral_copy, shrink)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \(8, 64\), "
                                         r"expected \(16, 64\)"):
        load_model(mistral_copy, progress=False)


def test_unknown_architecture_lists_supported_ones(mistral_copy):
    edit_config(mistral_copy, architectures=["BloomForCausalLM"])
    with pytest.raises(ValueError, match="architecture 'BloomForCausalLM' is not supported") as e:
        load_model(mistral_copy, progress=False)
    assert all(name in str(e.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_in_config_is_named(mistral_copy):
    edit_config(mistral_copy, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        load_model(mistral_copy, progress=False)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path, progress=False)


def test_directory_without_weights_is_refused(mistral_copy):
    (mistral_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(mistral_copy, progress=False)


def test_index_naming_a_missing_shard_is_refused(model_dirs, tmp_path):
    llama = shutil.copytree(model_dirs["llama"], tmp_path / "llama")
    victim = sorted(llama.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"checkpoint file {victim.name} listed in the index is missing"):
        load_model(llama, progress=False)


def test_path_that_is_neither_directory_nor_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        load_model(tmp_path / "no" / "such" / "model", progress=False)


def test_hub_id_fails_clearly_when_offline():
    # conftest sets HF_HUB_OFFLINE=1: tests never touch the network
    with pytest.raises(FileNotFoundError, match="could not fetch model 'jaxengine-tests/not-a-model' from the Hugging"):
        load_model("jaxengine-tests/not-a-model", progress=False)


def test_a_tokenizer_of_its_own_code_loads_only_when_trusted(tokenizer_dir, tmp_path, engines):
    """As vLLM's --trust-remote-code: refused at once without it (transformers would ask on the terminal), loaded
    with it, by `load_tokenizer` and by an engine."""
    from jaxengine.engine.llm_engine import load_tokenizer
    from tests.tiny_models import make_remote_code_tokenizer

    custom = make_remote_code_tokenizer(tokenizer_dir, tmp_path / "custom")
    with pytest.raises(ValueError, match="runs code of its own: pass --trust-remote-code"):
        load_tokenizer(custom)
    tokenizer = load_tokenizer(custom, trust_remote_code=True)
    assert type(tokenizer).__name__ == "ShoutingTokenizer"
    assert tokenizer.decode(tokenizer.encode("hello")) == "HELLO"
    with pytest.raises(ValueError, match="--trust-remote-code"):
        engines("llama", tokenizer=str(custom))
    engine = engines("llama", tokenizer=str(custom), trust_remote_code=True)
    assert type(engine.tokenizer).__name__ == "ShoutingTokenizer"


def test_a_hub_id_is_fetched_at_the_revision_into_the_download_dir(monkeypatch, model_dirs, tmp_path, engines):
    """--revision and --download-dir, as vLLM's, reach huggingface_hub (no network here: the fetch is faked to hand
    back a local model); a local directory or the demo model, which they cannot apply to, refuses them."""
    import huggingface_hub

    from jaxengine.config import EngineConfig
    from jaxengine.models.loader import resolve_model_dir

    calls = []

    def fetch(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(model_dirs["llama"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    assert resolve_model_dir("org/tiny", revision="v2", download_dir=str(tmp_path)) == model_dirs["llama"]
    repo, kwargs = calls[-1]
    assert repo == "org/tiny" and kwargs["revision"] == "v2" and kwargs["cache_dir"] == str(tmp_path)
    assert "*.safetensors" in kwargs["allow_patterns"] and "*.py" not in kwargs["allow_patterns"]
    resolve_model_dir("org/tiny", trust_remote_code=True)  # a tokenizer's own code comes along
    assert calls[-1][1]["revision"] is None and "*.py" in calls[-1][1]["allow_patterns"]
    with pytest.raises(ValueError, match="local directory"):
        resolve_model_dir(model_dirs["llama"], revision="v2")
    with pytest.raises(ValueError, match="hub id"):
        EngineConfig(download_dir=str(tmp_path))
    engines("llama", model="org/tiny", revision="abc123", download_dir=str(tmp_path))  # the engine's own fetch
    repo, kwargs = calls[-1]
    assert repo == "org/tiny" and kwargs["revision"] == "abc123" and kwargs["cache_dir"] == str(tmp_path)
