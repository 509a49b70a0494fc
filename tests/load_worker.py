"""Loads a checkpoint into stacked layers with an executable cache, on one device and on meshes of 1 and 2
(fake CPU) devices, each with its own cache folder (run by tests/test_executable_cache.py). A fresh process:
no program is in JAX's memory, and JAX's persistent cache is off, as in an engine. Prints one JSON line per
load: the compiles, the cache's hits and entries, and each weight's digest and sharding."""

import hashlib
import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxengine.compile_counter import compile_count  # noqa: E402
from jaxengine.models.loader import load_model  # noqa: E402
from jaxengine.parallel.sharding import make_mesh  # noqa: E402
from jaxengine.runner.executables import ExecutableCache  # noqa: E402


def main(model_dir: str, cache_dir: str) -> None:
    for size in (0, 1, 2):
        directory = Path(cache_dir) / f"mesh{size}"
        cache = ExecutableCache(directory)
        before = compile_count()
        model, _ = load_model(model_dir, progress=False, mesh=make_mesh(size, None) if size else None,
                              executables=cache)
        weights = {"/".join(map(str, path)): [hashlib.sha256(np.asarray(v.get_value()).tobytes()).hexdigest(),
                                              str(v.get_value().sharding)]
                   for path, v in nnx.to_flat_state(nnx.state(model))}
        print(json.dumps({"mesh": size, "stacked": not model.layers_unstacked, "compiles": compile_count() - before,
                          "hits": cache.hits, "entries": len(list(directory.glob("*.jaxexec"))),
                          "weights": weights}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
