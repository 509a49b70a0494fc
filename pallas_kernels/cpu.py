"""Native CPU kernels, XLA FFI custom calls: the ragged paged attention (`cpu_attention.cc`), a float32 x
bfloat16 matmul (`cpu_matmul.cc`, with a layer's RMSNorm applied to its input rows, and a residual added to its
output or the gated MLP's activation applied to it), the sampler's argmax, random draw and logprobs
(`cpu_sampling.cc`), Gated DeltaNet's recurrence over per-sequence states updated in place
(`cpu_linear_attention.cc`) and a fusion barrier.

XLA:CPU runs the reference attention's gathers and many tiny batched dots far from memory bandwidth; the
native body reads each request's K/V straight from its pages (float32 q; float32, bfloat16 or float8 pages), and
its companion writer puts each step's K/V into the pages in place (`write_kv`: XLA:CPU's scatter into a bfloat16
or float8 pool converts the whole pool around every write). XLA:CPU's bfloat16 dots reach a fraction of the AVX-512
BF16 peak at decode and prefill row counts; the native matmul uses that instruction directly, or on AVX2 CPUs
widens each pair of bfloat16 weights to float32 as it reads them (`matmul_available()`). Both are compiled from
source into one library with the system C++ compiler on first use and cached under `~/.cache/jaxengine/kernels`
(or `$JAXENGINE_KERNEL_CACHE`), keyed by the sources (and their headers), jaxlib's FFI headers and the CPU's flags.
Where no compiler is found, `available()` is False and XLA's own ops take over.
"""

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("cpu_attention.cc", "cpu_matmul.cc", "cpu_int8.cc", "cpu_sampling.cc",
                              "cpu_linear_attention.cc"))
# The headers the sources include: part of the build's key.
_HEADERS = tuple(Path(__file__).with_name(name)
                 for name in ("cpu_gated.h", "cpu_matmul_avx2.h", "cpu_pool.h", "cpu_tiles.h", "cpu_vector.h"))
_TARGET = "jaxengine_cpu_ragged_paged_attention"
_SINKS_TARGET = "jaxengine_cpu_ragged_paged_attention_sinks"
_MATMUL_TARGET = "jaxengine_cpu_matmul_bf16"
_GROUPED_MATMUL_TARGET = "jaxengine_cpu_grouped_matmul_bf16"
_GROUPED_MXFP4_TARGET = "jaxengine_cpu_grouped_matmul_mxfp4"
_INT8_MATMUL_TARGET = "jaxengine_cpu_matmul_int8"
_DEQUANT_MATMUL_TARGET = "jaxengine_cpu_matmul_dequant"
_WRITE_TARGET = "jaxengine_cpu_write_kv"
_ROPE_WRITE_TARGET = "jaxengine_cpu_rope_write_kv"
_BARRIER_TARGET = "jaxengine_cpu_fusion_barrier"
_ARGMAX_TARGET = "jaxengine_cpu_first_argmax"
_SAMPLE_TARGET = "jaxengine_cpu_sample"
_LOGPROBS_TARGET = "jaxengine_cpu_token_logprobs"
_DELTA_TARGET = "jaxengine_cpu_gated_delta_rule"


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
    """Builds (once per sources, headers and CPU) and loads the kernel library; raises if it cannot."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    sources = [source.read_bytes() for source in (*_SOURCES, *_HEADERS)]
    for part in (*sources, (Path(include) / "xla/ffi/api/ffi.h").read_bytes(), cpu_flags().encode(), compiler.encode()):
        key.update(part)
    cache = Path(os.environ.get("JAXENGINE_KERNEL_CACHE", "~/.cache/jaxengine/kernels")).expanduser()
    library = cache / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if library.is_file():
        touch(library)  # now the most recently used: other processes' pruning keeps it
    else:
        _build_once(compiler, include, library)
    try:
        lib = ctypes.cdll.LoadLibrary(str(library))
    except OSError:
        if library.is_file():
            raise
        _build_once(compiler, include, library)  # pruned by another process between the check and the load
        lib = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuAttention), platform="cpu")
    jax.ffi.register_ffi_target(_SINKS_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuAttentionSinks), platform="cpu")
    jax.ffi.register_ffi_target(_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuMatmulBf16), platform="cpu")
    jax.ffi.register_ffi_target(_GROUPED_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuGroupedMatmulBf16),
                                platform="cpu")
    jax.ffi.register_ffi_target(_GROUPED_MXFP4_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuGroupedMatmulMxfp4),
                                platform="cpu")
    jax.ffi.register_ffi_target(_DEQUANT_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuMatmulDequant),
                                platform="cpu")
    jax.ffi.register_ffi_target(_INT8_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuMatmulInt8), platform="cpu")
    jax.ffi.register_ffi_target(_WRITE_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuWriteKv), platform="cpu")
    jax.ffi.register_ffi_target(_ROPE_WRITE_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuRopeWriteKv), platform="cpu")
    jax.ffi.register_ffi_target(_BARRIER_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuFusionBarrier), platform="cpu")
    jax.ffi.register_ffi_target(_ARGMAX_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuFirstArgmax), platform="cpu")
    jax.ffi.register_ffi_target(_SAMPLE_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuSample), platform="cpu")
    jax.ffi.register_ffi_target(_LOGPROBS_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuTokenLogprobs), platform="cpu")
    jax.ffi.register_ffi_target(_DELTA_TARGET, jax.ffi.pycapsule(lib.JaxengineCpuGatedDeltaRule), platform="cpu")
    return lib


def _build_once(compiler: str, include: str, library: Path) -> None:
    """Builds `library` unless another process has built it meanwhile: processes that start together on an empty
    cache (a server's workers, test runners, the processes of a multi-host run on one machine) wait for the first
    one's build instead of each compiling the same sources on the same cores (see _build_lock)."""
    with _build_lock(library.parent):
        if not library.is_file():  # (else built by another process while this one waited: just now, so used)
            _build(compiler, include, library)


@contextlib.contextmanager
def _build_lock(cache: Path):
    """One kernel build at a time in a cache directory, across processes (an exclusive lock on its `build.lock`;
    none where the platform has no fcntl)."""
    cache.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(cache / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(compiler: str, include: str, library: Path) -> None:
    """Compiles the sources into `library` (atomically), then prunes the cache it is in. Each source is compiled
    to an object by its own compiler process, as many at once as this process may use cores (the longest,
    cpu_attention.cc, first), then they are linked: on a 2-core EPYC 82 s one after the other, 44 s so. Runs under
    _build_lock, which makes the cache directory."""
    flags = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
             "-fno-signed-zeros", "-fassociative-math", f"-I{include}"]
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in _SOURCES]

        def compile_source(source: Path, target: Path) -> subprocess.CompletedProcess:
            return subprocess.run([compiler, *flags, "-c", str(source), "-o", str(target)], capture_output=True,
                                  text=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(_SOURCES), _usable_cores())) as pool:
            results = list(pool.map(compile_source, _SOURCES, objects))
        for source, result in zip(_SOURCES, results):
            if result.returncode != 0:
                raise RuntimeError(f"building the CPU kernels failed ({source.name}):\n{result.stderr[-2000:]}")
        built = Path(tmp) / library.name
        result = subprocess.run([compiler, "-shared", *map(str, objects), "-o", str(built)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"linking the CPU kernels failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)  # atomic: a process loading it sees a complete file or none
    logger.info("built the native CPU kernels: %s", library)
    prune_libraries(library.parent, keep=library)


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (no sched_getaffinity: macOS)
        return max(1, os.cpu_count() or 1)


KEPT_LIBRARIES = 8  # built libraries the cache keeps, the most recently used (~0.4 MB each)


def prune_libraries(cache: Path, keep: Path, limit: int = KEPT_LIBRARIES) -> None:
    """Removes all but the `limit` most recently used libraries from the kernel cache (`keep`, just built,
    stays). Each version of the sources builds its own library, and without this they pile up. A library that
    another process has loaded stays usable (it is mapped), and one that a process loads afterwards is
    rebuilt."""
    others = [path for path, _ in reversed(cache_entries(cache, "cpu_kernels-*.so")) if path != keep]
    for entry in others[max(limit - 1, 0):]:
        entry.unlink(missing_ok=True)
        logger.info("removed the least recently used kernel library %s", entry.name)


def cache_entries(directory: Path, pattern: str) -> list[tuple[Path, int]]:
    """The files matching `pattern` in a cache directory with their sizes, the least recently used (`touch`)
    first; one that another process removes meanwhile is left out."""
    entries = []
    for entry in directory.glob(pattern):
        try:
            stat = entry.stat()
        except FileNotFoundError:
            continue
        entries.append((stat.st_mtime, entry, stat.st_size))
    return [(entry, size) for _, entry, size in sorted(entries, key=lambda e: e[0])]


def touch(path: Path) -> None:
    """Marks a cache entry as just used (its mtime), for least-recently-used pruning."""
    try:
        os.utime(path)
    except OSError:  # gone meanwhile, or a read-only cache: the order of use is only a hint
        pass


@functools.cache
def available() -> bool:
    try:
        _library()
        return True
    except Exception as e:  # no compiler, a failed build: the reference body takes over
        logger.warning("native CPU kernels unavailable, using XLA's ops: %s", e)
        return False


@functools.cache
def matmul_available() -> bool:
    """Whether the native bfloat16 matmul can run here: the library builds and the CPU has AVX-512 BF16, or
    AVX2 with FMA and F16C (cpu_matmul_avx2.h: each pair of bfloat16 weights widened to float32 as it is read)."""
    flags = set(cpu_flags().split())
    return ({"avx512_bf16", "avx512bw"} <= flags or {"avx2", "fma", "f16c"} <= flags) and available()


@functools.cache
def int8_matmul_available() -> bool:
    """Whether the native W8A8 int8 matmul (cpu_int8.cc) can run here: the library builds and the CPU has
    AVX-512 VNNI."""
    flags = cpu_flags().split()
    return "avx512_vnni" in flags and "avx512bw" in flags and available()


TILE_MIN_ROWS = 8  # calls with fewer live rows run on registers even where tiles run (cpu_matmul.cc: kTileMinRows)


@functools.cache
def matmul_tiles() -> bool:
    """Whether the native matmul runs on AMX tiles here (calls of TILE_MIN_ROWS live rows or more; fewer run on
    registers): the CPU has AMX-BF16, Linux lets the process use its tile registers and JAXENGINE_CPU_AMX is not
    0 (otherwise every call runs on AVX-512 BF16 registers)."""
    return matmul_available() and bool(_library().JaxengineCpuMatmulTiles())


PANEL = 32  # output columns per packed panel (cpu_matmul.cc)


def _packing(w):
    """How `pack_bf16` and `pack_gated` rearrange `w`: with jax.numpy where it is traced, else with numpy on
    the host (at load time: XLA would compile each op for each weight shape, ~1.2 s of a stacked 30-layer
    model's start-up, and numpy's copies are no slower than the compiled ops). Returns (array module, the
    result's wrapper: same kind of array as `w`; `device_put`, as `jnp.asarray` of a host array compiles a copy
    program per shape)."""
    if isinstance(w, jax.core.Tracer):
        return jnp, lambda out: out
    return np, (lambda out: out) if isinstance(w, np.ndarray) else jax.device_put


def _bitcast(xp, x, dtype):
    """x's bits as `dtype` (numpy's view, jax's bitcast; a narrower dtype splits the last axis's elements: the
    caller reshapes)."""
    return np.ascontiguousarray(x).view(dtype) if xp is np else jax.lax.bitcast_convert_type(x, dtype)


_HOST_CHUNK = 1 << 26  # pack_bf16's values at a time on the host


def pack_bf16(w):
    """w [..., K, N] -> bfloat16 [..., ceil(N / 32), ceil(K / 2), 64], the native matmul's layout: panels of
    32 output columns, each contiguous, holding (w[2k, n], w[2k + 1, n]) pairs (zero-padded). A numpy `w`
    gives a numpy result, a jax array (traced or not) a jax array."""
    xp, result = _packing(w)
    *lead, K, N = w.shape
    P, K2 = -(-N // PANEL), -(-K // 2)
    step = max(1, _HOST_CHUNK // max(w.size // max(N, 1) * PANEL, 1)) * PANEL  # columns of a host chunk
    if xp is np and N > step:  # on the host, a group of panels at a time: a few times a group's bytes of
        # temporaries instead of the whole weight's (an output head of 201088 x 2880: ~3.5 GB of them)
        w, out = np.asarray(w), np.empty((*lead, P, K2, 2 * PANEL), jnp.bfloat16)
        for n0 in range(0, N, step):
            out[..., n0 // PANEL:(n0 + step) // PANEL, :, :] = pack_bf16(w[..., n0:n0 + step])
        return result(out)
    bits = _bitcast(xp, xp.asarray(w, jnp.bfloat16), np.uint16)
    if 2 * K2 != K or P * PANEL != N:
        bits = xp.pad(bits, [(0, 0)] * len(lead) + [(0, 2 * K2 - K), (0, P * PANEL - N)])
    # Each pair one 32-bit word, w[2k, n] in its low half (first in memory); then whole words move to their
    # panels (an element-wise interleave of the two rows took numpy twice as long).
    pairs = bits[..., 0::2, :].astype(np.uint32) | (bits[..., 1::2, :].astype(np.uint32) << 16)
    panels = xp.moveaxis(pairs.reshape(*lead, K2, P, PANEL), -2, -3)  # [..., P, K2, 32]
    return result(_bitcast(xp, panels, jnp.bfloat16).reshape(*lead, P, K2, 2 * PANEL))


GATED = PANEL // 2  # gate (and up) columns per panel of a pack_gated weight


def pack_gated(gate, up):
    """gate, up [..., K, I] (I a multiple of 16) -> the packed weight of `gated_pairs`: `pack_bf16` of their
    columns taken 16 at a time in turn, so that each 32-column panel holds 16 gate columns and the same 16 up
    columns (the kernel applies the activation to a panel's products while they are in registers). Numpy
    weights give a numpy result, jax arrays a jax array."""
    *lead, K, I = gate.shape
    if up.shape != gate.shape or I % GATED:
        raise ValueError(f"pack_gated needs gate and up of one shape [..., K, I], I a multiple of {GATED}, got "
                         f"{gate.shape} and {up.shape}")
    xp, result = _packing(gate if isinstance(gate, jax.core.Tracer) else up)
    w = xp.stack([xp.asarray(x).reshape(*lead, K, I // GATED, GATED) for x in (gate, up)], axis=-2)
    return result(pack_bf16(w.reshape(*lead, K, 2 * I)))


def unpack_gated(y):
    """The [..., 2I] float32 products of a `pack_gated` weight (columns in its order) -> (gate, up) [..., I]."""
    y = y.reshape(*y.shape[:-1], -1, 2, GATED)
    return y[..., 0, :].reshape(*y.shape[:-3], -1), y[..., 1, :].reshape(*y.shape[:-3], -1)


def pack_int4_panels(q, scale, zero=None):
    """W4A16 weights for the native matmul: int4 values in int8 [..., K, N] (in [-8, 7], as compressed-tensors
    stores them: the unsigned value minus 8), their float scales [..., groups, N] and zero points (None: the
    symmetric 0; else int [..., groups, N] offset as the values are) (numpy, on the host; K an even multiple of the
    groups) -> (uint8 [..., P, ceil(K / 2), 32], float32 [..., P, groups, 64]): panels of 32 output columns as
    `pack_bf16`'s, each byte a column's two consecutive unsigned values (the first in its low nibble), each panel's
    group scales beside it followed by their biases, -(zero + 8) x scale. The kernel dequantizes a panel to
    bfloat16 (unsigned value times its group's scale plus the bias: (value - zero) x scale, exact in float32, then
    rounded) before multiplying."""
    q, scale = np.asarray(q, np.int16), np.asarray(scale, np.float32)
    zero = np.zeros(scale.shape, np.float32) if zero is None else np.asarray(zero, np.float32)
    *lead, K, N = q.shape
    groups = scale.shape[-2]
    if scale.shape[-1] != N or K % groups or (K // groups) % 2 or zero.shape != scale.shape:
        raise ValueError(f"pack_int4_panels needs scales (and zero points) [..., groups, {N}] of groups of an even "
                         f"size dividing K={K}, got {scale.shape} ({zero.shape})")
    P, K2 = -(-N // PANEL), K // 2
    nibbles = np.pad(q + 8, [(0, 0)] * len(lead) + [(0, 0), (0, P * PANEL - N)]).astype(np.uint8)
    pairs = nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)  # [..., K2, P * 32]
    packed = np.ascontiguousarray(np.moveaxis(pairs.reshape(*lead, K2, P, PANEL), -2, -3))
    return packed, _panel_scales(scale, -(zero + 8) * scale, P)


def pack_fp8_panels(w, scale):
    """FP8 weights for the native matmul: float8 e4m3 values [..., K, N] (ml_dtypes.float8_e4m3fn) and their float
    scales [..., groups, N] (numpy, on the host; K an even multiple of the groups) -> (uint8 [..., P, ceil(K / 2),
    64], float32 [..., P, groups, 64]): panels of 32 output columns as `pack_bf16`'s, each pair of rows' 32 values
    of the first then 32 of the second, each panel's group scales (times 256: the kernel decodes a value as it /
    256) beside it followed by zero biases. The kernel dequantizes a panel to bfloat16 (value times its group's
    scale, exact in float32, then rounded) before multiplying."""
    bits = np.asarray(w).view(np.uint8)
    scale = np.asarray(scale, np.float32)
    *lead, K, N = bits.shape
    groups = scale.shape[-2]
    if scale.shape[-1] != N or K % groups or (K // groups) % 2:
        raise ValueError(f"pack_fp8_panels needs scales [..., groups, {N}] of groups of an even size dividing K={K}, "
                         f"got {scale.shape}")
    P, K2 = -(-N // PANEL), K // 2
    bits = np.pad(bits, [(0, 0)] * len(lead) + [(0, 0), (0, P * PANEL - N)])
    rows = bits.reshape(*lead, K2, 2, P, PANEL)  # [.., K2, (even, odd), P, 32]
    packed = np.ascontiguousarray(np.moveaxis(rows, -2, -4).reshape(*lead, P, K2, 2 * PANEL))
    return packed, _panel_scales(scale * 256, np.zeros_like(scale), P)


def pack_mxfp4_panels(blocks, scales, order=None):
    """MXFP4 weights as GPT-OSS checkpoints store them (quantization.dequantize_mxfp4's layout: `blocks` uint8
    [..., N, K / 32, 16], two float4 e2m1 codes a byte, the first in its low nibble, and `scales` uint8 [..., N,
    K / 32], each block of 32 inputs' power of two, E8M0), numpy, on the host -> (codes uint8 [..., P, K / 2, 32],
    exponents uint8 [..., P, K / 32, 32]) for `grouped_matmul_mxfp4`: panels of 32 output columns as
    `pack_int4_panels`' (a byte, a column's two consecutive inputs: the checkpoint's bytes as they are, moved), each
    panel's exponents beside it per block; output column n is the weights' column order[n] where `order` (a
    permutation of N: pack_gated's order of a fused gate/up weight) is given. Columns past N (to whole panels) are
    zero. One pass over the weights, a panel at a time (a gpt-oss-20b layer's gate/up: 3 copies in full took ~0.8 s)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != 16 or (
            blocks.shape[:-1] != scales.shape):
        raise ValueError(f"pack_mxfp4_panels needs uint8 blocks [..., N, K / 32, 16] and scales [..., N, K / 32], got "
                         f"{blocks.dtype} {blocks.shape} and {scales.dtype} {scales.shape}")
    *lead, N, groups, _ = blocks.shape
    order = np.arange(N) if order is None else np.asarray(order)
    if sorted(order.tolist()) != list(range(N)):
        raise ValueError(f"pack_mxfp4_panels' order must be a permutation of the {N} columns")
    P, rows = -(-N // PANEL), blocks.reshape(*lead, N, groups * 16)
    codes = np.zeros((*lead, P, groups * 16, PANEL), np.uint8)
    exponents = np.full((*lead, P, groups, PANEL), 127, np.uint8)
    for p in range(P):
        columns = order[p * PANEL:(p + 1) * PANEL]
        codes[..., p, :, :len(columns)] = np.swapaxes(rows[..., columns, :], -1, -2)
        exponents[..., p, :, :len(columns)] = np.swapaxes(scales[..., columns, :], -1, -2)
    return codes, exponents


def _panel_scales(scale, bias, P: int):
    """Scales and biases [..., groups, N] -> [..., P, groups, 64]: each panel's 32 scales then 32 biases."""
    *lead, groups, N = scale.shape

    def panels(a):  # [..., groups, N] -> [..., P, groups, 32]
        a = np.pad(a, [(0, 0)] * len(lead) + [(0, 0), (0, P * PANEL - N)])
        return np.moveaxis(a.reshape(*lead, groups, P, PANEL), -2, -3)

    return np.ascontiguousarray(np.concatenate([panels(scale), panels(bias)], -1), np.float32)


# _native_matmul's weight-only quantized kernel: int4 panels [L, P, K2, 32] or fp8 ones [L, P, K2, 64]
_DEQUANT = dict(target=_DEQUANT_MATMUL_TARGET, layout="[L, P, K2, 32 or 64] ")


def matmul_dequant(x, packed, scale, n: int, *, prologue: str | None = None, norm=None, eps: float = 0.0,
                   residual=None, live_rows=None, layer=None):
    """x f32[M, K] @ a weight-only quantized weight -> f32[M, n], (packed, scale) = pack_int4_panels (W4A16) or
    pack_fp8_panels (FP8) of a [(L,) K, n] weight: `matmul_bf16` of the dequantized weight (each value times its
    group's scale plus its bias, rounded to bfloat16), prologues, residual, live rows and a stacked weight's
    `layer` as there."""
    if prologue not in _PROLOGUES:
        raise ValueError(f"matmul_dequant's prologue must be one of {list(_PROLOGUES)}, got {prologue!r}")
    rounded = prologue == "rounded"
    one = packed.shape[-3:]
    K = (2 * one[1] if len(one) == 3 else 0) if rounded else x.shape[-1] if x.ndim else 0
    _check_dequant(x, packed, scale, n, K, rounded)
    return _native_matmul(x, (packed, scale), jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), K,
                          prologue=prologue, epilogue="store", norm=norm, eps=eps, residual=residual,
                          live_rows=live_rows, layer=layer, **_DEQUANT)


def gated_pairs_dequant(x, packed, scale, *, prologue: str | None = None, norm=None, eps: float = 0.0,
                        live_rows=None, layer=None, activation: str = "silu"):
    """`gated_pairs` of a weight-only quantized gate/up weight: (packed, scale) = pack_int4_panels or
    pack_fp8_panels of gate and up values [(L,) K, I] and their scales in `pack_gated`'s column order (16 gate and
    the same 16 up columns a panel)."""
    if prologue not in (None, "rms_norm"):
        raise ValueError(f"gated_pairs_dequant's prologue must be None or 'rms_norm', got {prologue!r}")
    K = x.shape[-1] if x.ndim else 0
    _check_dequant(x, packed, scale, packed.shape[-3] * PANEL, K, False)
    out = jax.ShapeDtypeStruct((x.shape[0], rounded_width(packed.shape[-3] * PANEL // 2)), jnp.uint32)
    return _native_matmul(x, (packed, scale), out, K, prologue=prologue, epilogue="gated_pairs", norm=norm, eps=eps,
                          residual=None, live_rows=live_rows, layer=layer, activation=activation, **_DEQUANT)


def _check_dequant(x, packed, scale, n: int, K: int, rounded: bool) -> None:
    one = packed.shape[-3:]
    if x.ndim != 2 or packed.ndim not in (3, 4) or one[:2] != (-(-n // PANEL), K // 2) or (
            one[2] not in (PANEL, 2 * PANEL)) or K % 2 or x.shape[1] != (rounded_width(K) if rounded else K) or (
            scale.ndim != packed.ndim or scale.shape[:-2] != packed.shape[:-2] or scale.shape[-1] != 2 * PANEL):
        raise ValueError(f"the native dequantizing matmul needs x [M, K] ([M, rounded_width(K)] when rounded) and "
                         f"pack_int4_panels or pack_fp8_panels of a [(L,) K, {n}] weight, got {x.shape}, "
                         f"{packed.shape} and scales {scale.shape}")
    if x.dtype != (jnp.uint32 if rounded else jnp.float32) or packed.dtype != jnp.uint8 or scale.dtype != jnp.float32:
        raise ValueError(f"the native dequantizing matmul needs float32 x (uint32 when rounded), a uint8 packed "
                         f"weight and float32 scales, got {x.dtype}, {packed.dtype} and {scale.dtype}")


def pack_int8(w, scale):
    """An int8 weight [..., K, N] and its float32 scales [..., N] (numpy, on the host) -> the native int8 matmul's
    (packed int8 [..., ceil(N / 32), ceil(K / 4), 128], comp int32 [..., P * 32], scales float32 [..., P * 32]):
    panels of 32 output columns, each contiguous, holding each column's 4 consecutive weights side by side
    (zero-padded); comp is 128 times each column's sum of weights (cpu_int8.cc takes off what its unsigned
    shift of x adds)."""
    w, scale = np.asarray(w, np.int8), np.asarray(scale, np.float32)
    *lead, K, N = w.shape
    P, K4 = -(-N // PANEL), -(-K // 4)
    padded = np.pad(w, [(0, 0)] * len(lead) + [(0, 4 * K4 - K), (0, P * PANEL - N)])
    quads = padded.reshape(*lead, K4, 4, P, PANEL)  # [..., K4, j, P, c] -> [..., P, K4, c, j]
    packed = np.ascontiguousarray(np.moveaxis(quads, (-2, -1), (-4, -2))).reshape(*lead, P, K4, 4 * PANEL)
    comp = 128 * padded.astype(np.int32).sum(axis=-2)
    scale = np.pad(scale, [(0, 0)] * len(lead) + [(0, P * PANEL - N)])
    return packed, comp, scale


def gated_columns(gate, up):
    """numpy arrays [..., I] (I a multiple of 16) -> [..., 2I] in `pack_gated`'s column order: 16 of gate's
    columns, the same 16 of up's, and so on (a quantized gate/up weight's values and scales alike)."""
    *lead, I = gate.shape
    if up.shape != gate.shape or I % GATED:
        raise ValueError(f"gate and up must be of one shape [..., I], I a multiple of {GATED}, got {gate.shape} and "
                         f"{up.shape}")
    return np.stack([np.asarray(x).reshape(*lead, I // GATED, GATED) for x in (gate, up)], axis=-2).reshape(
        *lead, 2 * I)


def _int8_call(x, packed, comp, scale, n: int, out_width: int, *, prologue, norm, eps, residual, live_rows, layer,
               epilogue, activation="silu"):
    """The checks of `matmul_int8` and `gated_int8` (n: the packed weight's columns), then `_native_matmul`'s."""
    if prologue not in (None, "rms_norm"):
        raise ValueError(f"the native int8 matmul's prologue must be None or 'rms_norm', got {prologue!r}")
    K = x.shape[-1] if x.ndim else 0
    one = packed.shape[-3:]
    if x.ndim != 2 or x.dtype != jnp.float32 or packed.dtype != jnp.int8 or packed.ndim not in (3, 4) or (
            one != (-(-n // PANEL), -(-K // 4), 4 * PANEL)) or comp.shape != packed.shape[:-3] + (one[0] * PANEL,) or (
            scale.shape != comp.shape):
        raise ValueError(f"the native int8 matmul needs float32 x [M, K] and pack_int8 of an int8 [(L,) K, {n}] "
                         f"weight, got {x.dtype} {x.shape}, {packed.dtype} {packed.shape}, comp {comp.shape}, scale "
                         f"{scale.shape}")
    return _native_matmul(x, (packed, comp, scale), jax.ShapeDtypeStruct((x.shape[0], out_width), jnp.float32), K,
                          prologue=prologue, epilogue=epilogue, norm=norm, eps=eps, residual=residual,
                          live_rows=live_rows, layer=layer, activation=activation, target=_INT8_MATMUL_TARGET,
                          layout="")


def matmul_int8(x, packed, comp, scale, n: int, *, prologue: str | None = None, norm=None, eps: float = 0.0,
                residual=None, live_rows=None, layer=None):
    """x f32[M, K] @ a W8A8 int8 weight -> f32[M, n], (packed, comp, scale) = pack_int8(w, w_scale) for w int8
    [K, n] (or stacked [L, K, n] with `layer` an int32 scalar, may be traced: read in place): each row of x
    (after the prologue) quantized to int8 with scale max|x| / 127, int8 products summed in int32, times both
    scales: jaxengine.models.quantization.int8_matmul's numbers. `prologue` "rms_norm" (with `norm` [K] and
    `eps`), `residual` and `live_rows` as for `matmul_bf16`."""
    return _int8_call(x, packed, comp, scale, n, n, prologue=prologue, norm=norm, eps=eps, residual=residual,
                      live_rows=live_rows, layer=layer, epilogue="store")


def gated_int8(x, packed, comp, scale, *, prologue: str | None = None, norm=None, eps: float = 0.0, live_rows=None,
               layer=None, activation: str = "silu"):
    """act(x' @ gate) * (x' @ up) -> f32[M, I] for (packed, comp, scale) = pack_int8 of gate and up (and their
    scales) in `pack_gated`'s column order (`gated_columns`; x' = x after the prologue), the products as
    `matmul_int8` computes them, the activation ("silu" or "gelu_tanh") applied as they leave the registers: no
    [M, 2I] result goes through memory. Stacked weights, `layer` and `live_rows` as for `matmul_int8`."""
    n = packed.shape[-3] * PANEL
    return _int8_call(x, packed, comp, scale, n, n // 2, prologue=prologue, norm=norm, eps=eps, residual=None,
                      live_rows=live_rows, layer=layer, epilogue="gated_pairs", activation=activation)


def rounded_width(k: int) -> int:
    """The row width (uint32 words) of x rounded to bfloat16 pairs for a matmul over K = k: k / 2 pairs in
    whole chunks of 16 (`gated_pairs`' result, `matmul_bf16(..., prologue="rounded")`'s x)."""
    return -(-k // 32) * 16


_PROLOGUES = {None: 0, "rms_norm": 1, "rounded": 2}
_EPILOGUES = {"store": 0, "gated_pairs": 1}
# the gated pairs' activation -> its epilogue (cpu_matmul.cc; cpu_gated.h): swigluoai with GPT-OSS's constants only
# (alpha 1.702, limit 7; SWIGLU_OAI_CONSTANTS)
GATED_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2, "swigluoai": 3}
SWIGLU_OAI_CONSTANTS = (1.702, 7.0)


def _epilogue(epilogue: str, activation: str) -> np.int32:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"the gated pairs' activation must be one of {list(GATED_ACTIVATIONS)}, got {activation!r}")
    return np.int32(GATED_ACTIVATIONS[activation] if epilogue == "gated_pairs" else _EPILOGUES[epilogue])


def _native_matmul(x, weights: tuple, out, K: int, *, prologue, epilogue, norm, eps, residual, live_rows, layer,
                   activation="silu", target=_MATMUL_TARGET, layout="[L, P, K2, 64] "):
    """The shared checks and the FFI call of the native matmuls (out: the result's shape and dtype): `weights` are
    the weight's operands, a packed weight first, one layer's (3 dimensions) or a stack of them with `layer` naming
    the one to use (`layout`: a stack's, for errors), and `target` the kernel: `matmul_bf16` and `gated_pairs`'s
    ((pack_bf16's [P, K2, 64],)), their weight-only quantized forms' ((pack_int4_panels' [P, K2, 32] or
    pack_fp8_panels' [P, K2, 64], scales and biases)), or the int8 ones' ((pack_int8's [P, K4, 128], comp,
    scales))."""
    packed = weights[0]
    if (packed.ndim == 4) != (layer is not None) or (layer is not None and jnp.ndim(layer) != 0):
        raise ValueError(f"the native matmul takes a scalar layer index with a stacked {layout}weight and "
                         f"only there, got weight {packed.shape} and layer {layer!r}")
    if (prologue == "rms_norm") != (norm is not None) or (norm is not None and norm.shape != (K,)):
        raise ValueError(f"the native matmul takes a norm weight [{K}] with the rms_norm prologue and only there")
    if residual is not None and (residual.shape != out.shape or residual.dtype != jnp.float32):
        raise ValueError(f"the native matmul's residual must be float32 {list(out.shape)}, got {residual.dtype} "
                         f"{residual.shape}")
    if live_rows is not None and jnp.ndim(live_rows) != 0:
        raise ValueError(f"the native matmul's live_rows must be a scalar row count, got shape {jnp.shape(live_rows)}")
    norm = jnp.zeros((0,), jnp.float32) if norm is None else norm.astype(jnp.float32)
    residual = jnp.zeros((0, 0), jnp.float32) if residual is None else residual
    live_rows = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(1)
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    _library()
    return jax.ffi.ffi_call(target, out)(x, *weights, layer, norm, residual, live_rows,
                                         prologue=np.int32(_PROLOGUES[prologue]),
                                         epilogue=_epilogue(epilogue, activation), eps=np.float32(eps))


def matmul_bf16(x, packed, n: int, *, prologue: str | None = None, norm=None, eps: float = 0.0, residual=None,
                live_rows=None, layer=None):
    """x f32[M, K] @ w -> f32[M, n], `packed` = pack_bf16(w) for w [K, n] (or pack_bf16 of stacked weights
    [L, K, n] with `layer` an int32 scalar, may be traced: w is their layer `layer`, read in place): x rounded
    to bfloat16, products accumulated in float32 (what `jnp.dot(x.astype(bfloat16), w,
    preferred_element_type=float32)` computes, up to summation order). `prologue`, applied to x's rows (in
    float32) before they are rounded:
    - "rms_norm": `norm * (x * rsqrt(mean(x ** 2) + eps))` with `norm` [K] (layers/norms.rms_norm for float32 x);
    - "rounded": x is already rounded, uint32 [M, rounded_width(K)]: `gated_pairs`' result for the same M and
      live_rows (K from the packed weight).
    `residual` f32[M, n], where given, is added to the result (in float32, as it is stored).
    `live_rows` (an int32 scalar, may be traced), where given: rows from it on are a bucket's padding; they
    are not computed and come out zero (residual included)."""
    if prologue not in _PROLOGUES:
        raise ValueError(f"matmul_bf16's prologue must be one of {list(_PROLOGUES)}, got {prologue!r}")
    rounded = prologue == "rounded"
    one = packed.shape[-3:]  # one layer's
    K = (2 * one[1] if len(one) == 3 else 0) if rounded else x.shape[-1] if x.ndim else 0
    if x.ndim != 2 or packed.ndim not in (3, 4) or one != (-(-n // PANEL), -(-K // 2), 2 * PANEL) or (
            x.shape[1] != (rounded_width(K) if rounded else K)):
        raise ValueError(f"matmul_bf16 needs x [M, K] ([M, rounded_width(K)] when rounded) and pack_bf16(w) of a "
                         f"[(L,) K, {n}] w, got {x.shape} and {packed.shape}")
    if x.dtype != (jnp.uint32 if rounded else jnp.float32) or packed.dtype != jnp.bfloat16:
        raise ValueError(f"matmul_bf16 needs float32 x (uint32 when rounded) and a bfloat16 packed w, got "
                         f"{x.dtype} and {packed.dtype}")
    return _native_matmul(x, (packed,), jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), K, prologue=prologue,
                          epilogue="store", norm=norm, eps=eps, residual=residual, live_rows=live_rows, layer=layer)


def gated_pairs(x, packed, *, prologue: str | None = None, norm=None, eps: float = 0.0, live_rows=None,
                layer=None, activation: str = "silu"):
    """act(x' @ gate) * (x' @ up) for `packed` = pack_gated(gate, up) (x' = x after the prologue, as in
    `matmul_bf16`), rounded to bfloat16 as the x of `matmul_bf16(..., prologue="rounded")` over the same rows
    and live_rows: uint32 [M, rounded_width(I)], laid out by the kernel's row blocks (an operand, not a matrix
    to read). The activation is applied to the float32 products as they leave the registers, then rounded: the
    numbers that rounding `act(gate) * up` of the float32 products gives, without their [M, 2I] round trip
    through memory or the next matmul's rounding pass. `activation`: "silu", "gelu_tanh" (the tanh
    approximation, as jax.nn.gelu's default) or "swigluoai" (GPT-OSS's clamped SwiGLU). A stacked `packed` (of
    [L, K, I] weights) takes `layer` as `matmul_bf16` does."""
    if prologue not in (None, "rms_norm"):
        raise ValueError(f"gated_pairs' prologue must be None or 'rms_norm', got {prologue!r}")
    K = x.shape[-1] if x.ndim else 0
    if x.ndim != 2 or x.dtype != jnp.float32 or packed.dtype != jnp.bfloat16 or packed.ndim not in (3, 4) or (
            packed.shape[-2:] != (-(-K // 2), 2 * PANEL)):
        raise ValueError(f"gated_pairs needs float32 x [M, K] and pack_gated(gate, up) of [(L,) K, I] weights, got "
                         f"{x.dtype} {x.shape} and {packed.dtype} {packed.shape}")
    I = packed.shape[-3] * PANEL // 2
    out = jax.ShapeDtypeStruct((x.shape[0], rounded_width(I)), jnp.uint32)
    return _native_matmul(x, (packed,), out, K, prologue=prologue, epilogue="gated_pairs", norm=norm, eps=eps,
                          residual=None, live_rows=live_rows, layer=layer, activation=activation)


def _grouped_modes(name: str, prologue: str | None, epilogue: str) -> tuple[bool, bool]:
    """(rounded, gated) of a grouped matmul's prologue and epilogue, checked."""
    if prologue not in (None, "rounded") or epilogue not in _EPILOGUES or (prologue, epilogue) == (
            "rounded", "gated_pairs"):
        raise ValueError(f"{name} takes prologue None or 'rounded' and epilogue 'store' or 'gated_pairs' (not both "
                         f"of the latter), got {prologue!r} and {epilogue!r}")
    return prologue == "rounded", epilogue == "gated_pairs"


def _grouped_result(x, n: int, gated: bool) -> jax.ShapeDtypeStruct:
    """A grouped matmul's result over n columns: f32 [M, n], or the gated pairs of its n / 2."""
    return jax.ShapeDtypeStruct((x.shape[0], rounded_width(n // 2) if gated else n),
                                jnp.uint32 if gated else jnp.float32)


def grouped_matmul_bf16(x, packed, sizes, first, n: int, *, prologue: str | None = None, epilogue: str = "store",
                        activation: str = "silu"):
    """A mixture of experts' grouped matmul: x's rows sorted by expert, the next sizes[g] rows (i32[G], in order)
    by expert g's weight, `packed` [S, P, K2, 64] the pack_bf16 (pack_gated for epilogue "gated_pairs") of S
    stacked [K, n] weights of which first + g (i32 scalar, may be traced: a layer's experts in a stack of all
    layers') is expert g's. Per group as `matmul_bf16` (epilogue "store": f32 [M, n]) or `gated_pairs`
    (epilogue "gated_pairs", of `activation`: the pairs, laid out by each group's row blocks, that a "rounded"
    grouped call over the same sizes reads), no residual and no norm. A group without rows reads no weight;
    rows past the sizes' sum come out zero. Only the groups' rows are multiplied, where XLA:CPU's `ragged_dot`
    multiplies every row by every group's weight."""
    rounded, gated = _grouped_modes("grouped_matmul_bf16", prologue, epilogue)
    if packed.ndim != 4 or packed.dtype != jnp.bfloat16 or x.ndim != 2 or x.dtype != (
            jnp.uint32 if rounded else jnp.float32) or sizes.ndim != 1 or jnp.ndim(first) != 0:
        raise ValueError(f"grouped_matmul_bf16 needs x [M, K] (float32; uint32 when rounded), a packed bfloat16 "
                         f"[S, P, K2, 64], sizes i32[G] and a scalar first, got {x.dtype} {x.shape}, {packed.dtype} "
                         f"{packed.shape}, {sizes.shape} and {jnp.shape(first)}")
    _library()
    call = jax.ffi.ffi_call(_GROUPED_MATMUL_TARGET, _grouped_result(x, n, gated))
    return call(x, packed, jnp.asarray(first, jnp.int32).reshape(1), sizes.astype(jnp.int32),
                jnp.zeros((0,), jnp.float32), prologue=np.int32(_PROLOGUES[prologue]),
                epilogue=_epilogue(epilogue, activation), eps=np.float32(0.0))


def grouped_matmul_mxfp4(x, codes, exponents, bias, sizes, first, n: int, *, prologue: str | None = None,
                         epilogue: str = "store", activation: str = "silu"):
    """`grouped_matmul_bf16` over MXFP4 weights: (codes [S, P, K2, 32], exponents [S, P, K2 / 16, 32]) =
    pack_mxfp4_panels of S stacked weights' blocks and scales ([S, n, K / 32, 16] and [S, n, K / 32]; for epilogue
    "gated_pairs", their columns in `pack_gated`'s order), each panel dequantized exactly to bfloat16 as it is
    taken; `bias` f32 [S, P * 32] (or None), in the same column order, is added to each expert's products (before
    the gated epilogue's activation). x, sizes, first, prologue, epilogue and activation as there."""
    rounded, gated = _grouped_modes("grouped_matmul_mxfp4", prologue, epilogue)
    S, P, K2 = codes.shape[:3] if codes.ndim == 4 else (0, 0, 0)
    K = 2 * K2 if rounded else x.shape[-1] if x.ndim == 2 else -1
    if codes.ndim != 4 or codes.dtype != jnp.uint8 or codes.shape[-1] != PANEL or exponents.dtype != jnp.uint8 or (
            exponents.shape != (S, P, K2 // 16, PANEL)) or K2 % 16 or P != -(-n // PANEL) or K != 2 * K2 or (
            x.ndim != 2 or x.dtype != (jnp.uint32 if rounded else jnp.float32)) or (
            rounded and x.shape[1] != rounded_width(K)) or sizes.ndim != 1 or jnp.ndim(first) != 0 or (
            bias is not None and (bias.shape != (S, P * PANEL) or bias.dtype != jnp.float32)):
        raise ValueError(f"grouped_matmul_mxfp4 needs x [M, K] (float32; uint32 [M, rounded_width(K)] when rounded), "
                         f"pack_mxfp4_panels of [S, {n}, K / 32, 16] blocks, a float32 bias [S, P * 32] or None, "
                         f"sizes i32[G] and a scalar first, got {x.dtype} {x.shape}, {codes.dtype} {codes.shape}, "
                         f"{exponents.dtype} {exponents.shape}, bias {None if bias is None else bias.shape}, "
                         f"{sizes.shape} and {jnp.shape(first)}")
    _library()
    return jax.ffi.ffi_call(_GROUPED_MXFP4_TARGET, _grouped_result(x, n, gated))(
        x, codes, exponents, jnp.zeros((0, 0), jnp.float32) if bias is None else bias,
        jnp.asarray(first, jnp.int32).reshape(1), sizes.astype(jnp.int32), prologue=np.int32(_PROLOGUES[prologue]),
        epilogue=_epilogue(epilogue, activation))


def _check_logits(x, name: str) -> None:
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"{name} needs float32 x [R, V], got {x.dtype} {x.shape}")


def _logit_patches(x, bias_ids, bias_values, banned, name: str):
    """The checked (bias_ids, bias_values, banned) of `first_argmax` and `sample` (empty where not given)."""
    _check_logits(x, name)
    rows = x.shape[0]
    if (bias_ids is None) != (bias_values is None):
        raise ValueError(f"{name} takes bias_ids and bias_values together")
    bias_ids = jnp.zeros((rows, 0), jnp.int32) if bias_ids is None else jnp.asarray(bias_ids)
    bias_values = jnp.zeros((rows, 0), jnp.float32) if bias_values is None else jnp.asarray(bias_values)
    banned = jnp.zeros((rows, 0), jnp.int32) if banned is None else jnp.asarray(banned)
    if (bias_ids.ndim != 2 or bias_ids.shape[0] != rows or bias_values.shape != bias_ids.shape or banned.ndim != 2
            or banned.shape[0] != rows):
        raise ValueError(f"{name} needs bias_ids and bias_values [{rows}, B] and banned [{rows}, N], got "
                         f"{bias_ids.shape}, {bias_values.shape} and {banned.shape}")
    return bias_ids.astype(jnp.int32), bias_values.astype(jnp.float32), banned.astype(jnp.int32)


def first_argmax(x, bias_ids=None, bias_values=None, banned=None):
    """jnp.argmax(x, axis=-1) of float32 x [R, V] as int32 [R]: each row's first maximum, a NaN counting as
    the maximum (the first NaN wins), in one pass over the rows. Where given, each row is taken after the
    greedy sampler's logit processing (`layers.sampler.process_logits` without slot state): bias_values
    f32[R, B] added at bias_ids i32[R, B], then -inf at banned i32[R, N]; ids outside [0, V) are unused
    entries. No copy of x is made for rows with nothing to apply."""
    patches = _logit_patches(x, bias_ids, bias_values, banned, "first_argmax")
    _library()
    return jax.ffi.ffi_call(_ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))(x, *patches)


def sample(x, temperature, top_k, top_p, min_p, seeds, counters, bias_ids=None, bias_values=None, banned=None,
           penalties=None):
    """One token per row of float32 logits x [R, V], drawn as `layers.sampler.sample` defines the distribution
    (the logit bias and bans first, as in `first_argmax`): rows with temperature 0 take `first_argmax`; the
    others sample softmax(x / temperature) restricted by min-p, top-k and top-p (i32/f32 [R] each; 0, 0 and 1
    are off). Returns (tokens i32[R], cutoff f32[R]): a sampled row's cutoff is the smallest scaled logit
    (x / temperature) among the tokens it could draw (NaN for rows taken greedily).

    `penalties`, where given, is the full sampler's slot state, applied first as `layers.sampler.
    process_logits` applies it: (output_counts i32[S, V], prompt_mask bool[S, V], allowed bool[S, V], slots
    i32[R] (outside [0, S): none), presence_penalty, frequency_penalty, repetition_penalty f32[R]).

    The draw is one uniform number per row, from its seed (u32[R]) and counter (i32[R], the tokens its
    sequence has generated): the same seed, counter and logits give the same token. It is not
    `jax.random`'s stream, so a seed gives different tokens here than on other backends. A sampled row with a
    NaN or no finite logit takes the greedy rule's token. Top-k and top-p find their cutoff without sorting
    the row (a histogram of the values, then a sort of the one or two buckets where the cut falls; a top-k of
    at most 1024 from its k largest, kept during one pass): XLA:CPU sorts [64, 49152] logits in ~0.6 s."""
    patches = _logit_patches(x, bias_ids, bias_values, banned, "sample")
    rows = x.shape[0]
    params = []
    for name, value, dtype in (("temperature", temperature, jnp.float32), ("top_k", top_k, jnp.int32),
                               ("top_p", top_p, jnp.float32), ("min_p", min_p, jnp.float32),
                               ("seeds", seeds, jnp.uint32), ("counters", counters, jnp.int32)):
        value = jnp.asarray(value)
        if value.shape != (rows,):
            raise ValueError(f"sample's {name} must be [{rows}], got {value.shape}")
        params.append(value.astype(dtype))
    vocab = x.shape[1]
    if penalties is None:
        penalties = (jnp.zeros((0, vocab), jnp.int32), jnp.zeros((0, vocab), bool), jnp.zeros((0, vocab), bool),
                     jnp.zeros(rows, jnp.int32), jnp.zeros(rows), jnp.zeros(rows), jnp.ones(rows))
    counts, prompt_mask, allowed, *per_row = penalties
    if counts.ndim != 2 or counts.shape[1] != vocab or prompt_mask.shape != counts.shape or (
            allowed.shape != counts.shape) or any(jnp.shape(v) != (rows,) for v in per_row):
        raise ValueError(f"sample's penalties need output_counts, prompt_mask and allowed [S, {vocab}] and slots and "
                         f"the three penalties [{rows}]")
    slot_state = (counts.astype(jnp.int32), prompt_mask.astype(bool), allowed.astype(bool),
                  jnp.asarray(per_row[0], jnp.int32), *(jnp.asarray(v, jnp.float32) for v in per_row[1:]))
    _library()
    out = (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32))
    return jax.ffi.ffi_call(_SAMPLE_TARGET, out)(x, *params, *patches, *slot_state)


def token_logprobs(x, tokens, num_top: int):
    """`layers.sampler.token_logprobs` of float32 x [R, V] and tokens i32[R]: (top ids i32[R, num_top], top
    logprobs f32[R, num_top], the token's logprob f32[R], its rank i32[R]), log_softmax computed as
    jax.nn.log_softmax does, the top ones in lax.top_k's order (ties: the lower id first). A token outside
    [0, V) has a NaN logprob and rank 1."""
    _check_logits(x, "token_logprobs")
    rows, vocab = x.shape
    if not 0 <= num_top <= vocab:
        raise ValueError(f"token_logprobs' num_top must be in [0, {vocab}], got {num_top}")
    if jnp.shape(tokens) != (rows,):
        raise ValueError(f"token_logprobs' tokens must be [{rows}], got {jnp.shape(tokens)}")
    _library()
    out = (jax.ShapeDtypeStruct((rows, num_top), jnp.int32), jax.ShapeDtypeStruct((rows, num_top), jnp.float32),
           jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32))
    return jax.ffi.ffi_call(_LOGPROBS_TARGET, out)(x, jnp.asarray(tokens, jnp.int32))


KV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)  # the pools the native body reads


def supports(q_dtype, kv_dtype) -> bool:
    """float32 queries over float32, bfloat16 or float8 (e4m3fn, e5m2) pages (computed in float32)."""
    return jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(kv_dtype) in KV_DTYPES


def write_kv(kv_pages, layer, rows, pages, offsets, scales=None):
    """kv_pages [L, P, S, 2 * Hkv, D] (float32, bfloat16 or float8) with kv_pages[layer, pages[t], offsets[t]] =
    rows[t] (rows float32 [T, 2 * Hkv, D]; K, the even rows, divided by scales[0] and V by scales[1] (`scales`
    f32[2], the KV cache's scales; None: 1), rounded to the pool's dtype to nearest even, float8 saturated at its
    largest finite value as `layers.attention.to_cache`); tokens whose page is outside [0, P) are skipped. Written
    in place: the pool is aliased to the result (donate it, as the engine does)."""
    if rows.ndim != 3 or kv_pages.ndim != 5 or rows.shape[1:] != kv_pages.shape[3:]:
        raise ValueError(f"write_kv needs rows [T, {kv_pages.shape[3:]}] for a pool {kv_pages.shape}, got {rows.shape}")
    if not supports(jnp.float32, kv_pages.dtype):
        raise ValueError(f"write_kv supports float32, bfloat16 and float8 pools, not {kv_pages.dtype}")
    _library()
    call = jax.ffi.ffi_call(_WRITE_TARGET, jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
                            input_output_aliases={0: 0})
    return call(kv_pages, jnp.asarray(layer, jnp.int32).reshape(1), rows.astype(jnp.float32),
                pages.astype(jnp.int32), offsets.astype(jnp.int32), _kv_scales(scales))


def _kv_scales(scales):
    """The writers' f32[2] (K's scale, V's): ones for None."""
    scales = jnp.ones(2, jnp.float32) if scales is None else jnp.asarray(scales, jnp.float32)
    if scales.shape != (2,):
        raise ValueError(f"the KV cache's scales must be [2] (K's, V's), got {scales.shape}")
    return scales


def rope_write_kv(qkv, cos, sin, kv_pages, layer, pages, offsets, num_heads: int, scales=None):
    """The rotary embedding of q and k (`layers/rope.apply_rope`) and `write_kv` of k and v in one pass, from
    the fused projection qkv float32 [T, (num_heads + 2 * Hkv) * D] ([q heads | k heads | v heads] per token)
    with cos, sin float32 [T, 1, D] (`rope_tables`). Returns q [T, num_heads, D] rotated, and the pool with
    this step's K/V written in place as `write_kv` writes them (`scales` as its; aliased: donate it)."""
    T = qkv.shape[0] if qkv.ndim == 2 else -1
    D, Hkv = kv_pages.shape[-1], kv_pages.shape[-2] // 2
    if qkv.ndim != 2 or kv_pages.ndim != 5 or qkv.shape[1] != (num_heads + 2 * Hkv) * D or D % 2:
        raise ValueError(f"rope_write_kv needs qkv [T, {(num_heads + 2 * Hkv) * D}] (num_heads={num_heads}, Hkv={Hkv}, "
                         f"an even D={D}) for a pool {kv_pages.shape}, got {qkv.shape}")
    if cos.shape != (T, 1, D) or sin.shape != (T, 1, D) or pages.shape != (T,) or offsets.shape != (T,):
        raise ValueError(f"rope_write_kv needs cos and sin [{T}, 1, {D}] and pages and offsets [{T}], got "
                         f"{cos.shape}, {sin.shape}, {pages.shape}, {offsets.shape}")
    if qkv.dtype != jnp.float32 or not supports(jnp.float32, kv_pages.dtype):
        raise ValueError(f"rope_write_kv needs float32 qkv and a float32, bfloat16 or float8 pool, got {qkv.dtype} "
                         f"and {kv_pages.dtype}")
    _library()
    call = jax.ffi.ffi_call(_ROPE_WRITE_TARGET, (jax.ShapeDtypeStruct((T, num_heads, D), jnp.float32),
                                                 jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)),
                            input_output_aliases={3: 1})
    return call(qkv, cos.reshape(T, D).astype(jnp.float32), sin.reshape(T, D).astype(jnp.float32), kv_pages,
                jnp.asarray(layer, jnp.int32).reshape(1), pages.astype(jnp.int32), offsets.astype(jnp.int32),
                _kv_scales(scales))


def gated_delta_rule(q, k, v, g, beta, state, layer, cu_q_lens, kv_lens, rows, num_seqs, delta: bool = True):
    """Gated DeltaNet's recurrence, or (not `delta`) Mamba2's (cpu_linear_attention.cc; jaxengine/layers/
    linear_attention.recurrence's contract): q, k float32 [T, Hk, dk], v [T, Hv, dv], g (log decay: [T, Hv], or
    [T, Hv, dk]: a decay per key row, Kimi Delta Attention's) and beta [T, Hv]; each request's state row of `state`
    [L, rows, Hv, dk, dv] (float32, or bfloat16: computed in float32, rounded as it is stored) at `layer` updated in
    place token by token (from zeros where its chunk starts its sequence: kv_lens equal to its chunk's length).
    Returns (out f32[T, Hv, dv], the state: aliased, donate it)."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    if (k.shape != q.shape or v.shape[0] != T or Hv % Hk or state.ndim != 5 or state.shape[2:] != (Hv, dk, dv)
            or g.shape not in ((T, Hv), (T, Hv, dk)) or beta.shape != (T, Hv)):
        raise ValueError(f"gated_delta_rule: q, k [T, Hk, dk], v [T, Hv, dv], g [T, Hv] or [T, Hv, dk], beta [T, Hv] "
                         f"and the state [L, rows, Hv, dk, dv] disagree: {q.shape}, {k.shape}, {v.shape}, {g.shape}, "
                         f"{beta.shape}, {state.shape}")
    if state.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"gated_delta_rule: the state must be float32 or bfloat16, not {state.dtype}")
    _library()
    call = jax.ffi.ffi_call(_DELTA_TARGET, (jax.ShapeDtypeStruct(v.shape, jnp.float32),
                                            jax.ShapeDtypeStruct(state.shape, state.dtype)),
                            input_output_aliases={5: 1})
    f32, i32 = (lambda x: jnp.asarray(x, jnp.float32)), (lambda x: jnp.asarray(x, jnp.int32))
    return call(f32(q), f32(k), f32(v), f32(g), f32(beta), state, i32(layer).reshape(1), i32(cu_q_lens),
                i32(kv_lens), i32(rows), i32(num_seqs).reshape(1), np.full(1, delta, np.int32))


def fusion_barrier(x):
    """x, held in a buffer: XLA:CPU cannot fuse x's computation into x's consumers (evaluating it again in each
    of them), which `jax.lax.optimization_barrier` does not prevent there (it is expanded away before fusion).
    An aliased identity call: nothing is copied."""
    _library()
    call = jax.ffi.ffi_call(_BARRIER_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})
    return call(x)


def ragged_paged_attention(q, kv_pages, layer, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window=None, soft_cap: float | None = None, sinks=None):
    """Same arguments and result as `reference.ragged_paged_attention` (with `sinks`: a call of its own, which
    adds each head's sink to the softmax's sum as the rows are stored)."""
    _library()
    scalar = lambda x: jnp.asarray(x, jnp.int32).reshape(1)  # noqa: E731
    window = 0 if sliding_window is None else sliding_window
    args = (q, kv_pages, scalar(layer), kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
            cu_q_lens.astype(jnp.int32), scalar(num_seqs), scalar(window))
    if sinks is not None:
        args += (jnp.asarray(sinks, jnp.float32).reshape(q.shape[1]),)
    call = jax.ffi.ffi_call(_TARGET if sinks is None else _SINKS_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(*args, sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0))
