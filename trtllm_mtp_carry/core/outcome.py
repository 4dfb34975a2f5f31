"""`CarryOutcome`: the result of one carry attempt, for logging, metrics and tests.

Variants are frozen dataclasses reached as `CarryOutcome.Adopted(...)` and so
on; they compare equal by fields, and `str()` gives the log text. `kind` is a
stable snake_case name for counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class CarryOutcome:
    """Base of the seven outcome variants; never instantiated itself."""

    __slots__ = ()
    kind: ClassVar[str]
    Adopted: ClassVar[type[Adopted]]
    NoCarry: ClassVar[type[NoCarry]]
    PrefixMismatch: ClassVar[type[PrefixMismatch]]
    ForeignSession: ClassVar[type[ForeignSession]]
    ForeignHiddens: ClassVar[type[ForeignHiddens]]
    NoHiddens: ClassVar[type[NoHiddens]]
    Fault: ClassVar[type[Fault]]

    @property
    def adopted(self) -> bool:
        """Whether the carried rows were adopted."""
        return False


@dataclass(frozen=True, slots=True)
class Adopted(CarryOutcome):
    """Kept `rows` carried rows and appended `appended` rows starting at key `first_key`."""

    rows: int
    appended: int
    first_key: int
    kind: ClassVar[str] = "adopted"

    @property
    def adopted(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"adopted rows={self.rows} appended={self.appended} first_key={self.first_key}"


NO_CARRY_REASONS: tuple[str, ...] = (
    "never_carried",  # nothing was ever deposited under this key (that the store remembers)
    "new_salt",  # the session carried rows under another cache_salt: a new salt starts fresh
    "in_use",  # another turn of this key adopted the entry and has not deposited it back yet
    "capacity",  # evicted: every slot of the optional slot cap was held
    "memory",  # evicted: the carry's memory budget (carry_memory) was full
    "pool_pressure",  # evicted: a live sequence needed the drafter pool's blocks
    "idle",  # evicted: the session did not return within the idle time-to-live
    "session_end",  # evicted: the session ended
    "cleared",  # evicted: the runtime dropped every entry
    "not_admitted",  # the last deposit was refused: the store was full of incumbents
    "too_large",  # the last deposit was refused: its rows exceed the whole budget
    "oom",  # the last deposit was refused: its rows could not be allocated (the executor said so)
    "not_deposited",  # the last turn adopted the rows and ended without depositing them
    "fault",  # an exception inside the carry (store, data plane, host moves) lost the rows
    "moved",  # evicted: another worker took the rows (the session's next turn landed there)
)
"""Why a session's own carried entry was absent, in the order counters list them."""


@dataclass(frozen=True, slots=True)
class NoCarry(CarryOutcome):
    """The store holds no entry under this session's key; `reason` says why (`NO_CARRY_REASONS`)."""

    reason: str = "never_carried"
    kind: ClassVar[str] = "no_carry"

    def __post_init__(self) -> None:
        if self.reason not in NO_CARRY_REASONS:
            raise ValueError(f"NoCarry reason must be one of {NO_CARRY_REASONS}, got {self.reason!r}")

    def __str__(self) -> str:
        return f"no carried state: {self.reason}"


@dataclass(frozen=True, slots=True)
class PrefixMismatch(CarryOutcome):
    """The prompt shares only `common` tokens with the entry: no row survives."""

    common: int
    entry_rows: int
    kind: ClassVar[str] = "prefix_mismatch"

    def __str__(self) -> str:
        return f"prefix mismatch (common={self.common} entry_rows={self.entry_rows})"


@dataclass(frozen=True, slots=True)
class ForeignSession(CarryOutcome):
    """The entry judged belongs to another session (or salt), or the prompt has no session.

    With several slots a session is only ever judged against its own entry, so
    this is the one-slot case (the seed's single slot holds another session's rows).
    """

    entry_session: int
    prompt_session: int
    kind: ClassVar[str] = "foreign_session"

    def __str__(self) -> str:
        return (
            f"foreign session (entry=0x{self.entry_session:016x} "
            f"prompt=0x{self.prompt_session:016x})"
        )


@dataclass(frozen=True, slots=True)
class ForeignHiddens(CarryOutcome):
    """The hidden store holds rows of ticket `owner`, not of the reader `expected`."""

    owner: int
    expected: int
    kind: ClassVar[str] = "foreign_hiddens"

    def __str__(self) -> str:
        return f"hidden rows belong to sequence gen {self.owner}, not {self.expected}"


@dataclass(frozen=True, slots=True)
class NoHiddens(CarryOutcome):
    """The hidden store does not cover the keys the append needs."""

    kind: ClassVar[str] = "no_hiddens"

    def __str__(self) -> str:
        return "hidden store does not cover the append span"


@dataclass(frozen=True, slots=True)
class Fault(CarryOutcome):
    """An exception inside the carry (its store, the data plane, the host moves) at `step` cost
    this turn its carry: the turn runs without it (blind) and deposits nothing; `error` is the
    exception's class name (`kind` is `fault`, as every variant's kind is its own). Not a miss and not an ownership conflict: the runtime that caught it
    names the step (its own vocabulary) and counts it by step and kind."""

    step: str
    error: str
    kind: ClassVar[str] = "fault"

    def __str__(self) -> str:
        return f"fault at {self.step}: {self.error}"


CarryOutcome.Adopted = Adopted
CarryOutcome.NoCarry = NoCarry
CarryOutcome.PrefixMismatch = PrefixMismatch
CarryOutcome.ForeignSession = ForeignSession
CarryOutcome.ForeignHiddens = ForeignHiddens
CarryOutcome.NoHiddens = NoHiddens
CarryOutcome.Fault = Fault

OUTCOME_KINDS: tuple[str, ...] = tuple(
    v.kind for v in (Adopted, NoCarry, PrefixMismatch, ForeignSession, ForeignHiddens, NoHiddens, Fault)
)
"""Every variant's `kind`, in SPEC order, `fault` last (for counters that list zeros too)."""
