"""Tensor parallelism on 8 fake CPU devices: same greedy tokens, real collectives, sharded weights."""

import jax.numpy as jnp
import pytest

from jaxengine import SamplingParams
from jaxengine.config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine
from tests import tiny_models
from tests.engine_util import random_prompts, run_to_completion

SMALL = dict(dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32, min_token_bucket=32,
             kv_cache_gib=0.01, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama8(tmp_path_factory, tokenizer_dir):
    return tiny_models.make_extra_model("llama8", tmp_path_factory.mktemp("llama8"), tokenizer_dir)


@pytest.fixture(scope="module")
def sharded_engines():
    cache = {}

    def get(model_dir, **settings):
        key = (str(model_dir), tuple(sorted(settings.items())))
        if key not in cache:
            cache[key] = LLMEngine(EngineConfig(model=str(model_dir), **(SMALL | settings)), progress=False)
        return cache[key]

    return get


def greedy_tokens(engine, prompts):
    finals = run_to_completion(engine, [(f"p{i}", p, GREEDY) for i, p in enumerate(prompts)])
    return [finals[f"p{i}"].outputs[0].token_ids for i in range(len(prompts))]


# gemma4 at 4: its sliding layers' 4 KV heads split, its full layers' one cannot (their cache stays whole: _forward)
CASES = [("llama8", 2), ("llama8", 4), ("llama8", 8), ("mistral", 2), ("mistral", 4), ("qwen2", 4), ("qwen3", 2),
         ("gemma3", 2), ("qwen2moe", 2), ("mixtral", 2), ("gptoss", 2), ("olmo2", 4), ("glm4moe", 2),
         ("deepseekv3", 2), ("cohere", 4), ("phi", 2), ("gemma4", 4)]


@pytest.mark.parametrize("name,tp", CASES)
def test_tensor_parallel_greedy_tokens_match_one_device(name, tp, llama8, model_dirs, sharded_engines):
    model_dir = llama8 if name == "llama8" else model_dirs[name]
    prompts = random_prompts(331, (3, 40, 17), seed=tp)
    want = greedy_tokens(sharded_engines(model_dir), prompts)
    sharded = sharded_engines(model_dir, tensor_parallel_size=tp)
    assert greedy_tokens(sharded, prompts) == want


def test_weights_and_kv_cache_are_sharded(llama8, sharded_engines):
    engine = sharded_engines(llama8, tensor_parallel_size=4)
    cfg, runner = engine.model_config, engine.runner
    assert cfg.num_kv_heads == 4  # 2 checkpoint KV heads, each repeated twice for 4 devices
    assert len(runner.state["layers"]) == 2  # a CPU mesh (XLA's dots): each layer its own arrays, unrolled
    for params in runner.state["layers"].values():
        q_proj = params["q_proj"][...]
        assert {s.data.shape for s in q_proj.addressable_shards} == {(64, 8 * 8 // 4)}
        assert {s.data.shape for s in params["down_proj"][...].addressable_shards} == {(128 // 4, 64)}
        assert {s.data.shape for s in params["k_proj"][...].addressable_shards} == {(64, 8)}  # one KV head each
        assert len(q_proj.devices()) == 4
    kv_shards = {s.data.shape for s in runner.kv_cache.addressable_shards}
    assert kv_shards == {runner.kv_cache.shape[:3] + (2, runner.kv_cache.shape[4])}


def test_compiled_step_contains_the_tensor_parallel_collectives(llama8, sharded_engines):
    engine = sharded_engines(llama8, tensor_parallel_size=2)
    hlo = next(iter(engine.runner._compiled.values())).as_text()
    assert "all-reduce" in hlo


@pytest.mark.parametrize("tp,dp,match", [
    (3, 1, "tensor_parallel_size=3 does not fit the model.*sizes that work here: \\[1, 2, 4, 8\\]"),
    (16, 1, "only 8 exist"),
    (4, 4, "only 8 exist"),
])
def test_impossible_layouts_are_refused(llama8, tp, dp, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=str(llama8), tensor_parallel_size=tp, data_parallel_size=dp, **SMALL),
                  progress=False)


def test_gemma4_kv_heads_are_not_repeated_for_tensor_parallelism(model_dirs):
    """Gemma 4's two layer shapes have KV head counts of their own: a tensor-parallel size that would repeat the
    sliding layers' one KV head (E2B's layout) is refused, naming the sizes that work."""
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not fit.*sizes that work here: \\[1\\]"):
        LLMEngine(EngineConfig(model=str(model_dirs["gemma4e"]), tensor_parallel_size=2, **SMALL), progress=False)


def test_tensor_and_data_parallel_replicas_match_one_device_and_share_the_load(llama8, sharded_engines):
    from jaxengine.engine.dp_engine import DataParallelEngine

    prompts = random_prompts(331, (3, 40, 17, 9, 60, 2), seed=11)
    want = greedy_tokens(sharded_engines(llama8), prompts)
    engine = DataParallelEngine(EngineConfig(model=str(llama8), tensor_parallel_size=2, data_parallel_size=2,
                                             **SMALL), progress=False)
    replica_devices = [set(r.runner.kv_cache.devices()) for r in engine.replicas]
    assert len(replica_devices[0] | replica_devices[1]) == 4 and not replica_devices[0] & replica_devices[1]
    for i, p in enumerate(prompts):
        engine.add_request(f"dp{i}", p, GREEDY)
    assert all(r.has_unfinished_requests() for r in engine.replicas)  # both replicas got work
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[f"dp{i}"].outputs[0].token_ids for i in range(len(prompts))] == want
    assert all(r.block_manager.num_free_blocks == r.block_manager.num_blocks for r in engine.replicas)


def test_orbax_round_trip_restores_sharded_with_identical_output(llama8, sharded_engines, tmp_path, capsys):
    import time

    from jaxengine.cli import main
    from jaxengine.models.loader import load_model
    from jaxengine.parallel.sharding import make_mesh

    out = tmp_path / "orbax"
    main(["convert", "--model", str(llama8), "--output", str(out)])
    assert "wrote an Orbax checkpoint" in capsys.readouterr().out
    prompts = random_prompts(331, (5, 33), seed=4)
    want = greedy_tokens(sharded_engines(llama8), prompts)
    assert greedy_tokens(sharded_engines(out, tensor_parallel_size=4), prompts) == want
    mesh = make_mesh(4)
    timings = {}
    for name, path in (("safetensors", llama8), ("orbax", out)):
        start = time.perf_counter()
        load_model(path, "float32", progress=False, mesh=mesh)
        timings[name] = time.perf_counter() - start
    print(f"load time on a 4-device mesh: safetensors {timings['safetensors']:.3f} s, orbax {timings['orbax']:.3f} s")
    with pytest.raises(SystemExit, match="already holds a converted checkpoint"):
        main(["convert", "--model", str(llama8), "--output", str(out)])


def test_native_cpu_attention_is_refused_on_a_mesh_and_auto_uses_the_reference(llama8, sharded_engines):
    with pytest.raises(ValueError, match="attention_backend 'native' runs on one CPU device"):
        LLMEngine(EngineConfig(model=str(llama8), tensor_parallel_size=2, attention_backend="native", **SMALL),
                  progress=False)
    engine = sharded_engines(llama8, tensor_parallel_size=2)
    hlo = next(iter(engine.runner._compiled.values())).as_text()
    assert "jaxengine_cpu_ragged_paged_attention" not in hlo


def test_every_parameter_axis_has_a_mesh_rule(model_dirs):
    """Every parameter of every test model (SPECS' and LIGHT_SPECS': each architecture's layers) names only logical
    axes the mesh rules know, so that an engine can place it (a new axis without a rule failed only at engine start)."""
    from flax import nnx

    from jaxengine.models.loader import load_config
    from jaxengine.parallel.sharding import LOGICAL_TO_MESH

    for name, model_dir in model_dirs.items():
        arch, cfg = load_config(model_dir)
        model = nnx.eval_shape(lambda: arch.model_class(cfg, jnp.float32))
        axes = {axis for _, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)
                for axis in var.get_metadata()["logical_axes"]}
        assert axes <= set(LOGICAL_TO_MESH), f"{name}: {sorted(axes - set(LOGICAL_TO_MESH))}"
