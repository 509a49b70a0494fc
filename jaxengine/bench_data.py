"""The benchmark datasets, named and shaped as `vllm bench` names them, so a user's dataset files and flags carry
over: `random` (token ids; lengths around a mean with `--random-range-ratio`, an optional shared prefix),
`sharegpt` (the first two turns of each conversation: the prompt and, by its token count, the output length),
`custom` (JSONL, one `{"prompt": ..., "output_tokens": ...}` a line), `prefix_repetition` (groups of prompts
sharing a random prefix: a prefix-caching load), `burstgpt` (the BurstGPT trace's CSV: GPT-4 requests' prompt and
response lengths), `spec_bench` (Spec-Bench's question.jsonl: each question's first turn, as the custom
dataset's prompts), `timed_trace` (`bench serve` only: a JSONL trace replayed at its timestamps, prompts made of
chunks that requests with the same hash ids share, as in the Mooncake traces) and our `json` (a JSON list of
prompts, strings or token-id lists).

A bad flag or file raises ValueError naming it, before any load is sent.
"""

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import random

import numpy as np

from jaxengine.cli import json_object

FIRST_ID = 4  # random ids start here, past the usual special tokens (the peers' workload.py does the same)
DATASETS = ("random", "sharegpt", "custom", "spec_bench", "prefix_repetition", "burstgpt", "json")
ID_DATASETS = ("random", "prefix_repetition", "burstgpt", "timed_trace")  # token-id prompts, below the vocabulary
JSONL_DATASETS = ("custom", "spec_bench", "timed_trace")  # one JSON value a line
PREFIX_REPETITION = {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 10, "output_len": 128}  # vLLM's defaults
# vLLM's timed_trace flags and defaults: the tokens a hash id stands for, the timestamps' unit in seconds, and the
# names of each line's fields.
TIMED_TRACE = {"chunk_hash_size": 16, "sec_multiplier": 1.0, "label_timestamp": "timestamp",
               "label_input_length": "input_length", "label_output_length": "output_length",
               "label_hash_ids": "hash_ids"}


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    timestamp: float | None = None  # a trace's: when to send it, in seconds from the load's start


def add_dataset_flags(p, *, seed: bool, trace: bool = False) -> None:
    """The dataset flags of `vllm bench serve` / `throughput` that we implement. `seed`: add `--seed` (the offline
    tools take the engine's `--seed` instead). `trace`: the timed_trace dataset too (`bench serve`'s)."""
    p.add_argument("--dataset-name", choices=DATASETS + ("timed_trace",) * trace, default="random")
    p.add_argument("--dataset-path", default=None,
                   help="the sharegpt JSON, custom, spec_bench or timed_trace JSONL, burstgpt CSV or json file")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                   help="random dataset: prompt tokens (default 128)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help="output tokens of every request; default: 128 for random and json, the dataset's own for "
                        "sharegpt, custom, spec_bench and burstgpt")
    p.add_argument("--random-range-ratio", type=str, default="0.0",
                   help="random dataset: lengths drawn uniformly from [len*(1-r), len*(1+r)]; a float, or JSON "
                        "{\"input\": r1, \"output\": r2}")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random dataset: this many random tokens shared by every prompt, before its own")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: output tokens of every request")
    p.add_argument("--custom-output-len", type=int, default=256,
                   help="custom: output tokens of every request; -1 takes each line's output_tokens")
    p.add_argument("--spec-bench-output-len", type=int, default=None,
                   help="spec_bench: output tokens of every request (default 256)")
    p.add_argument("--spec-bench-category", default=None,
                   help="spec_bench: only the questions of this category (default: all)")
    p.add_argument("--skip-chat-template", action="store_true",
                   help="custom and spec_bench: send the prompt as it is, not in the tokenizer's chat template")
    p.add_argument("--chat-template-kwargs", default=None,
                   help="custom and spec_bench: a JSON object of arguments for the chat template, e.g. "
                        "'{\"enable_thinking\": false}'")
    for name, default in PREFIX_REPETITION.items():
        p.add_argument(f"--prefix-repetition-{name.replace('_', '-')}", type=int, default=None,
                       help=f"prefix_repetition dataset (default {default})")
    p.add_argument("--disable-shuffle", action="store_true",
                   help="sharegpt, custom, spec_bench, prefix_repetition and burstgpt: keep the dataset's order")
    p.add_argument("--no-oversample", action="store_true",
                   help="sharegpt, custom, spec_bench and burstgpt: fewer requests than --num-prompts when the file "
                        "has fewer")
    if trace:
        for name, default in TIMED_TRACE.items():
            p.add_argument(f"--timed-trace-{name.replace('_', '-')}", type=type(default), default=None,
                           help=f"timed_trace dataset (default {default})")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def at_least(name: str, value: int, minimum: int = 1) -> None:
    """A flag's integer `value` is at least `minimum`, or ValueError naming the flag."""
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def range_ratios(text: str) -> tuple[float, float]:
    """`--random-range-ratio`: one float for both lengths, or a JSON object with "input" and "output"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--random-range-ratio must be a number or a JSON object, got {text!r}") from None
    if isinstance(value, dict):
        unknown = set(value) - {"input", "output"}
        if unknown:
            raise ValueError(f"--random-range-ratio: unknown keys {sorted(unknown)} (use input, output)")
        pair = (value.get("input", 0.0), value.get("output", 0.0))
    else:
        pair = (value, value)
    for r in pair:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
            raise ValueError(f"--random-range-ratio values must be numbers in [0, 1), got {text!r}")
    return float(pair[0]), float(pair[1])


def _length_range(mean: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def random_requests(vocab_size: int, num_prompts: int, input_len: int, output_len: int, seed: int,
                    range_ratio: tuple[float, float] = (0.0, 0.0), prefix_len: int = 0) -> list[BenchRequest]:
    """Ids uniform in [FIRST_ID, vocab) from numpy's default_rng(seed). The ids come first from the generator (a
    [num_prompts, longest] draw, each prompt its row's head), then the lengths, then the prefix: with no range and
    no prefix the prompts are the shared peer workload's."""
    at_least("--num-prompts", num_prompts)
    at_least("--input-len", input_len)
    at_least("--output-len", output_len)
    at_least("--random-prefix-len", prefix_len, 0)
    if vocab_size <= FIRST_ID:
        raise ValueError(f"the random dataset needs a vocabulary larger than {FIRST_ID}, got {vocab_size}")
    in_lo, in_hi = _length_range(input_len, range_ratio[0])
    out_lo, out_hi = _length_range(output_len, range_ratio[1])
    rng = np.random.default_rng(seed)
    ids = rng.integers(FIRST_ID, vocab_size, size=(num_prompts, in_hi))
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    prefix = rng.integers(FIRST_ID, vocab_size, size=prefix_len).tolist()
    return [BenchRequest(prefix + row[:n].tolist(), prefix_len + int(n), int(m))
            for row, n, m in zip(ids, in_lens, out_lens)]


def prefix_repetition_requests(vocab_size: int, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int, shuffle: bool = True) -> list[BenchRequest]:
    """vLLM's `prefix_repetition` dataset, as token ids: `num_prefixes` random prefixes of `prefix_len` ids, each
    followed by num_prompts // num_prefixes random suffixes of `suffix_len` ids (the remainder of num_prompts is
    left out, as vLLM leaves it), shuffled by `seed` unless `shuffle` is off. Ids uniform in [FIRST_ID, vocab) from
    numpy's default_rng(seed), each prefix before its group's suffixes."""
    at_least("--num-prompts", num_prompts)
    at_least("--prefix-repetition-prefix-len", prefix_len, 0)
    at_least("--prefix-repetition-suffix-len", suffix_len, 0)
    at_least("--prefix-repetition-num-prefixes", num_prefixes)
    at_least("--prefix-repetition-output-len", output_len)
    if prefix_len + suffix_len == 0:
        raise ValueError("--prefix-repetition-prefix-len and --prefix-repetition-suffix-len are both 0: empty prompts")
    if num_prompts < num_prefixes:
        raise ValueError(f"--num-prompts ({num_prompts}) must be at least --prefix-repetition-num-prefixes "
                         f"({num_prefixes})")
    if vocab_size <= FIRST_ID:
        raise ValueError(f"the prefix_repetition dataset needs a vocabulary larger than {FIRST_ID}, got {vocab_size}")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_prefixes):
        prefix = rng.integers(FIRST_ID, vocab_size, size=prefix_len).tolist()
        for _ in range(num_prompts // num_prefixes):
            prompt = prefix + rng.integers(FIRST_ID, vocab_size, size=suffix_len).tolist()
            requests.append(BenchRequest(prompt, len(prompt), output_len))
    if shuffle:
        random.Random(seed).shuffle(requests)
    return requests


def _read_json(path: str | None, what: str):
    if not path:
        raise ValueError(f"--dataset-path is required for the {what} dataset")
    try:
        with open(path, encoding="utf-8") as f:
            if what in JSONL_DATASETS:
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
    except OSError as e:
        raise ValueError(f"--dataset-path: cannot read {path!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path: {path!r} is not valid "
                         f"{'JSONL' if what in JSONL_DATASETS else 'JSON'}: {e}") from None


def _shuffled(items: list, seed: int, shuffle: bool) -> list:
    items = list(items)
    if shuffle:
        random.Random(seed).shuffle(items)  # the order vLLM's random.seed(seed); random.shuffle(...) gives
    return items


def _oversampled(requests: list[BenchRequest], num_prompts: int, seed: int, oversample: bool) -> list:
    if not requests:
        raise ValueError("--dataset-path: no usable requests in the dataset")
    if oversample and len(requests) < num_prompts:
        rng = random.Random(seed)
        requests = requests + [rng.choice(requests) for _ in range(num_prompts - len(requests))]
    return requests


def sharegpt_requests(path: str, tokenizer, num_prompts: int, seed: int, output_len: int | None = None,
                      shuffle: bool = True, oversample: bool = True) -> list[BenchRequest]:
    """Conversations with at least two turns, shuffled by seed; the first turn is the prompt, the second's token
    count the output length (or `output_len`). As vLLM, a pair is skipped when the prompt (or, without
    `output_len`, the output) has under 4 tokens, the prompt over 1024 or both over 2048."""
    at_least("--num-prompts", num_prompts)
    if output_len is not None:
        at_least("--sharegpt-output-len", output_len)
    data = _read_json(path, "sharegpt")
    if not isinstance(data, list):
        raise ValueError("--dataset-path: a sharegpt file is a JSON list of {\"conversations\": [...]} objects")
    data = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)
            and len(e["conversations"]) >= 2]
    requests = []
    for entry in _shuffled(data, seed, shuffle):
        if len(requests) >= num_prompts:
            break
        prompt, completion = (turn.get("value") if isinstance(turn, dict) else None
                              for turn in entry["conversations"][:2])
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue
        prompt_len = len(tokenizer(prompt).input_ids)
        out_len = output_len if output_len is not None else len(tokenizer(completion).input_ids)
        too_short = prompt_len < 4 or (output_len is None and out_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
    return _oversampled(requests, num_prompts, seed, oversample)


def custom_requests(path: str, tokenizer, num_prompts: int, seed: int, output_len: int = 256,
                    chat_template: bool = True, shuffle: bool = True, oversample: bool = True,
                    template_kwargs: dict | None = None) -> list[BenchRequest]:
    """JSONL lines with a "prompt" (and "output_tokens" when `output_len` is -1), shuffled by seed. The prompt is
    put in the tokenizer's chat template (as a user turn, with `template_kwargs`) unless `chat_template` is
    false."""
    if output_len != -1:
        at_least("--custom-output-len (or -1)", output_len)
    lines = _read_json(path, "custom")
    for item in lines:
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"--dataset-path: every custom line needs a string \"prompt\"; got {item!r}")
    return _chat_requests(lines, tokenizer, num_prompts, seed, output_len, chat_template, shuffle, oversample,
                          template_kwargs)


def spec_bench_requests(path: str, tokenizer, num_prompts: int, seed: int, output_len: int = 256,
                        category: str | None = None, chat_template: bool = True, shuffle: bool = True,
                        oversample: bool = True, template_kwargs: dict | None = None) -> list[BenchRequest]:
    """vLLM's `spec_bench` dataset: Spec-Bench's question.jsonl (`{"category": ..., "turns": [...]}` a line), each
    question's first turn a prompt (of `category`'s questions only, if given), then as the custom dataset's
    prompts with `output_len`."""
    at_least("--spec-bench-output-len (or --output-len)", output_len)
    lines = _read_json(path, "spec_bench")
    items = []
    for item in lines:
        turns = item.get("turns") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"--dataset-path: every spec_bench line needs \"turns\", a list of strings; got {item!r}")
        if category is None or item.get("category") == category:
            items.append({"prompt": turns[0]})
    if not items:
        found = sorted({str(item.get("category")) for item in lines})
        raise ValueError(f"--spec-bench-category: no question of category {category!r} (the file's: {found})")
    return _chat_requests(items, tokenizer, num_prompts, seed, output_len, chat_template, shuffle, oversample,
                          template_kwargs)


def _chat_requests(items: list[dict], tokenizer, num_prompts: int, seed: int, output_len: int, chat_template: bool,
                   shuffle: bool, oversample: bool, template_kwargs: dict | None) -> list[BenchRequest]:
    """Each item's "prompt" (in the chat template unless `chat_template` is false), shuffled by seed, asking for
    `output_len` tokens (-1: the item's "output_tokens"); vLLM's custom dataset."""
    at_least("--num-prompts", num_prompts)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the dataset's prompts go in the chat template, and this tokenizer has none: pass "
                         "--skip-chat-template")
    requests = []
    for item in _shuffled(items, seed, shuffle):
        if len(requests) >= num_prompts:
            break
        out_len = output_len
        if output_len == -1:
            out_len = item.get("output_tokens")
            if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
                raise ValueError("--custom-output-len -1 takes each line's output_tokens, which must be an integer "
                                 f">= 1; got {item!r}")
        prompt = item["prompt"]
        if chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True, **(template_kwargs or {}))
        requests.append(BenchRequest(prompt, len(tokenizer(prompt).input_ids), out_len))
    return _oversampled(requests, num_prompts, seed, oversample)


BURSTGPT_COLUMNS = ("Model", "Request tokens", "Response tokens")


def burstgpt_requests(path: str | None, vocab_size: int, num_prompts: int, seed: int, output_len: int | None = None,
                      shuffle: bool = True, oversample: bool = True) -> list[BenchRequest]:
    """vLLM's `burstgpt` dataset: the CSV's GPT-4 rows with a positive "Response tokens" (and "Request tokens":
    vLLM keeps an empty prompt, which no server takes), drawn as pandas' `sample(n, random_state=seed)` draws them
    (with replacement when the file has fewer: vLLM's sampling, so the same rows for the same --seed); request i
    is "Request tokens" ids (i + j) mod vocab_size, as vLLM's, sent as ids (vLLM decodes them to text and back),
    and asks for "Response tokens" (or `output_len`). Without `shuffle`, the first rows in the file's order;
    without `oversample`, at most the file's rows."""
    at_least("--num-prompts", num_prompts)
    if output_len is not None:
        at_least("--output-len", output_len)
    if not path:
        raise ValueError("--dataset-path is required for the burstgpt dataset (BurstGPT's CSV)")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in BURSTGPT_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"--dataset-path: {path!r} has no {missing} column(s); a BurstGPT CSV has "
                                 f"{list(BURSTGPT_COLUMNS)} among its columns")
            rows = []
            for line, row in enumerate(reader, start=2):
                try:
                    lengths = tuple(int(float(row[c])) for c in BURSTGPT_COLUMNS[1:])
                except (TypeError, ValueError):
                    raise ValueError(f"--dataset-path: line {line} of {path!r}: the token counts must be numbers, "
                                     f"got {[row[c] for c in BURSTGPT_COLUMNS[1:]]}") from None
                if row["Model"] == "GPT-4" and min(lengths) > 0:
                    rows.append(lengths)
    except OSError as e:
        raise ValueError(f"--dataset-path: cannot read {path!r}: {e}") from None
    if not rows:
        raise ValueError(f"--dataset-path: {path!r} has no GPT-4 rows with positive Request and Response tokens")
    n = num_prompts if oversample else min(num_prompts, len(rows))
    if shuffle:
        picked = np.random.RandomState(seed).choice(len(rows), size=n, replace=n > len(rows)).tolist()
    else:
        picked = [i % len(rows) for i in range(n)]
    requests = []
    for i, row in enumerate(picked):
        input_len, response_len = rows[row]
        prompt = [(i + j) % vocab_size for j in range(input_len)]
        requests.append(BenchRequest(prompt, input_len, response_len if output_len is None else output_len))
    return requests


def _chunk_ids(key: str, size: int, vocab_size: int, seed: int) -> list[int]:
    """`size` ids uniform in [FIRST_ID, vocab) that `key` and `seed` fix (the same in every process)."""
    entropy = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, entropy, size]).integers(FIRST_ID, vocab_size, size=size).tolist()


def timed_trace_requests(path: str | None, vocab_size: int, num_prompts: int, seed: int,
                         chunk_hash_size: int = 16, sec_multiplier: float = 1.0, label_timestamp: str = "timestamp",
                         label_input_length: str = "input_length", label_output_length: str = "output_length",
                         label_hash_ids: str = "hash_ids") -> list[BenchRequest]:
    """vLLM's `timed_trace` dataset: the first `num_prompts` lines of a JSONL trace (Mooncake's, Alibaba's), in
    order. A line's prompt is its hash ids' chunks, `chunk_hash_size` ids each (the last cut to what is left of
    the input length, the prompt to the chunks'), where a hash id stands for the same ids wherever it recurs (at
    the same size): requests that share a prefix of hash ids share that prefix of tokens. vLLM draws a chunk's ids
    from a seed Python's per-process string hash gives; here sha256 and `seed` fix them, so every run sends the
    same prompts. A line without hash ids (vLLM sends it empty) gets input-length ids of its own. The request is
    sent at its timestamp x `sec_multiplier` seconds from the start."""
    at_least("--num-prompts", num_prompts)
    at_least("--timed-trace-chunk-hash-size", chunk_hash_size)
    if not (isinstance(sec_multiplier, (int, float)) and math.isfinite(sec_multiplier) and sec_multiplier > 0):
        raise ValueError(f"--timed-trace-sec-multiplier must be a positive number, got {sec_multiplier!r}")
    if vocab_size <= FIRST_ID:
        raise ValueError(f"the timed_trace dataset needs a vocabulary larger than {FIRST_ID}, got {vocab_size}")
    lines = _read_json(path, "timed_trace")
    labels = {"--timed-trace-label-timestamp": label_timestamp, "--timed-trace-label-input-length": label_input_length,
              "--timed-trace-label-output-length": label_output_length}
    requests = []
    for index, entry in enumerate(lines[:num_prompts]):
        where = f"--dataset-path: trace line {index + 1}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a JSON object: {entry!r}")
        for flag, label in labels.items():
            if label not in entry:
                raise ValueError(f"{where} has no {label!r} field (fields: {sorted(entry)}); name the field with "
                                 f"{flag}")
        timestamp, input_len, output_len = (entry[label] for label in labels.values())
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
            raise ValueError(f"{where}: the timestamp must be a number, got {timestamp!r}")
        for what, value in (("input length", input_len), ("output length", output_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: the {what} must be an integer >= 1, got {value!r}")
        hash_ids = entry.get(label_hash_ids)
        if hash_ids is None:
            prompt = _chunk_ids(f"line {index}", input_len, vocab_size, seed)
        else:
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                         for h in hash_ids):
                raise ValueError(f"{where}: {label_hash_ids!r} must be a list of integers, got {hash_ids!r}")
            prompt, left = [], input_len
            for h in hash_ids:
                if left <= 0:
                    break
                size = min(chunk_hash_size, left)
                prompt += _chunk_ids(f"{h}:{size}", size, vocab_size, seed)
                left -= size
            if not prompt:
                raise ValueError(f"{where}: an empty {label_hash_ids!r} list makes an empty prompt")
        requests.append(BenchRequest(prompt, len(prompt), output_len, float(timestamp) * sec_multiplier))
    if not requests:
        raise ValueError("--dataset-path: no requests in the trace")
    return requests


def json_requests(path: str, get_tokenizer, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """Our `json` dataset: a JSON list of prompts (strings or token-id lists), the first `num_prompts` of it.
    `get_tokenizer()` gives the tokenizer that counts string prompts (only called if there is one)."""
    at_least("--num-prompts", num_prompts)
    at_least("--output-len", output_len)
    data = _read_json(path, "json")
    if not isinstance(data, list):
        raise ValueError("--dataset-path: a json dataset is a JSON list of prompts (strings or token-id lists)")
    requests = []
    for prompt in data[:num_prompts]:
        if isinstance(prompt, str):
            requests.append(BenchRequest(prompt, len(get_tokenizer()(prompt).input_ids), output_len))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            requests.append(BenchRequest(prompt, len(prompt), output_len))
        else:
            raise ValueError(f"--dataset-path: a json dataset's prompts are strings or token-id lists; got {prompt!r}")
    if not requests:
        raise ValueError("--dataset-path: no usable requests in the dataset")
    return requests


def _given(value, default):
    return default if value is None else value


def random_lengths(args) -> tuple[int, int]:
    """The random dataset's input and output lengths (before `--random-range-ratio`)."""
    return _given(args.input_len, 128), _given(args.output_len, 128)


def load_requests(args, *, vocab_size: int, get_tokenizer, seed: int) -> list[BenchRequest]:
    """The requests the dataset flags in `args` describe; `get_tokenizer()` is called only if a text needs its
    tokens counted."""
    ratio = range_ratios(args.random_range_ratio)
    repetition = {name: getattr(args, f"prefix_repetition_{name}") for name in PREFIX_REPETITION}
    if args.dataset_name != "prefix_repetition" and any(value is not None for value in repetition.values()):
        raise ValueError("the --prefix-repetition-* flags apply to the prefix_repetition dataset only")
    if args.dataset_name != "spec_bench" and (args.spec_bench_output_len, args.spec_bench_category) != (None, None):
        raise ValueError("the --spec-bench-* flags apply to the spec_bench dataset only")
    trace = {name: getattr(args, f"timed_trace_{name}", None) for name in TIMED_TRACE}
    if args.dataset_name != "timed_trace" and any(value is not None for value in trace.values()):
        raise ValueError("the --timed-trace-* flags apply to the timed_trace dataset only")
    template_kwargs = None
    if args.chat_template_kwargs is not None:
        if args.dataset_name not in ("custom", "spec_bench") or args.skip_chat_template:
            raise ValueError("--chat-template-kwargs applies to the custom and spec_bench datasets' chat template "
                             "(without --skip-chat-template)")
        try:
            template_kwargs = json_object(args.chat_template_kwargs)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--chat-template-kwargs: {e}") from None
    if args.dataset_name == "random":
        return random_requests(vocab_size, args.num_prompts, *random_lengths(args), seed, ratio,
                               args.random_prefix_len)
    if args.random_prefix_len or ratio != (0.0, 0.0):
        raise ValueError("--random-range-ratio and --random-prefix-len apply to the random dataset only")
    if args.dataset_name == "prefix_repetition":
        if args.input_len is not None:
            raise ValueError("--input-len applies to the random dataset; prefix_repetition prompts are "
                             "--prefix-repetition-prefix-len + --prefix-repetition-suffix-len tokens")
        if None not in (args.output_len, repetition["output_len"]) and args.output_len != repetition["output_len"]:
            raise ValueError("--output-len and --prefix-repetition-output-len disagree; give one")
        repetition["output_len"] = _given(args.output_len, repetition["output_len"])
        values = {name: _given(value, PREFIX_REPETITION[name]) for name, value in repetition.items()}
        return prefix_repetition_requests(vocab_size, args.num_prompts, **values, seed=seed,
                                          shuffle=not args.disable_shuffle)
    if args.input_len is not None:
        raise ValueError(f"--input-len applies to the random dataset only; the {args.dataset_name} dataset's "
                         "prompts have their own lengths")
    if args.dataset_name == "timed_trace":
        if args.output_len is not None or args.disable_shuffle or args.no_oversample:
            raise ValueError("--output-len, --disable-shuffle and --no-oversample do not apply to the timed_trace "
                             "dataset: each line sets its output length, and the first --num-prompts lines are "
                             "sent in order")
        return timed_trace_requests(args.dataset_path, vocab_size, args.num_prompts, seed,
                                    **{name: _given(value, TIMED_TRACE[name]) for name, value in trace.items()})
    if args.dataset_name == "burstgpt":
        return burstgpt_requests(args.dataset_path, vocab_size, args.num_prompts, seed, args.output_len,
                                 not args.disable_shuffle, not args.no_oversample)
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, get_tokenizer(), args.num_prompts, seed,
                                 _given(args.output_len, args.sharegpt_output_len), not args.disable_shuffle,
                                 not args.no_oversample)
    if args.dataset_name == "spec_bench":
        return spec_bench_requests(args.dataset_path, get_tokenizer(), args.num_prompts, seed,
                                   _given(args.output_len, _given(args.spec_bench_output_len, 256)),
                                   args.spec_bench_category, not args.skip_chat_template, not args.disable_shuffle,
                                   not args.no_oversample, template_kwargs)
    if args.dataset_name == "custom":
        return custom_requests(args.dataset_path, get_tokenizer(), args.num_prompts, seed,
                               _given(args.output_len, args.custom_output_len), not args.skip_chat_template,
                               not args.disable_shuffle, not args.no_oversample, template_kwargs)
    return json_requests(args.dataset_path, get_tokenizer, args.num_prompts, _given(args.output_len, 128))
