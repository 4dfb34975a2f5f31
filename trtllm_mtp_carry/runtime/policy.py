"""Drafter policies: what a warm turn does about the drafter's lost context.

- `carry`   adopt the previous turn's rows, append only the new span (default);
- `rebuild` recompute the target over the whole prompt, then the full drafter
            prefill: full context at full cost;
- `blind`   the drafter starts empty over the reused prefix (what TensorRT-LLM
            does today for hybrid models);
- `off`     no speculative decoding at all.

Every policy runs the full drafter prefill on a cold turn (the prefill from
position 0 fills the hidden store for the whole prompt anyway).
"""

from __future__ import annotations

from enum import Enum


class DrafterPolicy(str, Enum):
    """How a turn prepares the drafter; compares equal to its string value."""

    CARRY = "carry"
    REBUILD = "rebuild"
    BLIND = "blind"
    OFF = "off"

    @classmethod
    def parse(cls, value: DrafterPolicy | str) -> DrafterPolicy:
        """The policy named by `value`, or a ValueError listing the valid names."""
        if isinstance(value, DrafterPolicy):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown drafter policy {value!r}; expected one of {names}") from None

    @property
    def drafts(self) -> bool:
        """Whether this policy runs speculative decoding."""
        return self is not DrafterPolicy.OFF


ALL_POLICIES: tuple[DrafterPolicy, ...] = tuple(DrafterPolicy)
