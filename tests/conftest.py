import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

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
