"""Argument checks shared by the core: plain ints, named in every error.

The core takes plain Python ints; a bool is refused even though it is an int,
because `True` as a ticket or a count is always a caller bug.
"""

from __future__ import annotations

U64_LIMIT = 1 << 64


def check_u64(name: str, value: object) -> int:
    """Return `value` if it is an int in `[0, 2**64)`, else raise naming `name`."""
    if type(value) is not int:
        if isinstance(value, int) and not isinstance(value, bool):
            value = int(value)  # int subclasses (e.g. IntEnum) are fine as their value
        else:
            raise TypeError(f"{name} must be an int in [0, 2**64), got {value!r}")
    if not 0 <= value < U64_LIMIT:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def check_non_negative(name: str, value: object) -> int:
    """Return `value` if it is a non-negative int, else raise naming `name`."""
    if type(value) is not int:
        if isinstance(value, int) and not isinstance(value, bool):
            value = int(value)
        else:
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


def check_choice(value: object, choices: tuple[str, ...], what: str, noun: str) -> str:
    """`value` if it is one of `choices`, else a ValueError naming `what`, the value, what it is
    not (`noun`) and the choices."""
    if value not in choices:
        raise ValueError(f"{what}={value!r} is not {noun}; expected one of {', '.join(choices)}")
    assert isinstance(value, str)
    return value


def check_optional_key(name: str, value: object) -> int | None:
    """Return `value` if it is `None` or a non-negative int, else raise naming `name`."""
    return None if value is None else check_non_negative(name, value)
