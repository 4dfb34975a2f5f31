"""Process-wide carry settings: the SSM restore threshold, the MTP dispatch cap,
the number of carry slots, the drafter policy and whether the carry is armed.

Invariants:
- A pinned setting is fixed by its first read or write, for the whole process:
  a later `set_*` changes nothing and returns `False` so the caller can warn.
- A malformed environment value is a `ValueError` naming the variable and the
  value, raised at the first read; never a silent fallback to the default.
- Configured is not armed: the carry is armed only when configured and MTP is
  not in multi-sequence mode. Anything reporting the carry reports `armed`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Protocol

from ._checks import check_non_negative

DEFAULT_MARCONI_MIN_TOKENS = 256
"""Default SSM snapshot restore floor: the measured crossover lies between 99 and
219 matched tokens; 256 is in the winning region and block aligned."""

DEFAULT_MTP_MAX_SEQS = 32
"""Default MTP dispatch cap when neither the runtime nor the environment sets one."""

DEFAULT_CARRY_SLOTS = 16
"""Default number of carried entries (one per session): the bench's concurrency
target is 16 sessions, and a slot costs nothing until it holds rows; the pool
budget, not the slot count, bounds memory (pool pressure evicts entries LRU)."""

ENV_MARCONI_MIN_TOKENS = "TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS"
ENV_CARRY_SLOTS = "TRTLLM_MTP_CARRY_SLOTS"
ENV_MTP_MAX_SEQS = "TRTLLM_MTP_CARRY_MAX_SEQS"
ENV_DEBUG = "TRTLLM_MTP_CARRY_DEBUG"


def parse_env_int(name: str, raw: str, minimum: int = 0) -> int:
    """`raw` (the value of env `name`) as an int `>= minimum`, or a `ValueError` naming both."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"environment variable {name}={raw!r} is not a non-negative integer")
    value = int(text)
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be at least {minimum}")
    return value


class PinnedSetting:
    """An int fixed for the process by its first read or write (thread-safe).

    Read order when nothing pinned it: env `env_var`, else `default`. The
    module holds one instance per setting; tests make their own instances.
    """

    def __init__(self, name: str, env_var: str, default: int, minimum: int = 0) -> None:
        self.name = name
        self.env_var = env_var
        self.default = default
        self.minimum = minimum
        self._lock = threading.Lock()
        self._value: int | None = None
        self._source = ""

    def get(self) -> int:
        """The pinned value; the first call pins it from env or the default."""
        value = self._value
        if value is not None:
            return value
        with self._lock:
            if self._value is None:
                raw = os.environ.get(self.env_var)
                if raw is None:
                    self._value, self._source = self.default, "default"
                else:
                    self._value = parse_env_int(self.env_var, raw, self.minimum)
                    self._source = f"env {self.env_var}"
            return self._value

    def set(self, value: int, source: str = "set") -> bool:
        """Pin `value`. `True` if this call set it; `False` (nothing changed) if already pinned."""
        value = check_non_negative(self.name, value)
        if value < self.minimum:
            raise ValueError(f"{self.name} must be at least {self.minimum}, got {value}")
        with self._lock:
            if self._value is not None:
                return False
            self._value, self._source = value, source
            return True

    @property
    def source(self) -> str:
        """Where the value came from: `default`, `env <VAR>` or the setter's source ('' if unread)."""
        return self._source

    @property
    def pinned(self) -> bool:
        """Whether the value is fixed already."""
        return self._value is not None


MARCONI_MIN_TOKENS = PinnedSetting(
    "marconi_min_tokens", ENV_MARCONI_MIN_TOKENS, DEFAULT_MARCONI_MIN_TOKENS
)
MTP_MAX_SEQS = PinnedSetting("mtp_max_seqs", ENV_MTP_MAX_SEQS, DEFAULT_MTP_MAX_SEQS, minimum=1)
CARRY_SLOTS = PinnedSetting("carry_slots", ENV_CARRY_SLOTS, DEFAULT_CARRY_SLOTS, minimum=1)


def marconi_min_tokens() -> int:
    """Minimum snapshot depth, in matched tokens, for restoring an SSM snapshot; 0 removes the floor."""
    return MARCONI_MIN_TOKENS.get()


def set_marconi_min_tokens(value: int) -> bool:
    """Pin the restore threshold; `False` (nothing changed) if it was already read or set."""
    return MARCONI_MIN_TOKENS.set(value)


def mtp_max_seqs() -> int:
    """The MTP dispatch cap: sequences one MTP step may carry (runtime, else env, else 32)."""
    return MTP_MAX_SEQS.get()


def set_mtp_max_seqs(value: int) -> bool:
    """Pin the dispatch cap from the engine's configuration; `False` if already pinned."""
    return MTP_MAX_SEQS.set(value, source="engine configuration")


def carry_slots() -> int:
    """How many sessions' drafter rows the carry store keeps at once (runtime, else env, else 16).

    1 is the seed's single slot: the newest finished session wins it.
    """
    return CARRY_SLOTS.get()


def set_carry_slots(value: int) -> bool:
    """Pin the carry store's slot count (at least 1); `False` (nothing changed) if already pinned."""
    return CARRY_SLOTS.set(value)


def mtp_multi_seq_mode() -> bool:
    """Whether MTP dispatches more than one sequence per step (cap above 1)."""
    return mtp_max_seqs() > 1


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """The drafter policy: whether the drafter prompt prefill runs, and whether the carry is configured.

    `carry=True` needs `prefill=True`: the carry reads the hidden store the prefill fills.
    """

    prefill: bool = True
    carry: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill", "carry"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"DrafterContext.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.carry and not self.prefill:
            raise ValueError(
                "DrafterContext(carry=True, prefill=False): the carry reads the hidden store "
                "that the drafter prompt prefill fills"
            )


class HasDrafterContext(Protocol):
    """A model's lever set: anything with a `drafter` policy."""

    @property
    def drafter(self) -> DrafterContext: ...


def carry_armed_with(cfg: DrafterContext, multi_seq: bool) -> bool:
    """Whether the carry is armed: configured (`cfg.carry`) and MTP not in multi-sequence mode."""
    return cfg.carry and not multi_seq


def carry_armed(cfg: DrafterContext) -> bool:
    """`carry_armed_with` against the live dispatch cap."""
    return carry_armed_with(cfg, mtp_multi_seq_mode())


def mtp_carry_drafter_enabled(levers: HasDrafterContext) -> bool:
    """`carry_armed(levers.drafter)` for the model's lever set."""
    return carry_armed(levers.drafter)


def mtp_carry_debug() -> bool:
    """`True` when env `TRTLLM_MTP_CARRY_DEBUG` is exactly `"1"`: one log line per store and adopt."""
    return os.environ.get(ENV_DEBUG) == "1"
