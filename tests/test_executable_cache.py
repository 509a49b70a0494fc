"""The executable cache: a second process loads every compiled program instead of tracing and compiling
it, and runs them to the same results; a damaged entry is compiled again; past its size cap the least recently
used entries go. The native kernels' cache keeps its most recently used libraries."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("startup_worker.py")
LOAD_WORKER = Path(__file__).with_name("load_worker.py")
ROOT = Path(__file__).parent.parent


def run_python(*args, timeout: float = 600) -> list[str]:
    """The lines a Python process of this checkout (on one CPU device: no XLA_FLAGS) prints, once it has succeeded."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def start_engine(model_dir, cache_dir) -> dict:
    return json.loads(run_python(WORKER, model_dir, cache_dir)[-1])


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


def test_past_its_size_cap_the_least_recently_used_programs_go(tmp_path, monkeypatch):
    """The directory is read at the first store under a cap and again only to prune: a store that stays under it
    adds its size to the count (a large cache's stores each read it once, ~0.35 s apiece)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.runner import executables
    from jaxengine.runner.executables import ExecutableCache

    reads = []
    listing = executables.cache_entries
    monkeypatch.setattr(executables, "cache_entries", lambda *a: reads.append(a) or listing(*a))

    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    # Programs no earlier run can have left in JAX's persistent cache (a program loaded from there is not stored,
    # and turning that cache off does not stop a process that has used it), and that this run leaves out of it.
    offset = float(uuid.uuid4().int % 2**20)

    def get(cache, k):  # program k computes v * k + offset
        return cache.get(f"scale{k}", "f32[8]", lambda: jax.jit(lambda v: v * k + offset).lower(x))

    min_compile_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        cache = ExecutableCache(tmp_path)
        paths = {k: cache._path(f"scale{k}", "f32[8]") for k in (1, 2, 3, 4)}
        for k in (1, 2, 3):
            get(cache, k)
            os.utime(paths[k], (100 * k, 100 * k))  # last used in the order 1, 2, 3
        cache.max_bytes = int(2.5 * max(paths[k].stat().st_size for k in (1, 2, 3)))
        hit = get(cache, 1)  # a hit: now the most recently used
        assert cache.hits == 1 and paths[1].stat().st_mtime > 300
        get(cache, 4)  # stored: over the cap, so 2 and then 3 go
        assert len(reads) == 2  # counted, then pruned
        kept = sorted(p.name for p in tmp_path.glob("*.jaxexec"))
        cache.max_bytes *= 10
        get(cache, 2)  # stored again, under the cap: counted without reading the directory
        assert len(reads) == 2 and cache._total == sum(paths[k].stat().st_size for k in (1, 2, 4))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_secs)
    assert kept == sorted(paths[k].name for k in (1, 4))
    np.testing.assert_array_equal(np.asarray(hit(jnp.arange(8.0))), np.arange(8.0) + offset)


PERSISTENT_THEN_OFF = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jaxengine.compile_counter import persistent_cache_hit_count
from jaxengine.runner.executables import ExecutableCache
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
x = jax.ShapeDtypeStruct((8,), jnp.float32)
def program(v):
    return jnp.sin(v) * 3 + 1
def get(cache, name):  # "a" and "b" are one program: "b" comes from JAX's in-memory cache
    return cache.get(name, "f32[8]", lambda: jax.jit(program).lower(x))
cache = ExecutableCache(sys.argv[2])
get(cache, "a")
jax.config.update("jax_enable_compilation_cache", False)  # too late: JAX has used it, and goes on
get(cache, "b")
stored, persistent_hits = len(list(Path(sys.argv[2]).glob("*.jaxexec"))), persistent_cache_hit_count()
earlier = ExecutableCache(sys.argv[3])  # what the first run stored
results = [np.asarray(get(earlier, name)(jnp.arange(8.0))).tolist() for name in ("a", "b")]
print(json.dumps({"stored": stored, "persistent_hits": persistent_hits, "loaded": earlier.hits,
                  "results": results}))
"""


def test_a_program_from_jaxs_persistent_cache_is_never_stored(tmp_path):
    """XLA:CPU writes an executable that JAX's persistent cache loaded without its kernels, so neither it nor the
    same program from JAX's in-memory cache is stored, even after the config turns JAX's cache off (JAX goes on
    using a cache it has used). In a process that has loaded nothing from there, an in-memory hit is stored."""
    def run(executables, earlier):
        lines = run_python("-c", PERSISTENT_THEN_OFF, tmp_path / "jax", tmp_path / executables, tmp_path / earlier,
                           timeout=300)
        return json.loads(lines[-1])

    first = run("first", "first")  # compiles "a" (JAX's cache keeps it too) and stores both
    assert first["persistent_hits"] == 0 and first["stored"] == 2
    second = run("second", "first")  # "a" comes from JAX's cache, and so "b" does
    assert second["persistent_hits"] == 1 and second["stored"] == 0
    assert second["loaded"] == 2  # the first run's entries load and run
    expected = (np.sin(np.arange(8.0, dtype=np.float32)) * 3 + 1).tolist()
    for results in (first["results"], second["results"]):
        np.testing.assert_allclose(results, [expected, expected], rtol=1e-6)


def test_a_warm_load_of_stacked_layers_takes_its_programs_from_the_cache(model_dirs, tmp_path):
    """Stacked layers (a scanned layer loop: the default, but for CPUs where XLA's dots take the weights) are
    filled on the device one layer at a time by small programs, which the executable cache keeps: a second
    process's load compiles nothing and gives the same weights, on one device and on meshes. On a one-device
    mesh q's and o's programs differ only in their shardings' names and XLA compiles one for both: the cache
    stores it under each name."""
    def loads():
        return [json.loads(line) for line in run_python(LOAD_WORKER, model_dirs["llama"], tmp_path)]

    cold, warm = loads(), loads()
    assert [load["mesh"] for load in cold] == [load["mesh"] for load in warm] == [0, 1, 2]
    for before, after in zip(cold, warm):
        assert before["stacked"] and before["entries"] > 0 and before["hits"] == 0
        assert after["compiles"] == 0 and after["hits"] == after["entries"] == before["entries"]
        assert after["weights"] == before["weights"]


def test_loading_unstacked_layers_compiles_nothing(model_dirs):
    """An unrolled layer loop (the default on CPU where XLA's dots take the weights): every tensor goes to the
    device as it is, or packed on the host for the native matmul, so a load runs no program at all (a
    jnp.asarray of a host array would compile one per shape)."""
    from pallas_kernels import cpu
    from jaxengine.compile_counter import compile_count
    from jaxengine.models.loader import load_model

    for dtype in ("float32", "bfloat16") if cpu.matmul_available() else ("float32",):
        before = compile_count()
        model, _ = load_model(model_dirs["llama"], dtype, progress=False, unstacked=True, native_matmul=True)
        assert model.native_matmul == (dtype == "bfloat16")
        assert compile_count() == before, dtype


def _load_kernels(cache, **env) -> subprocess.CompletedProcess:
    """`pallas_kernels.cpu.available()` in a fresh process whose kernel cache is `cache`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAXENGINE_KERNEL_CACHE=str(cache), **env)
    code = "from pallas_kernels import cpu; print(cpu.available())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_kernel_build_keeps_the_most_recently_used_libraries(tmp_path):
    """Each version of the native kernels' sources builds its own library; a build prunes the cache to the
    KEPT_LIBRARIES most recently used. Built here by a stand-in compiler (an empty file, which then fails to
    load: the kernels are unavailable, as with any broken build)."""
    from pallas_kernels import cpu

    cache = tmp_path / "kernels"
    cache.mkdir()
    old = [f"cpu_kernels-{k:016x}.so" for k in range(cpu.KEPT_LIBRARIES + 3)]
    for k, name in enumerate(old):
        (cache / name).write_bytes(b"")
        os.utime(cache / name, (1000 + k, 1000 + k))  # used in the order of k
    (cache / "notes.txt").write_text("not a library")
    compiler = tmp_path / "fake-c++"
    compiler.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n: > "$2"\n')
    compiler.chmod(0o755)
    result = _load_kernels(cache, CXX=str(compiler))
    assert result.returncode == 0 and result.stdout.split()[-1] == "False", result.stderr[-3000:]
    libraries = {p.name for p in cache.glob("cpu_kernels-*.so")}
    built = libraries - set(old)
    assert len(built) == 1 and libraries == built | set(old[-(cpu.KEPT_LIBRARIES - 1):])
    assert (cache / "notes.txt").exists()


def test_processes_starting_together_build_the_kernels_once(tmp_path):
    """Two processes that find the kernel cache empty at the same time: one builds (each source by a compiler
    process of its own, then a link), the other waits on the cache's build lock and then finds the library there.
    The stand-in compiler logs its calls and takes a second over each, so that the two processes overlap; its
    empty library then fails to load in both (no kernels, as with any broken build), and neither rebuilds it."""
    from pallas_kernels import cpu

    cache, calls = tmp_path / "kernels", tmp_path / "calls"
    compiler = tmp_path / "fake-c++"
    compiler.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nsleep 1\nwhile [ "$1" != "-o" ]; do shift; done\n: > "$2"\n')
    compiler.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAXENGINE_KERNEL_CACHE=str(cache), CXX=str(compiler))
    code = "from pallas_kernels import cpu; print(cpu.available())"
    processes = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0 and out.split()[-1] == "False", err[-3000:]
    lines = calls.read_text().splitlines()
    compiled = sorted(line.split(" -c ")[1].split()[0] for line in lines if " -c " in line)
    assert compiled == sorted(str(source) for source in cpu._SOURCES)
    links = [line for line in lines if " -c " not in line]
    assert len(links) == 1 and links[0].startswith("-shared"), lines
    assert len(list(cache.glob("cpu_kernels-*.so"))) == 1


def test_loading_a_kernel_library_marks_it_used(tmp_path):
    from pallas_kernels import cpu

    if not cpu.available():
        pytest.skip("no native kernels here")
    library = Path(cpu._library()._name)
    (tmp_path / library.name).write_bytes(library.read_bytes())
    os.utime(tmp_path / library.name, (1000, 1000))
    inode = (tmp_path / library.name).stat().st_ino
    result = _load_kernels(tmp_path)
    assert result.returncode == 0 and result.stdout.split()[-1] == "True", result.stderr[-3000:]
    stat = (tmp_path / library.name).stat()
    assert stat.st_ino == inode and stat.st_mtime > 1000  # loaded from the cache, not rebuilt, and marked used
