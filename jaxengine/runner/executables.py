"""A disk cache of the runner's compiled programs, so that a warm start skips tracing and lowering.

JAX's persistent compilation cache only skips XLA's compile: each program is still traced and lowered in
Python first, about a second for a 30-layer model with an unrolled layer loop. This cache stores the
serialized executable itself. An entry's key covers everything the program depends on: jax and jaxlib,
the backend, XLA_FLAGS, the CPU's features, the source of the code that builds programs (models, layers,
runner, parallel, pallas_kernels), the program's name and static arguments (for model programs: the model's
graph definition, i.e. its architecture, config and static settings) and the shape, dtype, sharding and
devices of every argument.

In a multi-process engine each process keeps its own part of each program (its key holds the process's index
and the number of processes), on its own host's disk or beside the others' on a shared one: every process then
loads its programs at a warm start. (JAX's persistent cache, which multi-process engines used before, writes
from process 0 alone; the other processes found their programs only on a disk they shared with it and where
their keys were process 0's, which on CPU they are not: there they compiled every program at every start.)

An executable that JAX's persistent cache loaded cannot be serialized again (XLA:CPU then writes it without
its kernels: "Function ... not found" when it runs), so only a program that XLA compiled in this process is
stored: one compiled in this call, or, while nothing in the process has come from JAX's persistent cache, one
JAX's in-memory cache returns (an identical program under another name, e.g. two weights' loader programs whose
shardings differ only in name on one device); once a program has, an in-memory hit may be a persistent load,
and is not stored. The engine leaves JAX's persistent cache off; a process may still turn it on itself.

Entries of old versions (of jax, of this code, of a model's settings) are never hit again. With a size cap,
storing a program removes the least recently used entries past it: a hit refreshes an entry's modification
time, so that is the order of last use. A process that finds an entry gone compiles the program again.
"""

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding

from jaxengine.compile_counter import persistent_cache_hit_count, thread_counts
from pallas_kernels import cpu
from pallas_kernels.cpu import cache_entries, cpu_flags, touch

logger = logging.getLogger(__name__)

_SUFFIX = ".jaxexec"

_PROGRAM_SOURCES = ("jaxengine/models", "jaxengine/layers", "jaxengine/runner", "jaxengine/parallel",
                    "pallas_kernels")  # the code that traces into the step's programs


@functools.cache
def _source_digest() -> str:
    root = Path(__file__).resolve().parents[2]
    key = hashlib.sha256()
    for folder in _PROGRAM_SOURCES:
        for path in sorted(p for p in (root / folder).rglob("*") if p.suffix in (".py", ".cc")):
            key.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return key.hexdigest()


def signature(tree) -> str:
    """The structure, shapes, dtypes and shardings (with their devices, in order) of a pytree of arrays or
    ShapeDtypeStructs."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for leaf in leaves:
        sharding = leaf.sharding
        devices = [d.id for d in (sharding.mesh.devices.flat if isinstance(sharding, NamedSharding)
                                  else sorted(sharding.device_set, key=lambda d: d.id))]
        parts.append(f"{leaf.shape}:{leaf.dtype}:{sharding}:{devices}")
    return "\n".join(parts)


class ExecutableCache:
    def __init__(self, directory: str | Path, max_bytes: int | None = None):
        """`max_bytes`: the entries' total size cap (None: no cap)."""
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        backend = jax.devices()[0].client
        key = hashlib.sha256()
        for part in (jax.__version__, jax.lib.__version__, backend.platform, backend.platform_version,
                     os.environ.get("XLA_FLAGS", ""), cpu_flags() if backend.platform == "cpu" else "",
                     _source_digest(), f"process {jax.process_index()} of {jax.process_count()}"):
            key.update(part.encode() + b"\0")
        self._base = key
        if backend.platform == "cpu":
            # A stored program may call the native kernels, whose FFI targets exist once their library is loaded
            # (pallas_kernels/cpu.py). Tracing loads it, which a program taken from here skips: without it, a
            # process that had traced none yet (a multi-process engine's first program) could not load them.
            cpu.available()
        self.hits = 0
        self._total = None  # the entries' total size as this process last counted it (`_account`)

    def _path(self, name: str, args_signature: str) -> Path:
        key = self._base.copy()
        key.update(name.encode() + b"\0" + args_signature.encode())
        return self.directory / f"{key.hexdigest()[:32]}{_SUFFIX}"

    def get(self, name: str, args_signature: str, lower) -> jax.stages.Compiled:
        """The program stored under (name, args_signature), else `lower().compile()`, stored for next time.
        `name` must say everything about the program that its arguments do not."""
        path = self._path(name, args_signature)
        if path.is_file():
            try:
                compiled = self._load(path)
                self.hits += 1
                touch(path)
                return compiled
            except Exception as e:  # a damaged or incompatible entry: compile afresh and replace it
                logger.warning("could not load the cached program %s (%s): %s; compiling it", name, path.name, e)
        compiles, cache_hits = thread_counts()  # this thread's: another thread's compile says nothing of this one
        compiled = lower().compile()
        # Stored only if XLA compiled it in this process (see the module docstring): this call compiled it, or
        # JAX's in-memory cache returned it (another name's identical program) and nothing in this process has
        # come from JAX's persistent cache. (Not the config: once JAX has used its persistent cache, turning the
        # config off does not stop it.)
        compiles_now, cache_hits_now = thread_counts()
        if cache_hits_now == cache_hits and (compiles_now > compiles or persistent_cache_hit_count() == 0):
            self._store(path, compiled)
        return compiled

    @staticmethod
    def _load(path: Path) -> jax.stages.Compiled:
        entry = pickle.loads(path.read_bytes())
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in entry["devices"]]  # the executable's own devices (every process's), in order
        return serialize_executable.deserialize_and_load(entry["executable"], entry["in_tree"], entry["out_tree"],
                                                         execution_devices=devices)

    def _store(self, path: Path, compiled: jax.stages.Compiled) -> None:
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            # All of the program's devices, other processes' too: a multi-process program is loaded onto them all.
            devices = [d.id for d in compiled._executable._unloaded_executable.device_list]
            blob = pickle.dumps({"executable": executable, "in_tree": in_tree, "out_tree": out_tree,
                                 "devices": devices})
        except Exception as e:  # a backend without serialization: the program still runs, uncached
            logger.debug("not caching %s: %s", path.name, e)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as f:
            f.write(blob)
        os.replace(f.name, path)  # atomic: a concurrent reader sees a whole entry or none
        if self.max_bytes is not None:
            self._account(path, len(blob))

    def _account(self, path: Path, size: int) -> None:
        """Counts a stored entry of `size` bytes into the cache's total, pruning past max_bytes. The directory is read
        at this process's first store and then only to prune (another process's entries count from then on): read at
        every store, a cache of ~18,000 programs took 0.35 s a store, most of a start's time."""
        if self._total is None:
            self._total = sum(size for _, size in cache_entries(self.directory, f"*{_SUFFIX}"))
        else:
            self._total += size
        if self._total > self.max_bytes:
            self._prune(keep=path)

    def _prune(self, keep: Path) -> None:
        """Removes the least recently used entries until the rest fit in max_bytes (`keep`, just stored, stays)."""
        entries = cache_entries(self.directory, f"*{_SUFFIX}")
        total = sum(size for _, size in entries)
        for entry, size in entries:
            if total <= self.max_bytes:
                break
            if entry != keep:
                entry.unlink(missing_ok=True)
                total -= size
                logger.info("removed the least recently used cached program %s (cache over %d bytes)", entry.name,
                            self.max_bytes)
        self._total = total

