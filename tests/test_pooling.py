"""Embeddings (runner 'pooling'): LLM.embed / LLMEngine with PoolingParams against transformers' own hidden states."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from jaxengine import LLM, EngineConfig, PoolingParams, SamplingParams
from jaxengine.compile_counter import assert_no_compiles
from jaxengine.pooling_params import PoolerConfig
from tests.engine_util import random_prompts, run_to_completion

LENGTHS = [37, 5, 16, 1, 23]  # several 16-token chunks, one exactly a chunk, a single token


def _llm(engine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(10**9))
    return llm


def _reference(model_dir, prompts, pooling="LAST", normalize=True, dimensions=None):
    """transformers' base model's final hidden states, pooled as a Sentence Transformers pooler would."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            h = model(torch.tensor([p])).last_hidden_state[0].numpy().astype(np.float64)
        v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling][:dimensions]
        out.append(v / np.linalg.norm(v) if normalize else v)
    return out


def _embeddings(engine, prompts, params=None) -> list[np.ndarray]:
    return [np.array(o.outputs.embedding) for o in _llm(engine).embed(prompts, params, use_tqdm=False)]


def test_base_model_last_token(pooling_engines, embedding_models):
    """A base model's checkpoint (Qwen3Model) is an embedding model by default: LAST pooling, normalised, as
    transformers computes it, through chunked prompts; the KV blocks all come back."""
    engine = pooling_engines("base", runner="auto")
    assert engine.runner_type == "pooling" and engine.pooler == PoolerConfig("LAST", True, None)
    prompts = random_prompts(engine.model_config.vocab_size, LENGTHS, seed=1)
    got = _embeddings(engine, prompts)
    for g, ref in zip(got, _reference(embedding_models["base"], prompts)):
        assert g.shape == (64,) and abs(np.linalg.norm(g) - 1) < 1e-5
        np.testing.assert_allclose(g, ref, atol=2e-5)
    raw = _embeddings(engine, prompts, PoolingParams(use_activation=False))
    for g, ref in zip(raw, _reference(embedding_models["base"], prompts, normalize=False)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_matryoshka_dimensions(pooling_engines, embedding_models):
    engine = pooling_engines("base")
    prompts = random_prompts(engine.model_config.vocab_size, [20, 3], seed=2)
    got = _embeddings(engine, prompts, PoolingParams(dimensions=32))
    for g, ref in zip(got, _reference(embedding_models["base"], prompts, dimensions=32)):
        assert g.shape == (32,)
        np.testing.assert_allclose(g, ref, atol=2e-5)
    with pytest.raises(ValueError, match="dimensions=20 is not one the model supports: \\[16, 32, 64\\]"):
        _llm(engine).embed(prompts, PoolingParams(dimensions=20))
    assert not engine.has_unfinished_requests()


def test_sentence_transformers_pooler(pooling_engines, embedding_models):
    """A causal LM's checkpoint served with runner 'pooling' takes its Sentence Transformers pooler (mean,
    normalised); pooler_config's pooling_type replaces it (CLS); prompts that share a prefix compute it each
    time (no prefix cache for MEAN or CLS: a cached prefix has no hidden states)."""
    engine = pooling_engines("st")
    assert engine.pooler == PoolerConfig("MEAN", True, None)
    prompts = random_prompts(engine.model_config.vocab_size, LENGTHS, seed=3)
    prompts.append(prompts[0][:33] + [7])  # shares two full blocks with the first
    got = _embeddings(engine, prompts)
    for g, ref in zip(got, _reference(embedding_models["st"], prompts, "MEAN")):
        np.testing.assert_allclose(g, ref, atol=2e-5)
    cls = pooling_engines("st", pooler_config={"pooling_type": "cls", "use_activation": False})
    got = _embeddings(cls, prompts)
    for g, ref in zip(got, _reference(embedding_models["st"], prompts, "CLS", normalize=False)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        _llm(engine).embed(prompts, PoolingParams(dimensions=8))


def test_prefix_cache_and_no_compiles(pooling_engines):
    """LAST pooling reads the prefix cache (the last position is always computed): the same prompt twice gives
    the same embedding, the second from cached blocks; nothing compiles after warm-up."""
    engine = pooling_engines("base")
    llm = _llm(engine)
    prompt = random_prompts(engine.model_config.vocab_size, [40], seed=4)[0]
    with assert_no_compiles("embedding requests"):
        first = llm.encode([prompt], use_tqdm=False)[0]
        second = llm.encode([prompt], use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    np.testing.assert_allclose(first.outputs.data, second.outputs.data, atol=1e-6)
    assert first.finished and first.prompt_token_ids == prompt


def test_preemption_and_a_full_context(pooling_engines, embedding_models):
    """A pool too small for the prompts at once: sequences are preempted mid-prompt and recomputed, and each
    embedding is still its prompt's; a prompt may fill max_model_len (nothing is generated after it)."""
    engine = pooling_engines("st", num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = random_prompts(engine.model_config.vocab_size, [20, 20, 20, 100, 60, 128], seed=5)
    before = engine.scheduler.num_preemptions
    got = _embeddings(engine, prompts)
    assert engine.scheduler.num_preemptions > before
    for g, ref in zip(got, _reference(embedding_models["st"], prompts, "MEAN")):
        np.testing.assert_allclose(g, ref, atol=2e-5)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_refusals(pooling_engines, engines, embedding_models):
    pooling, generating = pooling_engines("base"), engines("qwen2")
    with pytest.raises(ValueError, match="sampling_params: this engine runs a pooling model"):
        run_to_completion(pooling, [("g", [5, 6], SamplingParams(max_tokens=2))])
    with pytest.raises(ValueError, match="pooling_params: this engine generates text"):
        run_to_completion(generating, [("p", [5, 6], PoolingParams())])
    with pytest.raises(ValueError, match="pooling_task 'token_embed' is not supported"):
        _llm(pooling).encode([[5, 6]], pooling_task="token_embed")
    with pytest.raises(ValueError, match="prompt has 129 tokens; max_model_len=128"):
        _llm(pooling).embed([[5] * 129])
    out = _llm(pooling).embed([[5] * 129], truncate_prompt_tokens=-1, use_tqdm=False)[0]  # the last 128 kept
    assert len(out.prompt_token_ids) == 128
    for bad, match in [(dict(dimensions=0), "dimensions must be >= 1"),
                       (dict(use_activation=1), "use_activation must be true, false or None"),
                       (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be >= -1")]:
        with pytest.raises(ValueError, match=match):
            PoolingParams(**bad)
    assert not pooling.has_unfinished_requests() and not generating.has_unfinished_requests()


def test_settings_refused(embedding_models, model_dirs, tmp_path):
    """Wrong settings fail at start with the setting named (before a model loads where they can)."""
    for settings, match in [(dict(runner="embed"), "runner must be one of auto, generate, pooling"),
                            (dict(convert="classify"), "convert must be one of auto, embed"),
                            (dict(runner="generate", convert="embed"), "convert='embed' makes a pooling model"),
                            (dict(pooler_config="MEAN"), "pooler_config must be a dict or None")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=str(embedding_models["base"]), **settings)
    small = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, kv_cache_gib=0.01,
                 warmup=False)
    with pytest.raises(ValueError, match="runner='generate': the checkpoint .* has no language-model head"):
        LLM(str(embedding_models["base"]), runner="generate", progress=False, **small)
    with pytest.raises(ValueError, match="pooler_config applies to runner 'pooling'"):
        LLM(str(model_dirs["qwen2"]), pooler_config={"pooling_type": "MEAN"}, progress=False, **small)
    for pooler, match in [({"normalize": True}, "unknown keys \\['normalize'\\] \\(normalize is use_activation\\)"),
                          ({"pooling_type": "MAX"}, "pooling_type must be one of LAST, MEAN, CLS"),
                          ({"dimensions": 8}, "does not support Matryoshka")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(model_dirs["qwen2"]), runner="pooling", pooler_config=pooler, progress=False, **small)
    st = tmp_path / "st"
    shutil.copytree(embedding_models["st"], st)
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling \\['pooling_mode_max_tokens'\\] is not supported"):
        LLM(str(st), runner="pooling", progress=False, **small)
    llm = LLM(str(st), runner="pooling", pooler_config={"pooling_type": "LAST"}, progress=False, **small)
    assert llm.engine.pooler == PoolerConfig("LAST", True, None)  # the override stands in for the pooler


def test_score_is_the_cosine_of_embeddings(pooling_engines):
    """LLM.score on an embedding model: each pair's cosine, paired 1:N or N:N as vLLM pairs them."""
    llm = _llm(pooling_engines("base"))
    texts = ["the cat sat", "a dog ran far away", "the cat sat on the mat", "zzz"]
    vectors = [np.array(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]

    def cosine(a, b):
        return a @ b / np.linalg.norm(a) / np.linalg.norm(b)

    one_to_many = llm.score(texts[0], texts[1:], use_tqdm=False)
    assert [round(o.outputs.score, 5) for o in one_to_many] == [round(cosine(vectors[0], v), 5) for v in vectors[1:]]
    pairwise = llm.score(texts[:2], texts[2:], use_tqdm=False)
    assert [round(o.outputs.score, 5) for o in pairwise] == [round(cosine(vectors[0], vectors[2]), 5),
                                                             round(cosine(vectors[1], vectors[3]), 5)]
    tok = llm.get_tokenizer()
    assert pairwise[0].prompt_token_ids == tok.encode(texts[0]) + tok.encode(texts[2])
    with pytest.raises(ValueError, match="score inputs must pair 1:1, 1:N or N:N, got 2:3"):
        llm.score(texts[:2], texts[1:])
    with pytest.raises(ValueError, match="data_2 must be a text or a list of texts"):
        llm.score("a", [[5, 6]])
    assert not llm.engine.has_unfinished_requests()


def _hf_classifier_logits(model_dir, prompts):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]


def test_sequence_classifier(pooling_engines, embedding_models):
    """A *ForSequenceClassification checkpoint is a classifier by default: its score head over the last token's
    hidden state, softmax over its labels (the logits without use_activation), as transformers computes them."""
    engine = pooling_engines("classifier", runner="auto")
    assert engine.runner_type == "pooling" and engine.pooling_task == "classify"
    assert engine.classifier.labels == ["negative", "neutral", "positive"]
    llm = _llm(engine)
    prompts = random_prompts(engine.model_config.vocab_size, LENGTHS, seed=6)
    expected = _hf_classifier_logits(embedding_models["classifier"], prompts)
    for out, logits in zip(llm.classify(prompts, use_tqdm=False), expected):
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, probs, atol=2e-5)
    raw = llm.classify(prompts, PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits in zip(raw, expected):
        np.testing.assert_allclose(out.outputs.probs, logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pooling_task 'embed': this model's task is 'classify' \\(use LLM.classi"):
        llm.embed(prompts)
    with pytest.raises(ValueError, match="dimensions apply to embeddings"):
        llm.classify(prompts, PoolingParams(dimensions=4))
    with pytest.raises(ValueError, match="this classifier has 3 labels; scoring pairs needs one"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="pooling_task 'classify': this model's task is 'embed'"):
        _llm(pooling_engines("base")).classify(prompts)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_cross_encoder_scores_pairs(pooling_engines, embedding_models):
    """A one-label classifier scores a pair of texts from their joint encoding (sigmoid of its logit)."""
    engine = pooling_engines("cross-encoder")
    llm = _llm(engine)
    tok = llm.get_tokenizer()
    query, documents = "the cat sat", ["a dog ran far away", "the cat sat on the mat"]
    pairs = [tok("the cat sat", text_pair=d)["input_ids"] for d in documents]
    expected = [1 / (1 + np.exp(-logits[0])) for logits in _hf_classifier_logits(embedding_models["cross-encoder"],
                                                                                 pairs)]
    scores = llm.score(query, documents, use_tqdm=False)
    np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=2e-5)
    assert scores[1].prompt_token_ids == pairs[1]


def test_sharded_replicas_embed_as_one_device(pooling_engines, embedding_models):
    """tensor_parallel_size=2 x data_parallel_size=2: each replica's hidden states come back whole (replicated) and
    the embeddings and scores equal one device's."""
    prompts = random_prompts(pooling_engines("base").model_config.vocab_size, LENGTHS, seed=7)
    want = _embeddings(pooling_engines("base"), prompts)
    llm = LLM(str(embedding_models["base"]), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, min_token_bucket=8, kv_cache_gib=0.01, tensor_parallel_size=2,
              data_parallel_size=2, progress=False)
    assert llm.engine.runner_type == "pooling" and len(llm.engine.replicas) == 2
    for got, expected in zip(llm.embed(prompts, use_tqdm=False), want):
        np.testing.assert_allclose(got.outputs.embedding, expected, atol=2e-5)
    assert all(r.block_manager.num_free_blocks == r.block_manager.num_blocks for r in llm.engine.replicas)


def _hf_last_logits(model_dir, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1].numpy().astype(np.float64) for p in prompts]


def test_hf_overrides_make_a_causal_lm_a_token_classifier(model_dirs, pooling_engines):
    """vLLM's --hf-overrides: a causal LM served as a classifier from its output head's rows of some tokens; with
    is_original_qwen3_reranker (Qwen3-Reranker's conversion) one label, sigmoid(yes - no): its two-way softmax's
    "yes". The tied Qwen3 (rows from the embedding) and the untied Llama (from lm_head)."""
    small = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=8,
                 kv_cache_gib=0.01, progress=False)
    prompts = random_prompts(331, [9, 30], seed=10)
    for arch, reranker in (("qwen3", True), ("llama", False)):
        tok = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
        ids = [40, 41] if reranker else [40, 41, 42]
        overrides = {"architectures": [f"{arch.capitalize()}ForSequenceClassification"],
                     "classifier_from_token": tok.convert_ids_to_tokens(ids), "is_original_qwen3_reranker": reranker}
        llm = LLM(str(model_dirs[arch]), hf_overrides=overrides, **small)
        assert llm.engine.pooling_task == "classify"
        for out, logits in zip(llm.classify(prompts, use_tqdm=False), _hf_last_logits(model_dirs[arch], prompts)):
            picked = logits[ids]
            want = [1 / (1 + np.exp(picked[0] - picked[1]))] if reranker else np.exp(picked) / np.exp(picked).sum()
            np.testing.assert_allclose(out.outputs.probs, want, atol=2e-5)
    with pytest.raises(ValueError, match="classifier_from_token: \\['not-a-token'\\] are not tokens"):
        LLM(str(model_dirs["qwen3"]), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                                    "classifier_from_token": ["not-a-token"]}, **small)
    longer = LLM(str(model_dirs["qwen3"]), hf_overrides={"max_position_embeddings": 96},
                 **(small | {"max_model_len": None}))
    assert longer.engine.max_model_len == 96 and longer.engine.runner_type == "generate"
