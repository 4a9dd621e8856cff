"""Policy values and exceptions in words, whatever they are: a policy's return value or error
is foreign data, and printing it must not fail (an int past Python's 4,300-digit limit, a
``__repr__`` or ``__str__`` that raises) or flood the report (a megabyte string)."""
from __future__ import annotations

__all__ = ["shown", "text"]

LIMIT = 200  # characters of one value


def shown(value, limit: int = LIMIT) -> str:
    """``repr(value)``, or a description of it where that fails, cut to ``limit``."""
    if type(value) is int and value.bit_length() > 12_000:  # ~3,600 digits: near the limit
        return f"<an int of about {int(value.bit_length() * 0.30103):,} digits>"
    try:
        out = repr(value)
    except BaseException as exc:  # noqa: BLE001 - a foreign object's repr
        return f"<a {type(value).__name__} whose repr raised {type(exc).__name__}>"
    return out if len(out) <= limit else out[:limit] + f"... ({len(out):,} characters)"


def text(exc: BaseException, limit: int = 2000) -> str:
    """``str(exc)``, or a description of it where that fails, cut to ``limit``."""
    try:
        out = str(exc)
    except BaseException as inner:  # noqa: BLE001 - a foreign exception's __str__
        return f"<its message could not be read: str() raised {type(inner).__name__}>"
    return out if len(out) <= limit else out[:limit] + f"... ({len(out):,} characters)"
