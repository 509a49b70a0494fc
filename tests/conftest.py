import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # fake devices for the sharding tests; others use device 0

from tests import tiny_models  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ.get("JAXENGINE_TEST_CACHE", os.path.expanduser("~/.cache/jaxengine/xla-tests")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

ARCHS = tuple(tiny_models.SPECS)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    tiny_models.make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("models")
    return {name: tiny_models.make_model(name, root / name, tokenizer_dir) for name in ARCHS}


@pytest.fixture(scope="session")
def engines(model_dirs):
    """Engines shared by the whole run, keyed by (arch, settings); small bucket sets keep compiles few."""
    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    cache = {}

    def get(arch, **settings):
        key = (arch, tuple(sorted(settings.items())))
        if key not in cache:
            base = dict(model=str(model_dirs[arch]), dtype="float32", max_model_len=512, max_num_seqs=8,
                        max_num_batched_tokens=64, min_token_bucket=8, kv_cache_gib=0.01, seed=0)
            cache[key] = LLMEngine(EngineConfig(**(base | settings)), progress=False)
        return cache[key]

    return get
