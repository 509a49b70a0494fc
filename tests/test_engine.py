"""The continuous-batching engine end to end against transformers' greedy decoding."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxengine import SamplingParams
from jaxengine.compile_counter import assert_no_compiles
from jaxengine.config import EngineConfig
from jaxengine.engine.request import Status
from tests.conftest import ARCHS
from tests.engine_util import hf_greedy, random_prompts, run_to_completion

PROMPT_LENS = (1, 7, 16, 33, 64, 100, 150, 200)
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_expected(model_dirs):
    cache = {}

    def get(arch):
        if arch not in cache:
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
            prompts = random_prompts(hf.config.vocab_size, PROMPT_LENS)
            cache[arch] = prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        return cache[arch]

    return get


def check_greedy(engine, prompts, expected, tag, max_tokens=NEW_TOKENS):
    params = GREEDY if max_tokens == NEW_TOKENS else SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True)
    finals = run_to_completion(engine, [(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)])
    for i, want in enumerate(expected):
        out = finals[f"{tag}-{i}"]
        assert out.outputs[0].token_ids == want, f"prompt {i} ({len(prompts[i])} tokens)"
        assert out.outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_transformers(arch, engines, hf_expected):
    prompts, expected = hf_expected(arch)
    check_greedy(engines(arch), prompts, expected, "batched")


def test_llama4_chunked_attention_decodes_as_transformers(engines, hf_expected):
    """Llama 4 (tiny_models.LIGHT_SPECS: chunks of 24 keys on its rotating layer, a NoPE expert layer): prompts up to
    200 tokens and their decode, chunked in 32-token steps, every query over its chunk's keys."""
    prompts, expected = hf_expected("llama4")
    check_greedy(engines("llama4", max_num_batched_tokens=32), prompts, expected, "llama4")


def test_one_token_bucket_serves_a_lone_request(engines, hf_expected, monkeypatch):
    """The default buckets start at one token and one request row, so a lone decoding request runs
    vector-matrix products instead of paying for padding rows."""
    prompts, expected = hf_expected("llama")
    engine = engines("llama", min_token_bucket=1)
    assert engine.runner.token_buckets[0] == 1 and engine.runner.requests_for(1) == 1
    buckets, run_step = [], engine.runner._run_step
    monkeypatch.setattr(engine.runner, "_run_step", lambda t, r, *a: buckets.append((t, r)) or run_step(t, r, *a))
    check_greedy(engine, prompts[2:3], expected[2:3], "lone")
    assert buckets[0][0] > 1 and set(buckets[1:]) == {(1, 1)}  # the prompt, then (tokens, rows) of each decode


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_preemption_matches_transformers(arch, engines, hf_expected):
    """A 32-token budget chunks every prompt longer than 32; 30 blocks of 16 tokens cannot hold all 8
    sequences (1,300 tokens in total), so running sequences are preempted and recomputed."""
    prompts, expected = hf_expected(arch)
    engine = engines(arch, max_num_batched_tokens=32, num_kv_blocks=30)
    before = engine.scheduler.num_preemptions
    check_greedy(engine, prompts, expected, "chunked")
    assert engine.scheduler.num_preemptions > before


def test_linear_attention_model_recomputes_prompts_instead_of_sharing_them(engines, hf_expected):
    """Qwen3.5 (SPECS: Gated DeltaNet layers, a state per sequence): no prefix caching (cached KV blocks cannot restore
    a state), so a repeated prompt and the samples of n = 2 each compute the whole prompt, on state rows that other
    sequences held before (a row is not cleared: a chunk that starts its sequence starts from zeros), and generate
    what transformers does; every row and block is back afterwards."""
    prompts, expected = hf_expected("qwen3_5")
    engine = engines("qwen3_5")
    assert not engine.block_manager.enable_prefix_caching
    check_greedy(engine, prompts[3:6], expected[3:6], "recurrent-first")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    with assert_no_compiles("a linear-attention model's steps after warm-up"):
        finals = run_to_completion(engine, [("recurrent-again", prompts[4], GREEDY),
                                            ("recurrent-n", prompts[5], params)])
    assert finals["recurrent-again"].outputs[0].token_ids == expected[4]
    assert finals["recurrent-again"].num_cached_tokens == 0
    assert [o.token_ids for o in finals["recurrent-n"].outputs] == [expected[5]] * 2
    runner = engine.runner  # rows still held belong to finished sequences (given back at the next step)
    assert sorted(runner.free_state_rows + list(runner.state_row_owners)) == list(range(engine.config.max_num_seqs))
    assert all(seq.status != Status.RUNNING for seq in runner.state_row_owners.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def few_greedy(model_dir, lengths=(7, 33, 100), num_tokens=16):
    """Three prompts and transformers' greedy continuations of `num_tokens` (the state models' reference forms are
    slow: fewer than hf_expected's)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, lengths)
    return prompts, [hf_greedy(hf, p, num_tokens) for p in prompts]


def test_attention_free_model_runs_without_a_kv_cache(engines, model_dirs):
    """Mamba2 (tiny_models.LIGHT_SPECS: mixers only): no KV cache (its blocks count tokens only, every sequence's
    longest fits), each sequence's state carried across 32-token prefill chunks and decode steps, as transformers'
    greedy decoding; no compiles after warm-up."""
    prompts, expected = few_greedy(model_dirs["mamba2"])
    engine = engines("mamba2", max_num_batched_tokens=32, min_token_bucket=32)
    assert engine.model_config.kv_cache_layers == 0 and engine.runner.kv_cache[0].size == 0
    assert engine.block_manager.num_blocks == 8 * 512 // 16
    with assert_no_compiles("an attention-free model's steps after warm-up"):
        check_greedy(engine, prompts, expected, "mamba2", max_tokens=16)


def test_bfloat16_state_rows_decode_as_transformers_within_its_rounding(engines, model_dirs):
    """mamba_ssm_cache_dtype bfloat16 (vLLM's flag): Mamba2's states held in bfloat16 (rounded as each step stores
    them, computed in float32; the convolution's state stays in the activations' dtype); every prompt's first token
    (its chunks' states rounded between them) as transformers' float32 greedy decoding (the rounding's effect on the
    logits: tests/test_state_models.py::test_bfloat16_states_stay_within_their_rounding); no compiles after warm-up."""
    prompts, expected = few_greedy(model_dirs["mamba2"])
    engine = engines("mamba2", max_num_batched_tokens=32, min_token_bucket=32, mamba_ssm_cache_dtype="bfloat16")
    conv, recurrent = engine.runner.kv_cache[1]
    assert recurrent.dtype == jnp.bfloat16 and conv.dtype == jnp.float32
    with assert_no_compiles("bfloat16 states' steps after warm-up"):
        finals = run_to_completion(engine, [(f"bf16-{i}", p, SamplingParams(temperature=0, max_tokens=16,
                                                                            ignore_eos=True))
                                            for i, p in enumerate(prompts)])
    assert [finals[f"bf16-{i}"].outputs[0].token_ids[0] for i in range(len(prompts))] == [e[0] for e in expected]
    assert all(len(finals[f"bf16-{i}"].outputs[0].token_ids) == 16 for i in range(len(prompts)))
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32, bfloat16"):
        EngineConfig(model=str(model_dirs["mamba2"]), mamba_ssm_cache_dtype="float16")


def test_parallel_hybrid_model_keeps_kv_cache_and_state_through_preemption(engines, model_dirs):
    """Falcon-H1 (tiny_models.LIGHT_SPECS: a Mamba2 mixer beside every attention layer, in the scanned loop): each
    layer writes the KV cache and its state row; 32-token prefill chunks and 8 blocks, which cannot hold the three
    sequences (preempted ones recompute, their state from zeros), decode as transformers' greedy decoding."""
    prompts, expected = few_greedy(model_dirs["falcon_h1"])
    engine = engines("falcon_h1", max_num_batched_tokens=32, min_token_bucket=32, num_kv_blocks=8)
    before = engine.scheduler.num_preemptions
    check_greedy(engine, prompts, expected, "falcon-h1", max_tokens=16)
    assert engine.scheduler.num_preemptions > before and engine.model_config.kv_cache_layers == 2


@pytest.mark.parametrize("setting, match", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding on Qwen3_5ForCausalLM"),
    (dict(enable_lora=True), r"LoRA adapters on Qwen3_5ForCausalLM \(linear-attention layers\)"),
])
def test_what_linear_attention_models_do_not_run_yet_is_refused(model_dirs, setting, match):
    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=str(model_dirs["qwen3_5"]), dtype="float32", max_model_len=256, max_num_seqs=4,
                               max_num_batched_tokens=32, kv_cache_gib=0.01, warmup=False, **setting), progress=False)


def test_shared_prefix_is_served_from_the_cache(engines, hf_expected, model_dirs):
    engine = engines("qwen2")
    prefix = random_prompts(engine.model_config.vocab_size, [64], seed=5)[0]
    first, second = prefix + [10, 11, 12], prefix + [20, 21]
    run_to_completion(engine, [("prefix-a", first, GREEDY)])
    out = run_to_completion(engine, [("prefix-b", second, GREEDY)])["prefix-b"]
    assert out.num_cached_tokens >= 48
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, second, NEW_TOKENS)


def test_a_prefix_is_shared_within_the_step_that_computes_it(engines, model_dirs):
    """Two prompts behind one 32-token prefix, admitted in the same step (a 64-token budget): the second takes the
    first's two prefix blocks, written in that same step before its tokens read them (as vLLM shares them), and
    still generates what transformers does."""
    engine = engines("qwen2")
    prefix = random_prompts(engine.model_config.vocab_size, [32], seed=11)[0]
    first, second = prefix + [10, 11, 12, 13], prefix + [20, 21, 22]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    steps = []
    step = engine.scheduler.schedule

    def recorded():
        chunks = step()
        steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in chunks])
        return chunks

    engine.scheduler.schedule = recorded
    try:
        outs = run_to_completion(engine, [("same-step-a", first, params), ("same-step-b", second, params)])
    finally:
        del engine.scheduler.schedule
    assert steps[0] == [("same-step-a", 0, 36), ("same-step-b", 32, 3)]  # both in the first step; b from token 32
    assert outs["same-step-b"].num_cached_tokens == 32
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32).eval()
    assert outs["same-step-a"].outputs[0].token_ids == hf_greedy(hf, first, 8)
    assert outs["same-step-b"].outputs[0].token_ids == hf_greedy(hf, second, 8)


def test_shared_prefixes_under_chunking_and_preemption_match_transformers(engines, model_dirs):
    """Blocks shared from when they are scheduled, under a 32-token budget (chunked prompts) and 30 blocks that
    cannot hold every sequence (preemptions): two groups of prompts behind two 40-token prefixes still generate
    what transformers does, and the prefixes are served from the cache."""
    engine = engines("llama", max_num_batched_tokens=32, num_kv_blocks=30)
    vocab = engine.model_config.vocab_size
    prefixes = random_prompts(vocab, [40, 40], seed=21)
    suffixes = random_prompts(vocab, [30, 45, 60, 38, 52, 66], seed=22)
    prompts = [prefixes[i % 2] + suffix for i, suffix in enumerate(suffixes)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    before, hits = engine.scheduler.num_preemptions, engine.block_manager.hit_tokens
    check_greedy(engine, prompts, expected, "shared-preempted")
    assert engine.scheduler.num_preemptions > before and engine.block_manager.hit_tokens - hits >= 4 * 32


def test_cache_salt_separates_prefix_caches(engines):
    engine = engines("qwen2")
    prompt = random_prompts(engine.model_config.vocab_size, [40], seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("salt-a", prompt, params, cache_salt="tenant-a")
    run_to_completion(engine, [])
    engine.add_request("salt-b", prompt, params, cache_salt="tenant-b")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["salt-b"].num_cached_tokens == 0


def test_randomized_workload_leaks_no_blocks_and_compiles_nothing(engines):
    engine = engines("llama", max_num_batched_tokens=32, num_kv_blocks=30)
    rng = np.random.default_rng(7)
    vocab = engine.model_config.vocab_size
    preemptions = engine.scheduler.num_preemptions
    with assert_no_compiles("a randomized workload after warm-up"):
        pending = list(range(50))
        live, step = set(), 0
        while pending or engine.has_unfinished_requests():
            for _ in range(int(rng.integers(0, 4))):
                if pending:
                    i = pending.pop()
                    params = SamplingParams(n=int(rng.integers(1, 4)), temperature=float(rng.choice([0, 0.8])),
                                            top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                                            max_tokens=int(rng.integers(1, 40)), seed=i)
                    engine.add_request(f"w{i}", rng.integers(3, vocab, int(rng.integers(1, 120))).tolist(), params)
                    live.add(f"w{i}")
            if live and rng.random() < 0.15:
                engine.abort_request(sorted(live)[int(rng.integers(len(live)))])
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
            step += 1
            assert step < 5000
    assert engine.scheduler.num_preemptions > preemptions
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_priority_policy_serves_a_later_high_priority_request_first(engines):
    engine = engines("llama", max_num_seqs=1, max_num_batched_tokens=32, scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("running", [5, 6, 7], params, priority=0)
    engine.step()  # occupies the only slot
    engine.add_request("early-low", [5, 6, 8], params, priority=5)
    engine.add_request("late-high", [5, 6, 9], params, priority=1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["running", "late-high", "early-low"]


def test_abort_frees_blocks_and_reports_abort(engines):
    engine = engines("mistral")
    engine.add_request("to-abort", list(range(3, 90)), SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.abort_request("to-abort")
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "to-abort"] == ["abort"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_kv_cache_dtype_follows_the_weights_on_cpu_and_refuses_what_cannot_run(engines, model_dirs):
    """`kv_cache_dtype: auto` on CPU: a bfloat16 cache where the native kernels run bfloat16 weights (twice the
    blocks for the same memory), float32 otherwise; the numerics of that path against transformers are in
    tests/test_models.py. A reduced-precision cache the CPU path cannot run is refused before anything starts."""
    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig
    from pallas_kernels import cpu

    f32 = engines("llama")
    assert f32.runner.kv_cache.dtype == jnp.float32
    engine = engines("llama", dtype="bfloat16")  # bfloat16 weights (the native matmul's where it runs, else XLA's)
    native = cpu.available()  # the native attention
    assert engine.runner.kv_cache.dtype == (jnp.bfloat16 if native else jnp.float32)
    assert engine.block_manager.num_blocks // (2 if native else 1) == f32.block_manager.num_blocks
    prompts = random_prompts(engine.model_config.vocab_size, (5, 40, 90), seed=11)
    with assert_no_compiles("greedy decoding over the engine's CPU cache dtype"):
        finals = run_to_completion(engine, [(f"kv{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert all(len(finals[f"kv{i}"].outputs[0].token_ids) == NEW_TOKENS for i in range(len(prompts)))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    explicit = dict(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512, kv_cache_gib=0.01,
                    warmup=False)
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' on CPU needs the native attention"):
        LLMEngine(EngineConfig(**explicit, kv_cache_dtype="bfloat16", attention_backend="reference"), progress=False)
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' on CPU"):
        LLMEngine(EngineConfig(**explicit, kv_cache_dtype="float16"), progress=False)
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_e5m2' on CPU needs the native attention \(bfloat16 and "
                                         r"fp8 only"):
        LLMEngine(EngineConfig(**explicit, kv_cache_dtype="fp8_e5m2", attention_backend="reference"), progress=False)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_latent_attention_caches_one_row_per_token_and_refuses_what_it_does_not_run(engines, model_dirs):
    """DeepSeek's multi-head latent attention keeps one row per token and layer in the KV cache (the latent and the
    rotary key: 32 + 8 values here, where its 4 heads' keys and values would take 4 x (24 + 12)), so the same cache
    memory holds more blocks; attention bodies that read K/V pairs, and LoRA, are refused before anything starts."""
    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    engine = engines("deepseekv3")
    cfg = engine.model_config
    assert engine.runner.kv_cache.shape == (cfg.num_layers, engine.block_manager.num_blocks, 16, 1, 40)
    assert engine.runner.kv_cache.dtype == jnp.float32
    assert engine.block_manager.num_blocks == int(0.01 * 2 ** 30) // (3 * 16 * 40 * 4)  # layers, tokens, row, float32
    prompts = random_prompts(cfg.vocab_size, (3, 70), seed=12)
    with assert_no_compiles("greedy decoding over the latent cache"):
        run_to_completion(engine, [(f"mla{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    explicit = dict(model=str(model_dirs["deepseekv3"]), dtype="float32", max_model_len=512, kv_cache_gib=0.01,
                    warmup=False)
    for backend in ("native", "pallas"):
        with pytest.raises(ValueError, match=f"attention_backend '{backend}' does not run multi-head latent attention"):
            LLMEngine(EngineConfig(**explicit, attention_backend=backend), progress=False)
    with pytest.raises(ValueError, match="LoRA adapters on multi-head latent attention"):
        LLMEngine(EngineConfig(**explicit, enable_lora=True), progress=False)


def test_chunked_attention_is_refused_to_the_bodies_that_do_not_run_it(model_dirs):
    """Llama 4's chunked attention (each query over its chunk's keys) runs the reference body under `auto` (its KV
    cache then float32 on CPU); an explicit native or pallas body is refused before anything starts."""
    from jaxengine import LLMEngine
    from jaxengine.config import EngineConfig

    explicit = dict(model=str(model_dirs["llama4"]), dtype="bfloat16", max_model_len=512, kv_cache_gib=0.01,
                    warmup=False)
    engine = LLMEngine(EngineConfig(**explicit), progress=False)
    assert engine.runner.kv_cache.dtype == jnp.float32 and min(engine.model_config.sliding_windows) == -24
    for backend in ("native", "pallas"):
        with pytest.raises(ValueError, match=f"attention_backend '{backend}' does not run chunked attention"):
            LLMEngine(EngineConfig(**explicit, attention_backend=backend), progress=False)


def test_scanned_layers_decode_as_the_unrolled_ones_on_cpu(engines):
    """`layer_loop: scan` on CPU over bfloat16 weights: where the native matmul runs it reads each layer of the
    stacked packed weights in place (no slice, no conversion); either way the tokens are the unrolled loop's,
    and nothing compiles after warm-up. `auto` scans where the native matmul runs, and unrolls where XLA's dots
    take the weights (bfloat16 without the native matmul, float32)."""
    from jaxengine.models.loader import native_matmul_applies

    scanned = engines("llama", dtype="bfloat16", layer_loop="scan")
    unrolled = engines("llama", dtype="bfloat16", layer_loop="unrolled")
    auto, auto_float32 = engines("llama", dtype="bfloat16"), engines("llama")  # the shared engines: float32

    def is_stacked(engine):  # per-layer arrays are keyed by the layer's index
        return not isinstance(next(iter(engine.runner.state["layers"])), int)

    assert is_stacked(scanned) and not is_stacked(unrolled) and not is_stacked(auto_float32)
    assert is_stacked(auto) == native_matmul_applies()
    layers = scanned.runner.state["layers"]  # packed (where the native matmul runs): all layers' [L, P, K2, 64]
    assert (layers["qkv_proj"].get_value().ndim == 4) if native_matmul_applies() else "qkv_proj" not in layers
    prompts = random_prompts(scanned.model_config.vocab_size, (3, 33, 70), seed=12)
    requests = [(f"loop{i}", p, GREEDY) for i, p in enumerate(prompts)]
    with assert_no_compiles("greedy decoding through the scanned layer loop"):
        got = run_to_completion(scanned, requests)
    want = run_to_completion(unrolled, requests)
    for rid, _, _ in requests:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert scanned.block_manager.num_free_blocks == scanned.block_manager.num_blocks


def test_shared_prefixes_under_priority_preemption_match_transformers(engines, model_dirs):
    """The priority policy preempts the lowest-priority request, which may have been scheduled earlier in the same
    step (its chunk is dropped, and its blocks must not be shared). Low-priority prompts start first, high-priority
    ones behind the same prefixes join, 30 blocks cannot hold them all: every output still matches transformers,
    and no block leaks."""
    engine = engines("llama", max_num_batched_tokens=32, num_kv_blocks=30, scheduling_policy="priority")
    vocab = engine.model_config.vocab_size
    prefixes = random_prompts(vocab, [24, 24], seed=31)
    suffixes = random_prompts(vocab, [70, 90, 60, 80, 75, 66], seed=32)
    prompts = [prefixes[i % 2] + suffix for i, suffix in enumerate(suffixes)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).eval()
    before = engine.scheduler.num_preemptions
    for i in range(3):
        engine.add_request(f"prio-low-{i}", prompts[i], GREEDY, priority=5)
    finals = {}
    for step in range(10_000):
        if step == 4:
            for i in range(3, 6):
                engine.add_request(f"prio-high-{i}", prompts[i], GREEDY, priority=0)
        if step > 4 and not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > before
    for i, prompt in enumerate(prompts):
        out = finals[f"prio-{'low' if i < 3 else 'high'}-{i}"]
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), i
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_opt_learned_positions_decode_as_transformers(engines, hf_expected):
    """OPT (the architecture of vLLM's quickstart model; tiny_models.LIGHT_SPECS): its learned positions, offset by
    2, read at every prefill chunk (32-token steps) and decode step."""
    prompts, expected = hf_expected("opt")
    check_greedy(engines("opt", max_num_batched_tokens=32), prompts, expected, "opt")
