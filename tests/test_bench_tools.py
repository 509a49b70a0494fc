"""`jaxengine bench throughput|latency` end to end on a tiny model, and the datasets they and `bench serve` share
(random with a range and a prefix, sharegpt, custom, spec_bench, prefix_repetition, burstgpt, timed_trace, json)
against what each file and flag says."""

import argparse
import copy
import json
import random

import numpy as np
import pytest

from jaxengine import bench_data
from jaxengine.bench import random_prompts, send_times
from jaxengine.cli import main
from jaxengine.engine.llm_engine import load_tokenizer

# The settings of the session's shared engines (tests/conftest.py), so these engines reuse their compiled programs.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens",
                "64", "--min-token-bucket", "8", "--kv-cache-gib", "0.01"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def _args(*argv):
    p = argparse.ArgumentParser()
    bench_data.add_dataset_flags(p, seed=True, trace=True)
    return p.parse_args(list(argv))


def _load(tokenizer, *argv):
    args = _args(*argv)
    return bench_data.load_requests(args, vocab_size=300, get_tokenizer=lambda: tokenizer, seed=args.seed)


def test_random_dataset_keeps_the_shared_workloads_prompts():
    # The peers' workload.py: default_rng(seed).integers(4, vocab, size=(num_prompts, input_len)).
    expected = np.random.default_rng(7).integers(4, 300, size=(5, 12)).tolist()
    reqs = bench_data.random_requests(300, 5, 12, 3, seed=7)
    assert [r.prompt for r in reqs] == expected == random_prompts(300, 5, 12, 7)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(12, 3)}


def test_random_dataset_range_ratio_and_prefix():
    reqs = _load(None, "--num-prompts", "200", "--input-len", "20", "--output-len", "10", "--random-range-ratio",
                 '{"input": 0.5, "output": 0.2}', "--random-prefix-len", "3", "--seed", "1")
    prefix = reqs[0].prompt[:3]
    in_lens = [r.prompt_len - 3 for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert all(r.prompt[:3] == prefix and len(r.prompt) == r.prompt_len for r in reqs)
    assert min(in_lens) == 10 and max(in_lens) == 30  # [floor(20 * 0.5), ceil(20 * 1.5)], all reached in 200 draws
    assert min(out_lens) == 8 and max(out_lens) == 12
    assert all(4 <= t < 300 for r in reqs for t in r.prompt)
    again = _load(None, "--num-prompts", "200", "--input-len", "20", "--output-len", "10", "--random-range-ratio",
                  '{"input": 0.5, "output": 0.2}', "--random-prefix-len", "3", "--seed", "1")
    assert again == reqs
    one = _load(None, "--num-prompts", "50", "--input-len", "20", "--random-range-ratio", "0.25")
    assert {r.output_len for r in one} <= set(range(96, 161)) and len({r.prompt_len for r in one}) > 3


@pytest.mark.parametrize("argv, field", [
    (("--random-range-ratio", "1.0"), "--random-range-ratio"),
    (("--random-range-ratio", '{"in": 0.1}'), "--random-range-ratio"),
    (("--random-range-ratio", "abc"), "--random-range-ratio"),
    (("--input-len", "0"), "--input-len"),
    (("--output-len", "-1"), "--output-len"),
    (("--num-prompts", "0"), "--num-prompts"),
    (("--random-prefix-len", "-2"), "--random-prefix-len"),
    (("--dataset-name", "sharegpt"), "--dataset-path"),
    (("--dataset-name", "sharegpt", "--dataset-path", "x.json", "--input-len", "5"), "--input-len"),
    (("--dataset-name", "custom", "--dataset-path", "x.jsonl", "--random-prefix-len", "5"), "--random-prefix-len"),
    (("--dataset-name", "json", "--dataset-path", "/nonexistent/prompts.json"), "--dataset-path"),
    (("--dataset-name", "prefix_repetition", "--num-prompts", "5"), "--prefix-repetition-num-prefixes"),
    (("--dataset-name", "prefix_repetition", "--input-len", "5"), "--input-len"),
    (("--dataset-name", "prefix_repetition", "--prefix-repetition-suffix-len", "-1"), "--prefix-repetition-suffix-len"),
    (("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "0", "--prefix-repetition-suffix-len",
      "0"), "--prefix-repetition-prefix-len"),
    (("--dataset-name", "prefix_repetition", "--output-len", "4", "--prefix-repetition-output-len", "5"),
     "--prefix-repetition-output-len"),
    (("--prefix-repetition-num-prefixes", "2"), "--prefix-repetition"),  # the random dataset's
    (("--dataset-name", "burstgpt"), "--dataset-path"),
    (("--dataset-name", "burstgpt", "--dataset-path", "/nonexistent/burst.csv"), "--dataset-path"),
    (("--dataset-name", "burstgpt", "--dataset-path", "x.csv", "--input-len", "5"), "--input-len"),
    (("--dataset-name", "timed_trace"), "--dataset-path"),
    (("--dataset-name", "timed_trace", "--dataset-path", "t.jsonl", "--output-len", "5"), "--output-len"),
    (("--dataset-name", "timed_trace", "--dataset-path", "t.jsonl", "--timed-trace-chunk-hash-size", "0"),
     "--timed-trace-chunk-hash-size"),
    (("--timed-trace-sec-multiplier", "0.001"), "--timed-trace"),  # the random dataset's
])
def test_bad_dataset_flags_are_refused_by_name(tokenizer, argv, field):
    with pytest.raises(ValueError, match=field):
        _load(tokenizer, *argv)


def test_prefix_repetition_dataset_groups_prompts_by_a_shared_prefix(tokenizer):
    flags = ("--dataset-name", "prefix_repetition", "--num-prompts", "11", "--prefix-repetition-prefix-len", "6",
             "--prefix-repetition-suffix-len", "3", "--prefix-repetition-num-prefixes", "3", "--seed", "5")
    reqs = _load(tokenizer, *flags, "--output-len", "7")
    assert len(reqs) == 9  # 11 // 3 prompts for each of the 3 prefixes, as vLLM's dataset makes them
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(9, 7)} and all(len(r.prompt) == 9 for r in reqs)
    assert all(4 <= t < 300 for r in reqs for t in r.prompt)
    groups = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt[:6]), []).append(tuple(r.prompt[6:]))
    assert sorted(map(len, groups.values())) == [3, 3, 3] and len({s for g in groups.values() for s in g}) == 9
    ordered = _load(tokenizer, *flags, "--disable-shuffle")
    assert all(ordered[i].prompt[:6] == ordered[i - i % 3].prompt[:6] for i in range(9))  # each group together
    assert sorted(r.prompt for r in ordered) == sorted(r.prompt for r in reqs)  # the same prompts, shuffled by --seed
    assert [r.prompt for r in ordered] != [r.prompt for r in reqs]
    assert {r.output_len for r in ordered} == {128}  # vLLM's default output length


def _sharegpt(tmp_path, tokenizer):
    words = "the quick brown fox jumps over a lazy dog".split()
    rng = random.Random(3)
    entries = []
    for i in range(12):
        prompt = " ".join(rng.choice(words) for _ in range(5 + i))
        answer = " ".join(rng.choice(words) for _ in range(4 + 2 * i))
        entries.append({"id": str(i), "conversations": [{"from": "human", "value": prompt},
                                                        {"from": "gpt", "value": answer}]})
    entries += [{"id": "one turn", "conversations": [{"from": "human", "value": "a b c d e f"}]},
                {"id": "short prompt", "conversations": [{"from": "human", "value": "a"},
                                                         {"from": "gpt", "value": "the quick brown fox jumps"}]},
                {"id": "short answer", "conversations": [{"from": "human", "value": "the quick brown fox jumps"},
                                                         {"from": "gpt", "value": "a"}]},
                {"id": "long prompt", "conversations": [{"from": "human", "value": "dog " * 1100},
                                                        {"from": "gpt", "value": "the quick brown fox jumps"}]},
                {"id": "no conversations"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path, entries


def test_sharegpt_dataset(tmp_path, tokenizer):
    path, entries = _sharegpt(tmp_path, tokenizer)

    def count(text):
        return len(tokenizer(text).input_ids)

    usable = [e for e in entries if e["id"].isdigit()]
    shuffled = [e for e in entries if len(e.get("conversations", [])) >= 2]
    random.Random(5).shuffle(shuffled)  # the order vLLM's client takes them in for --seed 5
    expected = [e for e in shuffled if e["id"].isdigit()]
    reqs = _load(tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "6",
                 "--seed", "5")
    turns = [(e["conversations"][0]["value"], e["conversations"][1]["value"]) for e in expected[:6]]
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [(p, count(p), count(a)) for p, a in turns]
    # More prompts than the file has: the usable ones, then draws from them (vLLM's oversampling), or only them.
    every = _load(tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "30",
                  "--disable-shuffle")
    assert [r.prompt for r in every[:12]] == [e["conversations"][0]["value"] for e in usable]
    assert len(every) == 30 and {r.prompt for r in every[12:]} <= {r.prompt for r in every[:12]}
    only = _load(tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "30",
                 "--no-oversample", "--sharegpt-output-len", "7")
    assert len(only) == 13 and {r.output_len for r in only} == {7}  # a fixed length keeps the short answer's pair
    fixed = _load(tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4",
                  "--output-len", "9")
    assert {r.output_len for r in fixed} == {9}


def _burstgpt(tmp_path, rows):
    path = tmp_path / "burstgpt.csv"
    header = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"
    path.write_text("\n".join([header] + [f"{i * 3},{m},{a},{b},{a + b},Conversation log"
                                          for i, (m, a, b) in enumerate(rows)]) + "\n")
    return path


def test_burstgpt_dataset(tmp_path, tokenizer):
    rows = [("GPT-4", 5 + i, 2 + i % 4) for i in range(9)]
    rows[2:2] = [("ChatGPT", 7, 3), ("GPT-4", 6, 0), ("GPT-4", 0, 4)]  # not GPT-4, a failed request, no prompt
    path = _burstgpt(tmp_path, rows)
    usable = [(a, b) for m, a, b in rows if m == "GPT-4" and a > 0 and b > 0]
    flags = ("--dataset-name", "burstgpt", "--dataset-path", str(path), "--seed", "3")
    reqs = _load(tokenizer, *flags, "--num-prompts", "6")
    # The rows pandas' DataFrame.sample(6, random_state=3) draws in vLLM's dataset (numpy's legacy generator).
    picked = [usable[k] for k in np.random.RandomState(3).choice(len(usable), 6, replace=False)]
    assert [(r.prompt_len, r.output_len) for r in reqs] == picked
    assert [r.prompt for r in reqs] == [[(i + j) % 300 for j in range(a)] for i, (a, _) in enumerate(picked)]
    # More prompts than rows: drawn with replacement (as vLLM), or only the rows; the file's order; a fixed length.
    many = _load(tokenizer, *flags, "--num-prompts", "20")
    picked = np.random.RandomState(3).choice(len(usable), 20, replace=True)
    assert [(r.prompt_len, r.output_len) for r in many] == [usable[k] for k in picked]
    assert len(_load(tokenizer, *flags, "--num-prompts", "20", "--no-oversample")) == len(usable)
    ordered = _load(tokenizer, *flags, "--num-prompts", "4", "--disable-shuffle", "--output-len", "3")
    assert [(r.prompt_len, r.output_len) for r in ordered] == [(a, 3) for a, _ in usable[:4]]
    (tmp_path / "no_model.csv").write_text("Timestamp,Request tokens,Response tokens\n1,5,5\n")
    (tmp_path / "words.csv").write_text("Model,Request tokens,Response tokens\nGPT-4,many,5\n")
    (tmp_path / "none.csv").write_text("Model,Request tokens,Response tokens\nChatGPT,5,5\n")
    for name, why in (("no_model", "no \\['Model'\\] column"), ("words", "line 2 .* must be numbers"),
                      ("none", "no GPT-4 rows")):
        with pytest.raises(ValueError, match=f"--dataset-path: .*{why}"):
            _load(tokenizer, "--dataset-name", "burstgpt", "--dataset-path", str(tmp_path / f"{name}.csv"))


def _trace(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_timed_trace_dataset(tmp_path):
    path = _trace(tmp_path, [
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 20, "output_length": 3, "hash_ids": [1, 9]},  # shares hash 1's chunk
        {"timestamp": 1250, "input_length": 100, "output_length": 2, "hash_ids": [2]},  # cut to its one chunk
        {"timestamp": 2000, "input_length": 7, "output_length": 4},  # no hash ids: its own ids
        {"timestamp": 9000, "input_length": 7, "output_length": 4, "hash_ids": [5]},  # past --num-prompts
    ])
    flags = ("--dataset-name", "timed_trace", "--dataset-path", str(path), "--num-prompts", "4",
             "--timed-trace-sec-multiplier", "0.001")
    reqs = _load(None, *flags)
    assert [(r.prompt_len, r.output_len, r.timestamp) for r in reqs] == [(40, 5, 0.0), (20, 3, 0.5), (16, 2, 1.25),
                                                                        (7, 4, 2.0)]
    assert all(len(r.prompt) == r.prompt_len and all(4 <= t < 300 for t in r.prompt) for r in reqs)
    first, second, third, _ = (r.prompt for r in reqs)
    assert second[:16] == first[:16] and second[16:] != first[16:20]  # hash 1's chunk, then hash 9's (4 of it)
    assert third == first[16:32]  # hash 2 at its full size: the same chunk wherever it recurs
    assert _load(None, *flags) == reqs and _load(None, *flags, "--seed", "1")[0].prompt != first
    # Chunks of another size, fields under other names, and a trace without the named field.
    renamed = _trace(tmp_path, [{"ts": 2, "in": 10, "out": 1, "blocks": [4, 4]}, {"ts": 3, "in": 4, "out": 2,
                                                                                 "blocks": [4]}], "renamed.jsonl")
    other = _load(None, "--dataset-name", "timed_trace", "--dataset-path", str(renamed),
                  "--timed-trace-chunk-hash-size", "6", "--timed-trace-label-timestamp", "ts",
                  "--timed-trace-label-input-length", "in", "--timed-trace-label-output-length", "out",
                  "--timed-trace-label-hash-ids", "blocks")
    assert [(r.prompt_len, r.output_len, r.timestamp) for r in other] == [(10, 1, 2.0), (4, 2, 3.0)]
    # Hash 4 at 6 tokens, then cut to the 4 left: a chunk of each size (as vLLM keys them), the same wherever it recurs.
    assert other[0].prompt[6:] == other[1].prompt != other[0].prompt[:4]
    with pytest.raises(ValueError, match="trace line 1 has no 'timestamp' field .*--timed-trace-label-timestamp"):
        _load(None, "--dataset-name", "timed_trace", "--dataset-path", str(renamed))
    for line, why in (({"timestamp": "x", "input_length": 4, "output_length": 1}, "timestamp must be a number"),
                      ({"timestamp": 1, "input_length": 0, "output_length": 1}, "input length"),
                      ({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": []}, "empty prompt"),
                      ({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": "ab"}, "list of integers")):
        bad = _trace(tmp_path, [line], "bad.jsonl")
        with pytest.raises(ValueError, match=f"trace line 1.*{why}"):
            _load(None, "--dataset-name", "timed_trace", "--dataset-path", str(bad))


def test_custom_and_json_datasets(tmp_path, tokenizer):
    lines = [{"prompt": f"question {i} about the fox", "output_tokens": 3 + i} for i in range(5)]
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    own = _load(tokenizer, "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "5",
                "--custom-output-len", "-1", "--disable-shuffle", "--skip-chat-template")
    assert [(r.prompt, r.output_len) for r in own] == [(x["prompt"], x["output_tokens"]) for x in lines]
    chat = _load(tokenizer, "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "2",
                 "--disable-shuffle")
    templated = tokenizer.apply_chat_template([{"role": "user", "content": lines[0]["prompt"]}], tokenize=False,
                                              add_generation_prompt=True)
    assert chat[0].prompt == templated and chat[0].prompt_len == len(tokenizer(templated).input_ids)
    assert {r.output_len for r in chat} == {256}
    # --chat-template-kwargs reach the template (as a reasoning model's enable_thinking does).
    thinking = copy.copy(tokenizer)
    thinking.chat_template = tokenizer.chat_template + "{% if enable_thinking %}<think>{% endif %}"
    custom = ["--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "1", "--disable-shuffle"]
    off, on = (_load(thinking, *custom, "--chat-template-kwargs", f'{{"enable_thinking": {v}}}')[0].prompt
               for v in ("false", "true"))
    assert on == off + "<think>" and off == templated
    for bad, message in ((["--chat-template-kwargs", "[1]"], "JSON object"),
                         (["--chat-template-kwargs", "{}", "--skip-chat-template"], "custom and spec_bench")):
        with pytest.raises(ValueError, match=message):
            _load(thinking, *custom, *bad)
    with pytest.raises(ValueError, match="custom and spec_bench"):
        _load(tokenizer, "--dataset-name", "json", "--dataset-path", str(path), "--chat-template-kwargs", "{}")
    path.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        _load(tokenizer, "--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["the fox", [5, 6, 7], "a dog"]))
    reqs = _load(tokenizer, "--dataset-name", "json", "--dataset-path", str(prompts), "--num-prompts", "2",
                 "--output-len", "4")
    assert [(r.prompt, r.output_len) for r in reqs] == [("the fox", 4), ([5, 6, 7], 4)]
    prompts.write_text(json.dumps([["x"]]))
    with pytest.raises(ValueError, match="token-id lists"):
        _load(tokenizer, "--dataset-name", "json", "--dataset-path", str(prompts))


def test_spec_bench_dataset(tmp_path, tokenizer):
    questions = [{"question_id": i, "category": ("writing", "math")[i % 2],
                  "turns": [f"question {i} about the fox", f"and a follow-up {i}"]} for i in range(7)]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    flags = ("--dataset-name", "spec_bench", "--dataset-path", str(path), "--seed", "4")
    reqs = _load(tokenizer, *flags, "--num-prompts", "3")
    # As vLLM's: the first turns, shuffled by --seed as its random.seed(seed); random.shuffle(...) orders them, in the
    # chat template, 256 tokens out.
    firsts = [q["turns"][0] for q in questions]
    random.Random(4).shuffle(firsts)
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in firsts[:3]]
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        (t, len(tokenizer(t).input_ids), 256) for t in templated]
    math_only = _load(tokenizer, *flags, "--num-prompts", "10", "--spec-bench-category", "math",
                      "--spec-bench-output-len", "9", "--skip-chat-template", "--no-oversample")
    assert sorted(r.prompt for r in math_only) == [q["turns"][0] for q in questions if q["category"] == "math"]
    assert {r.output_len for r in math_only} == {9}
    assert len(_load(tokenizer, *flags, "--num-prompts", "10")) == 10  # oversampled, as vLLM's
    with pytest.raises(ValueError, match="--spec-bench-category: no question of category 'coding'"):
        _load(tokenizer, *flags, "--spec-bench-category", "coding")
    with pytest.raises(ValueError, match="--spec-bench-\\* flags apply to the spec_bench dataset only"):
        _load(tokenizer, "--spec-bench-category", "math")
    path.write_text(json.dumps({"category": "math", "turns": []}) + "\n")
    with pytest.raises(ValueError, match="--dataset-path: every spec_bench line needs \"turns\""):
        _load(tokenizer, *flags)


def test_send_times_follow_the_rate_burstiness_and_ramp_up():
    assert not send_times(5, float("inf"), 1.0, 0).any()  # rate inf: all at once
    for burstiness in (0.5, 1.0, 4.0):
        times = send_times(20000, 20.0, burstiness, 1)
        gaps = np.diff(times)
        # As vLLM's client schedules them: the last leaves at count / rate whatever the draw.
        assert times[-1] == pytest.approx(20000 / 20) and gaps.mean() == pytest.approx(1 / 20, rel=0.01)
        # A gamma of shape k has a coefficient of variation of 1/sqrt(k): burstier traffic varies more.
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)
    # By --seed, from numpy's legacy generator as vLLM's client seeds it (np.random.seed): the same times as its.
    gaps = np.random.RandomState(7).gamma(1.0, 1 / 8, 5)
    assert send_times(5, 8.0, 1.0, 7) == pytest.approx(np.cumsum(gaps) * (5 / 8) / gaps.sum())
    assert send_times(4, 2.0, float("inf"), 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])  # evenly spaced
    # Ramp-up: request i's gap is drawn at its own rate, from start to end req/s (not rescaled).
    assert send_times(3, float("inf"), float("inf"), 0, ("linear", 1, 3)) == pytest.approx([1, 1.5, 1.5 + 1 / 3])
    assert send_times(3, float("inf"), float("inf"), 0, ("exponential", 1, 4)) == pytest.approx([1, 1.5, 1.75])
    ramp = np.diff(send_times(20000, float("inf"), 1.0, 2, ("linear", 10, 30)))
    assert ramp[:2000].mean() == pytest.approx(1 / 11, rel=0.05)
    assert ramp[-2000:].mean() == pytest.approx(1 / 29, rel=0.05)
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -2.0)):
        with pytest.raises(ValueError, match="--request-rate" if rate <= 0 else "--burstiness"):
            send_times(3, rate, burstiness, 0)


def _run(capsys, *argv):
    main(list(argv))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_throughput_runs_a_dataset_through_the_engine(model_dirs, tmp_path, tokenizer, capsys):
    model = str(model_dirs["llama"])
    result = _run(capsys, "bench", "throughput", "--model", model, *ENGINE_FLAGS, "--num-prompts", "5",
                  "--input-len", "7", "--output-len", "4", "--runs", "1", "--n", "2")
    assert result["benchmark"] == "throughput" and result["num_prompts"] == 5 and result["n"] == 2
    assert result["total_prompt_tokens"] == 5 * 7 and result["total_output_tokens"] == 5 * 2 * 4
    assert result["output_tok_s"] > 0 and result["compiles_during_runs"] == 0 and result["detokenize"] is True
    path, _ = _sharegpt(tmp_path, tokenizer)
    result = _run(capsys, "bench", "throughput", "--model", model, *ENGINE_FLAGS, "--dataset-name", "sharegpt",
                  "--dataset-path", str(path), "--num-prompts", "4", "--runs", "1", "--temperature", "0.7",
                  "--top-p", "0.9", "--repetition-penalty", "1.1")
    reqs = _load(tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4")
    # Each request generates its own answer's length (ignore_eos), as vLLM's throughput tool does.
    assert result["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert result["total_prompt_tokens"] == sum(r.prompt_len for r in reqs)
    assert result["sampling"] == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
    assert result["prefix_cache_hit_rate"] == 0  # off unless asked for, as in the peer scripts
    burst = _burstgpt(tmp_path, [("GPT-4", 9, 3), ("GPT-4", 20, 2), ("ChatGPT", 5, 5)])
    result = _run(capsys, "bench", "throughput", "--model", model, *ENGINE_FLAGS, "--dataset-name", "burstgpt",
                  "--dataset-path", str(burst), "--num-prompts", "3", "--runs", "1")
    reqs = bench_data.burstgpt_requests(str(burst), 300, 3, seed=0)  # the rows the engine's --seed (0) draws
    assert result["dataset_name"] == "burstgpt" and result["num_prompts"] == 3
    assert result["total_prompt_tokens"] == sum(r.prompt_len for r in reqs)
    assert result["total_output_tokens"] == sum(r.output_len for r in reqs)
    # A prefix-caching load: 8 prompts behind one 32-token prefix. Each timed run starts with an empty cache (the
    # warm-up ran the same prompts), so the hits are the run's own: the prompts admitted after the first computed
    # the prefix find it, and at most every prompt's two prefix blocks of its 40 tokens hit.
    repetition = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "32",
                  "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "1", "--num-prompts", "8",
                  "--output-len", "3", "--runs", "2"]
    result = _run(capsys, "bench", "throughput", "--model", model, *ENGINE_FLAGS, *repetition,
                  "--enable-prefix-caching", "--disable-detokenize")
    assert result["total_prompt_tokens"] == 8 * 40 and result["total_output_tokens"] == 8 * 3
    assert result["detokenize"] is False
    assert 0 < result["prefix_cache_hit_rate"] < 32 / 40


def test_bench_profile_traces_the_timed_work_into_the_profiler_dir(model_dirs, tmp_path, capsys):
    """--profile, as vLLM's: throughput traces its timed runs, latency one batch after the warm-up (and reports no
    timings); both through LLM.start_profile / stop_profile into --profiler-dir, which they need."""
    engine = ["--model", str(model_dirs["llama"]), *ENGINE_FLAGS]
    with pytest.raises(SystemExit, match="--profile .*--profiler-dir"):
        main(["bench", "throughput", *engine, "--profile", "--num-prompts", "2", "--runs", "1"])
    result = _run(capsys, "bench", "throughput", *engine, "--profile", "--profiler-dir", str(tmp_path / "t"),
                  "--num-prompts", "3", "--input-len", "5", "--output-len", "3", "--runs", "1")
    assert result["profiled"] is True and result["total_output_tokens"] == 9
    assert result["config"]["profiler_dir"] == str(tmp_path / "t")
    result = _run(capsys, "bench", "latency", *engine, "--profile", "--profiler-dir", str(tmp_path / "l"),
                  "--input-len", "5", "--output-len", "3", "--num-iters-warmup", "0")
    assert result["profiled"] is True and result["output_tokens_per_iter"] == 3 and "tpot_ms" not in result
    for folder in ("t", "l"):
        written = sorted(p.name.split(".", 1)[1] for p in (tmp_path / folder).rglob("*") if p.is_file())
        assert written == ["trace.json.gz", "xplane.pb"], written


def test_bench_latency_and_refusals(model_dirs, capsys):
    model = str(model_dirs["llama"])
    result = _run(capsys, "bench", "latency", "--model", model, *ENGINE_FLAGS, "--batch-size", "2", "--input-len",
                  "6", "--output-len", "5", "--num-iters", "2", "--num-iters-warmup", "1", "--n", "3",
                  "--disable-detokenize")
    assert result["benchmark"] == "latency" and result["batch_size"] == 2 and result["n"] == 3
    assert result["detokenize"] is False
    assert result["output_tokens_per_iter"] == 2 * 3 * 5  # --n sequences of every prompt
    # TTFT: 1-token runs'; TPOT: within the full runs, each request's first token to its last (not the difference
    # of the two medians, which a long prompt's noisy prefill could make negative).
    assert result["ttft_ms"] > 0 and result["e2e_ms"] > 0
    assert 0 < result["tpot_ms"] * 4 <= max(result["latencies"]) * 1e3
    assert len(result["latencies"]) == 2 and result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert result["e2e_ms"] == pytest.approx(result["percentiles"]["50"] * 1e3, abs=0.01)
    # the process's memory: its peak resident set, and the anonymous memory it holds (weights, KV cache, runtime)
    assert result["peak_rss_gib"] >= result["rss_anon_gib"] > 0.05
    with pytest.raises(SystemExit, match="--output-len"):
        main(["bench", "latency", "--model", model, *ENGINE_FLAGS, "--output-len", "1"])
    with pytest.raises(SystemExit, match="top_p"):
        main(["bench", "throughput", "--model", model, *ENGINE_FLAGS, "--top-p", "2"])
    with pytest.raises(SystemExit):  # a flag the tool does not take is refused, not ignored
        main(["bench", "latency", "--model", model, "--num-prompts", "3"])
    with pytest.raises(SystemExit):  # a timed trace is `bench serve`'s (as in vLLM): offline has no arrival times
        main(["bench", "throughput", "--model", model, "--dataset-name", "timed_trace", "--dataset-path", "t.jsonl"])


def test_bench_startup_times_a_cold_and_a_warm_server(model_dirs, capsys):
    # Any `jaxengine serve` flag: the server's own flags too (the header itself: tests/server). One token bucket
    # and two sequences: the cold start compiles few programs.
    engine = ["--model", str(model_dirs["llama"]), "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs",
              "2", "--max-num-batched-tokens", "16", "--min-token-bucket", "16", "--kv-cache-gib", "0.01",
              "--enable-request-id-headers"]
    result = _run(capsys, "bench", "startup", "--runs", "1", *engine)
    assert result["benchmark"] == "startup" and result["engine_args"] == engine
    assert result["cold_cache_s"] > 0 and len(result["warm_runs_s"]) == 1 and result["warm_cache_s"] > 0
    with pytest.raises(SystemExit, match="exited with 2 before it was ready(.|\n)*--no-such-flag"):
        main(["bench", "startup", "--runs", "1", *engine, "--no-such-flag"])


def test_results_name_the_commit_and_whether_the_tree_differs_from_it(tmp_path):
    import subprocess

    from jaxengine.bench import source_commit

    def git(*command):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=tmp_path, check=True,
                       capture_output=True)

    assert source_commit(str(tmp_path)) is None  # not a checkout
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked")
    assert source_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_commit(str(tmp_path)) == head + "-dirty"
