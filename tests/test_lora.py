"""LoRA adapters (vLLM's enable_lora / LoRARequest): each request's tokens are those of the base model with the
adapter merged into its weights (transformers as the oracle), whatever else shares the batch."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from jaxengine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from jaxengine.compile_counter import assert_no_compiles
from tests.engine_util import hf_greedy, random_prompts, run_to_completion
from tests.lora_util import LORA, make_adapter


@pytest.fixture(scope="module")
def adapters(lora_adapters):
    return lora_adapters

def _run(engine, jobs, max_tokens=12):
    """jobs: (prompt, lora_request or None) -> each request's token ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"j{i}", prompt, params, lora_request=lora)
    finals = run_to_completion(engine, [])
    return [finals[f"j{i}"].outputs[0].token_ids for i in range(len(jobs))]


@pytest.mark.parametrize("layer_loop", ["auto", "scan"])
def test_adapters_and_the_base_model_in_one_batch_match_merged_weights(engines, adapters, layer_loop):
    """Two adapters and the base model in the same steps (chunked prompts, a shared prompt that the prefix cache
    must not hand from one adapter to another): each request's tokens are transformers' with its adapter merged;
    nothing compiles after warm-up; every block and slot comes back."""
    engine = engines("llama", layer_loop=layer_loop, **LORA)
    prompts = random_prompts(engine.model_config.vocab_size, [9, 40, 17, 70], seed=21)
    shared = prompts[1]
    jobs = [(prompts[0], adapters["all"][0]), (shared, None), (shared, adapters["attn"][0]),
            (prompts[2], adapters["attn"][0]), (shared, adapters["all"][0]), (prompts[3], None)]
    with assert_no_compiles("LoRA steps"):
        got = _run(engine, jobs)
    for (prompt, lora), tokens in zip(jobs, got):
        oracle = adapters[None if lora is None else lora.lora_name][1]
        assert tokens == hf_greedy(oracle, prompt, 12), lora
    assert got[4] != got[1] and got[2] != got[1]  # the adapters change the output
    # Steps without an adapter's token skip the updates (the fused MLP runs): the base model's tokens still
    alone = _run(engine, [(prompts[3], None), (prompts[0], None)])
    assert alone == [got[5], hf_greedy(adapters[None][1], prompts[0], 12)]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.lora_slots.users == [0, 0]


def _prompt_logprobs(engine, prompt, lora):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    engine.add_request("p", prompt, params, lora_request=lora)
    out = run_to_completion(engine, [])["p"]
    return np.array([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def test_native_bfloat16_layers_take_the_updates(engines, adapters):
    """bfloat16 weights on the native CPU matmul (fused q/k/v and gate/up, scanned layers): each adapter's prompt
    logprobs are transformers' (float32) with it merged, to bfloat16's precision (the base model's own error here:
    median 0.006, at most 0.03; the adapters' updates grow the activations and so the rounding), and far from
    the base model's."""
    engine = engines("llama", dtype="bfloat16", **LORA)
    from jaxengine.models.loader import native_matmul_applies

    if not native_matmul_applies(engine.mesh):
        pytest.skip("the native CPU matmul does not run here (neither AVX-512 BF16 nor AVX2)")
    prompt = random_prompts(engine.model_config.vocab_size, [40], seed=22)[0]
    base = _prompt_logprobs(engine, prompt, None)
    for name in ("all", "mlp"):
        lora, hf = adapters[name]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, :-1]
        want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
        got = _prompt_logprobs(engine, prompt, lora)
        error, effect = np.abs(got - want), np.abs(want - base)
        assert np.median(error) < 0.05 < 0.5 < np.median(effect) and error.max() < 0.25, (name, error, effect)


def test_one_slot_serves_adapters_in_turn(engines, adapters):
    """max_loras=1: a request whose adapter finds the slot held by another's running requests waits, then loads
    it; all finish with their own adapter's tokens, and nothing compiles."""
    engine = engines("llama", enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = random_prompts(engine.model_config.vocab_size, [12, 20, 7, 15], seed=23)
    jobs = [(prompts[0], adapters["all"][0]), (prompts[1], adapters["mlp"][0]), (prompts[2], None),
            (prompts[3], adapters["all"][0])]
    with assert_no_compiles("LoRA slot loads"):
        got = _run(engine, jobs)
    for (prompt, lora), tokens in zip(jobs, got):
        assert tokens == hf_greedy(adapters[None if lora is None else lora.lora_name][1], prompt, 12)
    assert engine.lora_slots.users == [0]


def test_adapters_that_do_not_fit_are_refused(engines, adapters, model_dirs, tmp_path):
    engine = engines("llama", **LORA)
    config = json.loads((model_dirs["llama"] / "config.json").read_text())
    cases = {
        "rank": (dict(rank=16), "rank 16 is above max_lora_rank=8"),
        "dora": (dict(use_dora=True), "use_dora=True is not supported"),
        "saved": (dict(modules_to_save=["lm_head"]), "modules_to_save=\\['lm_head'\\] is not supported"),
        "bias": (dict(bias="all"), "bias='all' is not supported"),
    }
    for name, (settings, match) in cases.items():
        rank = settings.pop("rank", 4)
        make_adapter(tmp_path / name, config, rank, ("q_proj",), 5, **settings)
        if "bias" in settings:  # the config's bias key is the one written last
            (tmp_path / name / "adapter_config.json").write_text(json.dumps(
                json.loads((tmp_path / name / "adapter_config.json").read_text()) | {"bias": settings["bias"]}))
        with pytest.raises(ValueError, match=match):
            engine.add_lora(LoRARequest(name, 50 + len(name), str(tmp_path / name)))
    embed = tmp_path / "embed"
    make_adapter(embed, config, 4, ("q_proj",), 6)
    tensors = {"base_model.model.model.embed_tokens.lora_A.weight": np.zeros((4, 331), np.float32)}
    save_file(tensors, str(embed / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="is not a layer's LoRA weight"):
        engine.add_lora(LoRARequest("embed", 60, str(embed)))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine.add_lora(LoRARequest("nowhere", 61, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'all'"):
        engine.add_lora(adapters["all"][0])
        engine.add_lora(LoRARequest("other", 1, adapters["attn"][0].lora_path))
    for bad, match in ((dict(lora_int_id=0), "lora_int_id must be a positive integer"),
                       (dict(lora_name=""), "lora_name must be a non-empty string")):
        with pytest.raises(ValueError, match=match):
            LoRARequest(**(dict(lora_name="x", lora_int_id=3, lora_path="p") | bad))
    with pytest.raises(ValueError, match="this engine was started without enable_lora"):
        engines("llama").add_request("x", [5, 6], SamplingParams(max_tokens=1), lora_request=adapters["all"][0])
    for arch, match in (("mixtral", "mixture of experts are not supported"),
                        ("phi", r"LayerNorm model \(PhiForCausalLM\) are not supported"),
                        ("gemma4e", r"Gemma4ForCausalLM \(layers of two shapes\) are not supported")):
        with pytest.raises(ValueError, match=match):
            LLMEngine(EngineConfig(model=str(model_dirs[arch]), dtype="float32", warmup=False, enable_lora=True,
                                   kv_cache_gib=0.01, max_num_seqs=2, max_num_batched_tokens=8), progress=False)
    assert not engine.has_unfinished_requests()


def test_lora_on_an_ungated_mlp_is_refused():
    """Arcee's and Apertus's MLP has no gate projection (the adapted MLP's path has one): refused by name."""
    from jaxengine.lora import check_supported
    from jaxengine.models.registry import get_architecture

    for arch in ("ArceeForCausalLM", "ApertusForCausalLM"):
        hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=100, hidden_act="relu2")
        with pytest.raises(ValueError, match=rf"a model with an ungated MLP \({arch}\) are not supported"):
            check_supported(get_architecture(hf).read_config(hf))


def test_add_list_and_remove_adapters(engines, adapters):
    engine = engines("llama", **LORA)
    assert engine.add_lora(adapters["mlp"][0]) and 3 in engine.list_loras()
    assert engine.remove_lora(3) and 3 not in engine.list_loras() and not engine.remove_lora(3)


def test_beam_search_with_an_adapter(engines, adapters):
    """LLM.beam_search's lora_request (one per prompt here): each prompt's beams are the search over transformers
    with its adapter merged."""
    from jaxengine import BeamSearchParams
    from tests.test_beam_search import _llm, _reference

    engine = engines("llama", **LORA)
    prompts = random_prompts(engine.model_config.vocab_size, [6, 11], seed=24)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    outputs = _llm(engine).beam_search([{"prompt_token_ids": p} for p in prompts], params,
                                       lora_request=[adapters["attn"][0], None])
    for prompt, out, name in zip(prompts, outputs, ("attn", None)):
        assert [s.tokens for s in out.sequences] == [w[0] for w in _reference(adapters[name][1], prompt, 2, 4, 1.0)]
    assert engine.lora_slots.users == [0, 0]


def test_tensor_parallel_adapters_with_repeated_kv_heads(engines, model_dirs, tmp_path):
    """tensor_parallel_size=2 over Qwen3's one KV head (each device holds a copy: the adapter's k/v updates are
    repeated as the weights are): an adapter's tokens and the base model's beside it are transformers' with and
    without it merged."""
    from tests.lora_util import TARGETS, merged_hf

    config = json.loads((model_dirs["qwen3"] / "config.json").read_text())
    tensors = make_adapter(tmp_path / "q3", config, 4, tuple(TARGETS), 7)
    engine = engines("qwen3", tensor_parallel_size=2, **LORA)
    assert engine.model_config.num_kv_heads == 2  # repeated
    prompts = random_prompts(engine.model_config.vocab_size, [9, 30], seed=25)
    got = _run(engine, [(prompts[0], LoRARequest("q3", 9, str(tmp_path / "q3"))), (prompts[1], None)])
    base = merged_hf(model_dirs["qwen3"], {}, 0.0)
    assert got[0] == hf_greedy(merged_hf(model_dirs["qwen3"], tensors, 16.0 / 4), prompts[0], 12)
    assert got[1] == hf_greedy(base, prompts[1], 12) and got[0] != hf_greedy(base, prompts[0], 12)


def test_phi3_fused_projections_adapter(engines, model_dirs, tmp_path):
    """Phi-3's adapters target its fused qkv_proj and gate_up_proj (one A, B rows for each part; the tiny model's
    partial rotary layout applies to the q/k rows): tokens as transformers' with the adapter merged."""
    from tests.lora_util import merged_hf

    config = json.loads((model_dirs["phi3"] / "config.json").read_text())
    D, I, heads, kv = (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
                       config["num_key_value_heads"])
    head_dim, rank, rng = D // heads, 4, np.random.default_rng(8)
    shapes = {"self_attn.qkv_proj": (D, (heads + 2 * kv) * head_dim), "self_attn.o_proj": (heads * head_dim, D),
              "mlp.gate_up_proj": (D, 2 * I), "mlp.down_proj": (I, D)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.3, (rank, n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.3, (n_out, rank)).astype(np.float32)
    (tmp_path / "phi").mkdir()
    save_file(tensors, str(tmp_path / "phi" / "adapter_model.safetensors"))
    (tmp_path / "phi" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8}))
    engine = engines("phi3", **LORA)
    prompt = random_prompts(engine.model_config.vocab_size, [20], seed=26)[0]
    got = _run(engine, [(prompt, LoRARequest("phi", 11, str(tmp_path / "phi"))), (prompt, None)])
    assert got[0] == hf_greedy(merged_hf(model_dirs["phi3"], tensors, 2.0), prompt, 12) != got[1]
    assert got[1] == hf_greedy(merged_hf(model_dirs["phi3"], {}, 0.0), prompt, 12)


def test_host_memory_keeps_max_cpu_loras_adapters(engines, adapters):
    """max_cpu_loras (default max_loras): reading one more adapter lets the least recently used idle one go; a
    request for it reads it again, with the same tokens."""
    engine = engines("llama", enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    prompt = random_prompts(engine.model_config.vocab_size, [10], seed=27)[0]
    want = hf_greedy(adapters["all"][1], prompt, 12)
    assert _run(engine, [(prompt, adapters["all"][0])]) == [want]
    engine.add_lora(adapters["attn"][0])
    engine.add_lora(adapters["all"][0])  # used again: "attn" is now the least recently used
    engine.add_lora(adapters["mlp"][0])
    assert engine.list_loras() == {1, 3}
    engine.add_lora(adapters["attn"][0])
    assert engine.list_loras() == {3, 2}
    assert _run(engine, [(prompt, adapters["all"][0])]) == [want] and engine.list_loras() == {2, 1}
    with pytest.raises(ValueError, match="max_cpu_loras \\(1\\) must be >= max_loras \\(2\\)"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)


@pytest.mark.parametrize("arch, targets", [
    ("granite", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("glm4", ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")),
    ("olmo2", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))])
def test_adapters_over_rewritten_weights_and_other_layer_forms(engines, model_dirs, tmp_path, arch, targets):
    """Granite's residual multiplier, folded into o_proj and down_proj at load, scales their updates too; GLM's
    interleaved half-head rotation lays out the q/k updates' rows as the loader lays out the weights'; OLMo 2's
    projections take their inputs without a norm."""
    from tests.lora_util import make_adapter, merged_hf

    config = json.loads((model_dirs[arch] / "config.json").read_text())
    tensors = make_adapter(tmp_path / arch, config, 4, targets, seed=9, alpha=8.0)
    engine = engines(arch, **LORA)
    prompt = random_prompts(engine.model_config.vocab_size, [20], seed=27)[0]
    got = _run(engine, [(prompt, LoRARequest(arch, 12, str(tmp_path / arch))), (prompt, None)])
    assert got[0] == hf_greedy(merged_hf(model_dirs[arch], tensors, 2.0), prompt, 12) != got[1]
