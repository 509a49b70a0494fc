"""Field type checks for the settings dataclasses (SamplingParams, EngineConfig): a wrong type is refused with a
ValueError naming the field when the object is made, not found later inside an engine step. numpy's integers and
floats count as Python's, and are stored as them."""

import math
import numbers
import os


def is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def field_error(obj, name: str, what: str) -> ValueError:
    """The error for `obj`'s field `name` not being `what`."""
    return ValueError(f"{name} must be {what}, got {getattr(obj, name)!r}")


def check_field_types(obj, *, bools=(), integers=(), optional_integers=(), reals=(), finite_reals=(),
                      optional_strings=(), strings=(), optional_paths=()) -> None:
    """`optional_paths`: a string, an os.PathLike (stored as its string) or None."""
    def fail(name, what):
        raise field_error(obj, name, what)

    for name in bools:
        if not isinstance(getattr(obj, name), bool):
            fail(name, "true or false")
    for name in reals + finite_reals:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            fail(name, "a number")
        if name in finite_reals and not math.isfinite(value):
            fail(name, "a finite number")
        setattr(obj, name, float(value))
    for name in integers + optional_integers:
        value = getattr(obj, name)
        if value is None and name in optional_integers:
            continue
        if not is_integer(value):
            fail(name, "an integer" + (" or None" if name in optional_integers else ""))
        setattr(obj, name, int(value))
    for name in strings + optional_strings:
        value = getattr(obj, name)
        if not (isinstance(value, str) or (value is None and name in optional_strings)):
            fail(name, "a string" + (" or None" if name in optional_strings else ""))
    for name in optional_paths:
        value = getattr(obj, name)
        if isinstance(value, os.PathLike):
            setattr(obj, name, os.fspath(value))
        elif not (value is None or isinstance(value, str)):
            fail(name, "a path (a string) or None")
