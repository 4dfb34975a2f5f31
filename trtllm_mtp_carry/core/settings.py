"""Process-wide carry settings: the SSM restore threshold, the MTP dispatch cap,
the carry store's bounds (memory budget, optional slot cap, idle time-to-live,
eviction policy), common-prefix sharing, the drafter policy and whether the
carry is armed.

Invariants:
- A pinned setting is fixed by its first read or write, for the whole process:
  a later `set_*` changes nothing and returns `False` so the caller can warn.
- A malformed environment value is a `ValueError` naming the variable and the
  value, raised at the first read; never a silent fallback to the default.
- Anything reporting the carry reports `armed` beside `configured`. Since
  drafter rows are built right after each prefill chunk's target forward,
  from that chunk's hidden rows read under the sequence's own ticket, no other
  sequence can overwrite them first: the carry is armed whenever configured,
  at any MTP dispatch cap (the seed disarmed it in multi-sequence mode).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ._checks import check_choice, check_non_negative
from .row_format import DEFAULT_CARRY_ROW_DTYPE as DEFAULT_CARRY_ROW_DTYPE
from .row_format import ROW_DTYPES as ROW_DTYPES
from .row_format import check_row_dtype

DEFAULT_MARCONI_MIN_TOKENS = 256
"""Default SSM snapshot restore floor: the measured crossover lies between 99 and
219 matched tokens; 256 is in the winning region and block aligned."""

DEFAULT_MTP_MAX_SEQS = 32
"""Default MTP dispatch cap when neither the runtime nor the environment sets one."""

DEFAULT_CARRY_SLOTS: int | None = None
"""Default cap on carried entries: None, no cap (JSON `null`, `no cap` in text, no
`carry_slots` gauge in metrics: the one spelling of "no cap"). Memory (`carry_memory`)
bounds the store; a slot count is an optional extra cap (1 is the seed's single slot)."""

DEFAULT_CARRY_MEMORY = "1.0"
"""Default carry budget: the whole drafter pool, so a server at default settings
keeps every session whose rows fit (live sequences still win: pool pressure
evicts carried entries before any sequence loses its drafter)."""

DEFAULT_CARRY_HOST_MEMORY = 0
"""Default host tier budget of the carry store, in bytes: 0, no host tier (entries
evicted from the device budget leave the store; DECISIONS.md "Host tier")."""

DEFAULT_CARRY_IDLE_S = 600
"""Default idle time-to-live of a carried entry, in seconds (0: never expire):
an entry whose session has not come back for ten minutes is dropped."""

DEFAULT_CARRY_SHARE = True
"""Default for sharing common-prefix drafter blocks between carried entries: on.
Only blocks whose bytes are equal merge (within one cache salt), so it never
changes a row any session reads; `0` turns it off (each entry its own copy)."""

EVICTION_POLICIES: tuple[str, ...] = ("returns", "incumbent", "lrd", "slru")
"""Carry store eviction policies (see `carry_store.py`); the first is the default."""

DEFAULT_CARRY_EVICTION = EVICTION_POLICIES[0]

ENV_MARCONI_MIN_TOKENS = "TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS"
ENV_CARRY_SLOTS = "TRTLLM_MTP_CARRY_SLOTS"
ENV_CARRY_MEMORY = "TRTLLM_MTP_CARRY_MEMORY"
ENV_CARRY_HOST_MEMORY = "TRTLLM_MTP_CARRY_HOST_MEMORY"
ENV_CARRY_ROW_DTYPE = "TRTLLM_MTP_CARRY_ROW_DTYPE"
ENV_CARRY_IDLE_S = "TRTLLM_MTP_CARRY_IDLE_S"
ENV_CARRY_EVICTION = "TRTLLM_MTP_CARRY_EVICTION"
ENV_CARRY_SHARE = "TRTLLM_MTP_CARRY_SHARE"
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


T = TypeVar("T")


class Pinned(Generic[T]):
    """A value fixed for the process by its first read or write (thread-safe).

    Read order when nothing pinned it: env `env_var` (through `parse(name, raw)`,
    which raises a ValueError naming the variable and the value), else `default`.
    """

    def __init__(self, name: str, env_var: str, default: T, parse: Callable[[str, str], T]) -> None:
        self.name = name
        self.env_var = env_var
        self.default = default
        self._parse = parse
        self._lock = threading.Lock()
        self._value: T | None = None
        self._source = ""

    def get(self) -> T:
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
                    self._value = self._parse(self.env_var, raw)
                    self._source = f"env {self.env_var}"
            return self._value

    def check_env(self) -> None:
        """Parse env `env_var` if set, pinning nothing: a ValueError naming the variable and
        its value if malformed (what a command checks before it prints anything)."""
        raw = os.environ.get(self.env_var)
        if raw is not None:
            self._parse(self.env_var, raw)

    def _pin(self, value: T, source: str) -> bool:
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


class PinnedSetting(Pinned[int]):
    """An int fixed for the process by its first read or write (thread-safe).

    Read order when nothing pinned it: env `env_var`, else `default`. The
    module holds one instance per setting; tests make their own instances.
    """

    def __init__(self, name: str, env_var: str, default: int, minimum: int = 0) -> None:
        super().__init__(name, env_var, default, lambda var, raw: parse_env_int(var, raw, minimum))
        self.minimum = minimum

    def set(self, value: int, source: str = "set") -> bool:
        """Pin `value`. `True` if this call set it; `False` (nothing changed) if already pinned."""
        value = check_non_negative(self.name, value)
        if value < self.minimum:
            raise ValueError(f"{self.name} must be at least {self.minimum}, got {value}")
        return self._pin(value, source)


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True, slots=True)
class CarryMemory:
    """The carry budget: `nbytes` of drafter rows, or a `fraction` of the drafter pool.

    Exactly one of the two is set; `resolve(pool_bytes)` gives the budget in bytes.
    """

    nbytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.fraction is None):
            raise ValueError("CarryMemory takes exactly one of nbytes and fraction")
        if self.nbytes is not None:
            check_non_negative("carry_memory bytes", self.nbytes)
        if self.fraction is not None and not (
                isinstance(self.fraction, float) and 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"carry_memory fraction must be in [0, 1], got {self.fraction!r}")

    def resolve(self, pool_bytes: int) -> int:
        """The budget in bytes for a drafter pool of `pool_bytes` bytes."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(self.fraction * check_non_negative("pool_bytes", pool_bytes))

    def __str__(self) -> str:
        if self.nbytes is not None:
            return format_bytes(self.nbytes)
        return f"{100 * (self.fraction or 0.0):g}% of the drafter pool"


_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int) -> str:
    """`n` bytes as every command prints a byte figure (one rule): the largest binary unit
    (KiB, MiB, GiB, TiB) that `n` reaches, at most two decimals, trailing zeros dropped, no
    space: `8GiB`, `1.5GiB`, `512MiB`, `1023.99MiB`, `768B`. A value two decimals hold is
    exact (and reads back through `parse_carry_memory`); any other is rounded, and one that
    rounds to 1024 of a unit is the next unit (`2**30 - 1` is `1GiB`, never `1024MiB`)."""
    n = check_non_negative("bytes", n)
    for i, (unit, size) in enumerate(_BINARY_UNITS):
        if n >= size:
            value = round(n / size, 2)
            if value >= 1024 and i > 0:  # rounded up to a whole unit more: say it in that unit
                unit, value = _BINARY_UNITS[i - 1][0], 1.0
            return f"{value:.2f}".rstrip("0").rstrip(".") + unit
    return f"{n}B"


def parse_carry_memory(text: object, what: str = "carry_memory") -> CarryMemory:
    """`text` as a carry budget: bytes with a unit (`4GiB`, `512MiB`, `1000000B`,
    `2GB`) or a bare fraction of the drafter pool in [0, 1] (`0.5`, `1`).

    ValueError naming `what` and the value otherwise (a bare number above 1 is
    refused: bytes need a unit, so `2` can never be read as two bytes by mistake).
    """
    return _parse_memory(text, what, fractions=True)


def parse_carry_host_memory(text: object, what: str = "carry_host_memory") -> int:
    """`text` as a host tier budget in bytes: bytes with a unit (`8GiB`, `512MiB`), an int
    of bytes, or `0` (no host tier). ValueError/TypeError naming `what` and the value
    otherwise (a fraction is refused: host memory is no fraction of the drafter pool).
    """
    memory = _parse_memory(text, what, fractions=False)
    assert memory.nbytes is not None or memory.fraction == 0.0
    return memory.nbytes or 0


def _parse_memory(text: object, what: str, fractions: bool) -> CarryMemory:
    """The one size parser: with `fractions` a bare number in [0, 1] is a fraction of the
    drafter pool, without them only a bare 0 is allowed (none), and every message says so."""
    if isinstance(text, CarryMemory):
        return text
    hint = ("use bytes with a unit (4GiB, 512MiB, 1000000B) or a fraction of the drafter pool in [0, 1] (0.5)"
            if fractions else "use bytes with a unit (8GiB, 512MiB, 1000000B), or 0 for no host tier")
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        example = "'4GiB' or '0.5'" if fractions else "'8GiB' or an int of bytes"
        raise TypeError(f"{what} must be a str like {example}, got {text!r}")
    if isinstance(text, int):
        return CarryMemory(nbytes=check_non_negative(what, text))
    label = f"{what}={text!r}" if what else repr(text)
    if isinstance(text, float):
        if not fractions and text != 0.0:
            raise ValueError(f"{label}: {_NO_FRACTION}")
        if not 0.0 <= text <= 1.0:
            raise ValueError(f"{what or 'carry_memory'}={text!r}: a fraction of the drafter pool must be in [0, 1]")
        return CarryMemory(fraction=text)
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number) if number else None
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")) or (
            unit and unit not in _UNITS):
        raise ValueError(f"{label} is not a size: {hint}")
    if not unit:
        if not fractions and value != 0.0:
            raise ValueError(f"{label}: {_NO_FRACTION}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"{label}: a bare number is a fraction of the drafter pool and must be "
                "in [0, 1]; give bytes with a unit (e.g. 4GiB)"
            )
        return CarryMemory(fraction=float(value))
    nbytes = value * _UNITS[unit]
    if nbytes < 0 or nbytes != int(nbytes):
        raise ValueError(f"{label} must be a whole, non-negative number of bytes")
    return CarryMemory(nbytes=int(nbytes))


_NO_FRACTION = "host memory is bytes with a unit (8GiB, 512MiB), or 0 for no host tier; it is no fraction of the drafter pool"


def _from_env(parse: Callable[..., T]) -> Callable[[str, str], T]:
    """`parse` (a budget parser) as a setting's environment parser: errors name the variable."""

    def parse_env(name: str, raw: str) -> T:
        try:
            return parse(raw, what=f"environment variable {name}")
        except TypeError as exc:  # env values are str: unreachable, kept for mypy's sake
            raise ValueError(str(exc)) from None

    return parse_env


_SWITCH = {"1": True, "on": True, "true": True, "yes": True,
           "0": False, "off": False, "false": False, "no": False}


def parse_switch(value: object, what: str) -> bool:
    """`value` as on/off: a bool, or one of 1/0, on/off, true/false, yes/no (any case).

    ValueError naming `what` and the value otherwise.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _SWITCH:
        return _SWITCH[value.strip().lower()]
    raise ValueError(f"{what}={value!r} is not on or off; use 1/0, on/off, true/false or yes/no")


def check_eviction_policy(value: object, what: str = "carry_eviction") -> str:
    """`value` if it names an eviction policy, else a ValueError naming `what`, the value and the choices."""
    return check_choice(value, EVICTION_POLICIES, what, "an eviction policy")


MARCONI_MIN_TOKENS = PinnedSetting(
    "marconi_min_tokens", ENV_MARCONI_MIN_TOKENS, DEFAULT_MARCONI_MIN_TOKENS
)
MTP_MAX_SEQS = PinnedSetting("mtp_max_seqs", ENV_MTP_MAX_SEQS, DEFAULT_MTP_MAX_SEQS, minimum=1)
# 0 inside the pinned int stands for no cap; `carry_slots()` hands it out as None (a cap is >= 1)
CARRY_SLOTS = PinnedSetting("carry_slots", ENV_CARRY_SLOTS, DEFAULT_CARRY_SLOTS or 0, minimum=1)
CARRY_IDLE_S = PinnedSetting("carry_idle_s", ENV_CARRY_IDLE_S, DEFAULT_CARRY_IDLE_S)
CARRY_MEMORY: Pinned[CarryMemory] = Pinned(
    "carry_memory", ENV_CARRY_MEMORY, parse_carry_memory(DEFAULT_CARRY_MEMORY), _from_env(parse_carry_memory)
)
CARRY_HOST_MEMORY: Pinned[int] = Pinned(
    "carry_host_memory", ENV_CARRY_HOST_MEMORY, DEFAULT_CARRY_HOST_MEMORY, _from_env(parse_carry_host_memory)
)
CARRY_EVICTION: Pinned[str] = Pinned(
    "carry_eviction", ENV_CARRY_EVICTION, DEFAULT_CARRY_EVICTION,
    lambda name, raw: check_eviction_policy(raw.strip(), f"environment variable {name}"),
)
CARRY_ROW_DTYPE: Pinned[str] = Pinned(
    "carry_row_dtype", ENV_CARRY_ROW_DTYPE, DEFAULT_CARRY_ROW_DTYPE,
    lambda name, raw: check_row_dtype(raw.strip(), f"environment variable {name}"),
)

CARRY_SHARE: Pinned[bool] = Pinned(
    "carry_share", ENV_CARRY_SHARE, DEFAULT_CARRY_SHARE,
    lambda name, raw: parse_switch(raw, f"environment variable {name}"),
)

CARRY_VARIABLES: tuple[Pinned[Any], ...] = (
    MARCONI_MIN_TOKENS, MTP_MAX_SEQS, CARRY_SLOTS, CARRY_MEMORY, CARRY_HOST_MEMORY,
    CARRY_ROW_DTYPE, CARRY_EVICTION, CARRY_IDLE_S, CARRY_SHARE,
)
"""Every pinned setting read from a `TRTLLM_MTP_CARRY_*` variable (`TRTLLM_MTP_CARRY_DEBUG`
aside: exactly `1` turns it on, anything else is off). The command line checks each one
before a command prints anything (`check_environment`); a new setting belongs here."""


def check_environment() -> None:
    """ValueError naming the first malformed `TRTLLM_MTP_CARRY_*` settings variable; pins nothing."""
    for setting in CARRY_VARIABLES:
        setting.check_env()


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


def carry_slots() -> int | None:
    """The optional cap on carried entries (runtime, else env, else None: no cap).

    Memory (`carry_memory`) is what bounds the store; 1 is the seed's single
    slot: the newest finished session wins it.
    """
    return CARRY_SLOTS.get() or None


def set_carry_slots(value: int) -> bool:
    """Pin the carry store's slot cap (at least 1); `False` (nothing changed) if already pinned."""
    return CARRY_SLOTS.set(value)


def carry_memory() -> CarryMemory:
    """The carry budget (runtime, else env `TRTLLM_MTP_CARRY_MEMORY`, else the whole drafter pool)."""
    return CARRY_MEMORY.get()


def set_carry_memory(value: CarryMemory | str | int | float, source: str = "set") -> bool:
    """Pin the carry budget: `'4GiB'`, `'512MiB'`, bytes as an int, or a fraction of the pool
    (`0.5`, `'0.5'`). ValueError/TypeError naming a malformed value; `False` if already pinned."""
    return CARRY_MEMORY._pin(parse_carry_memory(value), source)


def carry_host_memory() -> int:
    """The carry store's host tier budget in bytes (runtime, else env
    `TRTLLM_MTP_CARRY_HOST_MEMORY`, else 0: no host tier)."""
    return CARRY_HOST_MEMORY.get()


def set_carry_host_memory(value: str | int, source: str = "set") -> bool:
    """Pin the host tier budget: `'8GiB'`, `'512MiB'`, bytes as an int, or 0 (none).
    ValueError/TypeError naming a malformed value; `False` if already pinned."""
    return CARRY_HOST_MEMORY._pin(parse_carry_host_memory(value), source)


def carry_row_dtype() -> str:
    """The row format of carried entries, `bf16`, `fp8` or `nvfp4` (runtime, else env
    `TRTLLM_MTP_CARRY_ROW_DTYPE`, else `bf16`; core/row_format.py)."""
    return CARRY_ROW_DTYPE.get()


def set_carry_row_dtype(value: str, source: str = "set") -> bool:
    """Pin the row format of carried entries (one of `ROW_DTYPES`); `False` if already pinned."""
    return CARRY_ROW_DTYPE._pin(check_row_dtype(value), source)


def carry_idle_s() -> int:
    """Seconds a carried entry may wait for its session before it is dropped (0: never; default 600)."""
    return CARRY_IDLE_S.get()


def set_carry_idle_s(value: int, source: str = "set") -> bool:
    """Pin the idle time-to-live in seconds (0: never expire); `False` if already pinned."""
    return CARRY_IDLE_S.set(value, source)


def carry_eviction() -> str:
    """The carry store's eviction policy (runtime, else env, else `returns`)."""
    return CARRY_EVICTION.get()


def set_carry_eviction(value: str, source: str = "set") -> bool:
    """Pin the eviction policy (one of `EVICTION_POLICIES`); `False` if already pinned."""
    return CARRY_EVICTION._pin(check_eviction_policy(value), source)


def carry_share() -> bool:
    """Whether carried entries share equal common-prefix drafter blocks (runtime, else env, else on)."""
    return CARRY_SHARE.get()


def set_carry_share(value: bool | str, source: str = "set") -> bool:
    """Pin common-prefix sharing on or off (`parse_switch`); `False` if already pinned."""
    return CARRY_SHARE._pin(parse_switch(value, "carry_share"), source)


def carry_settings_line() -> str:
    """The carry's resolved settings on one line, as `chat` prints them at start (reading
    them pins them): `carry settings: memory ..., host tier ..., eviction ..., ...`."""
    host = carry_host_memory()
    return (f"carry settings: memory {carry_memory()}, host tier {format_bytes(host) if host else 'none'}, "
            f"eviction {carry_eviction()}, idle TTL {carry_idle_s() or 'never'}"
            f"{' s' if carry_idle_s() else ''}, slots {carry_slots() or 'no cap'}, sharing "
            f"{'on' if carry_share() else 'off'}, restore threshold {marconi_min_tokens()}, "
            f"MTP dispatch cap {mtp_max_seqs()}")


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
    """Whether the carry is armed: exactly when configured (`cfg.carry`), whatever `multi_seq`.

    Drafter rows are built per prefill chunk, read under the sequence's own ticket, so
    the model-level hidden store is safe when MTP dispatches several sequences per step
    and the dispatch mode never disarms the carry; `multi_seq` is the mode callers
    report, and is not read.
    """
    del multi_seq  # armed at any dispatch cap: rows are built per prefill chunk
    return cfg.carry


def carry_armed(cfg: DrafterContext) -> bool:
    """`carry_armed_with` against the live dispatch cap."""
    return carry_armed_with(cfg, mtp_multi_seq_mode())


def mtp_carry_drafter_enabled(levers: HasDrafterContext) -> bool:
    """`carry_armed(levers.drafter)` for the model's lever set."""
    return carry_armed(levers.drafter)


def mtp_carry_debug() -> bool:
    """`True` when env `TRTLLM_MTP_CARRY_DEBUG` is exactly `"1"`: one log line per store and adopt."""
    return os.environ.get(ENV_DEBUG) == "1"
