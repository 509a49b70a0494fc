"""The executable cache: a second process loads every compiled program instead of tracing and compiling
it, and runs them to the same results; a damaged entry is compiled again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("startup_worker.py")
ROOT = Path(__file__).parent.parent


def start_engine(model_dir, cache_dir) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(cache_dir)], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_and_warm(model_dirs, tmp_path_factory):
    cache = tmp_path_factory.mktemp("executables")
    cold = start_engine(model_dirs["llama"], cache)
    return cache, cold, start_engine(model_dirs["llama"], cache)


def test_a_cold_start_compiles_and_stores_every_program(cold_and_warm):
    cache, cold, _ = cold_and_warm
    assert cold["loaded"] == 0 and cold["compiles_in_warmup"] == cold["programs"]
    assert len(list((cache / "executables").glob("*.jaxexec"))) == cold["programs"]


def test_a_warm_start_loads_every_program_and_compiles_nothing(cold_and_warm):
    _, cold, warm = cold_and_warm
    assert warm["loaded"] == warm["programs"] and warm["compiles_in_warmup"] == 0
    assert warm["kv_cache_donated"]
    for field in ("tokens", "prompt_logprobs", "logprobs"):
        assert warm[field] == cold[field]


def test_a_damaged_entry_is_compiled_again(cold_and_warm, model_dirs):
    cache, cold, _ = cold_and_warm
    entries = sorted((cache / "executables").glob("*.jaxexec"))
    entries[0].write_bytes(b"not an executable")
    again = start_engine(model_dirs["llama"], cache)
    assert again["loaded"] == again["programs"] - 1 and again["compiles_in_warmup"] == 1
    assert again["tokens"] == cold["tokens"]
    assert entries[0].read_bytes() != b"not an executable"
