"""Integer inputs: versions and parameters are accepted through ``operator.index`` (numpy and torch
integer scalars pass; ``bool``, floats and strings do not) and kept as plain ints."""

from __future__ import annotations

import operator

from .errors import InvalidParameterError, ProtocolError


def as_int(name: str, value: object, error: type[ProtocolError] = InvalidParameterError) -> int:
    """``value`` as a plain int, or ``error`` naming ``name``."""
    if type(value) is int:
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as a plain int ``>= minimum``, or :class:`InvalidParameterError` naming ``name``."""
    number = as_int(name, value)
    if number < minimum:
        raise InvalidParameterError(f"{name} must be >= {minimum}, got {number}")
    return number
