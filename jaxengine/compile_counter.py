"""Counts XLA compilations (fresh or from the persistent cache) in this process."""

import contextlib
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0


def _on_event(event: str, duration: float, **_) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    return _count


@contextlib.contextmanager
def assert_no_compiles(what: str = "this block"):
    """Fails if anything compiles inside the block."""
    before = _count
    yield
    if _count != before:
        raise AssertionError(f"{_count - before} XLA compilation(s) happened during {what}")
