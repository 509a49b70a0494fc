"""Native CPU body of the ragged paged attention (`cpu_attention.cc`, an XLA FFI custom call).

XLA:CPU runs the reference body's gathers and many tiny batched dots far from memory bandwidth; this body
reads each request's K/V straight from its pages. It is compiled from source with the system C++ compiler
on first use and cached under `~/.cache/jaxengine/kernels` (or `$JAXENGINE_KERNEL_CACHE`), keyed by the
source, jaxlib's FFI headers and the CPU's flags. Where no compiler is found, `available()` is False and the
attention falls back to the reference body. Float32 q and pages only (the CPU compute dtype).
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.cc")
_TARGET = "jaxengine_cpu_ragged_paged_attention"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@functools.cache
def _library() -> ctypes.CDLL:
    """Builds (once per source, headers and CPU) and loads the kernel library; raises if it cannot."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), (Path(include) / "xla/ffi/api/ffi.h").read_bytes(), cpu_flags().encode(),
                 compiler.encode()):
        key.update(part)
    cache = Path(os.environ.get("JAXENGINE_KERNEL_CACHE", "~/.cache/jaxengine/kernels")).expanduser()
    library = cache / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if not library.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / library.name
            command = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
                       "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math", f"-I{include}",
                       str(_SOURCE), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building {_SOURCE.name} failed:\n{result.stderr[-2000:]}")
            os.replace(built, library)  # atomic: concurrent builders each install a complete file
        logger.info("built the native CPU attention kernel: %s", library)
    lib = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuAttention), platform="cpu")
    return lib


@functools.cache
def available() -> bool:
    try:
        _library()
        return True
    except Exception as e:  # no compiler, a failed build: the reference body takes over
        logger.warning("native CPU attention unavailable, using the reference body: %s", e)
        return False


def supports(q_dtype, kv_dtype) -> bool:
    return jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(kv_dtype) == jnp.float32


def ragged_paged_attention(q, kv_pages, layer, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window=None, soft_cap: float | None = None):
    """Same arguments and result as `reference.ragged_paged_attention`."""
    _library()
    scalar = lambda x: jnp.asarray(x, jnp.int32).reshape(1)  # noqa: E731
    window = 0 if sliding_window is None else sliding_window
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, kv_pages, scalar(layer), kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32), scalar(num_seqs), scalar(window),
                sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0))
