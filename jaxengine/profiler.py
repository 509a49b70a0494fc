"""`start_profile()` / `stop_profile()`, as vLLM's (`LLM.start_profile`, the server's `/start_profile` and
`/stop_profile`, `--profile` on `jaxengine bench`): a `jax.profiler` trace of everything the process runs in
between (XLA programs and the host threads), written under the engine's `profiler_dir`, where vLLM writes a
torch profiler trace. Each trace is a folder `plugins/profile/<time>/` holding an `.xplane.pb` (TensorBoard's
profile plugin, XProf) and a `.trace.json.gz` (Perfetto, chrome://tracing). JAX runs one trace per process at a
time; a multi-host server's trace covers the serving process only."""

import os
import threading
from pathlib import Path

import jax

_lock = threading.Lock()
_running: Path | None = None  # where the running trace goes


def start(profiler_dir: str | None, prefix: str | None = None) -> Path:
    """Starts a trace into `profiler_dir` (or its subfolder `prefix`); returns that folder. ValueError where the
    engine has no profiler_dir, a trace is already running, or the prefix is not a plain folder name."""
    global _running
    if not profiler_dir:
        raise ValueError("profiling needs the engine's profiler_dir (--profiler-dir DIR)")
    if prefix is not None and (not prefix or prefix in (".", "..") or os.sep in prefix or "/" in prefix):
        raise ValueError(f"profile_prefix must be a plain folder name, got {prefix!r}")
    directory = Path(profiler_dir).expanduser() / (prefix or "")
    with _lock:
        if _running is not None:
            raise ValueError(f"a profile is already running (into {_running}); stop it first")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"profiler_dir: cannot write traces into {directory}: {e}") from None
        try:
            jax.profiler.start_trace(str(directory))
        except RuntimeError as e:  # a trace started outside this module
            raise ValueError(f"jax.profiler could not start a trace: {e}") from None
        _running = directory
    return directory


def stop() -> Path:
    """Stops the running trace and writes it; returns its folder. ValueError where none is running."""
    global _running
    with _lock:
        if _running is None:
            raise ValueError("no profile is running (start_profile first)")
        directory, _running = _running, None
        try:
            jax.profiler.stop_trace()
        except RuntimeError as e:  # stopped outside this module
            raise ValueError(f"jax.profiler could not stop the trace into {directory}: {e}") from None
    return directory


def stop_if_running() -> Path | None:
    """At shutdown: writes a trace still running (its folder), else does nothing (None)."""
    with _lock:
        running = _running is not None
    return stop() if running else None
