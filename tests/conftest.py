import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One cache for the tests' compiled programs (JAXENGINE_TEST_CACHE: an empty one gives a cold run): JAX's, and the
# engines' stored programs (its executables/), in the engines of this process and of the servers and workers it starts
TEST_CACHE = os.environ.get("JAXENGINE_TEST_CACHE", os.path.expanduser("~/.cache/jaxengine/xla-tests"))
os.environ["JAXENGINE_COMPILATION_CACHE"] = TEST_CACHE

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # fake devices for the sharding tests; others use device 0

from tests import tiny_models  # noqa: E402

jax.config.update("jax_compilation_cache_dir", TEST_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

ARCHS = tuple(tiny_models.SPECS)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    tiny_models.make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("models")  # SPECS' (ARCHS: every model test) and LIGHT_SPECS' (a few tests)
    return {name: tiny_models.make_model(name, root / name, tokenizer_dir)
            for name in ARCHS + tuple(tiny_models.LIGHT_SPECS)}


@pytest.fixture(scope="session")
def engines(model_dirs):
    """Engines shared by the whole run, keyed by (arch, settings); small bucket sets keep compiles few. The
    `MAX_ENGINES` used last are kept (an older one is dropped, and built again if asked for): each engine's
    compiled programs hold ~500 memory maps, and a process may hold no more than vm.max_map_count (65530 by
    default: past it XLA's compiler aborts)."""
    import gc
    from collections import OrderedDict

    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    cache = OrderedDict()

    def get(arch, **settings):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in settings.items())))
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        if len(cache) >= MAX_ENGINES:
            cache.popitem(last=False)
            gc.collect()
        # token buckets 16, 32, 64: a decode step of up to 8 sequences pads to 16 rows, which costs the tiny models
        # less than compiling an 8-token bucket for every engine (the cold suite's largest items are these engines)
        base = dict(model=str(model_dirs[arch]), dtype="float32", max_model_len=512, max_num_seqs=8,
                    max_num_batched_tokens=64, min_token_bucket=16, kv_cache_gib=0.01, seed=0)
        cache[key] = LLMEngine(EngineConfig(**(base | settings)), progress=False)
        return cache[key]

    return get


MAX_ENGINES = 40


@pytest.fixture(scope="session")
def embedding_models(tmp_path_factory, tokenizer_dir):
    """Pooling checkpoints: "base", a Qwen3 base model (Qwen3Model: no output head, tensors without the "model."
    prefix) that declares Matryoshka dimensions; "st", the Llama causal LM with a Sentence Transformers pooler of
    its own (mean pooling, then Normalize); "classifier", a three-label Qwen2 sequence classifier; "cross-encoder",
    a one-label Llama one."""
    import json

    root = tmp_path_factory.mktemp("embedding-models")
    base = tiny_models.make_model("qwen3", root / "base", tokenizer_dir, cls="Qwen3Model", config_cls="Qwen3Config")
    config = tiny_models.read_config(base) | {"matryoshka_dimensions": [16, 32, 64]}
    (base / "config.json").write_text(json.dumps(config))
    st = tiny_models.make_model("llama", root / "st", tokenizer_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (st / "modules.json").write_text(json.dumps(modules))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 96, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    classifier = tiny_models.make_model("qwen2", root / "classifier", tokenizer_dir,
                                        cls="Qwen2ForSequenceClassification", config_cls="Qwen2Config",
                                        id2label=labels, label2id={v: k for k, v in labels.items()})
    cross_encoder = tiny_models.make_model("llama", root / "cross-encoder", tokenizer_dir,
                                           cls="LlamaForSequenceClassification", config_cls="LlamaConfig", num_labels=1)
    return {"base": base, "st": st, "classifier": classifier, "cross-encoder": cross_encoder}


@pytest.fixture(scope="session")
def pooling_engines(embedding_models):
    """Pooling engines (runner 'pooling') shared by the run, keyed by (model, settings): 16-token steps, so that
    the test prompts run in several chunks."""
    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    cache = {}

    def get(name, **settings):
        key = (name, tuple(sorted((k, repr(v)) for k, v in settings.items())))
        if key not in cache:
            base = dict(model=str(embedding_models[name]), dtype="float32", max_model_len=128, max_num_seqs=4,
                        max_num_batched_tokens=16, min_token_bucket=8, kv_cache_gib=0.01, seed=0, runner="pooling")
            cache[key] = LLMEngine(EngineConfig(**(base | settings)), progress=False)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def lora_adapters(model_dirs, tmp_path_factory):
    """tests.lora_util.make_adapters for the tiny Llama."""
    from tests.lora_util import make_adapters

    return make_adapters(model_dirs["llama"], tmp_path_factory.mktemp("loras"))
