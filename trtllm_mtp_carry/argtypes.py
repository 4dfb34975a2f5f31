"""argparse value types shared by every subcommand (torch-free).

One place for integer flags, so every command names the offending text the
same way (`argument --threads: must be at least 1, got 0`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .core.settings import parse_carry_host_memory, parse_carry_memory


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= `minimum`; the error quotes the offending text or value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            bound = "non-negative" if minimum == 0 else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "non_negative_int" if minimum == 0 else f"int_at_least_{minimum}"
    return parse


non_negative_int = int_at_least(0)
positive_int = int_at_least(1)


def finite_float(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite float > 0 (`positive`) or >= 0; the error quotes the text."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value == float("inf") or not (value > 0 if positive else value >= 0):
            raise argparse.ArgumentTypeError(
                f"must be a {'positive' if positive else 'non-negative'} number, got {text}")
        return value

    parse.__name__ = "positive_float" if positive else "non_negative_float"
    return parse


positive_float = finite_float(positive=True)
non_negative_float = finite_float(positive=False)


def _budget(text: str, parse: Callable[..., object]) -> str:
    """Check `text` with the settings parser `parse` and return it (the setter parses it
    again); the argparse error names the value."""
    try:
        parse(text, what="")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def carry_memory_size(text: str) -> str:
    """An argparse type: a carry budget (`4GiB`, `512MiB`, or a pool fraction like `0.5`)."""
    return _budget(text, parse_carry_memory)


def carry_host_memory_size(text: str) -> str:
    """An argparse type: a host tier budget (`8GiB`, `512MiB`, or 0 for none)."""
    return _budget(text, parse_carry_host_memory)
