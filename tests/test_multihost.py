"""Two local processes (jax.distributed on 127.0.0.1, gloo CPU collectives, 2 devices each) serve one
tensor-parallel engine with the leader/follower protocol. The tests share a compilation cache directory, as
`jaxengine serve --distributed` keeps one by default: the first test's processes store their programs there and
the second's serve with the programs loaded from it, each process its own."""

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxengine import SamplingParams, StructuredOutputsParams
from tests.engine_util import random_prompts, run_to_completion

WORKER = Path(__file__).with_name("multihost_worker.py")
ROOT = Path(__file__).parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(process_id, port, model_dir, mode, cache_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", MULTIHOST_CACHE_DIR=str(cache_dir))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the cache is cache_dir alone
    proc = subprocess.Popen([sys.executable, str(WORKER), str(process_id), str(port), str(model_dir), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    proc.lines = queue.Queue()
    threading.Thread(target=lambda: [proc.lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc


def read_line(proc, deadline):
    """The worker's next protocol line (prefixed '@@ '; gloo and logs share stdout), never blocking forever."""
    seen = []
    while time.monotonic() < deadline:
        try:
            line = proc.lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None and proc.lines.empty():
                raise AssertionError(f"process exited with {proc.returncode}: {''.join(seen)[-3000:]}") from None
            continue
        if line.startswith("@@ "):
            return line[3:].strip()
        seen.append(line)
    raise AssertionError("timed out waiting for the worker")


def kill(*procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


SPECS = [None, {"regex": "[a-z]{3,7}"}, None]  # the second request's allowed tokens reach the follower too


@pytest.fixture(scope="module")
def prompts_and_expected(model_dirs, engines):
    prompts = random_prompts(331, (5, 30, 12), seed=21)
    engine = engines("qwen2", max_num_batched_tokens=32, num_kv_blocks=30)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(**s) if s else None) for s in SPECS]
    finals = run_to_completion(engine, [(f"mh{i}", p, params[i]) for i, p in enumerate(prompts)])
    return prompts, [finals[f"mh{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("multihost-cache")


@contextlib.contextmanager
def two_processes(model_dir, prompts, mode, cache_dir):
    """Leader and follower started and the leader ready (prompts sent); both killed on the way out."""
    port = free_port()
    leader, follower = start(0, port, model_dir, mode, cache_dir), start(1, port, model_dir, mode, cache_dir)
    try:
        leader.stdin.write(json.dumps([prompts, SPECS]) + "\n")
        leader.stdin.flush()
        deadline = time.monotonic() + 240
        assert read_line(leader, deadline) == "ready"
        yield leader, follower, deadline
    finally:
        kill(leader, follower)


@pytest.mark.slow
def test_leader_fails_loudly_when_the_follower_dies(model_dirs, prompts_and_expected, cache_dir):
    prompts, _ = prompts_and_expected
    with two_processes(model_dirs["qwen2"], prompts, "forever", cache_dir) as (leader, follower, deadline):
        read_line(leader, deadline)  # the first round of tokens: both processes are stepping
        os.killpg(follower.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert leader.wait(timeout=60) != 0
        assert time.monotonic() - killed < 60


@pytest.mark.slow
def test_two_processes_serve_the_same_tokens_as_one(model_dirs, prompts_and_expected, cache_dir):
    prompts, expected = prompts_and_expected
    cached = any(cache_dir.iterdir())  # after the test above: the programs come from the cache
    with two_processes(model_dirs["qwen2"], prompts, "once", cache_dir) as (leader, follower, deadline):
        assert json.loads(read_line(leader, deadline)) == expected
        assert read_line(follower, deadline) == "follower stopped"
        warmups = json.loads(read_line(leader, deadline)), json.loads(read_line(follower, deadline))
        assert leader.wait(timeout=60) == 0 and follower.wait(timeout=60) == 0
    # [programs loaded, programs, compiles after the warm-up]: the follower's too. Nothing compiles while serving
    # (each command's broadcast was compiled in the warm-up, host arrays reach the devices without a program).
    for loaded, programs, compiles in warmups:
        assert loaded == (programs if cached else 0) and compiles == 0, warmups
