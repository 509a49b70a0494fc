"""Counts XLA compilations (fresh or from the persistent cache) in this process, and in the calling thread (JAX
reports a compile in the thread that asked for it)."""

import contextlib
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_PERSISTENT_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_persistent_cache_hits = 0
_this_thread = threading.local()  # compiles, persistent_cache_hits: the calling thread's counts


def _on_event(event: str, duration: float, **_) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1
        _this_thread.compiles = getattr(_this_thread, "compiles", 0) + 1


def _on_cache_hit(event: str, **_) -> None:
    global _persistent_cache_hits
    if event == _PERSISTENT_CACHE_HIT_EVENT:
        with _lock:
            _persistent_cache_hits += 1
        _this_thread.persistent_cache_hits = getattr(_this_thread, "persistent_cache_hits", 0) + 1


jax.monitoring.register_event_duration_secs_listener(_on_event)
jax.monitoring.register_event_listener(_on_cache_hit)


def compile_count() -> int:
    return _count


def persistent_cache_hit_count() -> int:
    """Executables that JAX's persistent cache returned; compile_count() counts them too."""
    return _persistent_cache_hits


def thread_counts() -> tuple[int, int]:
    """(compiles, persistent-cache hits) in the calling thread: a compile of its own, whatever other threads do."""
    return getattr(_this_thread, "compiles", 0), getattr(_this_thread, "persistent_cache_hits", 0)


@contextlib.contextmanager
def assert_no_compiles(what: str = "this block"):
    """Fails if anything compiles inside the block."""
    before = _count
    yield
    if _count != before:
        raise AssertionError(f"{_count - before} XLA compilation(s) happened during {what}")
