"""Helpers that drive an LLMEngine to completion and compute transformers' greedy continuations."""

import numpy as np
import torch


def run_to_completion(engine, requests, max_steps=10_000):
    """requests: list of (request_id, prompt, SamplingParams). Returns {request_id: final RequestOutput}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not drain"
    return finals


def hf_greedy(hf_model, prompt, num_tokens):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def random_prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]
